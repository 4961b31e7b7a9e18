"""Residual add and RMSNorm in one Triton kernel.

A decoder layer ends each half with `x = x + h` and the next half (or the final norm)
starts with `rms_norm(x)`: unfused on a GPU that is an add, then six to eight
elementwise and reduction kernels for the norm, each reading and writing the whole
[T, hidden] activation. Here one program per row reads x and h once, writes the sum
(the new residual) and the normalised row. The arithmetic is the reference's: the sum
rounded to the model dtype (the residual stream is kept in it), the norm in float32,
cast to the model dtype before the weight scales it (llama.rms_norm, Hugging Face).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, N] the residual stream
    h_ptr,  # [T, N] what the half-layer adds to it (unused without HAS_ADD)
    weight_ptr,  # [N]
    sum_ptr,  # [T, N] out: x + h (unused without HAS_ADD)
    out_ptr,  # [T, N] out: rms_norm(x + h) * weight
    x_stride, h_stride, sum_stride, out_stride,
    n_cols,
    eps,
    HAS_ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_ADD:
        # In the model dtype, as `x + h` rounds it in the reference.
        x = x + tl.load(h_ptr + row * h_stride + cols, mask=mask, other=0.0)
        tl.store(sum_ptr + row * sum_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, w * normed, mask=mask)


def _launch(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2 and x.stride(1) == 1, "rows of a [T, N] tensor, columns contiguous"
    t, n = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if h is not None else x
    if t:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(t,)](
            x, x if h is None else h, weight, total, out,
            x.stride(0), 0 if h is None else h.stride(0), total.stride(0), out.stride(0),
            n, eps, HAS_ADD=h is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16))
    return total, out


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x, h: [T, N] -> (x + h, rms_norm(x + h) * weight), both new tensors [T, N]."""
    assert h.shape == x.shape and h.stride(1) == 1
    return _launch(x, h, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, N] -> rms_norm(x) * weight [T, N], the same kernel without the add."""
    return _launch(x, None, weight, eps)[1]


def add_rms_norm_reference(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused torch ops the kernel replaces: an add, then llama.rms_norm's math."""
    total = x + h
    xf = total.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return total, weight * normed
