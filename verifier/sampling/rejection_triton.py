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

# One program per (request, chunk of BLOCK_V tokens): a batch of 64 requests over a 128k
# vocabulary runs 8064 short programs rather than 64 long ones (measured on an H100:
# 1024 tokens and 4 warps beat 2048-8192 tokens and 8-16 warps). The last of a request's
# programs to finish reduces the chunks' bests and writes the request's row.
BLOCK_V = 1024
NUM_WARPS = 4
PLACEHOLDER = tl.constexpr(PLACEHOLDER_TOKEN_ID) if HAS_TRITON else PLACEHOLDER_TOKEN_ID

# Per device, one arrival counter per request, zero between calls (the last program of
# each request resets its own); grown on demand. Calls on one device must not overlap
# in time, which holds for the verifier's single sampling stream.
_arrivals: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(batch_size: int, device: torch.device) -> torch.Tensor:
    counters = _arrivals.get(device)
    if counters is None or counters.numel() < batch_size:
        counters = torch.zeros(max(batch_size, 256), dtype=torch.int32, device=device)
        _arrivals[device] = counters
    return counters


if HAS_TRITON:

    @triton.jit
    def _rejection_sample_kernel(
        output_token_ids_ptr,  # [B, max_K + 1] int64
        num_accepted_ptr,  # [B] int64
        partial_score_ptr,  # [B, C] float32: each chunk's best residual / E (or p / E)
        partial_index_ptr,  # [B, C] int32: its token id
        arrivals_ptr,  # [>= B] int32, zero on entry and on exit
        target_probs_ptr,  # [N, V] float32
        target_argmax_ptr,  # [N] int64
        draft_token_ids_ptr,  # [sum K] int64
        draft_probs_ptr,  # [sum K, V] float32, or None
        num_draft_tokens_ptr,  # [B] int64
        is_greedy_ptr,  # [B] bool
        uniform_ptr,  # [sum K] float32
        exp_noise_ptr,  # [B, V] float32
        vocab_size,
        num_chunks,
        row_length,  # max_K + 1
        HAS_DRAFT_PROBS: tl.constexpr,
        BLOCK_B: tl.constexpr,  # a power of two >= B
        BLOCK_K: tl.constexpr,  # a power of two >= max_K + 1
        BLOCK_C: tl.constexpr,  # a power of two >= num_chunks
        BLOCK_V: tl.constexpr,  # tokens per chunk
    ):
        req = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        offs = chunk * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] this chunk's token ids
        in_vocab = offs < vocab_size
        is_greedy = tl.load(is_greedy_ptr + req)
        # The noise row depends on nothing else: its load overlaps acceptance below.
        e = tl.load(exp_noise_ptr + req * vocab_size + offs,
                    mask=offs < tl.where(is_greedy, 0, vocab_size), other=1.0)

        # Acceptance, every chunk's program alike. The loads are issued as vectors over
        # the drafts, so they take three dependent memory round trips, not two per draft.
        num_drafts = tl.load(num_draft_tokens_ptr + req)
        b = tl.arange(0, BLOCK_B)
        draft_start = tl.sum(tl.load(num_draft_tokens_ptr + b, mask=b < req, other=0), axis=0)
        row_start = draft_start + req  # request i owns K_i + 1 target rows
        j = tl.arange(0, BLOCK_K)
        is_draft = j < num_drafts
        x = tl.load(draft_token_ids_ptr + draft_start + j, mask=is_draft, other=0)  # [BLOCK_K]
        p_x = tl.load(target_probs_ptr + (row_start + j) * vocab_size + x, mask=is_draft,
                      other=0.0)
        if HAS_DRAFT_PROBS:
            q_x = tl.load(draft_probs_ptr + (draft_start + j) * vocab_size + x, mask=is_draft,
                          other=1.0)
        else:
            q_x = 1.0
        u = tl.load(uniform_ptr + draft_start + j, mask=is_draft, other=1.0)
        argmax = tl.load(target_argmax_ptr + row_start + j, mask=is_draft, other=-1)
        accept = tl.where(is_greedy, x == argmax, u * q_x < p_x)
        # The first rejected position, or K_i when every draft is accepted.
        first_rejected = is_draft & (accept.to(tl.int32) == 0)
        num_accepted = tl.min(tl.where(first_rejected, j, num_drafts), axis=0)
        rejected = num_accepted < num_drafts  # else all accepted: bonus token
        final_row = row_start + num_accepted

        if not is_greedy:  # greedy requests take the argmax of the raw logits instead
            # One token is sampled: recovered (argmax of residual / E) after a rejection,
            # else the bonus (argmax of p / E), so one argmax per chunk serves either.
            rejected_draft = draft_start + num_accepted
            p = tl.load(target_probs_ptr + final_row * vocab_size + offs, mask=in_vocab,
                        other=0.0)
            if HAS_DRAFT_PROBS:
                # No q row to read for the bonus token (it may lie past the drafts).
                q = tl.load(draft_probs_ptr + rejected_draft * vocab_size + offs,
                            mask=offs < tl.where(rejected, vocab_size, 0), other=0.0)
                residual = tl.maximum(p - q, 0.0)  # p itself for the bonus (q = 0)
            else:
                x_rejected = tl.load(draft_token_ids_ptr + rejected_draft, mask=rejected,
                                     other=-1)
                residual = tl.where(offs == x_rejected, 0.0, p)
            # Lanes past V score -1, so they never win; ties keep the first maximum.
            score = tl.where(in_vocab, tl.math.div_rn(residual, e), -1.0)
            best, best_idx = tl.max(score, axis=0, return_indices=True,
                                    return_indices_tie_break_left=True)
            tl.store(partial_score_ptr + req * num_chunks + chunk, best)
            tl.store(partial_index_ptr + req * num_chunks + chunk, chunk * BLOCK_V + best_idx)

        # Every thread's stores are issued before the release of the arrival count; the
        # program that arrives last (acquire) sees all the chunks' partial results.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + req, 1, sem="acq_rel")
        if arrived == num_chunks - 1:
            tl.store(arrivals_ptr + req, 0)  # zero again for the next call
            final_token = tl.load(target_argmax_ptr + final_row)
            if not is_greedy:
                c = tl.arange(0, BLOCK_C)
                scores = tl.load(partial_score_ptr + req * num_chunks + c, mask=c < num_chunks,
                                 other=-1.0)
                # Chunks are in vocabulary order: the first maximum is the earliest token.
                best, at = tl.max(scores, axis=0, return_indices=True,
                                  return_indices_tie_break_left=True)
                final_token = tl.load(partial_index_ptr + req * num_chunks + at).to(tl.int64)
                if best <= 0:
                    # An all-zero residual only comes from rounding when q ~ p: sample
                    # from p instead. Rare, so this one program walks the whole row.
                    best_p = -1.0
                    for v0 in range(0, vocab_size, BLOCK_V):
                        o = v0 + tl.arange(0, BLOCK_V)
                        m = o < vocab_size
                        p = tl.load(target_probs_ptr + final_row * vocab_size + o, mask=m,
                                    other=0.0)
                        e = tl.load(exp_noise_ptr + req * vocab_size + o, mask=m, other=1.0)
                        tile_best, tile_idx = tl.max(
                            tl.where(m, tl.math.div_rn(p, e), -1.0), axis=0,
                            return_indices=True, return_indices_tie_break_left=True)
                        better = tile_best > best_p
                        best_p = tl.where(better, tile_best, best_p)
                        final_token = tl.where(better, v0 + tile_idx, final_token).to(tl.int64)
            # The row: accepted drafts, the recovered or bonus token, placeholders.
            k = tl.arange(0, BLOCK_K)
            row = tl.where(k < num_accepted, x,
                           tl.where(k == num_accepted, final_token, PLACEHOLDER))
            tl.store(output_token_ids_ptr + req * row_length + k, row, mask=k < row_length)
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
    max_num_drafts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # output_token_ids [B, max_K + 1], num_accepted [B]
    """`rejection.rejection_sample_from_random` in one launch of a program per (request,
    vocabulary chunk). max_num_drafts, when the caller knows it, spares the device reads
    that would find it; the host then only allocates and launches, which at small
    batches is most of the sampler's time."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; it comes with the `gpu` extra")
    if exp_noise.dim() != 2:
        raise ValueError("exp_noise: the kernel samples by the exponential race, [B, V] noise "
                         "(draw_random with race=True)")
    max_k = check_inputs(target_probs, target_argmax, draft_token_ids, draft_probs,
                         num_draft_tokens, is_greedy, uniform, exp_noise, max_num_drafts)
    batch_size = num_draft_tokens.shape[0]
    vocab_size = target_probs.shape[1]
    device = target_probs.device
    output_token_ids = torch.empty(batch_size, max_k + 1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch_size, dtype=torch.int64, device=device)
    if batch_size == 0:
        return output_token_ids, num_accepted
    num_chunks = triton.cdiv(vocab_size, BLOCK_V)
    partial_score = torch.empty(batch_size, num_chunks, dtype=torch.float32, device=device)
    partial_index = torch.empty(batch_size, num_chunks, dtype=torch.int32, device=device)
    _rejection_sample_kernel[(batch_size, num_chunks)](
        output_token_ids, num_accepted, partial_score, partial_index,
        _arrival_counters(batch_size, device), target_probs.contiguous(),
        target_argmax.contiguous(), draft_token_ids.contiguous(),
        draft_probs.contiguous() if draft_probs is not None else None,
        num_draft_tokens.contiguous(), is_greedy.contiguous(), uniform.contiguous(),
        exp_noise.contiguous(), vocab_size, num_chunks, max_k + 1,
        draft_probs is not None, triton.next_power_of_2(batch_size),
        triton.next_power_of_2(max_k + 1), triton.next_power_of_2(num_chunks), BLOCK_V,
        num_warps=NUM_WARPS,
    )
    return output_token_ids, num_accepted
