"""Suffix decoding: drafts from counted suffix trees of the request and of past replies.

As in SuffixDecoding (Oliaro et al. 2024) and Arctic Inference's suffix drafter, which
vLLM and SGLang offer. Two trees of token counts: one per request over its prompt and
output so far, and one shared by the requests of a tenant over the replies of its
finished ones (agents and repeated tasks produce the same text again): the last
`max_cached_requests` replies of every tenant together, oldest out first, within
`max_cached_nodes` nodes in all. A tenant is a request's cache_salt (vLLM's field,
DraftEntry.Start.tenant; none: the shared default), so one tenant's acceptance never
tells whether a guessed continuation appeared in another's reply. Each tree holds every run of at most `max_depth` tokens with how often it
occurred (a suffix trie with its depth capped, so a tree of N tokens has at most
N * max_depth nodes).

To draft, each tree gives the longest suffix of the context (shorter than max_depth)
that occurred before with something after it. From there the draft follows the most
frequent continuation while the path's estimated probability (the product of
count(child) / count(children) along it) stays at least `min_token_prob`, for at most
min(K, max_spec_factor * match length + max_spec_offset) tokens: a long match earns a
long draft, a one-token match a short one. At the tree's depth the walk re-matches
the context plus the draft so far. The tree whose draft expects more accepted tokens
(the sum of its path probabilities) wins. The defaults (factor 1, offset 2, minimum
probability 0.3, where Arctic's are 1, 0 and 0.1) were chosen on the bench prompts:
the offset adds tokens a step, the higher minimum cuts draft rounds that are mostly
rejected (bench/results/suffix.md has the sweep).

Drafts depend on the context alone, so they carry no probabilities (one-hot q, exact
under rejection sampling for any sampling parameters).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from drafter.method import Draft, DrafterInfo, DraftMethod, OutcomeTable
from drafter.registry import register
from specdec.pb import common_pb2
from specdec.sampling import SamplingParams


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, _Node] = {}


class SuffixTree:
    """Counts of every token run of at most max_depth tokens in the sequences added.

    `extend` appends to one running sequence (a request's context) in O(max_depth)
    per token; `add` and `remove` count a whole sequence in or out (a past reply).
    """

    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 0
        # Nodes of the runs ending at the last token extended, by depth (1, 2, ...).
        self._open: list[_Node] = []

    def _child(self, node: _Node, token: int) -> _Node:
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = _Node()
            self.num_nodes += 1
        child.count += 1
        return child

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            deeper = self._open[: self.max_depth - 1]
            self._open = [self._child(self.root, t), *(self._child(n, t) for n in deeper)]

    def add(self, tokens: Sequence[int]) -> None:
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i: i + self.max_depth]:
                node = self._child(node, t)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `add(tokens)`: runs counted to zero leave the tree."""
        for i in range(len(tokens)):
            node = self.root
            for t in tokens[i: i + self.max_depth]:
                child = node.children[t]
                child.count -= 1
                if child.count == 0:
                    self.num_nodes -= _size(child)
                    del node.children[t]
                    break
                node = child

    def match(self, context: Sequence[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of context (shorter than max_depth) that has a
        continuation in the tree, and its length; (None, 0) when none has."""
        for length in range(min(len(context), self.max_depth - 1), 0, -1):
            node: _Node | None = self.root
            for t in context[len(context) - length:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, length
        return None, 0

    def draft(self, context: Sequence[int], max_tokens: int, spec_factor: float,
              spec_offset: float, min_prob: float) -> tuple[list[int], float]:
        """The draft continuing context and its expected number of accepted tokens."""
        node, length = self.match(context)
        return self.walk(node, length, context, max_tokens, spec_factor, spec_offset, min_prob)

    def walk(self, node: _Node | None, length: int, context: Sequence[int], max_tokens: int,
             spec_factor: float, spec_offset: float,
             min_prob: float) -> tuple[list[int], float]:
        """`draft` from the context's match (node, length) as `match` gives it."""
        if node is None:
            return [], 0.0
        budget = min(max_tokens, math.floor(spec_factor * length + spec_offset))
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < budget:
            if not node.children:
                # At the tree's depth: the run continues from the context's shorter
                # suffix (match reads no more than its last max_depth - 1 tokens).
                node, _ = self.match([*context[1 - self.max_depth:], *tokens])
                if node is None:
                    break
            total = sum(c.count for c in node.children.values())
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / total
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            node = child
        return tokens, score

    def suffix_nodes(self, context: Sequence[int]) -> list[_Node]:
        """[m]: the nodes of the context's last 1, 2, ..., m tokens, for every such run
        the tree holds. A run's suffixes are runs too, so the list stops at the first
        run missing."""
        nodes: list[_Node] = []
        for length in range(1, min(len(context), self.max_depth) + 1):
            node: _Node | None = self.root
            for t in context[len(context) - length:]:
                node = node.children.get(t)
                if node is None:
                    return nodes
            nodes.append(node)
        return nodes

    def extended(self, nodes: list[_Node], token: int) -> list[_Node]:
        """suffix_nodes(context + [token]) from nodes = suffix_nodes(context)."""
        out: list[_Node] = []
        for node in (self.root, *nodes[: self.max_depth - 1]):
            node = node.children.get(token)
            if node is None:
                break
            out.append(node)
        return out

    def matches_after(self, nodes: list[_Node]) -> dict[int, tuple[_Node, int]]:
        """match(context + [b]) for every token b whose match is two tokens or longer,
        from nodes = suffix_nodes(context): b -> (node, length). Such a match is a run
        of the context's last tokens followed by b, so b is a child of one of the nodes;
        the deepest one holding b with a continuation is the longest match."""
        found: dict[int, tuple[_Node, int]] = {}
        # A match is shorter than max_depth: the context's part of it at most D - 2.
        for depth in range(min(len(nodes), self.max_depth - 2), 0, -1):
            for b, child in nodes[depth - 1].children.items():
                if child.children and b not in found:
                    found[b] = (child, depth + 1)
        return found


def _size(node: _Node) -> int:
    return 1 + sum(_size(c) for c in node.children.values())


@dataclass(slots=True)
class _Request:
    tokens: list[int]  # prompt + output
    num_prompt: int
    tree: SuffixTree
    tenant: str = ""  # whose past replies it drafts from (SuffixMethod.scope)


@register
class SuffixMethod(DraftMethod):
    name = "suffix"

    def __init__(self, max_num_speculative_tokens: int = 8, max_depth: int = 24,
                 max_cached_requests: int = 100, max_cached_nodes: int = 250_000,
                 max_spec_factor: float = 1.0,
                 max_spec_offset: float = 2.0, min_token_prob: float = 0.3,
                 vocab_size: int = 0, tokenizer_hash: str = ""):
        if max_cached_requests < 0:
            raise ValueError(f"max_cached_requests must be >= 0, got {max_cached_requests}")
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        if max_cached_nodes < 0:
            raise ValueError(f"max_cached_nodes must be >= 0, got {max_cached_nodes}")
        if max_spec_factor < 0:
            raise ValueError(f"max_spec_factor must be >= 0, got {max_spec_factor}")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_cached_nodes = max_cached_nodes
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        # Works on ids alone; vocab_size 0 and hash "" say it fits any tokenizer.
        self._info = DrafterInfo(
            method=common_pb2.SPEC_METHOD_SUFFIX,
            vocab_size=vocab_size,
            tokenizer_hash=tokenizer_hash,
            max_num_speculative_tokens=max_num_speculative_tokens,
        )
        # Past replies, one tree per tenant (a request's cache_salt; "" = the shared
        # default): a request drafts only from its own tenant's, so the acceptance it sees
        # cannot tell whether a guess appeared in another tenant's reply.
        self._shared: dict[str, SuffixTree] = {}
        self._replies: deque[tuple[str, list[int]]] = deque()  # counted now, oldest first
        self._shared_nodes = 0  # nodes of every tenant's tree
        self._requests: dict[Hashable, _Request] = {}

    def info(self) -> DrafterInfo:
        return self._info

    @property
    def cached_replies(self) -> tuple[list[int], ...]:
        """The replies the tenants' trees count now, oldest first."""
        return tuple(reply for _, reply in self._replies)

    def shared_tree(self, tenant: str = "") -> SuffixTree | None:
        """The tree of a tenant's past replies (None: it has none)."""
        return self._shared.get(tenant)

    @property
    def num_nodes(self) -> int:
        """Nodes of every tree held now: the memory this method uses, about 270 bytes a
        node (bench/results/suffix.md measures it)."""
        return self._shared_nodes + sum(r.tree.num_nodes for r in self._requests.values())

    def start(self, key: Hashable, prompt_ids: list[int], output_ids: list[int],
              sampling: SamplingParams, max_num_speculative_tokens: int) -> None:
        tokens = list(prompt_ids) + list(output_ids)
        tree = SuffixTree(self.max_depth)
        tree.extend(tokens)
        self._requests[key] = _Request(tokens, len(prompt_ids), tree)

    def scope(self, key: Hashable, tenant: str) -> None:
        self._requests[key].tenant = tenant

    def advance(self, key: Hashable, num_drafted: int, num_accepted: int, new_token_ids: list[int],
                num_rollback_tokens: int, hidden_states: torch.Tensor | None,
                hidden_start_position: int) -> None:
        request = self._requests[key]
        if num_rollback_tokens:
            if num_rollback_tokens > len(request.tokens):
                raise ValueError(f"num_rollback_tokens {num_rollback_tokens} exceeds the "
                                 f"context's {len(request.tokens)} tokens")
            # Counts cannot be taken back one run at a time: count the rest again.
            del request.tokens[len(request.tokens) - num_rollback_tokens:]
            request.num_prompt = min(request.num_prompt, len(request.tokens))
            request.tree = SuffixTree(self.max_depth)
            request.tree.extend(request.tokens)
        request.tokens.extend(new_token_ids)
        request.tree.extend(new_token_ids)

    def propose(self, wanted: dict[Hashable, int]) -> dict[Hashable, Draft]:
        drafts: dict[Hashable, Draft] = {}
        for key, k in wanted.items():
            request = self._requests[key]
            if best := self._draft(request, request.tokens, k):
                drafts[key] = Draft(token_ids=best)
        return drafts

    def propose_after(self, key: Hashable, extra: list[int], k: int) -> list[int] | None:
        # The request's tree does not count `extra` yet: a bet drafts from the runs it
        # knows, a few tokens short of what the real Advance will count.
        # The trees read no more than the context's last max_depth - 1 tokens.
        request = self._requests[key]
        return self._draft(request, [*request.tokens[-self.max_depth:], *extra], k)

    def outcome_table(self, key: Hashable, drafts: list[int], k: int) -> OutcomeTable:
        # Lists the tokens b whose match is two tokens or longer: those that followed
        # the context's last token before. Any other b has a one-token match at most,
        # whose draft is a short guess from b's other occurrences (floor(factor +
        # offset) tokens, 3 by default); the table gives it none, and the servicer
        # answers the Advance by the table, so the verifier never waits for one.
        request = self._requests[key]
        k = min(k, self._info.max_num_speculative_tokens)
        shared = self._shared.get(request.tenant)
        trees = (request.tree,) if shared is None else (request.tree, shared)
        # As propose_after: the trees read the context's last max_depth - 1 tokens, and
        # the request's tree does not count the drafts.
        context = [*request.tokens[-self.max_depth:], *drafts]
        base = len(context) - len(drafts)
        nodes = [tree.suffix_nodes(context[:base]) for tree in trees]
        groups = []
        for a in range(len(drafts) + 1):
            if a:
                nodes = [tree.extended(n, drafts[a - 1])
                         for tree, n in zip(trees, nodes, strict=True)]
            found = [tree.matches_after(n) for tree, n in zip(trees, nodes, strict=True)]
            prefix = context[:base + a]
            bonus: list[int] = []
            lengths: list[int] = []
            tokens: list[int] = []
            for b in sorted(set().union(*found)):
                after = [*prefix, b]
                best, best_score = [], 0.0
                for tree, matches in zip(trees, found, strict=True):
                    node, length = matches.get(b) or tree.match(after[-1:])
                    draft, score = tree.walk(node, length, after, k, self.max_spec_factor,
                                             self.max_spec_offset, self.min_token_prob)
                    if score > best_score:  # as _draft: the request's tree wins a tie
                        best, best_score = draft, score
                if best:
                    bonus.append(b)
                    lengths.append(len(best))
                    tokens.extend(best)
            groups.append((np.asarray(bonus, dtype=np.int64),
                           np.asarray(lengths, dtype=np.int64),
                           np.asarray(tokens, dtype=np.int64)))
        return OutcomeTable(groups, k, copy_unlisted=False)

    def _draft(self, request: _Request, context: list[int], k: int) -> list[int]:
        """The draft of whichever tree expects more accepted tokens."""
        best: list[int] = []
        best_score = 0.0
        shared = self._shared.get(request.tenant)
        for tree in (request.tree, shared) if shared is not None else (request.tree,):
            tokens, score = tree.draft(context, min(k, self._info.max_num_speculative_tokens),
                                       self.max_spec_factor, self.max_spec_offset,
                                       self.min_token_prob)
            if score > best_score:
                best, best_score = tokens, score
        return best

    def free(self, key: Hashable) -> None:
        request = self._requests.pop(key, None)
        if request is None or self.max_cached_requests == 0:
            return
        reply = request.tokens[request.num_prompt:]
        if not reply:
            return
        self._count(request.tenant, reply, add=True)
        self._replies.append((request.tenant, reply))
        # Oldest out first, whatever their tenant: a reply count and a memory budget.
        while self._replies and (len(self._replies) > self.max_cached_requests
                                 or self._shared_nodes > self.max_cached_nodes):
            self._count(*self._replies.popleft(), add=False)

    def _count(self, tenant: str, reply: list[int], add: bool) -> None:
        tree = self._shared.get(tenant)
        if tree is None:
            tree = self._shared[tenant] = SuffixTree(self.max_depth)
        before = tree.num_nodes
        (tree.add if add else tree.remove)(reply)
        self._shared_nodes += tree.num_nodes - before
        if not tree.num_nodes:
            del self._shared[tenant]

    def has(self, key: Hashable) -> bool:
        return key in self._requests
