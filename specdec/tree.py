"""Token trees of draft proposals (DraftProposal.parents in drafter.proto).

A tree of N draft tokens is a list `parents` of N ints: parents[i] is the index
of token i's parent, -1 for a child of the root (the sequence's last committed
token), and parents[i] < i, so every prefix of a tree is a tree and any order
that lists parents first works for the verifier's forward. A chain is
parents == [-1, 0, 1, ..., N - 2].

The verifier feeds [root, token 0, ..., token N - 1] as one block: token i
sits at position root + depth(i) for RoPE, attends to the context, the root and
its own ancestors (`ancestor_mask`), and its target row scores what follows its
root path. For greedy requests the accepted tokens are the longest root path
whose every token is the target's argmax after its parent
(verifier/sampling/tree_acceptance.py); the KV of that path is then moved to
consecutive slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.models.kv_cache import AttentionMetadata


def check_parents(parents: Sequence[int], num_tokens: int, where: str = "parents") -> None:
    """Raise ValueError naming `where` unless parents describes a tree of num_tokens."""
    if len(parents) != num_tokens:
        raise ValueError(f"{where}: {len(parents)} entries for {num_tokens} draft tokens")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"{where}[{i}] = {p}: a parent must be -1 or an earlier token")


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each token: 1 for children of the root."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def first_child_chain(parents: Sequence[int]) -> list[int]:
    """Indices of the chain token 0, its first child, that one's first child, ...: what
    a tree keeps where only a chain can be verified (sampled requests)."""
    chain: list[int] = []
    want = -1
    for i, p in enumerate(parents):
        if p == want:
            chain.append(i)
            want = i
    return chain


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[N + 1, N + 1] bool over the block [root, token 0, ..., token N - 1]: row r may
    attend to column c (True) when c is r itself or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        mask[i + 1] = mask[p + 1]  # the parent's row (the root's for p = -1)
        mask[i + 1, i + 1] = True
    return mask


def plan_tree_attention(meta: AttentionMetadata, trees: Sequence[Sequence[int] | None],
                        root_positions: Sequence[int]) -> None:
    """Turn planned verify blocks into tree blocks: trees[b] is sequence b's parents
    (None: its block stays as planned), whose block is [root, tokens...] with the root
    at root_positions[b]. Sets meta.rope_positions (a token at depth d sits at the
    root's position + d) and meta.tree_masks (each tree's ancestor mask)."""
    rope = meta.positions.clone()
    starts = meta.query_start[:-1].tolist()
    masks: list[torch.Tensor | None] = []
    for parents, start, root in zip(trees, starts, root_positions, strict=True):
        masks.append(None if parents is None else ancestor_mask(parents))
        if parents is not None:
            depth = torch.tensor(depths(parents), dtype=torch.int64)
            rope[start + 1: start + 1 + len(parents)] = (root + depth).to(rope.device)
    meta.rope_positions, meta.tree_masks = rope, masks


def chain_with_siblings(top_ids: Sequence[Sequence[int]], top_probs: Sequence[Sequence[float]],
                        budget: int) -> tuple[list[int], list[int]]:
    """The best tree of at most `budget` tokens that a chain drafter's top choices give:
    top_ids[j][r], top_probs[j][r] are its r-th most likely token at depth j + 1 after
    the chain's own first j tokens (r = 0 is the chain's token, the most likely one).
    Each candidate scores its path probability, the product of the drafter's
    probabilities along it (EAGLE-2's estimate of its chance of acceptance), and the
    best `budget` are kept. Siblings (r > 0) are leaves: the drafter only ran the chain.
    A kept token's parent, the chain token above it, scores at least as much and sorts
    first at equal scores, so the kept set is always a tree.

    Returns (token_ids, parents), ordered by depth, then rank; token 0 and its first
    children form the chain (what a sampled request verifies)."""
    scored: list[tuple[float, int, int]] = []  # (path probability, depth - 1, rank)
    path = 1.0
    for j, (ids, probs) in enumerate(zip(top_ids, top_probs, strict=True)):
        scored.extend((path * p, j, r) for r, p in enumerate(probs[: len(ids)]))
        path *= probs[0]
    kept = sorted(sorted(scored, key=lambda c: (-c[0], c[1], c[2]))[:budget],
                  key=lambda c: (c[1], c[2]))
    index = {(j, r): i for i, (_, j, r) in enumerate(kept)}
    token_ids = [top_ids[j][r] for _, j, r in kept]
    parents = [-1 if j == 0 else index[(j - 1, 0)] for _, j, _ in kept]
    return token_ids, parents
