"""Sort-free Triton kernel for `specdec.sampling.apply_sampling`'s filters (CUDA tensors).

`apply_sampling` on CUDA calls `apply_filters_triton` instead of its torch path, whose
`_apply_top_k_top_p` sorts every [N, V] row: at batch 64, K = 4 and a 128k vocabulary
the sort made a sampled step about 8 times slower than one without filters.

Semantics, per row n (a request's parameters repeated over its rows), on the float32
logits x = logits / temperature (IEEE division; greedy rows come with temperature 1):

1. min-p (0 < min_p): drop the tokens less likely than min_p times the top token, that
   is x < max(x) + log(min_p) (float32). `_apply_min_p` compares the probabilities
   p < min_p * max(p) instead; the two differ only for x within float rounding of the
   threshold.
2. top-k (k in 1..V-1; 0 or >= V is off): keep the tokens with x >= the k-th largest x,
   ties with it included, as `_apply_top_k_top_p` does. (After min-p: when fewer than
   k tokens are left, top-k keeps them all.)
3. top-p (p < 1): on the softmax of what is left, keep token v when the tokens strictly
   more likely than v hold less than p of the mass; the top token always stays. Without
   ties this keeps exactly what the sort-based version keeps (the smallest top set with
   mass >= p). With exact ties at the boundary the sort-based version may keep part of a
   tie group (in the sort's order); this keeps all of it. The masses are float32 sums in
   another order than the sort's cumsum, so where a cumulative mass lies within ~1e-6 of
   p the two may keep one token more or less.
4. softmax over the kept tokens: [N, V] float32 probabilities, dropped tokens exactly 0.

Every filter keeps the tokens at or above a threshold, so the kept set of a row is
{x >= L} for one value L, and the kernel finds L without sorting. It searches on the
order-preserving int32 key of x (the float's bits, negative ones with the magnitude bits
flipped; -0.0 counts as +0.0), where a threshold is exact: the largest key t with
count(key >= t) >= k is the k-th largest x, and the largest key t with
mass(key >= t) >= p * (mass kept by min-p and top-k) is the top-p threshold.
A search keeps an interval [lo, hi) holding the answer and, per pass over the row, tries
NUM_PIVOTS keys spread evenly over it, so each pass narrows the interval 16-fold (4 of
the key's 32 bits); the same pass finds the smallest and largest key inside the interval
and snaps the ends to them, so the search stops as soon as the interval holds one
distinct value (typical logits: a few passes, not 8).

One program per row; passes over the row (reads of its V logits; the write pass also
writes V probabilities):
- 1: max, smallest key and (online) softmax sum;
- +1 when min-p is on for the row: count, mass and smallest key of what it keeps;
- top-k on (1 <= k < tokens left): <= 9 search passes (counts at the pivots);
- top-p on (p < 1): <= 9 search passes (masses at the pivots; the first one also sums
  the mass left by min-p and top-k, which the threshold is relative to);
- +1 when top-k ran and top-p did not: the softmax sum over the kept tokens;
- 1 write pass: exp(x - max) / sum where kept, else 0.
So 2 passes without filters, 1 + (<= 9) + 1 + 1 with top-k alone, and <= 21 with all
three. On synthetic 128k-token rows (Gaussian, Gumbel, peaked) a search took 3-6 passes
for top-k 50 or 1000, 2-4 for top-p 0.9 after top-k 50 and 3-7 for top-p alone: about
11 passes for temperature + top-k 50 + top-p 0.9. A search pass does NUM_PIVOTS
compares (and for top-p NUM_PIVOTS masked adds and one exp) per token. No host syncs
and no memory but the output: CUDA graphs can capture it.

Not bit-identical to the torch path: the sums are in another order (~1e-7 relative),
and a GPU's tl.exp (ex2.approx of a product by log2(e)) is off by up to a few 1e-7 times
|x - max(x)| relatively, so ~1e-6 for the least likely tokens kept. Tests run the kernel
on CPU with TRITON_INTERPRET=1 (tests/test_sampling_filters_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens per step of the max/sum, min-p, sum and write passes: [BLOCK] per step.
BLOCK = 2048
# Tokens per step of a search pass, which keeps [NUM_PIVOTS, SEARCH_BLOCK] partial counts
# or masses in registers and reduces them once per pass (with 4 warps each thread holds
# all the pivots of its tokens: no layout conversion per step; 112 registers, no spills
# on sm_90, from ptxas).
SEARCH_BLOCK = 256
# Keys tried per search pass: the interval narrows NUM_PIVOTS-fold (>= 2; 2 bisects).
NUM_PIVOTS = 16
NUM_WARPS = 4

KEY_MIN = tl.constexpr(-(2**31))  # below every non-NaN float's key: lanes past the row
KEY_MAX = tl.constexpr(2**31 - 1)  # above every non-NaN float's key


@triton.jit
def _sort_key(x):
    """int32 keys of float32 x, in x's order: t >= u as floats iff key(t) >= key(u)
    (-0.0 as +0.0; NaNs past the infinities)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _load_row(row_ptr, offs, vocab_size, temperature):
    """float32 logits / temperature at offs [BLOCK]; -inf past the row."""
    x = tl.load(row_ptr + offs, mask=offs < vocab_size, other=0.0).to(tl.float32)
    return tl.where(offs < vocab_size, tl.math.div_rn(x, temperature), float("-inf"))


