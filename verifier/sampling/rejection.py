"""Rejection sampling for speculative decoding: the pure-torch reference.

Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding
with Speculative Sampling") turns K drafted tokens and one target forward over them
into 1..K+1 tokens distributed exactly as the target would have sampled them:

- accepted tokens: draft x at position j is kept with probability min(1, p_j(x) / q_j(x))
  (greedy: when x == argmax of the raw logits), provided every earlier draft was kept.
- recovered token: at the first rejected position j, a token sampled instead from
  norm(max(0, p_j - q_j)) (greedy: the argmax). Accepted prefix + recovered token are
  distributed exactly as p.
- bonus token: when all K drafts are accepted, one more token sampled from p at the last
  row, which the forward computed anyway.
- output tokens = accepted tokens + (recovered token or bonus token).

p is the target distribution after temperature, min-p, top-k and top-p (vLLM's order).
Drafts without probabilities (ngram, greedy draft models, EAGLE) are one-hot q: q(x) = 1,
so x is accepted with probability p(x) and the recovered token comes from p with x
removed. That is exact for any draft rule that does not look at the sampler's random
numbers, since for every fixed draft the output is distributed as p.

Layout is ragged, as in vLLM v1: request i has K_i >= 0 drafts (K_i = 0 is a plain
decode step) and K_i + 1 target rows, for the positions of its last token and of each
draft: row j of request i is p( . | prefix, x_1..x_j), and the rows of the batch are
concatenated, [sum(K_i + 1), V]; the drafts are concatenated likewise, [sum K_i].

Randomness is drawn up front by `draw_random`, so `rejection_sample_from_random` is
deterministic and the Triton kernel (`rejection_triton.py`) can be checked against it
exactly. At most one token per request is sampled (the recovered or the bonus token), so
one draw per request serves whichever position needs it, in one of two forms:

- the exponential race (GPUs, the Triton kernel): a noise row [V] per request,
  argmax_v r(v) / E(v) with E(v) ~ Exp(1) i.i.d. is an exact sample from norm(r), needs
  no normalisation and parallelises over the vocabulary;
- the inverse CDF (CPUs): one float64 uniform u per request, the first token whose
  cumulative weight exceeds u * sum(r) (specdec.sampling.inverse_cdf). A CPU draws V
  exponentials in about 15 ns each, on one thread: 12 ms for a batch of 16 over
  SmolLM2's 49152 tokens, a third of the step; the inverse CDF takes 0.1 ms.
"""

from __future__ import annotations

import torch

from specdec.sampling import SamplingMetadata, inverse_cdf

# Pads `output_token_ids` after each request's last emitted token.
PLACEHOLDER_TOKEN_ID = -1


