"""Greedy acceptance of token-tree drafts (specdec/tree.py), ahead of the rejection sampler.

A tree block is [root, token 0, ..., token N - 1] under tree attention: token i's
row scores what follows its root path. The accepted tokens are the longest root
path whose every token is the target's argmax at its parent's row. That path,
as a chain of drafts over the rows [root, path...], is what the rejection
sampler then sees: it accepts all of it and adds the argmax at the path's end,
which is exactly the tree's greedy result. Trees are verified for greedy
requests only, so no draft distribution is involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def greedy_path(parents: Sequence[int], token_ids: Sequence[int],
                target_argmax: Sequence[int]) -> list[int]:
    """The accepted tokens of a greedy verify: indices of the longest root path on which
    every token equals the target's argmax at its parent's row. target_argmax: N + 1
    ints, the argmax of the raw logits at the root's row and then at each token's row.
    Among siblings with the same token the first wins."""
    path: list[int] = []
    node = -1
    while True:
        want = target_argmax[node + 1]
        child = next((i for i in range(node + 1, len(parents))
                      if parents[i] == node and token_ids[i] == want), None)
        if child is None:
            return path
        path.append(child)
        node = child


@dataclass(slots=True)
class TreeAcceptance:
    path: list[int]  # accepted token indices of the tree, root to leaf
    rows: list[int]  # the block's rows the chain reads: the root's (0), then 1 + j per j in path
    token_ids: list[int]  # the path's tokens: the chain's drafts


def accept_tree(logits: torch.Tensor, parents: Sequence[int],
                token_ids: Sequence[int]) -> TreeAcceptance:
    """logits: [N + 1, V] raw target logits of one tree block [root, token 0..N-1]."""
    path = greedy_path(parents, token_ids, logits.argmax(dim=-1).tolist())
    return TreeAcceptance(path, [0, *(1 + j for j in path)], [token_ids[j] for j in path])


@dataclass(slots=True)
class Chains:
    """A step's verify blocks with every tree block replaced by its accepted path."""

    logits: torch.Tensor  # [sum(len(d) + 1 for d in drafts), V], block after block
    drafts: list[list[int]]  # per block: its drafts, a chain
    paths: list[list[int] | None]  # per block: the accepted tree indices; None for a chain


def chain_blocks(logits: torch.Tensor, drafts: list[list[int]],
                 trees: list[list[int] | None]) -> Chains:
    """logits: [sum(len(d) + 1), V], the rows of each block [last token, drafts...] in
    order; trees: per block its drafts' parents, None for a chain (left as it is)."""
    if all(parents is None for parents in trees):
        return Chains(logits, drafts, [None] * len(drafts))
    rows: list[int] = []  # rows of `logits` the chains keep, in order
    chains: list[list[int]] = []
    paths: list[list[int] | None] = []
    first = 0  # first row of the block
    for draft, parents in zip(drafts, trees, strict=True):
        n = len(draft) + 1
        if parents is None:
            rows.extend(range(first, first + n))
            chains.append(draft)
            paths.append(None)
        else:
            accepted = accept_tree(logits[first: first + n], parents, draft)
            rows.extend(first + r for r in accepted.rows)
            chains.append(accepted.token_ids)
            paths.append(accepted.path)
        first += n
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    return Chains(logits.index_select(0, index), chains, paths)
