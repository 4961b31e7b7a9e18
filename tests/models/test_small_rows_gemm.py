"""The small-rows GEMM (specdec/models/small_rows_gemm.c): F.linear's result
on float32 CPU tensors for any number of rows (one pass over the weight for a
decode or verify step, blocked passes past it), each row's rounding independent
of the rows beside it and of the path, and the dispatch of linear()."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specdec.models import linear as linear_module
from specdec.models import small_rows
from specdec.models.linear import SMALL_ROWS_MAX, Linear, linear


@pytest.fixture(autouse=True, scope="module")
def kernel():
    if not small_rows.available():
        reason = small_rows.unavailable_reason()
        if reason.startswith("could not build"):  # a compiler and AVX-512 or AVX2 were there
            pytest.fail(reason)
        pytest.skip(reason)


def operands(m: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen),
            torch.randn(n, generator=gen))


@pytest.mark.parametrize("k", [16, 37, 576, 1536])
@pytest.mark.parametrize("n", [1, 7, 67, 576])
def test_matches_float64(n, k):
    """Every row count from one pass to blocked passes with a short last one, N
    and K with tails, with and without bias."""
    for m in [*range(1, 35), 47, 64]:
        x, w, b = operands(m, n, k, seed=m)
        want = x.double() @ w.double().T
        # Float32 rounding of a K-term dot product of unit normals: well under 1e-5 * K.
        tol = 1e-5 * max(k, 16) ** 0.5 * 4
        torch.testing.assert_close(small_rows.linear(x, w), want.float(), rtol=0, atol=tol)
        torch.testing.assert_close(small_rows.linear(x, w, b), (want + b.double()).float(),
                                   rtol=0, atol=tol)


def test_rows_batch_invariant():
    """A row's output is bit-for-bit the same alone, beside any other rows (in one
    pass or in blocked passes) and with one thread or two: what a verify step's
    row computes, a decode step or a prefill chunk of that token computes too."""
    rows = 3 * SMALL_ROWS_MAX + 5
    x, w, b = operands(rows, 1003, 576)
    alone = torch.cat([small_rows.linear(x[i:i + 1], w, b) for i in range(rows)])
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2):
            torch.set_num_threads(nt)
            for m in [*range(1, SMALL_ROWS_MAX + 3), 2 * SMALL_ROWS_MAX + 1, rows]:
                for start in range(0, rows - m + 1, 3):
                    got = small_rows.linear(x[start:start + m], w, b)
                    assert torch.equal(got, alone[start:start + m]), (nt, m, start)
    finally:
        torch.set_num_threads(threads)


def test_refuses_what_it_cannot_run():
    x, w, _ = operands(2, 8, 16)
    with pytest.raises(ValueError, match="float32"):
        small_rows.linear(x.double(), w.double())
    with pytest.raises(ValueError, match="columns"):
        small_rows.linear(x, w[:, :8])


def test_non_contiguous_input():
    x, w, b = operands(6, 64, 96)
    xt = x.T.contiguous().T  # same values, column-major
    assert not xt.is_contiguous()
    assert torch.equal(small_rows.linear(xt, w, b), small_rows.linear(x, w, b))


@pytest.mark.parametrize("invariant", [False, True])
def test_linear_dispatch(monkeypatch, invariant):
    """Up to SMALL_ROWS_MAX rows on the small-rows kernel, more on the oneDNN-packed
    weight; under SPECDEC_BATCH_INVARIANT every row count on the kernel."""
    monkeypatch.setattr(linear_module, "BATCH_INVARIANT", invariant)
    torch.manual_seed(0)
    layer = Linear(576, 256, bias=True)
    layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach())
    layer.small_rows = True
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for rows in (1, 5, 8, 12, SMALL_ROWS_MAX, SMALL_ROWS_MAX + 1, 24, 100):
            x = torch.randn(rows, 576, generator=gen)
            small = small_rows.linear(x, layer.weight, layer.bias)
            packed = torch.ops.mkldnn._linear_pointwise(x, layer.packed, layer.bias, "none", [], "")
            assert not torch.equal(small, packed), f"{rows} rows: the paths agree bit for bit"
            want = small if invariant or rows <= SMALL_ROWS_MAX else packed
            assert torch.equal(linear(x, layer), want), f"{rows} rows took the other path"
            torch.testing.assert_close(linear(x, layer), F.linear(x, layer.weight, layer.bias),
                                       rtol=0, atol=1e-5)


def test_switched_off_by_environment():
    code = ("from specdec.models import small_rows as s; "
            "print(s.available(), s.unavailable_reason())")
    env = dict(os.environ, SPECDEC_SMALL_ROWS_GEMM="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("False") and "SPECDEC_SMALL_ROWS_GEMM=0" in out


def test_max_rows_by_cpu_and_override(monkeypatch):
    """Intel with AVX-512 keeps 16 rows per pass on the kernel, other CPUs 12 (their
    13-16 row tiles lose to the packed weight); the environment overrides both."""
    monkeypatch.delenv(small_rows.ENV_MAX_ROWS, raising=False)
    monkeypatch.setattr(small_rows, "_vector_isa", lambda: "avx512f")
    monkeypatch.setattr(small_rows, "_cpu_vendor", lambda: "GenuineIntel")
    assert small_rows.max_rows() == 16
    monkeypatch.setattr(small_rows, "_cpu_vendor", lambda: "AuthenticAMD")
    assert small_rows.max_rows() == 12
    monkeypatch.setattr(small_rows, "_vector_isa", lambda: "avx2")
    monkeypatch.setattr(small_rows, "_cpu_vendor", lambda: "GenuineIntel")
    assert small_rows.max_rows() == 12
    monkeypatch.setenv(small_rows.ENV_MAX_ROWS, "8")
    assert small_rows.max_rows() == 8
    monkeypatch.setenv(small_rows.ENV_MAX_ROWS, "many")
    with pytest.raises(ValueError, match=small_rows.ENV_MAX_ROWS):
        small_rows.max_rows()


def test_prefetch_hint_by_cpu_vendor_and_the_same_bits_with_either(monkeypatch, tmp_path):
    """AMD streams the next tile's weight rows past the caches, other CPUs into L2
    (non-temporal, an Intel Xeon decoded 2.1x slower). The hint only moves data: the
    kernel built with either gives the same bits, each its own build in the cache."""
    monkeypatch.setattr(small_rows, "_cpu_vendor", lambda: "AuthenticAMD")
    assert small_rows.prefetch_hint() == "_MM_HINT_NTA"
    monkeypatch.setattr(small_rows, "_cpu_vendor", lambda: "GenuineIntel")
    assert small_rows.prefetch_hint() == "_MM_HINT_T1"
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    x, w, b = operands(5, 67, 576)
    outs = []
    for hint in ("_MM_HINT_NTA", "_MM_HINT_T1"):
        lib, why = small_rows.load(small_rows.SOURCE, small_rows.ENV_SWITCH,
                                   {"PREFETCH_HINT": hint})
        assert lib is not None, why
        y = torch.empty(5, 67)
        small_rows.gemm(lib)(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), 5, 67, 576,
                             2, 16)
        outs.append(y)
    assert len(list((tmp_path / "kernels").glob("small_rows_gemm-*.so"))) == 2
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(outs[0], F.linear(x, w, b), rtol=0, atol=1e-4)
