"""The verifier's sampling step: target distribution, random draws, then rejection
sampling on the Triton kernel where it runs (CUDA with triton installed) and on the
torch reference elsewhere; both give the same outputs bit for bit (rejection.py has
the terms, rejection_triton.py the kernel).

Seeded requests are sampled with a draw keyed by (seed, position): the token at
position t is the inverse CDF of p_t at u_t, one float64 uniform from a generator
seeded by mixing the request's seed with t (an exact sample of p_t, whatever the
device; specdec.sampling.inverse_cdf). A draft at t is accepted when it is that
token, so every emitted token is the one plain decoding with the same seed emits
there: a seeded request's text does not depend on K, its drafter, its batch or a
resume from its tokens so far. For a one-hot draft x the rule accepts with
probability p_t(x) and otherwise yields a sample of p_t without x, exactly the usual
rejection rule; for drafts with probabilities q it accepts with sum_x q(x) p(x)
instead of sum_x min(p, q)(x), the price of that determinism. Unseeded requests keep
the usual rule and one shared generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from specdec.sampling import SamplingMetadata, apply_sampling, inverse_cdf
from verifier.sampling.rejection import draw_random, greedy_accept, rejection_sample_from_random

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """A generator seed for one (request seed, token position): splitmix64 of their
    mix, so neighbouring positions and seeds get unrelated streams. [0, 2**63)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def position_keyed_tokens(
    target_probs: torch.Tensor,  # [sum(K_i + 1), V] float32
    num_draft_tokens: Sequence[int],  # [B]
    keys: Sequence[tuple[int, int] | None],  # [B] (seed, position of the row-0 token) or None
) -> dict[int, torch.Tensor]:  # row -> sampled token id (0-d int64)
    """Each keyed request's token at every one of its rows, from its position's draw."""
    rows: list[int] = []
    draws: list[torch.Tensor] = []
    generator = torch.Generator()  # host draws: the same numbers on any device
    row = 0
    for k, key in zip(num_draft_tokens, keys, strict=True):
        if key is not None:
            seed, position = key
            for j in range(k + 1):
                generator.manual_seed(position_seed(seed, position + j))
                rows.append(row + j)
                draws.append(torch.rand(1, generator=generator, dtype=torch.float64))
        row += k + 1
    if not rows:
        return {}
    device = target_probs.device
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    tokens = inverse_cdf(target_probs.index_select(0, index), torch.cat(draws).to(device))
    return dict(zip(rows, tokens.unbind(), strict=True))


def rejection_sample(
    target_logits: torch.Tensor,  # [sum(K_i + 1), V]
    draft_token_ids: torch.Tensor,  # [sum K] int64
    draft_probs: torch.Tensor | None,  # [sum K, V] float32; None = one-hot q
    num_draft_tokens: torch.Tensor,  # [B] int64
    metadata: SamplingMetadata,
    position_keys: Sequence[tuple[int, int] | None] | None = None,  # [B]
    target_argmax: torch.Tensor | None = None,  # [sum(K_i + 1)] int64, where already taken
) -> tuple[torch.Tensor, torch.Tensor]:  # output_token_ids [B, max_K + 1], num_accepted [B]
    """One verifier step's rejection sampling; the Triton kernel runs it on CUDA when present,
    and a batch of greedy requests only reads the argmaxes (greedy_accept).

    position_keys[i]: (seed, position of its first row's token) for a seeded sampled
    request, whose tokens then come from position-keyed noise (see the module's
    docstring) and are verified as greedy tokens are; None for the others."""
    if target_argmax is None:  # a CUDA graph's step took it (runner.py)
        target_argmax = target_logits.argmax(dim=-1)
    if metadata.all_greedy:
        return greedy_accept(target_argmax, draft_token_ids, num_draft_tokens)
    target_probs = apply_sampling(target_logits, metadata, num_draft_tokens + 1)
    if position_keys is not None and any(k is not None for k in position_keys):
        greedy = metadata.is_greedy.tolist()
        keys = [k if not g else None for k, g in zip(position_keys, greedy, strict=True)]
        tokens = position_keyed_tokens(target_probs, num_draft_tokens.tolist(), keys)
        if tokens:
            rows = torch.tensor(list(tokens), dtype=torch.int64, device=target_argmax.device)
            target_argmax = target_argmax.index_put((rows,), torch.stack(list(tokens.values())))
            greedy = [g or k is not None for g, k in zip(greedy, keys, strict=True)]
            metadata = replace(metadata, is_greedy=torch.tensor(greedy, device=metadata.is_greedy.device),
                               all_greedy=all(greedy))
    if metadata.all_greedy:  # the sampled ones all seeded: verified as greedy, above
        return greedy_accept(target_argmax, draft_token_ids, num_draft_tokens)
    # The exponential race on a GPU (the Triton kernel's form); the inverse CDF elsewhere,
    # where V exponentials per request cost more than the forward (rejection.py).
    race = target_logits.is_cuda
    uniform, final_noise = draw_random(num_draft_tokens, target_logits.shape[-1], metadata, race)

    from_random = rejection_sample_from_random
    if race:
        # Imported on first CUDA use: CPU runs never pay for importing triton.
        from verifier.sampling.rejection_triton import (
            HAS_TRITON,
            rejection_sample_from_random_triton,
        )

        if HAS_TRITON:
            from_random = rejection_sample_from_random_triton
    return from_random(target_probs, target_argmax, draft_token_ids, draft_probs,
                       num_draft_tokens, metadata.is_greedy, uniform, final_noise)
