"""A step's drafts: what the proposer sent, cut to what the target can verify.

A drafter may only lower a sequence's K. Out-of-vocabulary ids end a draft,
a malformed draft distribution drops it (K = 0 this step), and a token tree
is verified as a tree only for greedy requests without a sliding window;
anywhere else it keeps its chain of first children (specdec/tree.py). Under a
grammar (specdec/structured.py) a draft ends at the first token the grammar forbids,
and the text the grammar then forces (tokenized) joins it as free drafts, even when
the drafter proposed nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from specdec import tree as token_tree
from specdec.models import ModelConfig
from specdec.structured import GrammarState, allowed_tokens
from verifier.engine.proposer import Proposer
from verifier.engine.scheduler import Scheduled


@dataclass(slots=True)
class Drafts:
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> [K_i] draft ids
    # seq_id -> [K_i, V] draft distribution, for the proposals that carry one (the
    # others are one-hot).
    probs: dict[int, torch.Tensor] = field(default_factory=dict)
    # seq_id -> [K_i] parents, for the drafts that form a token tree rather than a chain.
    trees: dict[int, list[int]] = field(default_factory=dict)


def collect_drafts(proposer: Proposer | None, batch: list[Scheduled],
                   model_config: ModelConfig) -> Drafts:
    """Ask the proposer for the batch's drafts (K_i = item.num_speculative_tokens) and keep
    what can be verified."""
    drafts = Drafts()
    if proposer is None:
        return drafts
    wanted = {item.seq.seq_id: item.num_speculative_tokens for item in batch
              if item.num_speculative_tokens > 0}
    tokens = {item.seq.seq_id: item.seq.tokens for item in batch if item.num_speculative_tokens > 0}
    # Called even when nobody speculates: the proposer forwards pending outcomes.
    proposals = proposer.propose(wanted, tokens)
    vocab = model_config.vocab_size
    greedy = {item.seq.seq_id: item.seq.request.sampling.is_greedy for item in batch}
    grammars = {item.seq.seq_id: item.seq.request.grammar for item in batch
                if item.seq.request.grammar is not None}
    # Logits processors read the drafts before each row as output: one path.
    chain_only = {item.seq.seq_id for item in batch if item.seq.request.processors is not None}
    for seq_id, k in wanted.items():
        p = proposals.get(seq_id)
        grammar = grammars.get(seq_id)
        if p is None:
            if grammar is not None and (forced := grammar.forced_tokens([], k)):
                drafts.token_ids[seq_id] = forced
            continue
        # A drafter can only lower K; out-of-vocabulary ids end the draft (a
        # tree's prefix is a tree: parents come first).
        ids = list(itertools.takewhile(lambda t: 0 <= t < vocab, p.token_ids[:k]))
        if p.parents is not None and not token_tree.is_chain(p.parents[: len(ids)]):
            if p.probs is not None:
                continue  # trees carry one-hot drafts only: run K = 0
            parents = p.parents[: len(ids)]
            # Trees are verified for greedy requests only; a sampled request, a
            # sliding window (it would count a tree token's slot rather than its
            # position), a grammar or logits processors (they follow one path)
            # keep the chain of first children.
            if (greedy[seq_id] and model_config.sliding_window is None and grammar is None
                    and seq_id not in chain_only):
                drafts.trees[seq_id] = parents
            else:
                ids = [ids[i] for i in token_tree.first_child_chain(parents)]
        forced: list[int] = []
        if grammar is not None:
            # A draft the grammar forbids can never be accepted: cut it, and the rest;
            # then the text the grammar forces after the drafts joins them, free.
            ids = ids[: grammar.allowed_drafts(ids)]
            forced = grammar.forced_tokens(ids, k - len(ids))
        if p.probs is not None and ids:
            if p.probs.dim() != 2 or p.probs.shape[0] < len(ids) or p.probs.shape[1] != vocab:
                continue  # a malformed q can't be verified exactly: run K = 0
            q = p.probs[: len(ids)]  # [K_i, V]
            if grammar is not None:
                q = _within_grammar(q, grammar, ids, vocab)
                if q is None:
                    continue  # q gave a kept draft no mass: run K = 0
            if forced:  # a deterministic proposal: one-hot q
                q = torch.cat([q, torch.nn.functional.one_hot(
                    torch.tensor(forced), vocab).to(q.dtype)])
            drafts.probs[seq_id] = q
        ids = ids + forced
        drafts.token_ids[seq_id] = ids
    return drafts


def _within_grammar(q: torch.Tensor, grammar: GrammarState, ids: list[int],
                    vocab: int) -> torch.Tensor | None:
    """q [K, V] of drafts the grammar allows, each row renormalised over what the grammar
    allows after the drafts before it; None where a row keeps no mass.

    Cutting a chain at its first forbidden draft makes a kept draft j a sample of
    q_j restricted to the allowed set S_j, not of q_j: verified against q_j itself,
    its acceptance min(1, p/q_j) and residual would be those of another proposal, and
    the output law would drift from p (measured: the chi-square test under a grammar
    mask fails). Against q_j restricted to S_j and renormalised, the kept branch is
    exact, and so is the cut one, whose position is sampled from p."""
    bitmask = grammar.new_bitmask(len(ids) + 1)  # [K + 1, ceil(V / 32)]
    grammar.fill_masks(ids, bitmask, 0)
    allowed = allowed_tokens(bitmask, vocab)[: len(ids)].to(q.device)  # [K, V]
    q = q * allowed
    mass = q.sum(-1, keepdim=True)  # [K, 1]
    if not bool((mass > 0).all()):
        return None
    return q / mass
