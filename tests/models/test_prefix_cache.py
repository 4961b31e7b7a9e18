"""Prefix caching in the paged KV cache: refcounts, chained hashes, the LRU of
evictable blocks, and rollbacks that never touch a block another sequence shares."""

from __future__ import annotations

import pytest
import torch

from specdec.models import PagedKVCache
from specdec.models.prefix_cache import ROOT_HASH, BlockPool, chain_hash

BS = 4


def make(num_blocks=8) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=2, num_blocks=num_blocks,
                        block_size=BS, enable_prefix_caching=True)


def prefill(cache: PagedKVCache, seq_id: int, tokens: list[int], cache_salt: str = "") -> int:
    """Add a sequence, 'compute' the KV of its uncached tokens (each slot's K and V
    hold its token id and position), commit them. Returns the cached token count."""
    hit = cache.add(seq_id, tokens, cache_salt=cache_salt)
    meta = cache.plan([(seq_id, len(tokens) - hit)])
    kv = torch.tensor([[t, p] for t, p in zip(tokens[hit:], meta.positions.tolist(),
                                              strict=True)], dtype=torch.float32)[:, None]
    for layer in range(2):
        cache.write(layer, meta.slot_mapping, kv, kv)
    cache.commit(seq_id, tokens, len(tokens))
    return hit