@triton.jit
def _mass_above(row_ptr, vocab_size, temperature, row_max, lo, BLOCK: tl.constexpr):
    """(count, sum of exp(x - row_max), smallest key) of the tokens with key >= lo."""
    count = tl.zeros([BLOCK], tl.int32)
    mass = tl.zeros([BLOCK], tl.float32)
    smallest = tl.full([BLOCK], KEY_MAX, tl.int32)
    lo32 = lo.to(tl.int32)  # a float's key: fits
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(row_ptr, offs, vocab_size, temperature)
        key = tl.where(offs < vocab_size, _sort_key(x), KEY_MIN)
        kept = key >= lo32
        count += kept.to(tl.int32)
        mass += tl.where(kept, tl.exp(x - row_max), 0.0)
        smallest = tl.minimum(smallest, tl.where(kept, key, KEY_MAX))
    return tl.sum(count, axis=0), tl.sum(mass, axis=0), tl.min(smallest, axis=0)


@triton.jit
def _search(row_ptr, vocab_size, temperature, row_max,
            lo, hi,  # int64 scalars: cond(lo) holds, cond(hi) does not
            k,  # top-k: cond(t) = count(key >= t) >= k
            p, z,  # top-p: cond(t) = mass(key >= t) >= p * z; z < 0: mass(key >= lo)
            USE_MASS: tl.constexpr, BLOCK: tl.constexpr, P: tl.constexpr):
    """The largest key in [lo, hi) where cond holds (the key of a token), and with
    USE_MASS the mass at or above it (else z). Each pass over the row tries P keys
    t[0] = lo <= t[1] <= ... < hi and keeps [t[j], t[j + 1]) with the last t[j] where cond
    holds; the interval's smallest and largest token keys, found in the same pass, snap
    its ends inward, so an interval holding one distinct value ends the search."""
    j = tl.arange(0, P)  # [P]
    target = p * z  # negative until the first pass has summed mass(key >= lo)
    mass_lo = z
    while hi - lo > 1:
        t = lo + ((hi - lo) * j.to(tl.int64)) // P  # [P] int64 pivots, t[0] = lo
        t32 = t.to(tl.int32)
        lo32 = lo.to(tl.int32)
        hi32 = hi.to(tl.int32)  # <= key(+inf) + 1: fits
        count = tl.zeros([P, BLOCK], tl.int32)  # per lane: tokens with key >= t[j]
        mass = tl.zeros([P, BLOCK], tl.float32)  # per lane: their exp(x - row_max)
        inner_min = tl.full([BLOCK], KEY_MAX, tl.int32)  # keys in [lo, hi), per lane
        inner_max = tl.full([BLOCK], KEY_MIN, tl.int32)
        for start in range(0, vocab_size, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _load_row(row_ptr, offs, vocab_size, temperature)  # [BLOCK]
            key = tl.where(offs < vocab_size, _sort_key(x), KEY_MIN)
            above = key[None, :] >= t32[:, None]  # [P, BLOCK]
            if USE_MASS:
                mass += tl.where(above, tl.exp(x - row_max)[None, :], 0.0)
            else:
                count += above.to(tl.int32)
            inside = (key >= lo32) & (key < hi32)
            inner_min = tl.minimum(inner_min, tl.where(inside, key, KEY_MAX))
            inner_max = tl.maximum(inner_max, tl.where(inside, key, KEY_MIN))
        if USE_MASS:
            at = tl.sum(mass, axis=1)  # [P]: mass(key >= t[j]), nonincreasing in j
            target = tl.where(target < 0, p * tl.sum(tl.where(j == 0, at, 0.0), axis=0),
                              target)
            holds = (at >= target) | (j == 0)  # cond(lo) is known
        else:
            holds = tl.sum(count, axis=1) >= k
        best = tl.max(tl.where(holds, j, 0), axis=0)
        new_lo = tl.sum(tl.where(j == best, t, 0), axis=0)
        new_hi = tl.min(tl.where((j > best) & (t > new_lo), t, hi), axis=0)
        if USE_MASS:
            mass_lo = tl.sum(tl.where(j == best, at, 0.0), axis=0)
        # No token key in [lo, smallest) or (largest, hi): cond is the same at both ends.
        smallest = tl.min(inner_min, axis=0).to(tl.int64)
        largest = tl.max(inner_max, axis=0).to(tl.int64)
        lo = tl.where(smallest < new_hi, tl.maximum(new_lo, smallest), new_lo)
        hi = tl.where(largest >= lo, tl.minimum(new_hi, largest + 1), new_hi)
    return lo, mass_lo


@triton.jit
def _filters_kernel(
    probs_ptr,  # [N, V] float32, contiguous
    logits_ptr,  # [N, V] float32 / float16 / bfloat16, rows logits_stride apart
    temperature_ptr,  # [N] float32 (1 for greedy rows)
    min_p_ptr,  # [N] float32, 0 = off; or None
    top_k_ptr,  # [N] int64, 0 or >= V = off; or None
    top_p_ptr,  # [N] float32, 1 = off; or None
    vocab_size,
    logits_stride,
    HAS_MIN_P: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    BLOCK: tl.constexpr,
    SEARCH_BLOCK: tl.constexpr,
    NUM_PIVOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_stride
    temperature = tl.load(temperature_ptr + row)

    # Pass 1: max, smallest key and softmax sum, per lane (online: the sum is rescaled
    # when the lane's max grows), then across lanes.
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK], tl.float32)
    lane_min_key = tl.full([BLOCK], KEY_MAX, tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(row_ptr, offs, vocab_size, temperature)
        new_max = tl.maximum(lane_max, x)
        # Lanes with nothing above -inf yet stay at sum 0 (exp(-inf - -inf) would be NaN).
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
        lane_min_key = tl.minimum(lane_min_key,
                                  tl.where(offs < vocab_size, _sort_key(x), KEY_MAX))
    row_max = tl.max(lane_max, axis=0)
    z = tl.sum(tl.where(lane_max == float("-inf"), 0.0, lane_sum * tl.exp(lane_max - row_max)),
               axis=0)  # the mass kept so far; -1 once stale
    lo = tl.min(lane_min_key, axis=0).to(tl.int64)  # kept: key >= lo, a token's key
    hi = _sort_key(row_max).to(tl.int64) + 1  # above every key
    num_kept = tl.sum(tl.zeros([BLOCK], tl.int32), axis=0) + vocab_size

    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + row)
        if min_p > 0:
            cut = _sort_key(row_max + tl.log(min_p)).to(tl.int64)
            num_kept, z, smallest = _mass_above(row_ptr, vocab_size, temperature, row_max,
                                                cut, BLOCK)
            lo = smallest.to(tl.int64)  # the top token stays: not empty

    if HAS_TOP_K:
        k = tl.load(top_k_ptr + row)
        if (k >= 1) & (k < num_kept):  # else top-k keeps everything left
            lo, z = _search(row_ptr, vocab_size, temperature, row_max, lo, hi, k, 1.0,
                            z * 0.0 - 1.0, False, SEARCH_BLOCK, NUM_PIVOTS)

    if HAS_TOP_P:
        p = tl.load(top_p_ptr + row)
        if p < 1:
            lo, z = _search(row_ptr, vocab_size, temperature, row_max, lo, hi, 0, p, z,
                            True, SEARCH_BLOCK, NUM_PIVOTS)

    if z < 0:  # top-k ran, and no top-p pass summed the mass it kept
        _, z, _ = _mass_above(row_ptr, vocab_size, temperature, row_max, lo, BLOCK)

    # Write pass: the softmax over the kept tokens, exact zeros elsewhere.
    lo32 = lo.to(tl.int32)
    for start in range(0, vocab_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = _load_row(row_ptr, offs, vocab_size, temperature)
        probs = tl.where(_sort_key(x) >= lo32, tl.math.div_rn(tl.exp(x - row_max), z), 0.0)
        tl.store(probs_ptr + row * vocab_size + offs, probs, mask=offs < vocab_size)


def apply_filters_triton(
    logits: torch.Tensor,  # [N, V] float32, float16 or bfloat16
    temperature_rows: torch.Tensor,  # [N] float32, > 0 (1 for greedy rows)
    min_p_rows: torch.Tensor | None,  # [N] float32, 0 = off; None: off for every row
    top_k_rows: torch.Tensor | None,  # [N] int64, 0 or >= V = off; None: off for every row
    top_p_rows: torch.Tensor | None,  # [N] float32, 1 = off; None: off for every row
) -> torch.Tensor:  # [N, V] float32
    """`apply_sampling`'s probabilities (temperature, min-p, top-k, top-p, softmax) for
    rows whose parameters are already expanded per row; the module docstring has the
    semantics and the passes. One launch, a program per row, no host syncs."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got {tuple(logits.shape)}")
    num_rows, vocab_size = logits.shape
    for name, rows in (("temperature_rows", temperature_rows), ("min_p_rows", min_p_rows),
                       ("top_k_rows", top_k_rows), ("top_p_rows", top_p_rows)):
        if rows is not None and rows.shape != (num_rows,):
            raise ValueError(f"{name} must have shape ({num_rows},), got {tuple(rows.shape)}")
    probs = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=logits.device)
    if num_rows == 0 or vocab_size == 0:
        return probs
    if logits.stride(1) != 1:
        logits = logits.contiguous()

    def column(rows: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        return None if rows is None else rows.to(dtype).contiguous()

    _filters_kernel[(num_rows,)](
        probs, logits, column(temperature_rows, torch.float32),
        column(min_p_rows, torch.float32), column(top_k_rows, torch.int64),
        column(top_p_rows, torch.float32), vocab_size, logits.stride(0),
        min_p_rows is not None, top_k_rows is not None, top_p_rows is not None,
        BLOCK, SEARCH_BLOCK, NUM_PIVOTS, num_warps=NUM_WARPS,
    )
    return probs
