"""EAGLE and EAGLE-3 drafting: a small head reads the target's hidden states.

Position i of a sequence becomes one row of the head, (t_{i+1}, f_i), once
both the token after it and the target's feature f_i have arrived (the
verifier sends f for the positions it computed and kept: a prefill chunk,
or the previous last token plus the accepted drafts). Those committed rows
live in the head's KV cache. A proposal runs, batched over the sequences:

    step 1   the rows not yet in the cache, up to position n - 2 (t_{n-1} is
             the newest token), in one ragged forward; the output at n - 2
             drafts d_1 (the token at position n)
    step j   one row per sequence, (d_{j-1}, the previous step's output), at
             position n - 3 + j; drafts d_j

as vLLM's EAGLE proposer does, and then drops the draft rows from the cache
again: the next outcome brings the target's own features for whatever was
accepted. Drafts are greedy and carry no probabilities (one-hot q, exact).

With tree_width W > 1, a greedy request's proposal is a token tree, grown as
EAGLE-2 does: each head step runs one row for each of the W most probable nodes
of the newest depth (a node's score is the product of the head's probabilities
along its path, its estimated chance of acceptance) and draws each one's W most
likely children; of all the nodes drawn, the K most probable are proposed
(specdec/tree.py, top_subtree), which the verifier scores in the one forward a
chain of K would take. Those rows sit in the head cache side by side, each
attending to the committed rows and its own ancestors' rows (a [F, R + F] mask
over this proposal's R + F draft rows), at position n - 2 + depth; a step costs
W rows where a chain's costs one.

With lookup on (`lookup_min_n` > 0), a sequence whose context ends in an
n-gram of at least that many tokens seen earlier in it gets the prompt-lookup
draft (drafter/ngram.py) instead, and a head chain whose context plus drafts
runs into such an n-gram takes the lookup continuation from there: the head
copies badly (it drafts a quoted passage or the code being edited far worse
than lookup does), and lookup costs no forward. The features of steps drafted
by lookup still join the head cache at the next step the head drafts, so the
head context never goes stale.

A sequence started without features (a reconnect re-starts it with its
output so far) has none for its old positions and never will: its head
context begins at the first position whose feature arrives, and drafting
resumes from there with a shorter context rather than not at all.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from drafter.eagle_model import DraftHead, load_head
from drafter.method import Draft, DrafterInfo, DraftMethod, DraftSampling
from drafter.ngram import TokenBuffer, find_continuation
from drafter.registry import register
from specdec.pb import common_pb2
from specdec.tree import is_chain, top_subtree

# Feature rows a sequence may hold back before advance folds them into its head
# cache on its own: bounds the memory of sequences that run long without drafting.
_MAX_PENDING_ROWS = 256
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(slots=True)
class _Seq:
    cache_id: int
    tokens: TokenBuffer  # committed context t_0 .. t_{n-1}
    kv_begin: int = 0  # first position in the head cache (> 0 only after features went missing)
    kv_end: int = 0  # positions kv_begin .. kv_end - 1 are committed rows of the head cache
    greedy: bool = True  # the request samples greedily: its drafts may form a tree
    pending: list[torch.Tensor] = field(default_factory=list)  # [p, H] features of kv_end ..
    num_pending: int = 0
    last_out: torch.Tensor | None = None  # [H] head output at position kv_end - 1

    @property
    def feature_end(self) -> int:
        return self.kv_end + self.num_pending

    def pending_features(self) -> torch.Tensor:
        if len(self.pending) > 1:
            self.pending = [torch.cat(self.pending)]
        return self.pending[0]

    def keep_pending(self, start: int, stop: int) -> None:
        """Keep pending rows start..stop - 1 (counted from kv_end)."""
        if stop - start == self.num_pending:
            return
        rows = self.pending_features()[start:stop] if stop > start else None
        self.pending = [] if rows is None else [rows]
        self.num_pending = stop - start


class _EagleMethod(DraftMethod):
    """Shared by both heads; they differ only in the head (drafter/eagle_model.py)."""

    _spec_method: int

    def __init__(self, model_dir: str | Path | None = None, target_dir: str | Path | None = None,
                 dtype: str = "float32", device: str = "cpu", max_num_speculative_tokens: int = 8,
                 num_kv_blocks: int = 2048, block_size: int = 16, lookup_min_n: int = 0,
                 lookup_max_n: int = 4, min_confidence: float = 0.0, tree_width: int = 1):
        """model_dir: the head (config.json + safetensors); target_dir: the target model
        it drafts for (its config, embedding / lm_head where the head has none, and
        its tokenizer for the fingerprint). num_kv_blocks x block_size positions of head
        KV cache are shared by all sequences; one that does not fit gets no draft.
        lookup_min_n > 0: prompt lookup (n-grams of lookup_min_n..lookup_max_n tokens)
        drafts where it finds a match, the head elsewhere; 0 = the head alone.
        min_confidence: a head chain stops before a draft the head gives a lower
        probability (after the first); 0 = always K drafts. Trees have their own
        measure (path probabilities) and always propose K.
        tree_width > 1: greedy requests get EAGLE-2 token trees of K tokens, expanding
        tree_width nodes per depth into tree_width children each (sampled requests
        keep chains)."""
        if model_dir is None or target_dir is None:
            raise ValueError(f"{self.name} needs its head (model_dir, --model) and the target "
                             f"model directory (target_dir, --target)")
        if num_kv_blocks < 1 or block_size < 1:
            raise ValueError(f"num_kv_blocks and block_size must be >= 1, got {num_kv_blocks}, "
                             f"{block_size}")
        if not Path(target_dir).is_dir():
            raise ValueError(f"target_dir {target_dir}: not a directory")
        if lookup_min_n < 0 or (lookup_min_n and lookup_max_n < lookup_min_n):
            raise ValueError(f"lookup n-gram sizes need 0 <= lookup_min_n <= lookup_max_n, got "
                             f"lookup_min_n={lookup_min_n}, lookup_max_n={lookup_max_n}")
        self.lookup_min_n, self.lookup_max_n = lookup_min_n, lookup_max_n
        if not 0.0 <= min_confidence <= 1.0:
            raise ValueError(f"min_confidence must be in [0, 1], got {min_confidence}")
        self.min_confidence = min_confidence
        if tree_width < 1:
            raise ValueError(f"tree_width must be >= 1, got {tree_width}")
        self.tree_width = tree_width
        self.head: DraftHead = load_head(self.name, model_dir, target_dir, dtype, device)
        self.head.use_small_rows()  # inference only: the kernel has no autograd
        cfg = self.head.config
        vocab_size, tokenizer_hash = _fingerprint(Path(target_dir), cfg.vocab_size)
        self._info = DrafterInfo(
            method=self._spec_method,
            vocab_size=vocab_size,
            tokenizer_hash=tokenizer_hash,
            model_name=Path(model_dir).name,
            max_num_speculative_tokens=max_num_speculative_tokens,
            needs_hidden_states=True,
            hidden_state_layers=list(cfg.target_layers),
            hidden_size=cfg.target_hidden_size,
            hidden_state_dtype=self.head.dtype,
        )
        self._cache = self.head.make_kv_cache(num_kv_blocks, block_size)
        self._seqs: dict[Hashable, _Seq] = {}
        self._cache_ids = itertools.count()

    def info(self) -> DrafterInfo:
        return self._info

    def start(self, key: Hashable, prompt_ids: list[int], output_ids: list[int],
              sampling: DraftSampling, max_k: int) -> None:
        # Greedy whatever the sampling: one-hot drafts stay exact under rejection sampling.
        self.free(key)
        seq = _Seq(next(self._cache_ids), TokenBuffer(list(prompt_ids) + list(output_ids)),
                   greedy=sampling.temperature == 0.0)
        self._cache.add(seq.cache_id)
        self._seqs[key] = seq

    @torch.inference_mode()
    def advance(self, key: Hashable, num_drafted: int, num_accepted: int, new_token_ids: list[int],
                num_rollback_tokens: int, hidden_states: torch.Tensor | None,
                hidden_start_position: int) -> None:
        seq = self._seqs[key]
        if num_rollback_tokens:
            self._rollback(seq, num_rollback_tokens)
        seq.tokens.extend(new_token_ids)
        if hidden_states is not None and hidden_states.shape[0]:
            self._add_features(seq, hidden_states, hidden_start_position)
        rows = self._rows_ready(seq)
        if seq.num_pending > _MAX_PENDING_ROWS and rows and \
                self._cache.can_append(seq.cache_id, rows):
            self._catch_up([(seq, rows)])

    @torch.inference_mode()
    def propose(self, wanted: dict[Hashable, int]) -> dict[Hashable, Draft]:
        cap = self._info.max_num_speculative_tokens
        plan: list[tuple[Hashable, _Seq, int]] = []  # (key, seq, K)
        looked_up: dict[Hashable, Draft] = {}
        free_blocks = self._cache.num_free_blocks
        for key, k in wanted.items():
            seq, k = self._seqs.get(key), min(k, cap)
            if seq is None or k < 1:
                continue
            if self.lookup_min_n:
                copy = find_continuation(seq.tokens.view(), self.lookup_min_n,
                                         self.lookup_max_n, k)
                if copy.size:
                    looked_up[key] = Draft(copy.tolist())
                    continue
            if not self._can_draft(seq):
                continue
            rows = (k - 1) * (self.tree_width if seq.greedy else 1)  # draft rows, at most
            need = self._cache.blocks_needed(seq.cache_id, self._rows_ready(seq) + rows)
            if need > free_blocks:
                continue  # head cache full: this sequence runs without a draft this round
            free_blocks -= need
            plan.append((key, seq, k))
        if not plan:
            return looked_up
        self._catch_up([(seq, rows) for _, seq, _ in plan if (rows := self._rows_ready(seq))])
        try:
            drafts = self._draft([seq for _, seq, _ in plan], [k for _, _, k in plan])
        finally:
            for _, seq, _ in plan:
                self._cache.truncate(seq.cache_id, seq.kv_end - seq.kv_begin)
        return looked_up | {key: d for (key, _, _), d in zip(plan, drafts, strict=True)}

    def free(self, key: Hashable) -> None:
        seq = self._seqs.pop(key, None)
        if seq is not None:
            self._cache.free(seq.cache_id)

    def has(self, key: Hashable) -> bool:
        return key in self._seqs

    # -- features and the head cache -------------------------------------------------------

    @staticmethod
    def _rows_ready(seq: _Seq) -> int:
        """Rows that can join the cache: position i needs f_i and t_{i+1}."""
        return max(0, min(seq.feature_end, len(seq.tokens) - 1) - seq.kv_end)

    def _can_draft(self, seq: _Seq) -> bool:
        """Whether the head has (or is about to have) the row of position n - 2."""
        n = len(seq.tokens)
        if seq.feature_end < n - 1:
            return False  # the newest positions' features have not arrived
        return self._rows_ready(seq) > 0 or (seq.last_out is not None and seq.kv_end == n - 1)

    def _add_features(self, seq: _Seq, hidden: torch.Tensor, start: int) -> None:
        """hidden: [P, len(layers), H_t], the target's states of positions start..start+P-1."""
        num = hidden.shape[0]
        if start + num > len(seq.tokens):
            raise ValueError(f"hidden_states: positions {start}..{start + num - 1} are past the "
                             f"context's {len(seq.tokens)} tokens")
        features = self.head.features(hidden.to(self.head.device, self.head.dtype))  # [P, H]
        if start < seq.kv_begin or start > seq.feature_end:
            # No features join these to the cached rows: the head context starts over here.
            self._cut(seq, seq.kv_begin)
            seq.kv_begin = seq.kv_end = start
        elif start < seq.kv_end:
            self._cut(seq, start)  # the target recomputed committed positions
        else:
            seq.keep_pending(0, start - seq.kv_end)
        seq.pending.append(features)
        seq.num_pending += num

    def _rollback(self, seq: _Seq, num: int) -> None:
        n = len(seq.tokens) - num
        if n < 0:
            raise ValueError(f"num_rollback_tokens {num} exceeds the context's "
                             f"{len(seq.tokens)} tokens")
        seq.tokens.drop(num)
        # Row i used t_{i+1}; feature f_i used t_0..t_i.
        if seq.kv_end > max(n - 1, seq.kv_begin):
            self._cut(seq, max(n - 1, seq.kv_begin))
        else:
            seq.keep_pending(0, max(0, min(seq.num_pending, n - seq.kv_end)))

    def _cut(self, seq: _Seq, position: int) -> None:
        """Drop the cached rows from `position` on, and every pending feature."""
        seq.kv_end = position
        self._cache.truncate(seq.cache_id, position - seq.kv_begin)
        seq.pending, seq.num_pending, seq.last_out = [], 0, None

    def _catch_up(self, work: list[tuple[_Seq, int]]) -> None:
        """One forward over the ready rows of several sequences; they become committed."""
        if not work:
            return
        dev = self.head.device
        meta = self._cache.plan([(seq.cache_id, rows) for seq, rows in work])
        ids = torch.from_numpy(np.concatenate(
            [seq.tokens.view()[seq.kv_end + 1: seq.kv_end + 1 + rows] for seq, rows in work]
        )).to(dev, torch.int64)  # [T]
        features = torch.cat([seq.pending_features()[:rows] for seq, rows in work])
        positions = torch.cat([torch.arange(seq.kv_end, seq.kv_end + rows) for seq, rows in work])
        out = self.head(ids, features, positions.to(dev), meta, self._cache)  # [T, H]
        last = out.index_select(0, meta.last_token_indices())  # [B, H]
        for i, (seq, rows) in enumerate(work):
            seq.keep_pending(rows, seq.num_pending)
            seq.kv_end += rows
            seq.last_out = last[i]

    def _draft(self, seqs: list[_Seq], ks: list[int]) -> list[Draft]:
        """Drafts of each sequence, K_i tokens at most, one batched head step per depth.

        Sampled requests (and every request when tree_width is 1) get a greedy chain,
        which stops early where the head's probability of its next draft is below
        min_confidence (the first draft always stays). Greedy requests get EAGLE-2's
        dynamic tree: each step expands the tree_width most probable nodes of the
        newest depth (path probabilities), each into its tree_width most likely
        children, and the proposal is the K_i most probable nodes of all. With lookup
        on, a sequence whose context plus its most probable path ends in a repeated
        n-gram takes that path and the lookup continuation, as a chain, instead."""
        dev = self.head.device
        grows = [_Growth(k, self.tree_width if seq.greedy else 1) for seq, k in zip(seqs, ks, strict=True)]
        width = max(g.width for g in grows)
        # Step 1: every sequence's row of position n - 2 is in the head cache already.
        outs = torch.stack([seq.last_out for seq in seqs])  # [B, H]
        expanded: list[tuple[int, int]] = [(i, -1) for i in range(len(seqs))]  # (seq, node)
        while True:
            top_ids, top_probs = self.head.draft_top(outs, width)  # [R, width] each
            top_ids, top_probs = top_ids.tolist(), top_probs.tolist()
            for r, (i, node) in enumerate(expanded):
                grows[i].grow(node, outs[r], top_ids[r], top_probs[r], self.min_confidence)
            for i in {i for i, _ in expanded}:
                g = grows[i]
                g.choose_frontier()
                if self.lookup_min_n and g.new and g.depth[g.new[0]] < g.budget:
                    path = g.path(g.best_new())
                    context = np.concatenate((seqs[i].tokens.view(),
                                              np.asarray([g.tokens[v] for v in path], np.int32)))
                    copy = find_continuation(context, self.lookup_min_n, self.lookup_max_n,
                                             g.budget - len(path))
                    if copy.size:
                        g.take_chain(path, copy.tolist())
            work = [(i, v) for i, g in enumerate(grows) for v in g.frontier]
            if not work:
                return [g.proposal() for g in grows]
            # One row per frontier node: its token, after its parent's output, at its
            # position; it attends to the committed rows and its ancestors' rows.
            meta = self._cache.plan([(seqs[i].cache_id, len(g.frontier))
                                     for i, g in enumerate(grows) if g.frontier])
            masks = [g.row_mask() for g in grows if g.frontier]
            if any(m is not None for m in masks):
                meta.tree_masks = masks
            ids = torch.tensor([grows[i].tokens[v] for i, v in work], device=dev)
            positions = torch.tensor([seqs[i].kv_end + grows[i].depth[v] - 1 for i, v in work],
                                     device=dev)
            hidden = torch.stack([grows[i].parent_out(v, seqs[i].last_out) for i, v in work])
            outs = self.head(ids, hidden, positions, meta, self._cache)  # [R, H]
            for g in grows:
                g.commit_frontier()
            expanded = work