def kv_rows(cache: PagedKVCache, seq_id: int) -> list[list[float]]:
    """[length] (token, position) read back from the sequence's slots, layer 0."""
    blocks = cache.blocks(seq_id)
    slots = [blocks[p // BS] * BS + p % BS for p in range(cache.length(seq_id))]
    return cache.k[0, slots, 0].tolist()


def test_shared_prefix_is_reused_with_refcounts():
    cache = make()
    prompt = list(range(10, 20))  # 10 tokens: blocks [0:4] [4:8] full, [8:10] partial
    assert prefill(cache, 0, prompt) == 0
    # Same first 9 tokens: both full blocks hit; the partial one never is.
    assert prefill(cache, 1, prompt[:9] + [99, 98]) == 8
    a, b = cache.blocks(0), cache.blocks(1)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert [cache.pool.refcount[x] for x in a[:2]] == [2, 2]
    assert kv_rows(cache, 1)[:8] == [[t, p] for p, t in enumerate(prompt[:8])]
    # 3 blocks for sequence 0, 1 private for sequence 1.
    assert cache.num_free_blocks == 8 - 4


def test_the_last_prompt_token_is_always_computed():
    cache = make()
    prompt = list(range(8))  # exactly two full blocks
    prefill(cache, 0, prompt)
    assert prefill(cache, 1, prompt) == 4  # never 8: one token must produce logits


def test_hash_is_chained_over_the_prefix():
    cache = make()
    prefill(cache, 0, [1, 2, 3, 4, 5, 6, 7, 8, 0])
    # Block [5, 6, 7, 8] is cached, but after a different first block: no hit.
    assert prefill(cache, 1, [9, 9, 9, 9, 5, 6, 7, 8, 0]) == 0
    assert chain_hash(ROOT_HASH, [5, 6, 7, 8]) != chain_hash(chain_hash(ROOT_HASH, [1, 2, 3, 4]),
                                                            [5, 6, 7, 8])


def test_freed_blocks_stay_cached_and_are_evicted_least_recent_first():
    cache = make(num_blocks=6)
    prefill(cache, 0, [1] * 9)   # blocks A0 A1 (hashed) + a partial one
    prefill(cache, 1, [2] * 9)   # B0 B1 + partial
    a, b = cache.blocks(0), cache.blocks(1)
    cache.free(0)
    cache.free(1)
    assert cache.num_free_blocks == 6
    # Released last block first: the tail of a prefix goes before its head.
    assert cache.pool.evictable() == [a[1], a[0], b[1], b[0]]
    # Still findable after free: sequence 0's prompt hits both blocks again.
    assert prefill(cache, 2, [1] * 9) == 8
    cache.free(2)
    assert cache.pool.evictable() == [b[1], b[0], a[1], a[0]]
    # Three fresh blocks for a new prompt: the two never-hashed free ones first, then
    # the least recently released cached block, b[1].
    prefill(cache, 3, [3] * 11)
    assert cache.pool.num_evictions == 1 and cache.pool.evictable() == [b[0], a[1], a[0]]
    # b's chain kept its head only; its recompute takes a's blocks, oldest first.
    assert prefill(cache, 4, [2] * 9) == 4
    assert cache.pool.num_evictions == 3 and cache.pool.evictable() == []
    cache.free(3)
    assert prefill(cache, 5, [1] * 9) == 0


def test_eviction_order_is_lru():
    pool = BlockPool(3, enable_caching=True)
    blocks = [pool.allocate() for _ in range(3)]
    for i, block in enumerate(blocks):
        pool.register(block, bytes([i]))
    for block in (blocks[1], blocks[0], blocks[2]):
        pool.release(block)
    assert pool.lookup(bytes([0])) == blocks[0]
    pool.share(blocks[0])  # a hit takes it out of the LRU
    assert pool.evictable() == [blocks[1], blocks[2]]
    assert pool.allocate() == blocks[1] and pool.lookup(bytes([1])) is None
    pool.release(blocks[0])  # back in, now most recent
    assert pool.evictable() == [blocks[2], blocks[0]]
    assert pool.allocate() == blocks[2] and pool.allocate() == blocks[0]
    with pytest.raises(RuntimeError):
        pool.allocate()


def test_rollback_of_a_sharing_sequence_leaves_the_other_intact():
    cache = make()
    prompt = list(range(30, 39))
    prefill(cache, 0, prompt)
    before = kv_rows(cache, 0)
    assert prefill(cache, 1, prompt) == 8
    shared = cache.blocks(1)[:2]
    # Sequence 1 speculates 6 tokens past its prompt and rolls all of them back ...
    meta = cache.plan([(1, 6)])
    junk = torch.full((6, 1, 2), -1.0)
    cache.write(0, meta.slot_mapping, junk, junk)
    cache.truncate(1, 9)
    # ... then even below the shared prefix, into the middle of a shared block.
    cache.truncate(1, 6)
    assert cache.blocks(1)[0] == shared[0] and cache.blocks(1)[1] != shared[1]
    assert [cache.pool.refcount[x] for x in shared] == [2, 1]
    assert cache.pool.is_registered(shared[1])  # still cached for others
    meta = cache.plan([(1, 3)])  # appends go to the private copy
    cache.write(0, meta.slot_mapping, junk[:3], junk[:3])
    assert kv_rows(cache, 0) == before
    assert kv_rows(cache, 1)[:6] == before[:6]
    assert prefill(cache, 2, prompt) == 8  # and the cached chain still hits


def test_tree_move_refuses_committed_positions():
    cache = make()
    prefill(cache, 0, list(range(9)))
    cache.plan([(0, 3)])
    cache.move(0, [10, 11], [9, 10])  # speculative positions: fine
    with pytest.raises(ValueError, match="committed"):
        cache.move(0, [9], [3])


def test_only_committed_blocks_are_registered():
    cache = make()
    cache.add(0, [5] * 9)
    cache.plan([(0, 9)])
    cache.commit(0, [5] * 9, 3)  # only 3 tokens final: no full block yet
    assert not any(cache.pool.is_registered(b) for b in cache.blocks(0))
    cache.commit(0, [5] * 9, 9)
    assert [cache.pool.is_registered(b) for b in cache.blocks(0)] == [True, True, False]
    with pytest.raises(ValueError):
        cache.commit(0, [5] * 20, 20)  # past the sequence's KV


def test_duplicate_computation_stays_private():
    cache = make()
    cache.add(0, [7] * 5)
    cache.add(1, [7] * 5)  # admitted together: neither finds the other
    cache.plan([(0, 5), (1, 5)])
    cache.commit(0, [7] * 5, 5)
    cache.commit(1, [7] * 5, 5)
    b0, b1 = cache.blocks(0)[0], cache.blocks(1)[0]
    assert cache.pool.is_registered(b0) and not cache.pool.is_registered(b1)
    cache.free(1)
    assert cache.pool.num_evictable == 0  # the private copy is plainly free


def test_disabled_cache_never_hits():
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=4, block_size=BS)
    assert cache.add(0, [1] * 9) == 0
    cache.plan([(0, 9)])
    cache.commit(0, [1] * 9, 9)
    cache.free(0)
    assert cache.pool.num_evictable == 0 and cache.num_free_blocks == 4
    assert cache.add(1, [1] * 9) == 0


def test_a_copy_with_features_takes_the_prefix_over():
    """Blocks registered without features serve no sequence that wants them; a copy
    computed with features takes the hash over, and then serves both kinds."""
    cache = make()
    cache.keep_features((0,), hidden_size=3)
    tokens = list(range(9))
    prefill(cache, 0, tokens)  # no features kept: its two full blocks carry none
    cache.free(0)
    assert cache.add(1, tokens, features=True) == 0  # nothing it can take
    meta = cache.plan([(1, len(tokens))])
    rows = torch.arange(len(tokens) * 3, dtype=torch.float32).view(len(tokens), 3)
    cache.write_features(meta.slot_mapping, rows)
    cache.commit(1, tokens, len(tokens))
    assert cache.pool.num_evictable == 0  # the featureless copies went free at once
    cache.free(1)
    assert cache.add(2, tokens, features=True) == 8
    assert torch.equal(cache.read_features(2, 8), rows[:8])
    assert cache.add(3, tokens) == 8  # a sequence without features hits the same blocks
    assert cache.blocks(3)[:2] == cache.blocks(2)[:2]


def test_a_cache_salt_shares_only_with_its_own_salt():
    """vLLM's cache_salt: the same prompt under another salt (or none) finds nothing;
    under the same salt, every full block but the last token's."""
    cache = make(16)
    prompt = list(range(10, 20))
    assert prefill(cache, 0, prompt, "tenant-a") == 0
    assert prefill(cache, 1, prompt) == 0
    assert prefill(cache, 2, prompt, "tenant-b") == 0
    assert prefill(cache, 3, prompt, "tenant-a") == 8
    assert prefill(cache, 4, prompt) == 8  # no salt shares with no salt
    assert cache.blocks(3)[:2] == cache.blocks(0)[:2] != cache.blocks(2)[:2]
