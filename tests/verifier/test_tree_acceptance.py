"""Greedy acceptance of tree drafts: the accepted root path, and a step's blocks
turned into the chains the rejection sampler verifies."""

from __future__ import annotations

import torch

from tests.verifier.test_tree import PARENTS
from verifier.sampling.tree_acceptance import accept_tree, chain_blocks, greedy_path


def test_greedy_path_follows_the_target():
    tokens = [10, 11, 12, 20, 13, 21, 22]
    # argmax at rows [root, 0..6]: root wants 20 (token 3), token 3 wants 21, 5 wants 22,
    # 6 wants anything: the path is 3, 5, 6.
    argmax = [20, 11, 12, 0, 21, 0, 22, 5]
    assert greedy_path(PARENTS, tokens, argmax) == [3, 5, 6]
    argmax[0] = 10  # now the chain: 0, 1 (argmax at 0's row is 11), 2, then nothing
    assert greedy_path(PARENTS, tokens, argmax) == [0, 1, 2]
    argmax[1] = 13  # after 0 the target wants 13: sibling 4 of token 1
    assert greedy_path(PARENTS, tokens, argmax) == [0, 4]
    assert greedy_path(PARENTS, tokens, [99] * 8) == []


def _rows(argmax: list[int], vocab: int = 32) -> torch.Tensor:
    """[len(argmax), vocab] logits whose row i has its maximum at argmax[i]."""
    logits = torch.randn(len(argmax), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmax)), argmax] = 10.0
    return logits


def test_accept_tree_gives_the_path_as_a_chain():
    tokens = [10, 11, 12, 20, 13, 21, 22]
    accepted = accept_tree(_rows([20, 11, 12, 0, 21, 0, 22, 5]), PARENTS, tokens)
    assert accepted.path == [3, 5, 6]
    assert accepted.rows == [0, 4, 6, 7] and accepted.token_ids == [20, 21, 22]


def test_chain_blocks_reindexes_tree_blocks_only():
    chain, tokens = [7, 8], [10, 11, 12, 20, 13, 21, 22]
    # Blocks: a chain of 2 drafts (3 rows), a tree of 7 (8 rows), a prefill row (no drafts).
    logits = torch.cat([_rows([7, 8, 9]), _rows([10, 13, 0, 0, 0, 0, 0, 0]), _rows([3])])
    out = chain_blocks(logits, [chain, tokens, []], [None, PARENTS, None])
    assert out.drafts == [chain, [10, 13], []] and out.paths == [None, [0, 4], None]
    # The tree's rows [root, token 0, token 4] (3, 4, 8), the others as they were.
    assert torch.equal(out.logits, logits[[0, 1, 2, 3, 4, 8, 11]])
    # No tree: nothing changes.
    same = chain_blocks(logits[:3], [chain], [None])
    assert torch.equal(same.logits, logits[:3])
    assert same.drafts == [chain] and same.paths == [None]
