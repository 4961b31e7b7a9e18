"""Gateway policies: request parsing, admission (method, K, auto-disable), dynamic K.

Expected values come from independent computations: hand arithmetic on small
tables, enumeration of every accept/reject outcome for acceptance lengths, and a
brute-force argmax over k for K.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random

import numpy as np
import pytest

from gateway.policy.admission import Decision, Deployment, decide
from gateway.policy.dynamic_k import DynamicK, OnlineAcceptance
from gateway.policy.goodput import acceptance_length, choose_k, goodput
from gateway.policy.itl_profile import ItlProfile
from gateway.policy.request import SpeculativeRequest
from specdec.speculation import METHODS


def table(batch_sizes, ks, itl, acceptance=None) -> ItlProfile:
    """A profile holding itl(batch_size, k) at every grid point."""
    return ItlProfile(tuple(batch_sizes), tuple(ks),
                      tuple(tuple(float(itl(b, k)) for k in ks) for b in batch_sizes),
                      acceptance or {})


def expected_tokens(rates, k) -> float:
    """E[tokens per step], summed over all 2^k accept/reject outcomes of the k drafts.

    Each position is judged independently with its own rate (past the list: the last
    rate); a step keeps the drafts before the first rejection plus one target token.
    """
    r = [rates[min(i, len(rates) - 1)] if rates else 0.0 for i in range(k)]
    total = 0.0
    for outcome in itertools.product((True, False), repeat=k):
        p = math.prod(ri if ok else 1.0 - ri for ri, ok in zip(r, outcome, strict=True))
        kept = next((i for i, ok in enumerate(outcome) if not ok), k)
        total += p * (kept + 1)
    return total


def brute_force_k(itl_at_k, rates, max_num_speculative_tokens) -> int:
    """Smallest k in 0..max_num_speculative_tokens with the highest
    expected_tokens(k) / itl_at_k(k)."""
    g = [expected_tokens(rates, k) / itl_at_k(k) for k in range(max_num_speculative_tokens + 1)]
    return min(k for k in range(max_num_speculative_tokens + 1) if g[k] == max(g))


# --- SpeculativeRequest.from_json ---------------------------------------------------------


@pytest.mark.parametrize("obj", [None, {}, {"method": None, "num_speculative_tokens": None}])
def test_from_json_absent_gives_defaults(obj):
    assert SpeculativeRequest.from_json(obj) == SpeculativeRequest(None, None, False)


def test_from_json_reads_method_k_and_auto():
    assert SpeculativeRequest.from_json({"method": "eagle3", "num_speculative_tokens": 4}) == \
        SpeculativeRequest(method="eagle3", num_speculative_tokens=4, auto=False)
    assert SpeculativeRequest.from_json({"num_speculative_tokens": "auto"}) == \
        SpeculativeRequest(method=None, num_speculative_tokens=None, auto=True)
    assert SpeculativeRequest.from_json({"method": "none", "num_speculative_tokens": 0}) == \
        SpeculativeRequest(method="none", num_speculative_tokens=0)
    for method in METHODS:
        assert SpeculativeRequest.from_json({"method": method}).method == method


def test_from_json_unknown_method_names_field_and_choices():
    with pytest.raises(ValueError) as e:
        SpeculativeRequest.from_json({"method": "foo"})
    msg = str(e.value)
    assert msg.startswith("speculative.method: unknown method 'foo' (expected one of ")
    assert all(m in msg for m in METHODS)


@pytest.mark.parametrize("method", [3, True, ["ngram"], ""])
def test_from_json_bad_method_type_names_field(method):
    with pytest.raises(ValueError, match=r"^speculative\.method: "):
        SpeculativeRequest.from_json({"method": method})


@pytest.mark.parametrize("k", [-1, True, False, 2.0, 2.5, "3", "AUTO", [2], {}])
def test_from_json_bad_k_names_field(k):
    with pytest.raises(ValueError) as e:
        SpeculativeRequest.from_json({"num_speculative_tokens": k})
    assert str(e.value).startswith(
        'speculative.num_speculative_tokens: must be a non-negative integer or "auto"')


def test_from_json_unknown_keys_are_named():
    with pytest.raises(ValueError, match=r"^speculative: unknown field.*'metod'.*'k'"):
        SpeculativeRequest.from_json({"metod": "ngram", "k": 2, "method": "ngram"})


@pytest.mark.parametrize("obj", [[], "eagle", 3])
def test_from_json_needs_an_object(obj):
    with pytest.raises(ValueError, match=r"^speculative: must be an object"):
        SpeculativeRequest.from_json(obj)


def test_request_is_checked_on_construction():
    with pytest.raises(ValueError, match="speculative.num_speculative_tokens"):
        SpeculativeRequest(num_speculative_tokens=-2)
    with pytest.raises(ValueError, match="speculative.method"):
        SpeculativeRequest(method="medusa")


# --- decide -----------------------------------------------------------------------------


@pytest.fixture
def dep() -> Deployment:
    return Deployment(
        default_method="eagle",
        methods_available=frozenset({"ngram", "eagle"}),
        default_num_speculative_tokens=3,
        max_num_speculative_tokens=5,
    )


def test_decide_method_none_is_off_by_request(dep):
    assert decide(SpeculativeRequest(method="none"), dep) == Decision("none", 0, False, "request")
    assert decide(SpeculativeRequest(method="none", auto=True), dep) == \
        Decision("none", 0, False, "request")


def test_decide_k_zero_is_off_by_request(dep):
    assert decide(SpeculativeRequest(method="ngram", num_speculative_tokens=0), dep) == \
        Decision("none", 0, False, "request")
    assert decide(SpeculativeRequest(num_speculative_tokens=0), dep) == \
        Decision("none", 0, False, "request")


def test_decide_deployment_default_none_is_off(dep):
    plain = Deployment("none", frozenset({"ngram"}), 0, 4)
    assert decide(SpeculativeRequest(), plain).method == "none"
    # ...while a request may still ask for a drafter the deployment offers.
    assert decide(SpeculativeRequest(method="ngram", num_speculative_tokens=2), plain) == \
        Decision("ngram", 2, False, None)


def test_decide_k_over_max_is_an_error_naming_the_field(dep):
    assert decide(SpeculativeRequest(num_speculative_tokens=5), dep).num_speculative_tokens == 5
    with pytest.raises(ValueError, match=r"^speculative\.num_speculative_tokens: 6 .* 5"):
        decide(SpeculativeRequest(num_speculative_tokens=6), dep)
    with pytest.raises(ValueError, match=r"^speculative\.num_speculative_tokens"):
        decide(SpeculativeRequest(num_speculative_tokens=6, auto=True), dep)


def test_decide_unavailable_drafter_runs_plainly(dep):
    for req in (SpeculativeRequest(method="draft_model"),
                SpeculativeRequest(method="eagle3", num_speculative_tokens=2, auto=True)):
        assert decide(req, dep) == Decision(req.method, 0, False, "drafter_unavailable")
    gone = Deployment("eagle", frozenset(), 3, 5)
    assert decide(SpeculativeRequest(), gone) == Decision("eagle", 0, False, "drafter_unavailable")


def test_decide_defaults_and_explicit_values(dep):
    assert decide(SpeculativeRequest(), dep) == Decision("eagle", 3, False, None)
    assert decide(SpeculativeRequest(method="ngram"), dep) == Decision("ngram", 3, False, None)
    assert decide(SpeculativeRequest(num_speculative_tokens=1), dep) == \
        Decision("eagle", 1, False, None)


def test_decide_auto_k_is_an_upper_bound_and_starts_at_the_default_k(dep):
    # Bounded by the verifier's maximum (5), it drafts the deployment's default K (3)
    # until dynamic K has a profile to choose by.
    assert decide(SpeculativeRequest(auto=True), dep) == Decision("eagle", 5, True, None, 3)
    assert decide(SpeculativeRequest(num_speculative_tokens=2, auto=True), dep) == \
        Decision("eagle", 2, True, None, 2)
    assert decide(SpeculativeRequest.from_json({"method": "ngram", "num_speculative_tokens": "auto"}),
                  dep) == Decision("ngram", 5, True, None, 3)
    # A deployment whose default is plain starts an "auto" at its bound.
    plain = Deployment("none", frozenset({"ngram"}), 0, 4)
    assert decide(SpeculativeRequest(method="ngram", auto=True), plain).first_k == 4


def test_decision_first_k_is_checked():
    with pytest.raises(ValueError, match="first_k"):
        Decision("ngram", 2, True, None, first_k=3)
    with pytest.raises(ValueError, match="first_k"):
        Decision("ngram", 2, False, None, first_k=1)


def test_decide_default_auto_k_is_bounded_by_the_default_k(dep):
    auto = dataclasses.replace(dep, default_auto_k=True)
    # No K given: dynamic K within the K the deployment would run statically.
    assert decide(SpeculativeRequest(), auto) == Decision("eagle", 3, True, None, 3)
    assert decide(SpeculativeRequest(method="ngram"), auto) == Decision("ngram", 3, True, None, 3)
    # An explicit K stays static, an explicit "auto" may reach the verifier's maximum.
    assert decide(SpeculativeRequest(num_speculative_tokens=2), auto) == \
        Decision("eagle", 2, False, None)
    assert decide(SpeculativeRequest(auto=True), auto) == Decision("eagle", 5, True, None, 3)
    assert decide(SpeculativeRequest(method="none"), auto) == \
        Decision("none", 0, False, "request")
    with pytest.raises(ValueError, match="default_auto_k"):
        dataclasses.replace(dep, default_auto_k=1)


@pytest.mark.parametrize("kwargs, name", [
    ({"default_method": "medusa"}, "default_method"),
    ({"methods_available": {"eagle", "medusa"}}, "methods_available"),
    ({"default_num_speculative_tokens": -1}, "default_num_speculative_tokens"),
    ({"max_num_speculative_tokens": True}, "max_num_speculative_tokens"),
    ({"default_num_speculative_tokens": 6}, "default_num_speculative_tokens"),
])
def test_deployment_is_checked_on_construction(kwargs, name):
    args = {
        "default_method": "eagle",
        "methods_available": {"eagle"},
        "default_num_speculative_tokens": 3,
        "max_num_speculative_tokens": 5,
    } | kwargs
    with pytest.raises(ValueError, match=name):
        Deployment(**args)


def test_deployment_accepts_any_iterable_of_methods():
    d = Deployment("ngram", ["ngram", "eagle"], 2, 4)
    assert d.methods_available == frozenset({"ngram", "eagle"})


@pytest.mark.parametrize("args, name", [
    (("medusa", 1, False, None), "method"),
    (("ngram", -1, False, None), "num_speculative_tokens"),
    (("ngram", 1, False, "busy"), "disabled_reason"),
    (("none", 2, False, "request"), "num_speculative_tokens=0"),
])
def test_decision_is_checked_on_construction(args, name):
    with pytest.raises(ValueError, match=name):
        Decision(*args)


# --- ItlProfile.itl -----------------------------------------------------------------------

# A table that is not bilinear (f = b * k^2 + 5), so a wrong cell would show.
B, K = (1, 2, 4, 8), (0, 1, 2, 4)


def curved(b, k):
    return b * k * k + 5.0


def test_itl_is_exact_at_grid_points():
    p = table(B, K, curved)
    for b, k in itertools.product(B, K):
        assert p.itl(b, k) == curved(b, k)


def test_itl_midpoints_by_hand():
    p = table(B, K, curved)
    # Cell b in [2, 4], k in [2, 4]: corners 13, 37 (b=2), 21, 69 (b=4).
    assert p.itl(3, 3) == pytest.approx((13 + 37 + 21 + 69) / 4)
    # Edge midpoints: along k at b=8 between k=1 (13) and k=2 (37); along b at k=1.
    assert p.itl(8, 1.5) == pytest.approx((13 + 37) / 2)
    assert p.itl(6, 1) == pytest.approx((9 + 13) / 2)
    # A quarter point: b=1.25 (1/4 from 1 to 2), k=0.5; corners 5, 6 (b=1), 5, 7 (b=2).
    assert p.itl(1.25, 0.5) == pytest.approx(0.75 * 5.5 + 0.25 * 6.0)


def test_itl_reproduces_a_bilinear_function_everywhere():
    # Bilinear interpolation on any grid reproduces f = a + c*b + d*k + e*b*k exactly.
    def f(b, k):
        return 3.0 + 0.7 * b + 1.3 * k + 0.11 * b * k

    p = table((1, 3, 4, 16, 64), (0, 1, 2, 5, 8), f)
    rng = random.Random(0)
    for _ in range(200):
        b, k = rng.uniform(1, 64), rng.uniform(0, 8)
        assert p.itl(b, k) == pytest.approx(f(b, k), rel=1e-12)


def test_itl_clamps_outside_the_table():
    p = table(B, K, curved)
    assert p.itl(0.5, 2) == curved(1, 2)
    assert p.itl(100, 2) == curved(8, 2)
    assert p.itl(4, 9) == curved(4, 4)
    assert p.itl(4, -1) == curved(4, 0)
    assert p.itl(1000, 1000) == curved(8, 4)
    assert p.itl(0, 0) == curved(1, 0)
    assert p.itl(100, 1.5) == pytest.approx((curved(8, 1) + curved(8, 2)) / 2)


def test_itls_reads_many_ks_as_itl_reads_each():
    # The array form dynamic K reads: the same values, inside, between and outside
    # the grid, on the shared table and a method's own.
    p = ItlProfile(B, K, table(B, K, curved).itl_ms,
                   method_itl_ms={"eagle3": table(B, K, lambda b, k: curved(b, k) + 3 * k).itl_ms})
    ks = [-1.0, 0.0, 0.3, 1.0, 1.5, 2.0, 3.7, 4.0, 9.0]
    for b, method in itertools.product((0.5, 1, 1.25, 3, 8, 100), (None, "eagle3", "ngram")):
        want = [p.itl(b, k, method) for k in ks]
        assert p.itls(b, np.array(ks), method).tolist() == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="finite"):
        p.itls(2, np.array([1.0, float("nan")]))


def test_itl_single_row_and_column():
    p = ItlProfile((4,), (0,), ((7.5,),))
    assert p.itl(1, 0) == p.itl(64, 3) == 7.5


def test_itl_uses_the_method_table_where_there_is_one():
    def dear(b, k):  # a slow drafter: 3 ms more per draft token, at every batch size
        return curved(b, k) + 3.0 * k

    p = ItlProfile(B, K, table(B, K, curved).itl_ms,
                   method_itl_ms={"eagle3": table(B, K, dear).itl_ms})
    for b, k in itertools.product(B, K):
        assert p.itl(b, k, "eagle3") == dear(b, k)
        assert p.itl(b, k, "ngram") == p.itl(b, k) == p.itl(b, k, None) == curved(b, k)
    # Interpolated within the method's own table: the cell of test_itl_midpoints_by_hand
    # plus 3 ms x the corners' mean k (3).
    assert p.itl(3, 3, "eagle3") == pytest.approx((13 + 37 + 21 + 69) / 4 + 9.0)
    assert p.itl(100, 9, "eagle3") == dear(8, 4)


@pytest.mark.parametrize("kwargs, name", [
    ({"batch_sizes": (1, 4, 2)}, "batch_sizes"),
    ({"batch_sizes": (1, 1, 8)}, "batch_sizes"),
    ({"batch_sizes": (0, 4, 8)}, "batch_sizes"),
    ({"batch_sizes": (1.0, 4, 8)}, "batch_sizes"),
    ({"ks": (1, 2)}, "ks must include 0"),
    ({"ks": (0, 2, 1)}, "ks"),
    ({"ks": ()}, "ks"),
    ({"itl_ms": ((1.0, 2.0), (1.0, 2.0))}, "itl_ms must have 3 rows"),
    ({"itl_ms": ((1.0, 2.0), (1.0, 2.0), (1.0,))}, r"itl_ms\[2\]"),
    ({"itl_ms": ((1.0, 2.0), (1.0, 0.0), (1.0, 2.0))}, r"itl_ms\[1\]\[1\]"),
    ({"itl_ms": ((1.0, 2.0), (1.0, 2.0), (math.inf, 2.0))}, r"itl_ms\[2\]\[0\]"),
    ({"itl_ms": ((1.0, True), (1.0, 2.0), (1.0, 2.0))}, r"itl_ms\[0\]\[1\]"),
    ({"acceptance": {"eagle": (0.5, 1.2)}}, "acceptance"),
    ({"acceptance": {"eagle": ()}}, "acceptance"),
    ({"acceptance": {"none": (0.5,)}}, "acceptance has unknown method 'none'"),
    ({"method_itl_ms": {"none": ((1.0, 2.0),) * 3}}, "method_itl_ms has unknown method 'none'"),
    ({"method_itl_ms": {"eagel": ((1.0, 2.0),) * 3}}, "unknown method 'eagel'"),
    ({"method_itl_ms": {"eagle": ((1.0, 2.0),) * 2}}, r"method_itl_ms\['eagle'\] must have 3 rows"),
    ({"method_itl_ms": {"eagle": ((1.0, 2.0), (1.0,), (1.0, 2.0))}},
     r"method_itl_ms\['eagle'\]\[1\] must have 2 entries"),
    ({"method_itl_ms": {"eagle": ((1.0, 2.0), (1.0, 0.0), (1.0, 2.0))}},
     r"method_itl_ms\['eagle'\]\[1\]\[1\] must be a positive number"),
    ({"method_itl_ms": {"ngram": ((1.0, 2.0), (1.0, 2.0), (-1.0, 2.0))}},
     r"method_itl_ms\['ngram'\]\[2\]\[0\]"),
    ({"method_itl_ms": {"ngram": ((1.0, 2.0), (1.0, math.nan), (1.0, 2.0))}},
     r"method_itl_ms\['ngram'\]\[1\]\[1\]"),
])
def test_profile_is_checked_on_construction(kwargs, name):
    args = {"batch_sizes": (1, 4, 8), "ks": (0, 2), "itl_ms": ((1.0, 2.0),) * 3} | kwargs
    with pytest.raises(ValueError, match=name):
        ItlProfile(**args)


# --- acceptance_length, goodput, choose_k ------------------------------------------------


@pytest.mark.parametrize("rates", [(0.9, 0.7, 0.4), (1.0,), (0.0, 1.0), (0.3,), (0.8, 0.8, 0.8)])
def test_acceptance_length_matches_enumeration(rates):
    for k in range(7):
        assert acceptance_length(rates, k) == pytest.approx(expected_tokens(rates, k), rel=1e-12)


def test_acceptance_length_known_values():
    assert acceptance_length((0.5,), 0) == 1.0
    assert acceptance_length((1.0,), 4) == 5.0
    assert acceptance_length((), 5) == 1.0
    assert acceptance_length((0.0, 1.0), 3) == 1.0
    # Geometric series: 1 + 0.5 + 0.25 + 0.125.
    assert acceptance_length((0.5,), 3) == 1.875
    with pytest.raises(ValueError, match="k"):
        acceptance_length((0.5,), -1)


def test_goodput_is_tokens_per_ms():
    p = table((1, 8), (0, 2), lambda b, k: 10 + b * k)
    assert goodput(p, 8, (0.5,), 2) == pytest.approx((1 + 0.5 + 0.25) / 26)
    assert goodput(p, 1, (0.5,), 0) == pytest.approx(1 / 10)


def test_goodput_uses_the_method_table():
    p = ItlProfile((1, 8), (0, 2), ((10, 12), (10, 26)), method_itl_ms={"eagle": ((10, 30),) * 2})
    assert goodput(p, 8, (0.5,), 2) == pytest.approx(1.75 / 26)
    assert goodput(p, 8, (0.5,), 2, "ngram") == pytest.approx(1.75 / 26)
    assert goodput(p, 8, (0.5,), 2, "eagle") == pytest.approx(1.75 / 30)
    assert goodput(p, 1, (0.5,), 0, "eagle") == pytest.approx(1 / 10)


RANDOM_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def random_case(seed):
    """ITL grid {(b, k): ms} that tends to grow with b*k, and 1..8 per-position rates."""
    rng = random.Random(seed)
    grid = {(b, k): rng.uniform(5, 8) * (1 + rng.uniform(0, 0.05) * b * k)
            for b in RANDOM_BATCH_SIZES for k in range(9)}
    rates = [rng.uniform(0.2, 1.0) for _ in range(rng.randint(1, 8))]
    return grid, rates


@pytest.mark.parametrize("seed", range(20))
def test_choose_k_equals_brute_force(seed):
    grid, rates = random_case(seed)
    p = table(RANDOM_BATCH_SIZES, range(9), lambda b, k: grid[b, k])
    for b in RANDOM_BATCH_SIZES:
        for max_num_speculative_tokens in (0, 1, 4, 8):
            assert choose_k(p, b, rates, max_num_speculative_tokens) == \
                brute_force_k(lambda k, b=b: grid[b, k], rates, max_num_speculative_tokens)


def test_choose_k_brute_force_cases_are_not_trivial():
    # Guard for the test above: its cases must lead to several different K.
    chosen = set()
    for seed in range(20):
        grid, rates = random_case(seed)
        for b in RANDOM_BATCH_SIZES:
            chosen.add(brute_force_k(lambda k, b=b, grid=grid: grid[b, k], rates, 8))
    assert len(chosen) >= 4


def test_choose_k_between_grid_points_equals_brute_force_on_interpolated_itl():
    p = table((1, 8, 64), (0, 1, 2, 4, 8), lambda b, k: 8 + 0.02 * b * k * k + 0.1 * k)
    rates = (0.85, 0.75, 0.6)
    for b in (1.5, 3, 5.5, 20, 40, 63):
        assert choose_k(p, b, rates, 8) == brute_force_k(lambda k, b=b: p.itl(b, k), rates, 8)


def test_k_falls_as_the_batch_grows():
    # ITL = T0 + u * b * (k + 1). For k2 > k1 the goodput ratio g(k2)/g(k1) =
    # AL(k2)/AL(k1) * (T0 + u b (k1+1)) / (T0 + u b (k2+1)) falls as b grows, so once a
    # smaller k wins it keeps winning: K must be non-increasing in b. The table is
    # bilinear in (b, k), so interpolation between grid points is exact and the
    # property holds at every batch size, not only on the grid.
    batch_sizes = tuple(2 ** i for i in range(9))
    p = table(batch_sizes, range(9), lambda b, k: 10 + 0.2 * b * (k + 1))
    rates = (0.8,)
    sweep = [1 + 0.5 * i for i in range(511)]
    chosen = [choose_k(p, b, rates, 8) for b in sweep]
    assert all(a >= b for a, b in itertools.pairwise(chosen)), chosen
    # Nearly flat ITL at b=1 favours the longest block; at b=256 drafting costs more
    # than it yields (k=1: 1.8 tokens / 112.4 ms < k=0: 1 / 61.2 ms).
    assert chosen[0] == 8
    assert chosen[-1] == 0
    assert len(set(chosen)) >= 4


def test_k_zero_when_nothing_is_accepted():
    p = table((1, 16), range(6), lambda b, k: 10 + 0.01 * b * k)
    for b in (1, 4, 16):
        assert choose_k(p, b, (0.0,), 5) == 0
        assert choose_k(p, b, (), 5) == 0


def test_k_zero_when_itl_grows_faster_than_tokens():
    # ITL = 10 (k+1)^2 while AL(k) <= k+1: every k > 0 is strictly worse than k=0.
    p = table((1, 16), range(6), lambda b, k: 10 * (k + 1) ** 2)
    for b in (1, 8, 16):
        assert choose_k(p, b, (0.99,), 5) == 0


def test_k_ties_go_to_the_smaller_k():
    # Every draft accepted and ITL proportional to k+1: all k have goodput exactly 1/10.
    p = table((1, 16), range(6), lambda b, k: 10 * (k + 1))
    assert choose_k(p, 4, (1.0,), 5) == 0
    assert [goodput(p, 4, (1.0,), k) for k in range(6)] == [0.1] * 6


def test_choose_k_stays_within_the_profiled_ks():
    p = table((1, 8), (0, 1, 2), lambda b, k: 10 + k)
    # With every draft accepted K=2 beats K=0 and 1; larger K would only look free.
    assert choose_k(p, 1, (1.0,), 8) == 2
    assert choose_k(p, 1, (1.0,), 1) == 1


# --- OnlineAcceptance, DynamicK ----------------------------------------------------------


def test_online_acceptance_counts_by_hand():
    acc = OnlineAcceptance()
    for drafted, accepted in ((3, 0), (3, 3), (2, 1), (0, 0)):
        acc.update(drafted, accepted)
    assert acc.steps == 3
    # Position 1 judged in all 3 drafting steps, accepted twice; position 2 judged
    # after an accepted position 1 (steps 2 and 3), accepted once; position 3 judged
    # once (step 2) and accepted; position 4 never drafted -> prior.
    assert acc.rates((0.1, 0.2, 0.3, 0.4), prior_steps=0, max_num_speculative_tokens=5) == \
        pytest.approx((2 / 3, 1 / 2, 1.0, 0.4, 0.4))
    # The prior counts as prior_steps tries of every position.
    assert acc.rates((0.1, 0.2, 0.3, 0.4), prior_steps=2, max_num_speculative_tokens=5) == \
        pytest.approx(((2 + 0.2) / 5, (1 + 0.4) / 4, (1 + 0.6) / 3, 0.4, 0.4))


def test_online_acceptance_estimates_conditional_rates():
    rng = random.Random(1)
    true = (0.9, 0.6, 0.3)
    acc = OnlineAcceptance()
    for _ in range(20_000):
        accepted = 0
        while accepted < 3 and rng.random() < true[accepted]:
            accepted += 1
        acc.update(3, accepted)
    # Unconditional rates would be 0.9, 0.54, 0.162; standard errors are <= 0.005.
    assert acc.rates((), 0, 3) == pytest.approx(true, abs=0.02)
    # A prior worth 8 steps is nothing against 20 000 of them.
    assert acc.rates((0.0,), 8, 3) == pytest.approx(true, abs=0.02)


def test_online_acceptance_rejects_bad_input():
    acc = OnlineAcceptance()
    with pytest.raises(ValueError, match="num_accepted"):
        acc.update(2, 3)
    with pytest.raises(ValueError, match="num_drafted"):
        acc.update(-1, 0)
    assert acc.steps == 0
    with pytest.raises(ValueError, match="prior_steps"):
        acc.rates((0.5,), -1, 2)
    with pytest.raises(ValueError, match="half_life_steps"):
        OnlineAcceptance(0)


def test_online_acceptance_forgets_with_its_half_life():
    acc = OnlineAcceptance(half_life_steps=10)
    for _ in range(20):
        acc.age()
        acc.update(2, 0)  # position 1 always rejected
    prior = (0.9,)
    low = acc.rates(prior, 4, 1)[0]
    # 20 tries aged to sum_{i<20} 2^(-i/10) ~ 10.8 (+ 4 prior tries at 0.9).
    tried = sum(0.5 ** (i / 10) for i in range(20))
    assert low == pytest.approx(3.6 / (tried + 4))
    for _ in range(10):
        acc.age()  # steps without drafts: nothing new, the old evidence fades
    assert acc.rates(prior, 4, 1)[0] == pytest.approx(3.6 / (tried / 2 + 4))
    for _ in range(200):
        acc.age()
    assert acc.rates(prior, 4, 1)[0] == pytest.approx(0.9, abs=1e-3)
    # Without a half-life nothing fades.
    keep = OnlineAcceptance()
    keep.update(2, 0)
    for _ in range(100):
        keep.age()
    assert keep.rates(prior, 4, 1)[0] == pytest.approx(3.6 / 5)


def k_profile(acceptance=None) -> ItlProfile:
    # Cheap drafts at batch 1, dear ones at batch 64.
    return table((1, 64), range(5), lambda b, k: 10 + 0.5 * k + 0.02 * b * k, acceptance)


def test_dynamic_k_drops_to_zero_when_the_drafter_fails_and_tries_again_later():
    p = k_profile({"eagle": (0.9,)})
    # At batch 64 a draft position costs 1.78 ms on 10: K > 0 pays while position 1's
    # rate r gives 1 + r > 1.178.
    dk = DynamicK(lambda: p, "eagle", max_num_speculative_tokens=4, prior_steps=5,
                  half_life_steps=20)
    before = brute_force_k(lambda k: p.itl(64, k), (0.9,), 4)
    assert before > 0 and dk.next_k(64) == before
    steps = 0
    while (k := dk.next_k(64)) > 0:
        dk.observe(k, 0)
        steps += 1
        assert steps < 60, "a drafter never accepted must end at K = 0"
    tried = sum(0.5 ** (i / 20) for i in range(steps))
    assert dk.rates()[0] == pytest.approx(4.5 / (5 + tried))
    assert dk.rates()[0] < 0.178
    # Plain steps bring no evidence; the old one fades and speculation is tried again.
    waited = 0
    while dk.next_k(64) == 0:
        dk.observe(0, 0)
        waited += 1
        assert waited < 200
    assert waited >= 1 and dk.rates()[0] > 0.178


def test_dynamic_k_rises_when_the_drafter_beats_its_prior():
    p = k_profile({"ngram": (0.3,)})
    dk = DynamicK(lambda: p, "ngram", max_num_speculative_tokens=4, prior_steps=3)
    before = dk.next_k(1)
    assert before == brute_force_k(lambda k: p.itl(1, k), (0.3,), 4)
    assert 0 < before < 4
    for _ in range(6):
        k = dk.next_k(1)
        dk.observe(k, k)
    rates = dk.rates()
    # Positions up to `before` were always accepted: their rates move far from the
    # prior (0.3) toward 1; positions never drafted keep it.
    assert all(r > 0.6 for r in rates[:before])
    assert rates[-1] == 0.3 or dk.next_k(1) > before
    after = dk.next_k(1)
    assert after == brute_force_k(lambda k: p.itl(1, k), rates, 4)
    assert after > before
    assert dk.next_k(64) <= after


def method_cost_profile() -> ItlProfile:
    """The same verifier with two drafters: ngram's drafting is free, eagle3's 3.5 ms a token.

    With rates 0.8, AL(k) = 1, 1.8, 2.44, 2.952, 3.3616 (k = 0..4). Shared table 10 + 0.5k:
    goodput rises to k=4 (0.280 tokens/ms). eagle3's 10 + 4k: 0.100, 0.129, 0.136, 0.134,
    0.129, so k=2.
    """
    ks = range(5)
    return ItlProfile((1,), tuple(ks), (tuple(10 + 0.5 * k for k in ks),),
                      acceptance={"ngram": (0.8,), "eagle3": (0.8,)},
                      method_itl_ms={"eagle3": (tuple(10 + 4.0 * k for k in ks),)})


def test_choose_k_is_smaller_for_a_costlier_method():
    p = method_cost_profile()
    assert choose_k(p, 1, (0.8,), 4) == choose_k(p, 1, (0.8,), 4, "ngram") == 4
    assert choose_k(p, 1, (0.8,), 4, "eagle3") == 2
    assert brute_force_k(lambda k: 10 + 0.5 * k, (0.8,), 4) == 4
    assert brute_force_k(lambda k: 10 + 4.0 * k, (0.8,), 4) == 2


def test_dynamic_k_uses_its_methods_table():
    p = method_cost_profile()
    eagle3, ngram = (
        DynamicK(lambda: p, "eagle3", max_num_speculative_tokens=4),
        DynamicK(lambda: p, "ngram", max_num_speculative_tokens=4),
    )
    assert eagle3.method == "eagle3" and ngram.method == "ngram"
    assert eagle3.next_k(1) == 2
    assert ngram.next_k(1) == 4


def test_dynamic_k_neutral_prior_for_an_unprofiled_method():
    p = k_profile({"eagle": (0.95,)})
    dk = DynamicK(lambda: p, "draft_model", max_num_speculative_tokens=4)
    assert dk.prior == (0.5,)
    for b in (1, 16, 64):
        assert dk.next_k(b) == brute_force_k(lambda k, b=b: p.itl(b, k), (0.5,), 4)
    # The method's own prior is used where the profile has one.
    assert DynamicK(lambda: p, "eagle", max_num_speculative_tokens=4).next_k(64) == \
        brute_force_k(lambda k: p.itl(64, k), (0.95,), 4) != dk.next_k(64)


@pytest.mark.parametrize("kwargs, name", [
    ({"method": "none"}, "method"),
    ({"max_num_speculative_tokens": -1}, "max_num_speculative_tokens"),
    ({"prior_steps": -1}, "prior_steps"),
])
def test_dynamic_k_is_checked(kwargs, name):
    with pytest.raises(ValueError, match=name):
        DynamicK(
            **(
                {"profile": k_profile, "method": "eagle", "max_num_speculative_tokens": 4}
                | kwargs
            )
        )


# --- profile JSON -------------------------------------------------------------------------


def sample_profile() -> ItlProfile:
    return ItlProfile((1, 8, 32), (0, 2, 4), ((9.5, 10.0, 10.5), (11, 13, 15), (20, 30, 41.25)),
                      {"eagle": (0.8, 0.6, 0.5), "ngram": (0.4,)})


def test_profile_json_round_trip(tmp_path):
    p = sample_profile()
    obj = p.to_json()
    assert obj["version"] == 1
    assert ItlProfile.from_json(json.loads(json.dumps(obj))) == p
    path = tmp_path / "profile.json"
    p.save(path)
    q = ItlProfile.load(path)
    assert q == p
    assert q.itl(4.5, 3) == p.itl(4.5, 3)
    assert q.acceptance["eagle"] == (0.8, 0.6, 0.5)


def test_profile_json_round_trip_with_method_tables(tmp_path):
    eagle = ((12.0, 20.0, 28.5), (13, 22, 31), (22, 40, 61))
    p = dataclasses.replace(sample_profile(), method_itl_ms={"eagle": eagle})
    obj = json.loads(json.dumps(p.to_json()))
    assert obj["method_itl_ms"] == {"eagle": [list(row) for row in eagle]}
    assert obj["version"] == 1
    q = ItlProfile.from_json(obj)
    assert q == p and q.method_itl_ms == {"eagle": eagle}
    path = tmp_path / "profile.json"
    p.save(path)
    r = ItlProfile.load(path)
    assert r == p
    assert r.itl(8, 4, "eagle") == 31 and r.itl(8, 4, "ngram") == r.itl(8, 4) == 15
    assert r != sample_profile()


def test_profile_json_round_trip_with_availability(tmp_path):
    p = dataclasses.replace(sample_profile(), availability={"ngram": 0.65, "eagle": 1.0})
    obj = json.loads(json.dumps(p.to_json()))
    assert obj["availability"] == {"eagle": 1.0, "ngram": 0.65}
    q = ItlProfile.from_json(obj)
    assert q == p and q.availability == {"ngram": 0.65, "eagle": 1.0}
    path = tmp_path / "profile.json"
    p.save(path)
    assert ItlProfile.load(path) == p
    assert ItlProfile.load(path) != sample_profile()
    assert "availability" not in sample_profile().to_json()  # absent, written as before


def test_profile_without_method_tables_is_written_as_before(tmp_path):
    # A file of the single-table format loads, and is written back key for key.
    old = {"version": 1, "batch_sizes": [1, 8], "ks": [0, 2], "itl_ms": [[9.5, 10.0], [11, 13]],
           "acceptance": {"ngram": [0.4]}}
    p = ItlProfile.from_json(old)
    assert p.method_itl_ms == {}
    assert p.to_json() == old
    assert "method_itl_ms" not in sample_profile().to_json()
    path = tmp_path / "profile.json"
    p.save(path)
    assert json.loads(path.read_text()) == old


def test_profile_without_acceptance_loads(tmp_path):
    obj = sample_profile().to_json()
    del obj["acceptance"]
    assert ItlProfile.from_json(obj).acceptance == {}


def _malformed(**changes):
    obj = sample_profile().to_json()
    for key, value in changes.items():
        if value is ...:
            del obj[key]
        else:
            obj[key] = value
    return obj


@pytest.mark.parametrize("obj, name", [
    (_malformed(version=...), "missing key 'version'"),
    (_malformed(ks=...), "missing key 'ks'"),
    (_malformed(itl_ms=...), "missing key 'itl_ms'"),
    (_malformed(version=2), "'version'"),
    (_malformed(version=True), "'version'"),
    (_malformed(batch_sizes="1,8,32"), "'batch_sizes'"),
    (_malformed(itl_ms=[1, 2, 3]), "'itl_ms'"),
    (_malformed(itl_ms=[[1, 2, 3], [1, 2, 3]]), "itl_ms must have 3 rows"),
    (_malformed(itl_ms=[[1, 2, 3], [1, "x", 3], [1, 2, 3]]), r"itl_ms\[1\]\[1\]"),
    (_malformed(ks=[0, 2, 2]), "ks"),
    (_malformed(acceptance=[0.5]), "'acceptance'"),
    (_malformed(acceptance={"eagle": 0.5}), "'acceptance'"),
    (_malformed(acceptance={"eagel": [0.5]}), "'eagel'"),
    (_malformed(acceptence={"eagle": [0.5]}), "unknown key.*'acceptence'"),
    (_malformed(method_itl={"eagle": [[1, 2, 3]] * 3}), "unknown key.*'method_itl'"),
    (_malformed(method_itl_ms=[[1, 2, 3]] * 3), "'method_itl_ms'"),
    (_malformed(availability=[0.5]), "'availability'"),
    (_malformed(availability={"ngram": 1.5}), r"availability\['ngram'\]"),
    (_malformed(availability={"ngram": "often"}), r"availability\['ngram'\]"),
    (_malformed(availability={"ngarm": 0.5}), "availability has unknown method 'ngarm'"),
    (_malformed(method_itl_ms={"eagle": [1, 2, 3]}), "'method_itl_ms'"),
    (_malformed(method_itl_ms={"eagle": "fast"}), "'method_itl_ms'"),
    (_malformed(method_itl_ms={"eagel": [[1, 2, 3]] * 3}),
     "method_itl_ms has unknown method 'eagel'"),
    (_malformed(method_itl_ms={"eagle": [[1, 2, 3]] * 2}),
     r"method_itl_ms\['eagle'\] must have 3 rows"),
    (_malformed(method_itl_ms={"eagle": [[1, 2, 3], [1, 2], [1, 2, 3]]}),
     r"method_itl_ms\['eagle'\]\[1\] must have 3 entries"),
    (_malformed(method_itl_ms={"eagle": [[1, 2, 3], [1, 2, 3], [1, 0, 3]]}),
     r"method_itl_ms\['eagle'\]\[2\]\[1\]"),
    (_malformed(method_itl_ms={"eagle": [[1, 2, 3], [1, 2, "x"], [1, 2, 3]]}),
     r"method_itl_ms\['eagle'\]\[1\]\[2\]"),
    ([1, 2], "must be a JSON object"),
])
def test_malformed_profile_names_the_key(tmp_path, obj, name):
    with pytest.raises(ValueError, match=name):
        ItlProfile.from_json(obj)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ValueError, match=name) as e:
        ItlProfile.load(path)
    assert str(path) in str(e.value)


def test_profile_that_is_not_json(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text('{"version": 1, "ks": [0, ')
    with pytest.raises(ValueError, match="not valid JSON") as e:
        ItlProfile.load(path)
    assert str(path) in str(e.value)
