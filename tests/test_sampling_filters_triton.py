"""The sort-free Triton filters (specdec/sampling_filters_triton.py) against a float64
reference of their threshold semantics and against `apply_sampling`'s sort-based torch
path, which `apply_sampling` dispatches away from on CUDA.

Without CUDA the kernel runs in a child pytest with TRITON_INTERPRET=1 (Triton's
interpreter must be on before triton is first imported; see tests/verifier/
test_rejection.py), and the kernel is compiled for sm_90 here, which the interpreter
never does (it checks no types)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import triton

from specdec import sampling
from specdec import sampling_filters_triton as filters
from specdec.sampling import SamplingMetadata, SamplingParams, apply_sampling
from specdec.sampling_filters_triton import apply_filters_triton
from tests.interpreted import needs_triton, run_interpreted

ON_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if ON_CUDA else "cpu"
# The interpreter computes exp with numpy; a GPU's exp is Triton's (a few ulp), and its
# error grows with |x - max|.
RTOL = 1e-5 if ON_CUDA else 1e-6
ATOL = 1e-12
NUM_CHILD_TESTS = 13  # the tests below that the child runs (all but the two in the parent)



def test_kernel_interpreted():
    run_interpreted(__file__, "not test_kernel_interpreted and not test_kernel_compiles_for_sm90",
                    NUM_CHILD_TESTS)


@pytest.mark.skipif(ON_CUDA, reason="on CUDA the tests below compile and run the kernel")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="compiles in a process without the interpreter (the parent)")
@pytest.mark.parametrize("logits_type", ["*fp32", "*bf16"])
@pytest.mark.parametrize("flags", [(True, True, True), (False, False, False)],
                         ids=["all_filters", "no_filters"])
def test_kernel_compiles_for_sm90(flags, logits_type):
    """What only a compiler checks (types across branches and loops, layouts): the kernel
    lowers to a cubin for an H100 (ptxas comes with triton; no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    has_min_p, has_top_k, has_top_p = flags
    signature = {
        "probs_ptr": "*fp32", "logits_ptr": logits_type, "temperature_ptr": "*fp32",
        "min_p_ptr": "*fp32" if has_min_p else "constexpr",
        "top_k_ptr": "*i64" if has_top_k else "constexpr",
        "top_p_ptr": "*fp32" if has_top_p else "constexpr",
        "vocab_size": "i32", "logits_stride": "i32",
        "HAS_MIN_P": "constexpr", "HAS_TOP_K": "constexpr", "HAS_TOP_P": "constexpr",
        "BLOCK": "constexpr", "SEARCH_BLOCK": "constexpr", "NUM_PIVOTS": "constexpr",
    }
    constants = {"HAS_MIN_P": has_min_p, "HAS_TOP_K": has_top_k, "HAS_TOP_P": has_top_p,
                 "BLOCK": filters.BLOCK, "SEARCH_BLOCK": filters.SEARCH_BLOCK,
                 "NUM_PIVOTS": filters.NUM_PIVOTS}
    for name, used in (("min_p_ptr", has_min_p), ("top_k_ptr", has_top_k),
                       ("top_p_ptr", has_top_p)):
        if not used:
            constants[name] = None
    compiled = triton.compile(ASTSource(filters._filters_kernel, signature, constants),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": filters.NUM_WARPS})
    assert compiled.asm["cubin"]


# --- the reference ---------------------------------------------------------------


def reference(
    logits: torch.Tensor,  # [N, V]
    temperature: list[float],
    min_p: list[float],
    top_k: list[int],
    top_p: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:  # probabilities [N, V] float64, kept [N, V] bool
    """The module docstring's semantics in float64, on the float32 x = logits / t."""
    num_rows, vocab_size = logits.shape
    probs = torch.zeros(num_rows, vocab_size, dtype=torch.float64)
    kept = torch.zeros(num_rows, vocab_size, dtype=torch.bool)
    for n in range(num_rows):
        x = (logits[n].float().cpu() / torch.tensor(temperature[n], dtype=torch.float32))
        x = x.double()
        top = x.max()
        keep = torch.ones(vocab_size, dtype=torch.bool)
        if min_p[n] > 0:
            keep &= x >= top + math.log(min_p[n])
        if 1 <= top_k[n] < int(keep.sum()):
            kth = x[keep].sort(descending=True).values[top_k[n] - 1]
            keep &= x >= kth
        weight = torch.exp(x - top) * keep
        if top_p[n] < 1:
            # The mass of the kept tokens strictly more likely than each token.
            values = x[keep].sort().values  # ascending
            after = torch.exp(values - top).flip(0).cumsum(0).flip(0)  # mass at or above
            after = torch.cat([after, after.new_zeros(1)])
            above = after[torch.searchsorted(values, x, right=True)]
            keep &= above < top_p[n] * weight.sum()
            weight = torch.exp(x - top) * keep
        kept[n] = keep
        probs[n] = weight / weight.sum()
    return probs, kept


def assert_same_filtering(probs: torch.Tensor, ref_probs: torch.Tensor,
                          ref_kept: torch.Tensor) -> None:
    """The kernel keeps exactly the reference's tokens (dropped ones exactly 0), with
    probabilities within RTOL relatively (ATOL for the tiniest)."""
    probs, ref_probs = probs.cpu(), ref_probs.cpu()
    assert probs.dtype == torch.float32 and probs.shape == ref_probs.shape
    differ = (probs > 0) != ref_kept
    assert not differ.any(), f"kept sets differ at (row, token) {differ.nonzero()[:10].tolist()}"
    error = (probs.double() - ref_probs).abs()
    worst = (error - RTOL * ref_probs).max()
    assert worst <= ATOL, f"probabilities differ by up to {float(worst):.3g} past rtol"


def random_rows(gen: torch.Generator, num_rows: int, vocab_size: int,
                scale: float = 3.0) -> torch.Tensor:
    """Gaussian logits without ties (float32 draws tie often: ~V^2 / 2^25 per row), for
    the tests that compare kept sets with the sort-based path exactly."""
    logits = torch.randn(num_rows, vocab_size, generator=gen) * scale
    for row in logits:
        while len(row.unique()) < vocab_size:
            row.copy_(torch.randn(vocab_size, generator=gen) * scale)
    return logits


# Rows' (temperature, min_p, top_k, top_p): off values, k = 1, k = V - 1, k = V, p tiny,
# p = 1 beside rows that use top-p, min-p leaving fewer than k, all three together.
VOCAB = 3001  # not a multiple of any block
ROW_PARAMS = [
    (1.0, 0.0, 0, 1.0),
    (0.8, 0.0, 50, 0.9),
    (1.3, 0.05, 0, 1.0),
    (0.5, 0.0, 1, 1.0),
    (1.0, 0.0, 0, 1e-6),
    (1.0, 0.0, 0, 0.5),
    (2.0, 0.1, 100, 0.7),
    (1.0, 0.0, VOCAB - 1, 1.0),
    (1.0, 0.0, VOCAB, 0.999),
    (0.7, 0.0, 10, 0.5),
    (1.0, 1.0, 0, 1.0),
    (1.5, 0.2, 1000, 0.95),
    (3.0, 0.0, 2000, 0.9999),
    (1.0, 0.001, 0, 0.3),
]


def columns(row_params: list[tuple]) -> tuple[list, list, list, list]:
    return tuple(list(column) for column in zip(*row_params, strict=True))


def run_kernel(logits: torch.Tensor, temperature: list[float], min_p: list[float] | None,
               top_k: list[int] | None, top_p: list[float] | None) -> torch.Tensor:
    def tensor(values, dtype):
        return None if values is None else torch.tensor(values, dtype=dtype, device=DEVICE)

    return apply_filters_triton(logits.to(DEVICE), tensor(temperature, torch.float32),
                                tensor(min_p, torch.float32), tensor(top_k, torch.int64),
                                tensor(top_p, torch.float32))


# --- against the reference -------------------------------------------------------


@needs_triton
@pytest.mark.parametrize(
    ("block", "search_block", "num_pivots"),
    [(None, None, None), (512, 64, 4), (256, 128, 2)],
    ids=["default", "small_blocks_4_pivots", "bisection"],
)
def test_matches_the_reference(block, search_block, num_pivots, monkeypatch):
    """Random rows, each filter on and off, in blocks that end past the row; with 2
    pivots the search is a bisection on the key (up to 32 passes)."""
    if block is not None:
        monkeypatch.setattr(filters, "BLOCK", block)
        monkeypatch.setattr(filters, "SEARCH_BLOCK", search_block)
        monkeypatch.setattr(filters, "NUM_PIVOTS", num_pivots)
    gen = torch.Generator().manual_seed(0)
    logits = random_rows(gen, len(ROW_PARAMS), VOCAB)
    temperature, min_p, top_k, top_p = columns(ROW_PARAMS)
    ref_probs, ref_kept = reference(logits, temperature, min_p, top_k, top_p)
    probs = run_kernel(logits, temperature, min_p, top_k, top_p)
    assert_same_filtering(probs, ref_probs, ref_kept)
    # The filters do act: the unfiltered row keeps everything, the others keep fewer,
    # k = 1 and p tiny one token, k = V - 1 all but one.
    num_kept = ref_kept.sum(1).tolist()
    assert num_kept[0] == VOCAB and num_kept[8] < VOCAB
    assert num_kept[3] == num_kept[4] == num_kept[10] == 1 and num_kept[7] == VOCAB - 1
    assert num_kept[1] <= 50 and num_kept[6] <= 100 and num_kept[11] < 1000
    assert len(set(num_kept)) > 8


@needs_triton
def test_filters_left_off_per_row_or_for_all():
    """A filter column of None is the same as a column of off values."""
    gen = torch.Generator().manual_seed(1)
    logits = random_rows(gen, 3, VOCAB)
    temperature = [1.0, 0.6, 1.7]
    none = run_kernel(logits, temperature, None, None, None)
    off = run_kernel(logits, temperature, [0.0] * 3, [0] * 3, [1.0] * 3)
    assert torch.equal(none, off)
    assert_same_filtering(none, *reference(logits, temperature, [0.0] * 3, [0] * 3, [1.0] * 3))
    # One filter at a time.
    for min_p, top_k, top_p in (([0.01, 0.0, 0.2], None, None), (None, [0, 7, 300], None),
                                (None, None, [0.3, 1.0, 0.8])):
        probs = run_kernel(logits, temperature, min_p, top_k, top_p)
        assert_same_filtering(probs, *reference(logits, temperature, min_p or [0.0] * 3,
                                                top_k or [0] * 3, top_p or [1.0] * 3))


@needs_triton
def test_keys_across_exponents():
    """Values from 1e-36 to 16 of both signs: the k-th largest is among the tiny ones,
    whose keys are far apart from the large ones' (the search is on the bit pattern);
    in row 1 it is 0, and the zeros of either sign stay, as -0.0 == 0.0."""
    gen = torch.Generator().manual_seed(2)
    magnitude = torch.exp2(torch.rand(3, VOCAB, generator=gen) * 124 - 120)
    logits = torch.where(torch.rand(3, VOCAB, generator=gen) < 0.5, -magnitude, magnitude)
    logits[1:, :100] = 0.0
    logits[1:, 50:100] = -0.0
    num_positive = int((logits[1] > 0).sum())
    params = [(1.0, 0.0, VOCAB // 2, 1.0), (1.0, 0.0, num_positive + 1, 1.0),
              (1.0, 0.0, 1000, 0.5)]
    temperature, min_p, top_k, top_p = columns(params)
    ref_probs, ref_kept = reference(logits, temperature, min_p, top_k, top_p)
    probs = run_kernel(logits, temperature, min_p, top_k, top_p)
    assert_same_filtering(probs, ref_probs, ref_kept)
    assert int(ref_kept[0].sum()) == VOCAB // 2
    assert int(ref_kept[1].sum()) == num_positive + 100


@needs_triton
def test_float16_logits_and_their_ties():
    """float16 logits (upcast in the kernel) have many exact ties: at the top-k and top-p
    boundaries the whole tie group stays, as in the reference."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(len(ROW_PARAMS), VOCAB, generator=gen) * 3).half()
    temperature, min_p, top_k, top_p = columns(ROW_PARAMS)
    ref_probs, ref_kept = reference(logits, temperature, min_p, top_k, top_p)
    assert_same_filtering(run_kernel(logits, temperature, min_p, top_k, top_p),
                          ref_probs, ref_kept)


@needs_triton
def test_masked_tokens():
    """Tokens at -inf (a logits processor's mask) come out 0; a row with one finite
    token puts all the mass there."""
    gen = torch.Generator().manual_seed(4)
    logits = random_rows(gen, 3, VOCAB)
    logits[0, ::2] = float("-inf")
    logits[1, 1:] = float("-inf")
    logits[2, 100:] = float("-inf")
    # Row 2: the 200th largest is -inf, so top-k keeps every token.
    params = [(1.0, 0.0, 0, 0.9), (0.9, 0.1, 5, 0.5), (1.0, 0.0, 200, 1.0)]
    temperature, min_p, top_k, top_p = columns(params)
    probs = run_kernel(logits, temperature, min_p, top_k, top_p).cpu()
    ref_probs, ref_kept = reference(logits, temperature, min_p, top_k, top_p)
    assert_same_filtering(probs, ref_probs, ref_kept & (ref_probs > 0))
    assert probs[1, 0] == 1 and (probs[1, 1:] == 0).all()
    assert int((probs[2] > 0).sum()) == 100 and (probs[0, ::2] == 0).all()


# --- against the torch path, through apply_sampling -------------------------------


def sample_through_dispatch(logits: torch.Tensor, meta: SamplingMetadata,
                            num_rows: torch.Tensor, monkeypatch) -> torch.Tensor:
    """apply_sampling's CUDA branch (switched on): on CUDA itself, or on CPU tensors posing
    as CUDA ones, whose call to apply_filters_triton is caught and then run."""
    monkeypatch.setattr(sampling, "SORT_FREE_FILTERS", True)
    if ON_CUDA:
        meta_cuda = SamplingMetadata(
            temperature=meta.temperature.cuda(), is_greedy=meta.is_greedy.cuda(),
            top_k=None if meta.top_k is None else meta.top_k.cuda(),
            top_p=None if meta.top_p is None else meta.top_p.cuda(),
            min_p=None if meta.min_p is None else meta.min_p.cuda(),
            generators=meta.generators, all_greedy=meta.all_greedy)
        return apply_sampling(logits.cuda(), meta_cuda, num_rows.cuda())
    calls = []
    with monkeypatch.context() as patch:
        patch.setattr(filters, "apply_filters_triton", lambda *args: calls.append(args) or "")
        patch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        assert apply_sampling(logits, meta, num_rows) == ""
    assert len(calls) == 1
    return apply_filters_triton(*calls[0])


def metadata(params: list[SamplingParams]) -> SamplingMetadata:
    return SamplingMetadata.from_params(params, [p.make_generator() for p in params],
                                        torch.Generator().manual_seed(0))


def assert_close_to_torch_path(probs: torch.Tensor, torch_probs: torch.Tensor) -> None:
    probs = probs.cpu()
    differ = (probs > 0) != (torch_probs > 0)
    assert not differ.any(), f"kept sets differ at (row, token) {differ.nonzero()[:10].tolist()}"
    torch.testing.assert_close(probs, torch_probs, rtol=1e-5, atol=1e-9)


@needs_triton
def test_matches_the_torch_path(monkeypatch):
    """Requests of several rows each, greedy ones among them, every filter in use:
    the same kept tokens as the sort-based path and close probabilities."""
    params = [SamplingParams(temperature=t, min_p=m, top_k=k, top_p=p)
              for t, m, k, p in ROW_PARAMS]
    params += [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, top_k=5)]
    num_rows = torch.tensor([1, 3, 2, 1, 2, 1, 4, 1, 1, 2, 1, 2, 1, 1, 2, 3])
    gen = torch.Generator().manual_seed(5)
    logits = random_rows(gen, int(num_rows.sum()), VOCAB)
    meta = metadata(params)
    torch_probs = apply_sampling(logits, meta, num_rows)
    probs = sample_through_dispatch(logits, meta, num_rows, monkeypatch)
    assert_close_to_torch_path(probs, torch_probs)
    num_kept = (torch_probs > 0).sum(1)
    assert (num_kept < VOCAB).sum() > 15 and len(set(num_kept.tolist())) > 10


@needs_triton
def test_greedy_rows_are_the_softmax_of_the_raw_logits(monkeypatch):
    """A greedy request's rows: temperature 1 and its filters off, whatever its
    neighbours use (the sampler takes their argmax of the raw logits anyway)."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=3,
                                                              top_p=0.5, min_p=0.1),
              SamplingParams(temperature=0.0, seed=3)]
    num_rows = torch.tensor([2, 2, 3])
    gen = torch.Generator().manual_seed(6)
    logits = random_rows(gen, 7, VOCAB)
    meta = metadata(params)
    probs = sample_through_dispatch(logits, meta, num_rows, monkeypatch).cpu()
    greedy = torch.tensor([True, True, False, False, True, True, True])
    torch.testing.assert_close(probs[greedy], logits[greedy].softmax(-1), rtol=1e-5, atol=1e-9)
    assert ((probs[~greedy] > 0).sum(1) <= 3).all()
    assert_close_to_torch_path(probs, apply_sampling(logits, meta, num_rows))


@needs_triton
def test_ties_at_the_top_k_boundary_stay(monkeypatch):
    """Logits on a grid of halves: the k-th largest is tied with others, and every token
    tied with it stays, in both paths."""
    gen = torch.Generator().manual_seed(7)
    logits = (torch.randn(3, VOCAB, generator=gen) * 4).round() / 2
    # k puts the k-th largest first in its tie group: the group's other tokens stay too.
    kth = [logits[row].sort(descending=True).values[rank] for row, rank in enumerate((9, 99))]
    top_k = [int((logits[row] > value).sum()) + 1 for row, value in enumerate(kth)]
    params = [SamplingParams(top_k=top_k[0]), SamplingParams(top_k=top_k[1], temperature=0.7),
              SamplingParams(top_k=1000, min_p=0.001)]
    num_rows = torch.ones(3, dtype=torch.int64)
    meta = metadata(params)
    torch_probs = apply_sampling(logits, meta, num_rows)
    probs = sample_through_dispatch(logits, meta, num_rows, monkeypatch)
    assert_close_to_torch_path(probs, torch_probs)
    num_kept = (probs > 0).sum(1).tolist()
    for row in range(2):
        assert num_kept[row] == int((logits[row] >= kth[row]).sum()) > top_k[row]


@needs_triton
def test_ties_at_the_top_p_boundary_stay_whole(monkeypatch):
    """Where the top-p boundary cuts a tie group, this keeps the whole group (tokens
    strictly more likely hold less than p); the sort-based path keeps part of it."""
    logits = torch.full((1, 64), -10.0)
    logits[0, :4] = torch.tensor([2.0, 1.0, 1.0, 1.0])
    probs_all = logits.softmax(-1)[0]
    top_p = float(probs_all[0] + 1.5 * probs_all[1])  # inside the tie group of 1.0
    meta = metadata([SamplingParams(top_p=top_p)])
    num_rows = torch.ones(1, dtype=torch.int64)
    probs = sample_through_dispatch(logits, meta, num_rows, monkeypatch).cpu()
    assert (probs[0, :4] > 0).all() and (probs[0, 4:] == 0).all()
    assert_same_filtering(probs, *reference(logits, [1.0], [0.0], [0], [top_p]))
    torch_kept = apply_sampling(logits, meta, num_rows)[0] > 0
    assert 1 < int(torch_kept.sum()) < 4 and not (torch_kept & (probs[0] == 0)).any()


# --- the assertions can fail ---------------------------------------------------------


@needs_triton
def test_the_checks_catch_a_wrong_answer():
    """One token more or less, or a probability off by 3 * RTOL (1e-4 for the comparison
    with the torch path), fails the comparisons; so does the right answer to other
    parameters, and to none."""
    gen = torch.Generator().manual_seed(8)
    logits = random_rows(gen, 2, VOCAB)
    temperature, min_p, top_k, top_p = [1.0, 0.8], [0.0, 0.0], [50, 0], [1.0, 0.9]
    probs = run_kernel(logits, temperature, min_p, top_k, top_p).cpu()
    ref_probs, ref_kept = reference(logits, temperature, min_p, top_k, top_p)
    assert_same_filtering(probs, ref_probs, ref_kept)

    one_more = probs.clone()
    one_more[0, (probs[0] == 0).nonzero()[0]] = 1e-9
    one_less = probs.clone()
    one_less[1, probs[1].argmax()] = 0.0
    off = probs.clone()
    off[1, probs[1].argmax()] *= 1 + 3 * RTOL
    for wrong in (one_more, one_less, off):
        with pytest.raises(AssertionError):
            assert_same_filtering(wrong, ref_probs, ref_kept)
    off[1, probs[1].argmax()] = probs[1].max() * (1 + 1e-4)
    for wrong in (one_more, one_less, off):
        with pytest.raises(AssertionError):
            assert_close_to_torch_path(wrong, ref_probs.float())
    for other_top_k, other_top_p in (([51, 0], top_p), (top_k, [1.0, 0.91])):
        with pytest.raises(AssertionError, match="kept sets differ"):
            assert_same_filtering(probs, *reference(logits, temperature, min_p, other_top_k,
                                                    other_top_p))
    unfiltered = reference(logits, temperature, [0.0] * 2, [0] * 2, [1.0] * 2)
    with pytest.raises(AssertionError, match="kept sets differ"):
        assert_same_filtering(probs, *unfiltered)


@needs_triton
def test_bad_shapes_are_refused():
    logits = torch.zeros(2, 8, device=DEVICE)
    ones = torch.ones(2, device=DEVICE)
    with pytest.raises(ValueError, match="logits"):
        apply_filters_triton(logits[0], ones, None, None, None)
    with pytest.raises(ValueError, match="top_p_rows"):
        apply_filters_triton(logits, ones, None, None, ones[:1])
    assert apply_filters_triton(logits[:0], ones[:0], None, None, None).shape == (0, 8)
