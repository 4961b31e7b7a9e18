"""The paged attention kernel (specdec/models/paged_attention.c): torch's attention
result for decode and verify rows read straight from the paged cache, each row's
rounding independent of the batch and of the rows verified beside it, and the split
of a step between the kernel and torch's path (prefill chunks, token trees, float64)."""

from __future__ import annotations

import pytest
import torch

from specdec.models import linear, paged_attention
from specdec.models.attention import SdpaBackend, _SplitState
from specdec.models.kv_cache import AttentionMetadata
from specdec.tree import ancestor_mask

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


@pytest.fixture(autouse=True, scope="module")
def kernel():
    if not paged_attention.available():
        reason = paged_attention.unavailable_reason()
        if reason.startswith("could not build"):  # a compiler and AVX2 were there
            pytest.fail(reason)
        pytest.skip(reason)


def cache(num_blocks: int, dtype=torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks * BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(num_blocks * BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
    return k, v


def step(lens: list[int], queries: list[int], tables: list[list[int]],
         trees: list[torch.Tensor | None] | None = None) -> AttentionMetadata:
    """Sequence b has lens[b] tokens, its last queries[b] new in this step."""
    positions = torch.cat([torch.arange(n - q, n) for n, q in zip(lens, queries, strict=True)])
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        positions=positions, slot_mapping=torch.zeros(len(positions), dtype=torch.int64),
        query_start=torch.tensor([0, *queries]).cumsum(0),
        seq_lens=torch.tensor(lens), block_tables=torch.tensor([t + [0] * (width - len(t))
                                                               for t in tables]),
        query_lens=list(queries), max_seq_len=max(lens), block_size=BLOCK, tree_masks=trees)


def shuffled_tables(lens: list[int], seed: int = 1) -> tuple[list[list[int]], int]:
    """Each sequence's blocks, scattered over the pool (block 0 left as padding)."""
    counts = [-(-n // BLOCK) for n in lens]
    order = (torch.randperm(sum(counts), generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    tables, at = [], 0
    for c in counts:
        tables.append(order[at:at + c])
        at += c
    return tables, sum(counts) + 1


def queries(num_tokens: int, dtype=torch.float32, seed: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, HEADS, DIM, generator=gen).to(dtype)  # [T, H, D]


def test_matches_torch_on_a_ragged_batch(monkeypatch):
    """Decode rows, verify blocks up to MAX_QUERY, a prefill chunk past it (torch's,
    by default) and a token tree, contexts from 1 token to several hundred."""
    monkeypatch.setattr(linear, "BATCH_INVARIANT", False)
    lens = [1, 37, 300, 16, 129, 64, 250]
    qs = [1, 3, 16, 1, 17, 40, 5]
    tree = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    tree[3, 1:3] = False  # token 3 hangs off token 0
    trees = [None] * 6 + [tree]
    tables, blocks = shuffled_tables(lens)
    k, v = cache(blocks)
    meta = step(lens, qs, tables, trees)
    q = queries(sum(qs))
    backend = SdpaBackend(HEADS, KV_HEADS, DIM)
    state = backend.prepare(meta)
    assert isinstance(state, _SplitState)
    assert state.kernel_seqs.tolist() == [0, 1, 2, 3, 6]  # 17 and 40 rows: torch
    got = backend.forward(q, k, v, state)
    want = backend.forward(q, k, v, backend._prepare(meta))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # float64 (the exactness tests' tiny models): torch's path for the whole step.
    k64, v64, q64 = k.double(), v.double(), q.double()
    state64 = backend.prepare(meta)
    assert torch.equal(backend.forward(q64, k64, v64, state64),
                       backend.forward(q64, k64, v64, backend._prepare(meta)))


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 128), (4, 4, 72), (6, 2, 8)])
def test_matches_torch_at_other_head_shapes(heads, kv_heads, dim):
    """Head dimensions of two vector passes of 64 columns, of one and a rest of 8, and
    of 8 alone; GQA groups of 4 and 3 and none; contexts on both sides of the kernel's
    runs of eight keys (7, 8, 9 and longer)."""
    lens, qs = [7, 8, 9, 300, 65, 129], [1, 8, 2, 5, 16, 1]
    tables, blocks = shuffled_tables(lens)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(blocks * BLOCK, kv_heads, dim, generator=gen)
    v = torch.randn(blocks * BLOCK, kv_heads, dim, generator=gen)
    q = torch.randn(sum(qs), heads, dim, generator=gen)
    backend = SdpaBackend(heads, kv_heads, dim)
    meta = step(lens, qs, tables)
    state = backend.prepare(meta)
    assert isinstance(state, _SplitState) and state.rest is None
    torch.testing.assert_close(backend.forward(q, k, v, state),
                               backend.forward(q, k, v, backend._prepare(meta)),
                               rtol=1e-5, atol=1e-5)


def test_rows_are_batch_invariant():
    """A sequence's rows come out bit for bit the same alone or beside others, and a
    verify block's rows equal decode steps at the same positions: what keeps a
    speculative step's greedy tokens those of plain decoding in float32."""
    lens = [200, 90, 333]
    tables, blocks = shuffled_tables(lens)
    k, v = cache(blocks)
    backend = SdpaBackend(HEADS, KV_HEADS, DIM)
    q = queries(3 + 1 + 4)
    together = backend.forward(q, k, v, backend.prepare(step(lens, [3, 1, 4], tables)))
    alone = backend.forward(q[:3], k, v, backend.prepare(step(lens[:1], [3], tables[:1])))
    assert torch.equal(together[:3], alone)
    # Row 1 of the first sequence's block sits at position 198: a decode step there
    # (the sequence 199 tokens long) gives the same bits.
    decode = backend.forward(q[1:2], k, v, backend.prepare(step([199], [1], tables[:1])))
    assert torch.equal(decode, together[1:2])
    # And in a batch of sixteen, on either thread count.
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            big = backend.forward(torch.cat([q[:3]] * 16), k, v,
                                  backend.prepare(step(lens[:1] * 16, [3] * 16, tables[:1] * 16)))
            assert all(torch.equal(big[3 * i:3 * i + 3], alone) for i in range(16))
    finally:
        torch.set_num_threads(threads)


def test_a_tree_token_reads_what_decoding_its_path_would():
    """A token tree's row gets the bits of a decode step of its path: its context,
    then its ancestors and itself, as if they had been decoded one by one."""
    context = 150
    mask = ancestor_mask([-1, 0, 0, 1, 2, 3])  # block: root, then tokens 0..5
    q_len = mask.shape[0]
    lens = [context + q_len, 90]
    tables, blocks = shuffled_tables(lens)
    k, v = cache(blocks)
    backend = SdpaBackend(HEADS, KV_HEADS, DIM)
    q = queries(q_len + 1)
    meta = step(lens, [q_len, 1], tables, [mask, None])
    state = backend.prepare(meta)
    assert state.kernel_seqs.tolist() == [0, 1] and state.tree_bits is not None
    tree = backend.forward(q, k, v, state)
    torch.testing.assert_close(tree, backend.forward(q, k, v, backend._prepare(meta)),
                               rtol=1e-5, atol=1e-5)
    # Token 4 (block row 5) descends from tokens 0 and 2 (rows 1, 3): decoding that path
    # puts the root, 0, 2, 4 at positions context .. context + 3. Lay a cache out so.
    path = [0, 1, 3, 5]
    slots = torch.tensor([tables[0][(context + r) // BLOCK] * BLOCK + (context + r) % BLOCK
                          for r in range(q_len)])
    k2, v2 = k.clone(), v.clone()
    k2[slots[:len(path)]], v2[slots[:len(path)]] = k[slots[path]], v[slots[path]]
    decode = backend.forward(q[5:6], k2, v2, backend.prepare(
        step([context + len(path)], [1], tables[:1])))
    assert torch.equal(decode, tree[5:6])


def test_batch_invariant_mode_takes_prefill_chunks(monkeypatch):
    """Under SPECDEC_BATCH_INVARIANT=1 prefill chunks run on the kernel too: the last
    row of a 60-row chunk gets the bits of a decode step at its position, as a
    prompt's tail after a prefix-cache hit gets those of a full prefill."""
    monkeypatch.setattr(linear, "BATCH_INVARIANT", True)
    lens = [200, 300]
    tables, blocks = shuffled_tables(lens)
    k, v = cache(blocks)
    backend = SdpaBackend(HEADS, KV_HEADS, DIM)
    q = queries(60 + 1)
    state = backend.prepare(step(lens, [60, 1], tables))
    assert isinstance(state, _SplitState) and state.kernel_seqs.tolist() == [0, 1]
    chunk = backend.forward(q, k, v, state)
    decode = backend.forward(q[59:60], k, v, backend.prepare(step([200], [1], tables[:1])))
    assert torch.equal(chunk[59:60], decode)
    torch.testing.assert_close(chunk, backend.forward(q, k, v, backend._prepare(
        step(lens, [60, 1], tables))), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(linear, "BATCH_INVARIANT", False)
    assert backend.prepare(step(lens, [60, 1], tables)).kernel_seqs.tolist() == [1]


def test_bad_operands_are_refused():
    k, v = cache(2)
    meta = step([5], [1], [[1]])
    out = torch.empty(1, HEADS, DIM)
    with pytest.raises(ValueError, match="q must be contiguous float32"):
        paged_attention.attend(queries(1).double(), k, v, out, meta.block_tables,
                               meta.query_start, meta.seq_lens, torch.tensor([0]), None, 5, BLOCK)
    with pytest.raises(ValueError, match="seqs must be contiguous int64"):
        paged_attention.attend(queries(1), k, v, out, meta.block_tables, meta.query_start,
                               meta.seq_lens, torch.tensor([0], dtype=torch.int32), None, 5,
                               BLOCK)
