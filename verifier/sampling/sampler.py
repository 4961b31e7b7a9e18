"""The verifier's sampling step: target distribution, random draws, then rejection
sampling on the Triton kernel where it runs (CUDA with triton installed) and on the
torch reference elsewhere; both give the same outputs bit for bit (rejection.py has
the terms, rejection_triton.py the kernel)."""

from __future__ import annotations

import torch

from specdec.sampling import SamplingMetadata, apply_sampling
from verifier.sampling.rejection import draw_random, rejection_sample_from_random


def rejection_sample(
    target_logits: torch.Tensor,  # [sum(K_i + 1), V]
    draft_token_ids: torch.Tensor,  # [sum K] int64
    draft_probs: torch.Tensor | None,  # [sum K, V] float32; None = one-hot q
    num_draft_tokens: torch.Tensor,  # [B] int64
    metadata: SamplingMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:  # output_token_ids [B, max_K + 1], num_accepted [B]
    """One verifier step's rejection sampling; the Triton kernel runs it on CUDA when present."""
    target_argmax = target_logits.argmax(dim=-1)  # greedy reads the raw logits
    if metadata.all_greedy:
        target_probs = target_logits.float()  # never read: only greedy requests
    else:
        target_probs = apply_sampling(target_logits, metadata, num_draft_tokens + 1)
    uniform, exp_noise = draw_random(num_draft_tokens, target_logits.shape[-1], metadata)

    from_random = rejection_sample_from_random
    if target_logits.is_cuda:
        # Imported on first CUDA use: CPU runs never pay for importing triton.
        from verifier.sampling.rejection_triton import (
            HAS_TRITON,
            rejection_sample_from_random_triton,
        )

        if HAS_TRITON:
            from_random = rejection_sample_from_random_triton
    return from_random(target_probs, target_argmax, draft_token_ids, draft_probs,
                       num_draft_tokens, metadata.is_greedy, uniform, exp_noise)
