"""Rotary embedding of q and k and the paged KV write, in one Triton kernel.

Unfused, a layer computes cos/sin for the step, rotates q and k (four elementwise
kernels over [T, H + Hkv, D]) and writes k and v into the cache with two index_copy
kernels. Here one program per token reads its row of the qkv projection [H + 2 Hkv, D]
once: it rotates the query heads into q_out, rotates the key heads and writes them,
and the value heads unrotated, to the token's cache slot. cos and sin come from the
position and the model's inverse frequencies in float32 (rope.RotaryEmbedding's
arithmetic, scaling included), so no [T, D] tables are made per step. The rotation is
Hugging Face's rotate-half: out1 = x1 cos - x2 sin, out2 = x2 cos + x1 sin (x1, x2 the
halves of a head), computed in float32 and rounded once to the model dtype, where the
reference rounds each product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.models.rope import apply_rotary, cos_sin


@triton.jit
def _rotary_kv_kernel(
    qkv_ptr,  # [T, H + 2 Hkv, D]: this step's projection
    q_out_ptr,  # [T, H, D] out: rotated queries
    k_cache_ptr, v_cache_ptr,  # [slots, Hkv, D]: one layer's cache
    rope_pos_ptr,  # [T] int64: the position each token is rotated by
    slot_ptr,  # [T] int64: the cache slot each token's k and v go to
    inv_freq_ptr,  # [D / 2] float32
    qkv_stride, q_out_stride, cache_stride,  # row strides of the three
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
    HALF_P2: tl.constexpr, QH_P2: tl.constexpr, KH_P2: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = D // 2
    i = tl.arange(0, HALF_P2)
    i_ok = i < half
    freq = tl.load(rope_pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=i_ok,
                                                              other=0.0)
    cos = tl.cos(freq)[None, :]  # [1, HALF]
    sin = tl.sin(freq)[None, :]
    row = qkv_ptr + t * qkv_stride

    # Query heads 0..H-1 -> q_out.
    h = tl.arange(0, QH_P2)
    m = (h < H)[:, None] & i_ok[None, :]
    src = row + h[:, None] * D + i[None, :]  # [QH, HALF]: first halves
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=m, other=0.0).to(tl.float32)
    dst = q_out_ptr + t * q_out_stride + h[:, None] * D + i[None, :]
    tl.store(dst, x1 * cos - x2 * sin, mask=m)
    tl.store(dst + half, x2 * cos + x1 * sin, mask=m)

    # Key heads H..H+Hkv-1 rotated, value heads after them as they are -> the cache slot.
    slot = tl.load(slot_ptr + t)
    g = tl.arange(0, KH_P2)
    m = (g < HKV)[:, None] & i_ok[None, :]
    src = row + (H + g[:, None]) * D + i[None, :]
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=m, other=0.0).to(tl.float32)
    dst = k_cache_ptr + slot * cache_stride + g[:, None] * D + i[None, :]
    tl.store(dst, x1 * cos - x2 * sin, mask=m)
    tl.store(dst + half, x2 * cos + x1 * sin, mask=m)
    src = row + (H + HKV + g[:, None]) * D + i[None, :]
    dst = v_cache_ptr + slot * cache_stride + g[:, None] * D + i[None, :]
    tl.store(dst, tl.load(src, mask=m), mask=m)
    tl.store(dst + half, tl.load(src + half, mask=m), mask=m)


def rotary_kv_write(qkv: torch.Tensor, num_heads: int, rope_positions: torch.Tensor,
                    slot_mapping: torch.Tensor, inv_freq: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """qkv: [T, H + 2 Hkv, D] (rows may be strided, heads contiguous); rope_positions,
    slot_mapping: [T] int64; inv_freq: [D / 2] float32; k_cache, v_cache: [slots, Hkv, D].
    Writes the rotated keys and the values into the cache; returns the rotated
    queries [T, H, D]."""
    t, heads, d = qkv.shape
    num_kv = (heads - num_heads) // 2
    assert heads == num_heads + 2 * num_kv and d % 2 == 0
    assert qkv.stride(2) == 1 and qkv.stride(1) == d, "each token's heads contiguous"
    assert k_cache.shape[1:] == (num_kv, d) and k_cache.is_contiguous() and v_cache.is_contiguous()
    q = qkv.new_empty(t, num_heads, d)
    if t:
        _rotary_kv_kernel[(t,)](
            qkv, q, k_cache, v_cache, rope_positions, slot_mapping, inv_freq,
            qkv.stride(0), q.stride(0), k_cache.stride(0),
            H=num_heads, HKV=num_kv, D=d, HALF_P2=triton.next_power_of_2(d // 2),
            QH_P2=triton.next_power_of_2(num_heads), KH_P2=triton.next_power_of_2(num_kv),
            num_warps=4)
    return q


def rotary_kv_write_reference(qkv, num_heads, rope_positions, slot_mapping, inv_freq,
                              k_cache, v_cache) -> torch.Tensor:
    """The unfused torch ops: rope.apply_rotary on q and k, then the cache's index_copy."""
    num_kv = (qkv.shape[1] - num_heads) // 2
    cos, signed_sin = cos_sin(rope_positions, inv_freq, qkv.dtype)
    qk = apply_rotary(qkv[:, :num_heads + num_kv], cos, signed_sin)
    k_cache.index_copy_(0, slot_mapping, qk[:, num_heads:])
    v_cache.index_copy_(0, slot_mapping, qkv[:, num_heads + num_kv:])
    return qk[:, :num_heads]
