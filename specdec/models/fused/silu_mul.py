"""SiLU(gate) * up in one Triton kernel, reading the fused gate_up projection in place.

The MLP's gate_up output is [T, 2I] (gate columns first); unfused, F.silu and the
product are two kernels over [T, I] plus the strided views. One program per
(row, chunk of BLOCK columns) reads a chunk of gate and the matching chunk of up and
writes the product. As in the reference, SiLU is computed in float32 and rounded to
the model dtype before the product (F.silu on a bfloat16 tensor returns bfloat16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2I]
    out_ptr,  # [T, I]
    gate_up_stride, out_stride,
    n_cols,  # I
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    base = gate_up_ptr + row * gate_up_stride
    gate = tl.load(base + cols, mask=mask, other=0.0)
    up = tl.load(base + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(up.dtype)
    tl.store(out_ptr + row * out_stride + cols, silu * up, mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [T, 2I] (columns contiguous) -> silu(gate) * up: [T, I]."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(t, n)
    if t:
        _silu_mul_kernel[(t, triton.cdiv(n, BLOCK))](
            gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=BLOCK, num_warps=4)
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