def draw_random(
    num_draft_tokens: torch.Tensor,  # [B] int64
    vocab_size: int,
    metadata: SamplingMetadata,
    race: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # uniform [sum K] float32, final noise (below)
    """All random numbers one rejection-sampling step needs, from each request's generator.

    A non-greedy request i draws uniform [K_i] (acceptance), then its recovered or bonus
    token's draw: exponential noise [V] float32 when `race` (the final noise is [B, V]),
    else one float64 uniform (the final noise is [B], for `inverse_cdf`), from its own
    generator; greedy requests draw nothing. A seeded request owns its generator, so its
    draws depend only on its own K_i and V, whatever else is in the batch. Unseeded
    requests share one generator and draw together.
    """
    device = metadata.temperature.device
    counts = num_draft_tokens.tolist()
    uniform = torch.zeros(sum(counts), dtype=torch.float32, device=device)  # [sum K]
    # Greedy requests' rows: never read, but keep the divisions finite.
    final_shape, final_dtype = ((len(counts), vocab_size), torch.float32) if race else \
        ((len(counts),), torch.float64)
    final = torch.full(final_shape, 0.5, dtype=final_dtype, device=device)
    if metadata.all_greedy:
        return uniform, final

    # Group sampled requests by generator object, in batch order.
    groups: dict[int, tuple[torch.Generator, list[int]]] = {}
    for i, (generator, greedy) in enumerate(
        zip(metadata.generators, metadata.is_greedy.tolist(), strict=True)
    ):
        if not greedy:
            groups.setdefault(id(generator), (generator, []))[1].append(i)

    starts = [0] * len(counts)  # index of each request's first draft
    for i in range(1, len(counts)):
        starts[i] = starts[i - 1] + counts[i - 1]
    for generator, requests in groups.values():
        drafts = [d for i in requests for d in range(starts[i], starts[i] + counts[i])]
        if drafts:
            uniform[torch.tensor(drafts, device=device)] = torch.rand(
                len(drafts), generator=generator, dtype=torch.float32, device=device
            )
        rows = torch.tensor(requests, device=device)
        if race:
            noise = torch.empty(len(requests), vocab_size, dtype=torch.float32, device=device)
            final[rows] = noise.exponential_(generator=generator)
        else:
            final[rows] = torch.rand(len(requests), generator=generator, dtype=torch.float64,
                                     device=device)
    # Exp(1) can round to 0; p / 0 would give inf or nan.
    return uniform, final.clamp_(min=torch.finfo(torch.float32).tiny) if race else final


def check_inputs(
    target_probs: torch.Tensor,
    target_argmax: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    num_draft_tokens: torch.Tensor,
    is_greedy: torch.Tensor,
    uniform: torch.Tensor,
    final_noise: torch.Tensor,
    max_num_drafts: int | None = None,
) -> int:
    """Assert the shapes and dtypes of `rejection_sample_from_random`; return max K_i.
    Given max_num_drafts (the caller knows the K_i), nothing is read from the device."""
    (batch_size,) = num_draft_tokens.shape
    (total_drafts,) = draft_token_ids.shape
    num_rows, vocab_size = target_probs.shape
    if max_num_drafts is None:
        assert int(num_draft_tokens.sum()) == total_drafts, "num_draft_tokens must sum to the drafts"
    assert num_rows == total_drafts + batch_size, "target rows must be sum(K_i + 1)"
    assert target_probs.dtype == torch.float32
    assert target_argmax.shape == (num_rows,) and target_argmax.dtype == torch.int64
    assert draft_token_ids.dtype == torch.int64 and num_draft_tokens.dtype == torch.int64
    assert draft_probs is None or (
        draft_probs.shape == (total_drafts, vocab_size) and draft_probs.dtype == torch.float32
    )
    assert is_greedy.shape == (batch_size,) and is_greedy.dtype == torch.bool
    assert uniform.shape == (total_drafts,) and uniform.dtype == torch.float32
    assert (final_noise.shape == (batch_size, vocab_size) and final_noise.dtype == torch.float32) \
        or (final_noise.shape == (batch_size,) and final_noise.dtype == torch.float64), \
        "final_noise: exponential noise [B, V] float32 or uniforms [B] float64"
    if max_num_drafts is not None:
        return max_num_drafts
    return int(num_draft_tokens.max()) if batch_size else 0


def rejection_sample_from_random(
    target_probs: torch.Tensor,  # [N, V] float32, N = sum(K_i + 1)
    target_argmax: torch.Tensor,  # [N] int64, argmax of the raw logits
    draft_token_ids: torch.Tensor,  # [sum K] int64
    draft_probs: torch.Tensor | None,  # [sum K, V] float32; None = one-hot q
    num_draft_tokens: torch.Tensor,  # [B] int64
    is_greedy: torch.Tensor,  # [B] bool
    uniform: torch.Tensor,  # [sum K] float32 in [0, 1)
    final_noise: torch.Tensor,  # [B, V] float32 > 0 (the race) or [B] float64 in [0, 1)
    max_num_drafts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # output_token_ids [B, max_K + 1], num_accepted [B]
    """Accept, recover and add bonus tokens, given the random numbers: a pure function.
    final_noise: the sampled token's draws, as `draw_random` makes them.

    Row i of `output_token_ids` holds request i's accepted drafts, then its recovered or
    bonus token, then PLACEHOLDER_TOKEN_ID; `num_accepted[i]` counts the accepted drafts.
    max_num_drafts: max K_i when the caller knows it (saves a device read).
    """
    max_k = check_inputs(target_probs, target_argmax, draft_token_ids, draft_probs,
                         num_draft_tokens, is_greedy, uniform, final_noise, max_num_drafts)
    draft_start, row_start, is_draft, draft_index, row_index = _layout(num_draft_tokens, max_k)
    x = draft_token_ids[draft_index]  # [B, max_K]

    # Acceptance at every draft position, then keep the prefix before the first rejection.
    if max_k > 0:
        p_x = target_probs[row_index, x]  # [B, max_K]
        q_x = draft_probs[draft_index, x] if draft_probs is not None else 1.0
        # u * q < p is u < p / q without a division (so the kernel matches bit for bit);
        # strict, so a token the filters removed (p = 0) is never accepted.
        accept_random = uniform[draft_index] * q_x < p_x
        accept = torch.where(is_greedy[:, None], x == target_argmax[row_index], accept_random)
    else:
        accept = is_draft  # [B, 0]: no draft positions
    num_accepted = _kept(accept, is_draft)  # [B]
    rejected = num_accepted < num_draft_tokens  # [B]; else every draft was accepted: bonus

    # The one sampled token: recovered at the first rejection, else bonus at the last row.
    final_row = row_start + num_accepted  # [B]
    # [B, V]; with no drafts in the batch, row i is request i's (a K = 0 step's rows, uncopied)
    p = target_probs[final_row] if max_k > 0 else target_probs
    residual = p
    if max_k > 0:
        rejected_draft = torch.where(rejected, draft_start + num_accepted, 0)  # [B]
        if draft_probs is not None:
            residual = (p - draft_probs[rejected_draft]).clamp_min(0.0)
        else:
            residual = p.scatter(1, draft_token_ids[rejected_draft][:, None], 0.0)
    # max(0, p - q) is zero everywhere only through rounding, when q ~ p; sample from p then.
    if final_noise.dim() == 2:  # the race
        residual_score = residual / final_noise  # [B, V]
        use_residual = rejected & (residual_score.amax(dim=1) > 0)  # [B]
        sampled = torch.where(use_residual, residual_score.argmax(dim=1),
                              (p / final_noise).argmax(dim=1))
    else:
        weights = p
        if max_k > 0:
            use_residual = rejected & (residual.amax(dim=1) > 0)  # [B]
            weights = torch.where(use_residual[:, None], residual, p)
        sampled = inverse_cdf(weights, final_noise)
    final_token = torch.where(is_greedy, target_argmax[final_row], sampled)  # [B]
    return _outputs(x, num_accepted, final_token), num_accepted


def greedy_accept(
    target_argmax: torch.Tensor,  # [N] int64, argmax of the raw logits, N = sum(K_i + 1)
    draft_token_ids: torch.Tensor,  # [sum K] int64
    num_draft_tokens: torch.Tensor,  # [B] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # output_token_ids [B, max_K + 1], num_accepted [B]
    """`rejection_sample_from_random` for a batch of greedy requests only: a draft is
    kept while it is the argmax of its row, and the token after the kept ones is the
    argmax of the next row. Nothing else is read: the general function also builds and
    divides [B, V] rows of probabilities by noise for the sampled token, which greedy
    requests never take (2-3 ms of a 30 ms CPU step at batch 16)."""
    max_k = int(num_draft_tokens.max()) if num_draft_tokens.numel() else 0
    _, row_start, is_draft, draft_index, row_index = _layout(num_draft_tokens, max_k)
    x = draft_token_ids[draft_index]  # [B, max_K]
    num_accepted = _kept(x == target_argmax[row_index], is_draft)  # [B]
    return _outputs(x, num_accepted, target_argmax[row_start + num_accepted]), num_accepted


def greedy_chains(argmax: list[int], drafts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """greedy_accept on a batch's chains as lists, for a caller that wants lists: per
    chain its new tokens (the drafts kept while each is the argmax of its row, then the
    argmax of the row after them) and how many drafts it kept. argmax: [sum(K_i + 1)],
    each row's argmax, K_i = len(drafts[i]): computed inside a CUDA graph's step or by
    the caller. A walk in Python: greedy_accept's dozen small tensor ops cost a CPU step
    about 0.3 ms, 2 % of a 14 ms step at one request in flight."""
    token_ids, num_accepted = [], []
    row = 0
    for chain in drafts:
        kept = 0
        while kept < len(chain) and chain[kept] == argmax[row + kept]:
            kept += 1
        token_ids.append([*chain[:kept], argmax[row + kept]])
        num_accepted.append(kept)
        row += len(chain) + 1
    return token_ids, num_accepted


def _layout(num_draft_tokens: torch.Tensor, max_k: int) -> tuple[torch.Tensor, ...]:
    """Where request i's drafts and rows are: draft_start [B] and row_start [B] (its
    first draft and row), is_draft [B, max_K] (position j < K_i), and the indices of
    each position's draft and row, draft_index and row_index [B, max_K] (0 past K_i)."""
    batch_size, device = num_draft_tokens.shape[0], num_draft_tokens.device
    draft_start = num_draft_tokens.cumsum(0) - num_draft_tokens  # [B]
    row_start = draft_start + torch.arange(batch_size, device=device)  # [B]: K_i + 1 rows each
    position = torch.arange(max_k, device=device)  # [max_K]
    is_draft = position < num_draft_tokens[:, None]  # [B, max_K]
    draft_index = torch.where(is_draft, draft_start[:, None] + position, 0)  # [B, max_K]
    row_index = torch.where(is_draft, row_start[:, None] + position, 0)  # [B, max_K]
    return draft_start, row_start, is_draft, draft_index, row_index


def _kept(accept: torch.Tensor, is_draft: torch.Tensor) -> torch.Tensor:
    """[B]: how many drafts each request keeps, the prefix of its positions accepted
    (accept, is_draft [B, max_K]) before the first rejection."""
    return (accept & is_draft).long().cumprod(dim=1).sum(dim=1)


def _outputs(x: torch.Tensor, num_accepted: torch.Tensor, final_token: torch.Tensor) -> torch.Tensor:
    """[B, max_K + 1]: request i's first num_accepted[i] drafts (x [B, max_K]), then
    final_token[i], then PLACEHOLDER_TOKEN_ID."""
    batch_size, max_k = x.shape
    output_token_ids = torch.full((batch_size, max_k + 1), PLACEHOLDER_TOKEN_ID,
                                  dtype=torch.int64, device=x.device)
    is_accepted = torch.arange(max_k, device=x.device) < num_accepted[:, None]  # [B, max_K]
    output_token_ids[:, :max_k] = torch.where(is_accepted, x, PLACEHOLDER_TOKEN_ID)
    output_token_ids.scatter_(1, num_accepted[:, None], final_token[:, None])
    return output_token_ids