class _Growth:
    """The drafts of one sequence during one proposal: a tree of scored nodes (a chain
    when width is 1). Node v has a token, a parent (-1: the last committed token), a
    depth and a score, the product of the head's probabilities along its path. A node
    the head has run a row for (an expanded node) has that row's output, from which its
    children were drawn, and a place among this proposal's draft rows in the head cache."""

    def __init__(self, budget: int, width: int):
        self.budget, self.width = budget, width
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.depth: list[int] = []
        self.scores: list[float] = []
        self.outs: dict[int, torch.Tensor] = {}  # expanded node -> [H] its row's output
        self.rows: dict[int, int] = {}  # expanded node -> its draft row in the head cache
        self.new: list[int] = []  # nodes the last step made
        self.frontier: list[int] = []  # nodes the next step expands
        self.chain: list[int] | None = None  # set when lookup ends the proposal as a chain

    def grow(self, node: int, out: torch.Tensor, ids: list[int], probs: list[float],
             min_confidence: float) -> None:
        """Add node's children (node -1: the root) from its row's output `out` and the
        head's most likely tokens after it (ids, probs: most likely first)."""
        if node >= 0:
            self.outs[node] = out
        base = 1.0 if node < 0 else self.scores[node]
        depth = 1 if node < 0 else self.depth[node] + 1
        if self.width == 1 and node >= 0 and probs[0] < min_confidence:
            return  # the chain ends before a draft the head is unsure of
        for t, p in zip(ids[: self.width], probs[: self.width], strict=True):
            self.new.append(len(self.tokens))
            self.tokens.append(t)
            self.parents.append(node)
            self.depth.append(depth)
            self.scores.append(base * p)

    def choose_frontier(self) -> None:
        """The next step expands the `width` best new nodes, unless the tree is full
        (depth = budget) or a node cannot make the final cut: its descendants score no
        more than it does, so one that ranks below the budget now never gets in."""
        best = sorted(range(len(self.tokens)), key=lambda v: (-self.scores[v], v))
        cut = set(best[: self.budget])
        new = sorted(self.new, key=lambda v: (-self.scores[v], v))[: self.width]
        self.frontier = [v for v in new if v in cut and self.depth[v] < self.budget]

    def best_new(self) -> int:
        return min(self.new, key=lambda v: (-self.scores[v], v))

    def path(self, node: int) -> list[int]:
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def take_chain(self, path: list[int], continuation: list[int]) -> None:
        self.chain = [self.tokens[v] for v in path] + continuation
        self.frontier = []

    def parent_out(self, node: int, root_out: torch.Tensor) -> torch.Tensor:
        p = self.parents[node]
        return root_out if p < 0 else self.outs[p]

    def row_mask(self) -> torch.Tensor | None:
        """[F, R + F] bool over this proposal's draft rows in the head cache (R from
        earlier steps, then the frontier's F): each frontier row sees its ancestors'
        rows and itself. None for a chain, whose causal order is already right."""
        if self.width == 1:
            return None
        num = len(self.rows)
        mask = torch.zeros(len(self.frontier), num + len(self.frontier), dtype=torch.bool)
        for f, v in enumerate(self.frontier):
            mask[f, num + f] = True
            for u in self.path(v)[:-1]:
                mask[f, self.rows[u]] = True
        return mask

    def commit_frontier(self) -> None:
        for v in self.frontier:
            self.rows[v] = len(self.rows)
        self.new, self.frontier = [], []

    def proposal(self) -> Draft:
        if self.chain is not None:
            return Draft(self.chain)
        if self.width == 1:
            return Draft(self.tokens)
        kept, parents = top_subtree(self.parents, self.scores, self.budget)
        return Draft([self.tokens[v] for v in kept],
                     parents=None if is_chain(parents) else parents)


def _fingerprint(target_dir: Path, vocab_size: int) -> tuple[int, str]:
    """(vocab_size, hash) as the verifier reports them for this target: the tokenizer's
    hash when it covers the model's whole vocabulary, else "" (vocab_size alone)."""
    if not any((target_dir / name).is_file() for name in _TOKENIZER_FILES):
        return vocab_size, ""
    # Imported here: transformers is slow to import and only a real target needs it.
    from specdec.tokenizer import Tokenizer

    try:
        vocab, digest = Tokenizer.from_dir(target_dir).fingerprint()
    except (OSError, ValueError) as e:
        raise ValueError(f"target_dir {target_dir}: cannot load its tokenizer: {e}") from None
    return vocab_size, digest if vocab == vocab_size else ""


@register
class EagleMethod(_EagleMethod):
    name = "eagle"
    _spec_method = common_pb2.SPEC_METHOD_EAGLE


@register
class Eagle3Method(_EagleMethod):
    name = "eagle3"
    _spec_method = common_pb2.SPEC_METHOD_EAGLE3

