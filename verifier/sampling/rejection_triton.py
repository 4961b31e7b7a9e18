"""Triton kernel for `rejection_sample_from_random` (see `rejection.py` for the terms).

Same signature and outputs as the torch reference, bit for bit: acceptance compares
u * q(x) < p(x) (products are exactly rounded everywhere), the exponential race divides
with `div_rn` (IEEE division; Triton's `/` may be approximate on GPUs), and the vocab
argmax keeps the first maximum, as torch.argmax does. Tests run it on CPU with
TRITON_INTERPRET=1. Triton comes with the `gpu` extra; without it HAS_TRITON is False.
"""

from __future__ import annotations

import torch

from .rejection import PLACEHOLDER_TOKEN_ID, check_inputs

try:
    import triton
    import triton.language as tl
except ImportError:
    HAS_TRITON = False
else:
    HAS_TRITON = True

# Vocab tile of the recovered/bonus argmax; one program walks a whole row in tiles.
BLOCK_V = 1024


if HAS_TRITON:

    @triton.jit
    def _rejection_sample_kernel(
        output_token_ids_ptr,  # [B, max_K + 1] int64, prefilled with PLACEHOLDER_TOKEN_ID
        num_accepted_ptr,  # [B] int64
        target_probs_ptr,  # [N, V] float32
        target_argmax_ptr,  # [N] int64
        draft_token_ids_ptr,  # [sum K] int64
        draft_probs_ptr,  # [sum K, V] float32, or None
        num_draft_tokens_ptr,  # [B] int64
        draft_start_ptr,  # [B] int64: index of each request's first draft
        is_greedy_ptr,  # [B] bool
        uniform_ptr,  # [sum K] float32
        exp_noise_ptr,  # [B, V] float32
        vocab_size,
        output_stride,
        HAS_DRAFT_PROBS: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        req = tl.program_id(0).to(tl.int64)
        num_drafts = tl.load(num_draft_tokens_ptr + req)
        draft_start = tl.load(draft_start_ptr + req)
        row_start = draft_start + req  # request i owns K_i + 1 target rows
        is_greedy = tl.load(is_greedy_ptr + req)

        # Triton loops cannot break: a draft counts only while no earlier one was rejected,
        # i.e. while num_accepted still equals its position.
        num_accepted = 0
        for j in range(0, num_drafts):
            x = tl.load(draft_token_ids_ptr + draft_start + j)
            row = row_start + j
            p_x = tl.load(target_probs_ptr + row * vocab_size + x)
            if HAS_DRAFT_PROBS:
                q_x = tl.load(draft_probs_ptr + (draft_start + j) * vocab_size + x)
            else:
                q_x = 1.0
            u = tl.load(uniform_ptr + draft_start + j)
            accept = tl.where(is_greedy, x == tl.load(target_argmax_ptr + row), u * q_x < p_x)
            num_accepted += (accept & (num_accepted == j)).to(tl.int32)
        for j in range(0, num_accepted):
            token = tl.load(draft_token_ids_ptr + draft_start + j)
            tl.store(output_token_ids_ptr + req * output_stride + j, token)

        final_row = row_start + num_accepted
        final_token = tl.load(target_argmax_ptr + final_row)
        if not is_greedy:
            rejected = num_accepted < num_drafts  # else all accepted: bonus token
            rejected_draft = draft_start + num_accepted
            x_rejected = tl.load(draft_token_ids_ptr + rejected_draft, mask=rejected, other=-1)
            # Running argmax over tiles of residual / E and of p / E; strict > across tiles
            # keeps the first maximum, and lanes past V score -1 so they never win.
            best_residual = -1.0
            best_residual_idx = 0
            best_p = -1.0
            best_p_idx = 0
            for v0 in range(0, vocab_size, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                in_vocab = offs < vocab_size
                p = tl.load(target_probs_ptr + final_row * vocab_size + offs, mask=in_vocab,
                            other=0.0)
                e = tl.load(exp_noise_ptr + req * vocab_size + offs, mask=in_vocab, other=1.0)
                if HAS_DRAFT_PROBS:
                    # No q row to read for the bonus token (it may lie past the drafts).
                    q = tl.load(draft_probs_ptr + rejected_draft * vocab_size + offs,
                                mask=offs < tl.where(rejected, vocab_size, 0), other=0.0)
                    residual = tl.maximum(p - q, 0.0)
                else:
                    residual = tl.where(offs == x_rejected, 0.0, p)
                residual_score = tl.where(in_vocab, tl.math.div_rn(residual, e), -1.0)
                p_score = tl.where(in_vocab, tl.math.div_rn(p, e), -1.0)

                tile_best, tile_idx = tl.max(residual_score, axis=0, return_indices=True,
                                             return_indices_tie_break_left=True)
                better = tile_best > best_residual
                best_residual = tl.where(better, tile_best, best_residual)
                best_residual_idx = tl.where(better, v0 + tile_idx, best_residual_idx)
                tile_best, tile_idx = tl.max(p_score, axis=0, return_indices=True,
                                             return_indices_tie_break_left=True)
                better = tile_best > best_p
                best_p = tl.where(better, tile_best, best_p)
                best_p_idx = tl.where(better, v0 + tile_idx, best_p_idx)
            # An all-zero residual only comes from rounding when q ~ p: sample from p then.
            use_residual = rejected & (best_residual > 0)
            final_token = tl.where(use_residual, best_residual_idx, best_p_idx).to(tl.int64)
        tl.store(output_token_ids_ptr + req * output_stride + num_accepted, final_token)
        tl.store(num_accepted_ptr + req, num_accepted)


def rejection_sample_from_random_triton(
    target_probs: torch.Tensor,  # [N, V] float32, N = sum(K_i + 1)
    target_argmax: torch.Tensor,  # [N] int64
    draft_token_ids: torch.Tensor,  # [sum K] int64
    draft_probs: torch.Tensor | None,  # [sum K, V] float32; None = one-hot q
    num_draft_tokens: torch.Tensor,  # [B] int64
    is_greedy: torch.Tensor,  # [B] bool
    uniform: torch.Tensor,  # [sum K] float32
    exp_noise: torch.Tensor,  # [B, V] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # output_token_ids [B, max_K + 1], num_accepted [B]
    """`rejection.rejection_sample_from_random`, one Triton program per request."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; it comes with the `gpu` extra")
    max_k = check_inputs(target_probs, target_argmax, draft_token_ids, draft_probs,
                         num_draft_tokens, is_greedy, uniform, exp_noise)
    batch_size = num_draft_tokens.shape[0]
    vocab_size = target_probs.shape[1]
    device = target_probs.device
    output_token_ids = torch.full(
        (batch_size, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device
    )
    num_accepted = torch.empty(batch_size, dtype=torch.int64, device=device)
    if batch_size == 0:
        return output_token_ids, num_accepted
    draft_start = num_draft_tokens.cumsum(0) - num_draft_tokens  # [B]
    _rejection_sample_kernel[(batch_size,)](
        output_token_ids,
        num_accepted,
        target_probs.contiguous(),
        target_argmax.contiguous(),
        draft_token_ids.contiguous(),
        draft_probs.contiguous() if draft_probs is not None else None,
        num_draft_tokens.contiguous(),
        draft_start,
        is_greedy.contiguous(),
        uniform.contiguous(),
        exp_noise.contiguous(),
        vocab_size,
        output_token_ids.stride(0),
        HAS_DRAFT_PROBS=draft_probs is not None,
        BLOCK_V=BLOCK_V,
        num_warps=4,
    )
    return output_token_ids, num_accepted
