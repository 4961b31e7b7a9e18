"""Paged KV cache bookkeeping: appends take blocks only when needed,
rollback returns whole blocks, a full cache refuses without side effects."""

from __future__ import annotations

import pytest
import torch

from specdec.models import KVCacheFull, PagedKVCache


def make(num_blocks=6, block_size=4) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=2, num_blocks=num_blocks,
                        block_size=block_size)


def test_append_and_truncate_move_whole_blocks():
    cache = make()
    cache.add(7)
    meta = cache.plan([(7, 6)])  # 6 tokens -> 2 blocks of 4
    assert cache.num_free_blocks == 4
    assert meta.positions.tolist() == list(range(6))
    assert meta.seq_lens.tolist() == [6]
    cache.plan([(7, 2)])  # fills block 2 exactly, no new block
    assert cache.num_free_blocks == 4
    cache.truncate(7, 5)  # back into block 2: nothing to return yet
    assert cache.num_free_blocks == 4 and cache.length(7) == 5
    cache.truncate(7, 4)  # block 2 now unused
    assert cache.num_free_blocks == 5
    cache.free(7)
    assert cache.num_free_blocks == 6 and 7 not in cache


def test_rollback_keeps_earlier_kv_in_place():
    cache = make()
    cache.add(0)
    meta = cache.plan([(0, 5)])
    k = torch.arange(5 * 2, dtype=torch.float32).view(5, 1, 2)
    cache.write(0, meta.slot_mapping, k, k)
    slots_before = meta.slot_mapping[:3].clone()
    cache.truncate(0, 3)
    meta2 = cache.plan([(0, 2)])
    # The kept prefix stays where it was; the new tokens reuse positions 3, 4.
    assert meta2.positions.tolist() == [3, 4]
    assert torch.equal(cache.k[0][slots_before], k[:3])


def test_full_cache_refuses_without_changes():
    cache = make(num_blocks=3)
    cache.add(0)
    cache.add(1)
    cache.plan([(0, 8)])
    assert not cache.can_append(1, 5)
    with pytest.raises(KVCacheFull):
        cache.plan([(1, 1), (0, 5)])
    assert cache.length(0) == 8 and cache.length(1) == 0 and cache.num_free_blocks == 1


def test_ragged_metadata_layout():
    cache = make(num_blocks=8)
    for s in (0, 1, 2):
        cache.add(s)
    cache.plan([(1, 3)])
    meta = cache.plan([(0, 2), (1, 1), (2, 5)])
    assert meta.query_start.tolist() == [0, 2, 3, 8]
    assert meta.positions.tolist() == [0, 1, 3, 0, 1, 2, 3, 4]
    assert meta.last_token_indices().tolist() == [1, 2, 7]
    assert len(set(meta.slot_mapping.tolist())) == 8  # no two tokens share a slot
