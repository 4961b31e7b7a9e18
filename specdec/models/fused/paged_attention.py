"""Paged attention of decode and verify rows in Triton, reading the KV cache in place.

torch's path (specdec/models/attention.py) gathers every sequence's keys and values
into a contiguous [B, L, Hkv, D] copy and builds a [B, 1, Qmax, L] mask each layer.
Here each program walks its sequence's block table itself: a key at position n lives
at slot block_tables[b, n // block_size] * block_size + n % block_size, so nothing is
copied and no mask tensor exists; causality (by each row's position, not by its index
in the block: the CUDA-graph runner pads rows at position 0), the sequence's length
and the sliding window are computed per tile.

One program per (sequence, kv head, split of the keys): all query rows of the
sequence times all query heads that share the kv head (GQA) form one tile, so a
verify block of K + 1 rows reads each key once, not K + 1 times. Long contexts are
split (split-KV, "flash decoding") so that a small batch still fills the GPU; a
second kernel merges the splits' partial softmaxes.

Nothing reads device values on the host and the grid comes from shapes and host ints
only, so a step can be captured in a CUDA graph. Limits: chains only (token trees,
with their per-block ancestor masks, run on torch's path); every sequence brings at
most `max_query_len` rows (rows past it are dropped); rows of a sequence are
contiguous and the sequences together cover all T rows.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

# Keys per inner tile, independent of block_size (each key's slot is looked up). A
# split's key count is rounded up to a multiple of it.
BLOCK_N = 64
LOG2E = 1.4426950408889634


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D] q's dtype: written when ONE_SPLIT
    part_m_ptr,  # [T, H, S] float32: each split's running max (log2 units), else
    part_l_ptr,  # [T, H, S] float32: its sum of exp2(score - max)
    part_acc_ptr,  # [T, H, S, D] float32: its unnormalised output
    q_ptr,  # [T, H, D]
    k_ptr, v_ptr,  # [slots, Hkv, D], slot = block * BLOCK_SIZE + offset
    block_tables_ptr,  # [B, W] int32 or int64
    query_start_ptr,  # [B + 1] int64
    seq_lens_ptr,  # [B] int64
    positions_ptr,  # [T] int64
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_bt,
    qk_scale,  # scale * log2(e): scores go straight into exp2
    table_width,  # W
    sliding_window,
    num_heads, num_splits,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    SPLIT: tl.constexpr,  # keys per split, a multiple of BLOCK_N
    BLOCK_M: tl.constexpr,  # >= max_query_len * GROUP, a power of two >= 16 (tl.dot)
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM, >= 16
    HAS_WINDOW: tl.constexpr,
    ONE_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input_precision: "ieee" keeps float32 off TF32
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    num_rows = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)

    # Tile row r is query row r // GROUP of the sequence, head kv_head * GROUP + r % GROUP:
    # the group's heads are adjacent in q, so a token's heads load as one stretch.
    r = tl.arange(0, BLOCK_M)
    row = q_start + r // GROUP  # [M] token index in the step
    head = kv_head * GROUP + r % GROUP  # [M]
    row_ok = r // GROUP < num_rows  # [M] padding rows of the tile: not loaded, not stored
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    pos = tl.load(positions_ptr + row, mask=row_ok, other=0)  # [M]

    # This split's keys, trimmed to what some row can see: up to the last row's position
    # (< seq_len) and, with a window, from the first row's window start.
    hi = tl.minimum((split + 1) * SPLIT, table_width * BLOCK_SIZE)
    hi = tl.minimum(hi, tl.minimum(seq_len, tl.max(tl.where(row_ok, pos, -1), axis=0) + 1))
    lo = split * SPLIT
    if HAS_WINDOW:
        first = tl.min(tl.where(row_ok, pos, seq_len), axis=0) - sliding_window + 1
        # Down to a tile edge; SPLIT is a multiple of BLOCK_N, so lo stays in the split.
        lo = tl.maximum(lo, tl.maximum(first, 0) // BLOCK_N * BLOCK_N)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores
    l_sum = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running sum of exp2(...) * v
    table = block_tables_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)  # [N] key positions
        n_ok = n < hi
        block = tl.load(table + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + n % BLOCK_SIZE  # [N]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)  # [N, D]
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)  # [N, D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [M, N] float32
        see = row_ok[:, None] & (n[None, :] <= pos[:, None]) & (n[None, :] < seq_len)
        if HAS_WINDOW:
            see = see & (n[None, :] > pos[:, None] - sliding_window)
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row that has seen no key yet keeps m = -inf: shift by 0 instead, so that
        # -inf - -inf never happens (exp2(-inf - 0) = 0 leaves l and acc at 0).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - shift)  # [M] rescales what was summed under the old max
        p = tl.exp2(s - shift[:, None])  # [M, N]
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    if ONE_SPLIT:
        o = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
        tl.store(out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        # A split past the rows' keys ran no tile: it leaves l = 0, m = -inf, acc = 0.
        part = (row * num_heads + head) * num_splits + split  # [M]
        tl.store(part_m_ptr + part, m, mask=row_ok)
        tl.store(part_l_ptr + part, l_sum, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [T, H, D] q's dtype
    part_m_ptr, part_l_ptr,  # [T, H, S] float32
    part_acc_ptr,  # [T, H, S, D] float32
    stride_ot, stride_oh,
    num_heads, num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next power of two >= S
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    part = (row * num_heads + head) * num_splits + s  # [S]
    m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    l_sum = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)  # [S, D]
    # Every split rescaled to the common max; empty splits (m = -inf) weigh 0.
    m_max = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # [S]
    total = tl.sum(l_sum * w, axis=0)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)  # [D]
    tl.store(out_ptr + row * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d_ok)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_keys(batch: int, num_kv_heads: int, keys: int, device: torch.device) -> int:
    """Keys per split when the caller names none: on a GPU, enough splits that the
    (sequence, kv head, split) programs fill every multiprocessor twice (flash
    decoding: one sequence's 4-8 kv heads alone would leave most of an H100's 132 idle
    while they walk the whole context), never under one tile of keys; elsewhere one."""
    if device.type != "cuda":
        return keys
    wanted = triton.cdiv(2 * _multiprocessors(device), batch * num_kv_heads)
    return max(BLOCK_N, triton.cdiv(keys, wanted))


def paged_attention(q, k_cache, v_cache, block_tables, query_start, seq_lens, positions,
                    block_size: int, max_query_len: int, *, scale: float | None = None,
                    sliding_window: int | None = None, split_size: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D]; k_cache, v_cache: [slots, Hkv, D]; block_tables: [B, W] int32 or int64;
    query_start: [B + 1] int64; seq_lens: [B] int64; positions: [T] int64.
    max_query_len: host int, an upper bound on every sequence's rows (1 for decode, K + 1 for verify).
    split_size: keys per split (default: split_keys, from shapes alone).
    Returns out [T, H, D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    batch, width = block_tables.shape
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads"
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim
    assert q.stride(2) == k_cache.stride(2) == v_cache.stride(2) == 1, "head_dim contiguous"
    assert block_tables.stride(1) == 1
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if num_tokens == 0 or batch == 0:
        return out
    group = num_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if split_size is None:
        split_size = split_keys(batch, num_kv_heads, width * block_size, q.device)
    split = triton.cdiv(split_size, BLOCK_N) * BLOCK_N
    num_splits = triton.cdiv(width * block_size, split)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot's inner dim is >= 16
    if num_splits == 1:
        part_m = part_l = part_acc = None
    else:  # scratch for the partial softmaxes, merged below
        part_m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32,
                             device=q.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim,
                               dtype=torch.float32, device=q.device)
    _paged_attention_kernel[(batch, num_kv_heads, num_splits)](
        out, part_m, part_l, part_acc, q, k_cache, v_cache, block_tables, query_start,
        seq_lens, positions,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        scale * LOG2E, width, sliding_window or 0, num_heads, num_splits,
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=block_size, SPLIT=split,
        BLOCK_M=max(16, triton.next_power_of_2(max_query_len * group)), BLOCK_N=BLOCK_N,
        BLOCK_D=block_d, HAS_WINDOW=sliding_window is not None, ONE_SPLIT=num_splits == 1,
        PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_m, part_l, part_acc, out.stride(0), out.stride(1), num_heads, num_splits,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )
    return out


def paged_attention_reference(q, k_cache, v_cache, block_tables, query_start, seq_lens, positions,
                              block_size: int, *, scale: float | None = None,
                              sliding_window: int | None = None) -> torch.Tensor:
    """The same in plain torch, per sequence, softmax in float32: the tests' truth."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros_like(q)
    starts = query_start.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        rows = slice(starts[b], starts[b + 1])
        n = torch.arange(seq_len, device=q.device)  # [L] key positions
        slots = block_tables[b].long()[n // block_size] * block_size + n % block_size
        k = k_cache[slots].float().repeat_interleave(group, dim=1)  # [L, H, D]
        v = v_cache[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), k) * scale  # [H, q, L]
        pos = positions[rows, None]  # [q, 1]
        see = n[None, :] <= pos
        if sliding_window is not None:
            see = see & (n[None, :] > pos - sliding_window)
        probs = scores.masked_fill(~see, float("-inf")).softmax(dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
