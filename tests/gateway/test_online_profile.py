"""The online step-time model: it recovers a known cost from synthetic step
statistics, counts each verifier step once, gives no profile before enough
steps, and its profile makes dynamic K speculate where rows are cheap and not
where they are dear."""

from __future__ import annotations

import random

import numpy as np
import pytest

from gateway.policy import online_profile
from gateway.policy.batch_k import allocate
from gateway.policy.dynamic_k import NEUTRAL_ACCEPTANCE, DynamicK
from gateway.policy.goodput import choose_k
from gateway.policy.itl_profile import ItlProfile
from gateway.policy.online_profile import (
    ACCEPTANCE_PRIOR_STEPS,
    CALIBRATION_HALF_LIFE,
    CALIBRATION_PRIOR_TOKENS,
    MEMORY_STEPS,
    METHOD_AVAILABILITY_PRIOR_STEPS,
    MIN_STEPS,
    PLAIN_STEPS,
    PRIOR_ROWS_PER_A,
    RECALL_STEPS,
    RECALL_TOLERANCE,
    REFIT_STEPS,
    ROW_KNOTS,
    FittedProfile,
    OnlineProfile,
    RobustWeight,
    StepCost,
    StepSample,
    batch_grid,
)


def sample(step, batch, rows, ms, wait=0.0, method="none", k=0, drafted=0, accepted=0,
           replica="v0", prefill=False) -> StepSample:
    return StepSample(replica=replica, step=step, batch_size=batch, num_tokens=rows,
                      step_time_ms=ms, draft_wait_ms=wait, method=method,
                      num_speculative_tokens=k, num_drafted=drafted, num_accepted=accepted,
                      prefill=prefill)


class Verifier:
    """Synthetic steps of a verifier whose cost is known: forward a + b * rows,
    draft wait w + d[m] + s[m] * sequences + e[m] * draft tokens asked of m + h[m] *
    the most asked of one sequence. Each step's responses (one per sequence) are
    observed, as the gateway sees them."""

    def __init__(self, model: OnlineProfile, a, b, w=0.0, d=None, e=None, replica="v0",
                 s=None, h=None):
        self.model, self.a, self.b, self.w = model, a, b, w
        self.d, self.e, self.s, self.h = d or {}, e or {}, s or {}, h or {}
        self.replica = replica
        self.step = 0

    def run(self, seqs: list[tuple[str, int]], prefill_rows: int = 0,
            first: bool = False) -> None:
        """One step over sequences (method, K); every drafted token is accepted."""
        self.step += 1
        rows = prefill_rows + sum(1 + k for _, k in seqs)
        wait = self.w
        for m in {m for m, k in seqs if k}:
            mine = [k for mm, k in seqs if mm == m and k]
            wait += (self.d[m] + self.s.get(m, 0.0) * len(mine) + self.e[m] * sum(mine)
                     + self.h.get(m, 0.0) * max(mine))
        ms = self.a + self.b * rows + wait
        for i, (m, k) in enumerate(seqs):
            self.model.observe(sample(self.step, len(seqs), rows, ms, wait, m, k, k, k,
                                      self.replica, prefill=first and i == 0))


def test_fit_recovers_forward_and_draft_costs():
    model = OnlineProfile()
    # An EAGLE head: a cost per sequence and per depth beside the one per token.
    v = Verifier(model, a=30.0, b=4.0, w=0.5, d={"eagle3": 12.0, "ngram": 0.3},
                 e={"eagle3": 1.5, "ngram": 0.0}, s={"eagle3": 0.7}, h={"eagle3": 0.5})
    rng = random.Random(0)
    for _ in range(300):
        batch = rng.choice([1, 2, 4, 8])
        seqs = [(rng.choice(["eagle3", "ngram", "none"]), rng.randint(0, 4)) for _ in range(batch)]
        seqs = [(m, 0 if m == "none" else k) for m, k in seqs]
        v.run(seqs)
    cost = model.cost()
    assert cost is not None
    # A straight line: the changes of slope stay near 0. (The prior b ~ a / 16 of the
    # first segment, rows <= 4, leaves a bias of a fraction of a percent.)
    assert cost.a == pytest.approx(30.0, rel=1e-2)
    assert cost.b == pytest.approx(4.0, rel=2e-2)
    assert all(abs(c) < 0.1 for c in cost.hinges), cost.hinges
    assert cost.w == pytest.approx(0.5, abs=0.05)
    # (The ridges toward 0 of the terms per sequence and per depth, which the data
    # tell apart from the fixed one only through the steps' spread of sequences and
    # Ks, leave a bias of a few hundredths.)
    assert cost.d["eagle3"] == pytest.approx(12.0, abs=0.15)
    assert cost.s["eagle3"] == pytest.approx(0.7, abs=0.07)
    assert cost.e["eagle3"] == pytest.approx(1.5, abs=0.03)
    assert cost.h["eagle3"] == pytest.approx(0.5, abs=0.05)
    assert cost.d["ngram"] == pytest.approx(0.3, abs=0.05)
    for term in (cost.s, cost.e, cost.h):
        assert term["ngram"] == pytest.approx(0.0, abs=0.02)
    # The profile's tables are the cost, at every batch size up to 16.
    prof = model.profile(max_num_seqs=16, max_num_speculative_tokens=4)
    assert prof.batch_sizes == tuple(range(1, 17)) and prof.ks == (0, 1, 2, 3, 4)
    for b in (1, 3, 16):
        assert prof.itl(b, 0) == pytest.approx(cost.itl(b, 0))
        assert prof.itl(b, 3, "eagle3") == pytest.approx(
            30.5 + 4 * b * 4 + 12 + 0.7 * b + 1.5 * b * 3 + 0.5 * 3, rel=2e-3)
    assert set(prof.method_itl_ms) == {"eagle3", "ngram"}


def test_each_step_counts_once_whatever_its_responses():
    once, many = OnlineProfile(), OnlineProfile()
    for step in range(1, 41):
        rows = 1 + step % 7
        once.observe(sample(step, 1, rows, 10.0 + 2.0 * rows))
        for _ in range(8):  # the same step seen through eight requests
            many.observe(sample(step, 8, rows, 10.0 + 2.0 * rows))
    # The last step stays open until a later one arrives: 39 steps fitted.
    assert once.num_steps == many.num_steps == 39
    assert many.cost() == once.cost()
    # A late response of a step already fitted changes nothing.
    many.observe(sample(12, 8, 100, 500.0))
    many.observe(sample(41, 1, 2, 14.0))
    assert many.num_steps == 40


def test_steps_count_per_replica_and_a_restart_starts_over():
    model = OnlineProfile()
    for step in range(1, 11):
        model.observe(sample(step, 1, 2, 20.0, replica="v0"))
        model.observe(sample(step, 1, 2, 20.0, replica="v1"))  # same numbers, other steps
    assert model.num_steps == 18
    model.observe(sample(5000, 1, 2, 20.0, replica="v0"))
    model.observe(sample(1, 1, 2, 20.0, replica="v0"))  # far below: the verifier restarted
    model.observe(sample(2, 1, 2, 20.0, replica="v0"))
    assert model.num_steps == 21


def test_prefill_steps_stay_out_of_the_forward_fit():
    model = OnlineProfile()
    v = Verifier(model, a=20.0, b=1.0)
    for i in range(60):
        v.run([("none", 0)] * (1 + i % 8))
        # A long prompt's prefill costs more per row than decode; it must not bend the line.
        v.run([("none", 0)], prefill_rows=400, first=True)
        v.model.observe(sample(v.step, 1, 401, 2000.0, replica="v0", prefill=True))
    cost = model.cost()
    assert cost.a == pytest.approx(20.0, rel=1e-2) and cost.b == pytest.approx(1.0, rel=3e-2)
    assert cost.forward(8) == pytest.approx(28.0, rel=1e-2)


def test_no_profile_before_enough_steps_then_the_prior_split():
    model = OnlineProfile()
    for step in range(1, MIN_STEPS + 1):  # the last stays open: MIN_STEPS - 1 fitted
        assert model.profile(16, 4) is None and model.cost() is None
        model.observe(sample(step, 1, 1, 34.0))
    assert model.profile(16, 4) is None
    model.observe(sample(MIN_STEPS + 1, 1, 1, 34.0))
    cost = model.cost()
    # Batch 1, plain: every step fed one row, so only a + b is seen; the prior splits it.
    assert cost.a + cost.b == pytest.approx(34.0, rel=1e-3)
    assert cost.b == pytest.approx(cost.a / PRIOR_ROWS_PER_A, rel=1e-3)
    assert cost.d == {} and cost.e == {}
    # No drafting seen: no method table, no measured acceptance, the neutral prior.
    prof = model.profile(16, 4)
    assert prof.method_itl_ms == {} and prof.acceptance == {}
    assert DynamicK(lambda: prof, "eagle3", 4).prior == (NEUTRAL_ACCEPTANCE,)


def test_coefficients_stay_non_negative():
    model = OnlineProfile()
    for step in range(1, 80):  # noise only: more rows look cheaper
        rows = 1 + step % 9
        model.observe(sample(step, rows, rows, 50.0 - 0.5 * rows))
    cost = model.cost()
    assert cost.b == 0.0 and cost.a > 0


def test_acceptance_prior_is_measured_per_method():
    model = OnlineProfile()
    v = Verifier(model, a=40.0, b=2.5, d={"ngram": 0.0}, e={"ngram": 0.0})
    for _ in range(30):
        v.run([("ngram", 4)])
        # The eagle3 request's drafts: first accepted, second rejected.
        v.model.observe(sample(v.step, 2, 10, 60.0, 0.0, "eagle3", 4, 4, 1))
    prof = model.profile(16, 4)
    # The posterior around the neutral 0.5 worth ACCEPTANCE_PRIOR_STEPS drafting steps
    # (30 observations, aged by a half-life far longer than that).
    n, w = 30, ACCEPTANCE_PRIOR_STEPS
    assert prof.acceptance["ngram"] == pytest.approx(((n + w / 2) / (n + w),) * 4, rel=1e-2)
    assert prof.acceptance["eagle3"] == pytest.approx(
        ((n + w / 2) / (n + w), (w / 2) / (n + w), 0.5, 0.5), rel=1e-2)


def test_availability_prior_is_the_share_of_asked_steps_with_drafts_per_method():
    model = OnlineProfile()
    v = Verifier(model, a=40.0, b=2.5, d={"ngram": 0.0}, e={"ngram": 0.0})
    for i in range(60):
        v.run([("ngram", 4)])
        # An ngram request asked for 4 drafts that had none in two steps of three; an
        # eagle3 request that always had them; a plain one, never asked, and a response
        # completing a prompt (on another replica, so that v0's steps stay decode steps).
        model.observe(sample(v.step, 4, 10, 60.0, 0.0, "ngram", 4, 0 if i % 3 else 4, 0))
        model.observe(sample(v.step, 4, 10, 60.0, 0.0, "eagle3", 2, 2, 1))
        model.observe(sample(v.step, 4, 10, 60.0, 0.0, "none"))
        model.observe(sample(i + 1, 4, 10, 60.0, 0.0, "ngram", 4, 0, 0, replica="v1",
                             prefill=True))
    prof = model.profile(16, 4)
    # ngram: the Verifier's 60 steps had drafts, the request's 20 of 60: 80 of 120,
    # around 1 worth METHOD_AVAILABILITY_PRIOR_STEPS (aged by a half-life far longer).
    w = METHOD_AVAILABILITY_PRIOR_STEPS
    assert prof.availability["ngram"] == pytest.approx((80 + w) / (120 + w), rel=1e-2)
    assert prof.availability["eagle3"] == pytest.approx(1.0)
    assert set(prof.availability) == {"ngram", "eagle3"}  # methods that were asked
    # A request's own share starts from its method's.
    dk = DynamicK(lambda: prof, "ngram", 4)
    assert dk.availability() == pytest.approx(prof.availability["ngram"])
    for _ in range(100):
        dk.observe(0, 0, asked=True)
    assert dk.availability() < 0.2


def test_profile_makes_k_zero_at_a_large_batch_and_speculates_at_batch_one():
    """The issue's CPU cost: a = 40 ms, b = 2.5 ms per fed row, good acceptance."""
    model = OnlineProfile()
    v = Verifier(model, a=40.0, b=2.5, d={"eagle3": 3.0}, e={"eagle3": 0.2})
    rng = random.Random(1)
    for _ in range(200):
        batch = rng.choice([1, 4, 16])
        v.run([("eagle3", rng.randint(0, 4)) for _ in range(batch)])
    prof = model.profile(max_num_seqs=128, max_num_speculative_tokens=4)
    assert choose_k(prof, 1, (0.8,), 4, "eagle3") == 4
    # Without drafter cost, K = 1 beats plain while 1.8 (a + bB) > a + 2bB, i.e.
    # B < 4a/b = 64 at acceptance 0.8, and B < 1.5a/b = 24 at 0.6.
    assert choose_k(prof, 16, (0.8,), 4, "eagle3") > 0
    assert choose_k(prof, 128, (0.8,), 4, "eagle3") == 0
    assert choose_k(prof, 4, (0.6,), 4, "eagle3") > 0
    assert choose_k(prof, 32, (0.6,), 4, "eagle3") == 0


def test_dynamic_k_follows_the_model_as_it_learns():
    model = OnlineProfile()
    # A light prior on the request's own counts, so that they soon outweigh it.
    dk = DynamicK(lambda: model.profile(16, 4), "ngram", 4, prior_steps=8, half_life_steps=48)
    assert dk.next_k(1) is None  # nothing measured: the caller keeps its K
    v = Verifier(model, a=10.0, b=0.1, d={"ngram": 0.0}, e={"ngram": 0.0})
    for i in range(MIN_STEPS + 5):
        v.run([("ngram", i % 5)])
    assert dk.next_k(1) == 4  # rows nearly free, and every draft so far accepted
    for _ in range(100):  # this request's own drafts: never accepted
        dk.observe(4, 0)
    # Its own evidence outweighs the method's rates (all accepted so far) ...
    assert dk.rates()[0] < 0.15
    # ... but rows are nearly free: trying the positions after it still pays.
    assert dk.next_k(1) == 4
    # The machine gets busy: a row now costs four times the fixed part of a step.
    v.a, v.b = 10.0, 40.0
    for i in range(2000):
        v.run([("ngram", i % 5)] * 4)
    # Steps of 4 sequences feed 4..20 rows: 40 ms a row there.
    cost = model.cost()
    assert cost.forward(20) - cost.forward(4) == pytest.approx(40.0 * 16, rel=1e-2)
    assert dk.next_k(1) == dk.next_k(16) == 0


def test_a_drafter_always_asked_the_same_k_counts_as_a_fixed_cost():
    """Batch 1 at K = 4 only: d and e*4 cannot be told apart. The prior takes the
    wait as fixed, so it is not multiplied by 16 at batch 16; once batch sizes
    vary the split is measured."""
    model = OnlineProfile()
    v = Verifier(model, a=40.0, b=2.5, d={"eagle3": 6.0}, e={"eagle3": 2.0})
    for _ in range(100):
        v.run([("eagle3", 4)])
    cost = model.cost()
    asked, sequences, depth = {"eagle3": 4}, {"eagle3": 1}, {"eagle3": 4}
    assert cost.wait(asked, sequences, depth) == pytest.approx(14.0, rel=1e-3)
    assert cost.d["eagle3"] == pytest.approx(14.0, rel=1e-2)
    assert max(cost.e["eagle3"], cost.s["eagle3"], cost.h["eagle3"]) < 0.1
    for i in range(300):
        v.run([("eagle3", 4)] * (1 + i % 8))
    cost = model.cost()
    # Each sequence adds 4 tokens: what it costs is measured, not yet whether per
    # sequence or per token.
    assert cost.d["eagle3"] == pytest.approx(6.0, abs=0.1)
    assert cost.s["eagle3"] + 4 * cost.e["eagle3"] == pytest.approx(8.0, abs=0.05)
    for i in range(300):
        v.run([("eagle3", 1 + i % 4)] * (1 + i % 7))
    cost = model.cost()
    assert cost.d["eagle3"] == pytest.approx(6.0, abs=0.1)
    assert cost.e["eagle3"] == pytest.approx(2.0, abs=0.05)
    assert cost.s["eagle3"] == pytest.approx(0.0, abs=0.1)
    assert cost.h["eagle3"] == pytest.approx(0.0, abs=0.1)


def test_step_sample_is_checked():
    with pytest.raises(ValueError, match="num_tokens"):
        sample(1, 1, -1, 10.0)
    with pytest.raises(ValueError, match="step_time_ms"):
        sample(1, 1, 1, float("nan"))
    with pytest.raises(ValueError, match="method"):
        sample(1, 1, 1, 10.0, method="medusa")
    with pytest.raises(ValueError, match="num_accepted"):
        sample(1, 1, 1, 10.0, method="ngram", k=2, drafted=1, accepted=2)


def test_batch_grid_and_cost():
    assert batch_grid(1) == (1,)
    assert batch_grid(16) == tuple(range(1, 17))
    assert batch_grid(24) == (*range(1, 17), 24)
    assert batch_grid(128) == (*range(1, 17), 24, 32, 48, 64, 96, 128)
    c = StepCost(a=40.0, b=2.5, w=1.0, d={"eagle3": 10.0}, e={"eagle3": 0.5})
    assert c.itl(1, 0) == 43.5
    assert c.itl(2, 3, "eagle3") == 40 + 1 + 2.5 * 8 + 10 + 0.5 * 6
    assert c.itl(2, 3, "ngram") == 40 + 1 + 2.5 * 8  # never drafted: no drafter cost yet


def test_forward_with_a_knee_is_fitted_and_k_follows_it():
    """A CPU-like forward: rows up to 12 nearly free (weights streamed once), 2.2 ms a
    row past them, less past 64. The fit follows the bends, and dynamic K's choices
    are those the true cost gives, at batch sizes on both sides of the knee; a line
    through the same steps would pick differently."""

    def true_forward(rows):
        return 25.0 + 0.8 * min(rows, 12) + 2.2 * max(0, min(rows, 64) - 12) \
            + 1.4 * max(0, rows - 64)

    model = OnlineProfile()
    rng = random.Random(3)
    step = 0
    fed = []
    for _ in range(600):
        batch = rng.randint(1, 16)
        seqs = [("ngram", rng.randint(0, 4)) for _ in range(batch)]
        rows = sum(1 + k for _, k in seqs)
        fed.append(rows)
        step += 1
        for m, k in seqs:
            model.observe(sample(step, batch, rows, true_forward(rows), 0.0, m, k, k, k))
    cost = model.cost()
    for rows in (1, 4, 8, 12, 16, 24, 32, 48, 64):
        assert cost.forward(rows) == pytest.approx(true_forward(rows), rel=0.06), rows
    # Few steps feed more than 64 rows (16 sequences all at K >= 3): the bend there is
    # only partly seen.
    assert cost.forward(80) == pytest.approx(true_forward(80), rel=0.1)
    prof = model.profile(max_num_seqs=16, max_num_speculative_tokens=4)
    truth = StepCost(a=0.0, b=0.0, w=0.0, d={}, e={})
    truth_itl = {(b, k): true_forward(b * (k + 1)) for b in range(1, 17) for k in range(5)}
    # The least-squares line through the same steps, the model before the knots.
    slope, intercept = np.polyfit(fed, [true_forward(r) for r in fed], 1)
    line = StepCost(a=intercept, b=slope, w=0.0, d={}, e={})
    line_differs = False
    for b in (1, 2, 4, 6, 8, 12, 16):
        for alpha in (0.5, 0.7, 0.9):
            want = max(range(5), key=lambda k: (sum(alpha ** i for i in range(k + 1))
                                                / truth_itl[(b, k)], -k))
            assert choose_k(prof, b, (alpha,), 4, "ngram") == want, (b, alpha)
            line_differs |= max(range(5), key=lambda k: (
                sum(alpha ** i for i in range(k + 1)) / line.itl(b, k), -k)) != want
    assert line_differs
    assert truth.forward(100) == 0.0  # a zero cost stays zero (no stray hinge terms)


def test_forward_is_read_non_decreasing():
    """A fit whose later slope turned negative (noise past the data) reads flat there,
    and a negative jump as none."""
    c = StepCost(a=20.0, b=2.0, w=0.0, d={}, e={}, hinges=(0.0, 0.0, 0.0, -3.0, *[0.0] * 7))
    assert c.forward(8) == 36.0 and c.forward(16) == 52.0
    assert c.forward(40) == 52.0  # slope 2 - 3 < 0 past 16: flat, not falling
    c = StepCost(a=20.0, b=2.0, w=0.0, d={}, e={}, jumps=(0.0, 0.0, 10.0, -4.0, *[0.0] * 7))
    assert c.forward(12) == 44.0 and c.forward(13) == 56.0 and c.forward(17) == 64.0


def test_the_fit_is_non_decreasing_so_steps_past_a_knot_are_priced_at_their_mean():
    """eagle3 at batch 4, K = 2 then K = 4: 12 rows at 37 ms, 16 at 41, then 18 / 19 /
    20 rows at 49 / 47 / 46 ms (a slow tail at 18). Fitted freely, a jump past 16 with
    a falling slope after it matches those three, and read non-decreasing it priced all
    of them (and every row past) at the dearest. Fitted non-decreasing, the three are
    priced at about their mean, and so is every row past them."""
    model, step = OnlineProfile(), 0
    for rows, ms, repeats in ((3, 23.0, 20), (5, 24.0, 20), (12, 37.0, 150), (16, 41.0, 50),
                              (18, 49.0, 40), (19, 47.0, 40), (20, 46.0, 40)):
        batch = 1 if rows < 12 else 4
        for _ in range(repeats):
            step += 1
            for _ in range(batch):
                model.observe(sample(step, batch, rows, ms, 0.0, "eagle3", 2, 2, 1))
    cost = model.cost()
    for rows in (18, 19, 20, 24):
        assert cost.forward(rows, 4) == pytest.approx(47.3, abs=0.6), rows
    for rows, ms in ((12, 37.0), (16, 41.0)):
        assert cost.forward(rows, 4) == pytest.approx(ms, abs=1.0), rows


def cpu_forward(rows, jump=40.0):
    """Up to 12 rows the weights stream once (0.5 ms a row); past 12 the kernel hands
    over, a step costs `jump` ms more, then 2 ms a row."""
    return 30.0 + 0.5 * min(rows, 12) + (jump if rows > 12 else 0.0) + 2.0 * max(0, rows - 12)


def fit_batch_of_four(truth, steps=400, seed=5) -> OnlineProfile:
    """Steps of 4 sequences, each drafting 0-3 (a drafter without a proposal feeds no
    rows), so the steps' rows spread over 4..16 and past the 12-row knot."""
    model, rng = OnlineProfile(), random.Random(seed)
    for step in range(1, steps + 1):
        ks = [rng.randint(0, 3) for _ in range(4)]
        rows = 4 + sum(ks)
        for k in ks:
            model.observe(sample(step, 4, rows, truth(rows), 0.0, "ngram", 3, k, k))
    return model


def test_a_jump_past_a_knot_is_fitted_and_read_between_grid_points():
    model = fit_batch_of_four(cpu_forward)
    cost = model.cost()
    for rows in (4, 8, 12, 13, 14, 16):
        assert cost.forward(rows) == pytest.approx(cpu_forward(rows), rel=0.05), rows
    # At batch 4, 13 rows is K = 2.25: between the grid's K = 2 (12 rows) and 3 (16).
    # The fitted profile reads the fit there; its own tables, interpolated, would
    # spread the jump over the four rows and price 13 rows far below what they cost.
    prof = model.profile(max_num_seqs=16, max_num_speculative_tokens=4)
    assert isinstance(prof, FittedProfile)
    assert prof.itl(4, 9 / 4) == pytest.approx(cpu_forward(13), rel=0.05)
    tables = ItlProfile(batch_sizes=prof.batch_sizes, ks=prof.ks, itl_ms=prof.itl_ms)
    assert tables.itl(4, 9 / 4) < 0.8 * cpu_forward(13)
    for b, k in ((4, 2), (3, 1), (16, 4)):  # on the grid the two agree
        assert prof.itl(b, k) == pytest.approx(tables.itl(b, k), rel=1e-12)
    assert prof.itl(40, 9) == prof.itl(16, 4)  # clamped to the grid's edges, as tables are
    # Where the truth bends without a jump, the fit adds none to speak of.
    bend = fit_batch_of_four(lambda rows: cpu_forward(rows, jump=0.0)).cost()
    assert max(bend.jumps) < 2.0
    for rows in (12, 13, 16):
        assert bend.forward(rows) == pytest.approx(cpu_forward(rows, jump=0.0), rel=0.05)


def test_a_cost_per_sequence_is_told_from_a_cost_per_row():
    """A sequence costs 6 ms whatever its rows (its attention, its sampling): a plain
    step of 8 sequences then costs more than a step of 3 feeding the same 8 rows. Once
    batch sizes and drafts vary, the fit tells the two apart."""
    def truth(rows, sequences):
        return cpu_forward(rows) + 6.0 * sequences

    model, rng = OnlineProfile(), random.Random(3)
    for step in range(1, 601):
        batch = rng.randint(1, 12)
        ks = [rng.choice((0, 0, 1, 2, 3)) for _ in range(batch)]
        rows = batch + sum(ks)
        for k in ks:
            model.observe(sample(step, batch, rows, truth(rows, batch), 0.0, "ngram", 3, k, k))
    cost = model.cost()
    assert cost.g == pytest.approx(6.0, rel=0.15)
    for rows, sequences in ((8, 8), (8, 3), (11, 11), (13, 4), (24, 8)):
        assert cost.forward(rows, sequences) == pytest.approx(truth(rows, sequences),
                                                              rel=0.05), (rows, sequences)
    prof = model.profile(max_num_seqs=16, max_num_speculative_tokens=4)
    assert prof.itl(8, 0) - prof.itl(3, 5 / 3) == pytest.approx(30.0, rel=0.2)


def test_one_k_leaves_the_cost_per_sequence_to_the_rows():
    """Every step at K = 2: rows are 3 x sequences, and the two cannot be told apart.
    The ridge keeps g near 0 and the rows carry the cost, which prices those steps
    right all the same."""
    model = OnlineProfile()
    rng = random.Random(4)
    for step in range(1, 401):
        batch = rng.randint(1, 5)
        rows = 3 * batch
        for _ in range(batch):
            model.observe(sample(step, batch, rows, 30.0 + 2.0 * rows + 3.0 * batch, 0.0,
                                 "ngram", 2, 2, 2))
    cost = model.cost()
    assert cost.g < 0.5
    for batch in (1, 3, 5):
        assert cost.forward(3 * batch, batch) == pytest.approx(30.0 + 9.0 * batch, rel=0.05)


def test_itls_of_the_fitted_cost_match_its_itl():
    # Jumps, bends, a cost per sequence and drafter costs, read at many K at once
    # (dynamic K's array form) and one at a time, inside and past the grid's edges.
    cost = StepCost(a=30.0, b=1.5, w=0.7, d={"ngram": 2.0}, e={"ngram": 0.1},
                    hinges=(0.5, -0.8, 0.2) + (0.0,) * (len(ROW_KNOTS) - 3),
                    jumps=(0.0, 0.0, 25.0, -3.0) + (0.0,) * (len(ROW_KNOTS) - 4), g=1.2)
    model_profile = FittedProfile(batch_sizes=(1, 2, 4, 8, 16), ks=tuple(range(5)),
                                  itl_ms=((1.0,) * 5,) * 5, method_itl_ms={"ngram": ((1.0,) * 5,) * 5},
                                  cost=cost)
    ks = np.linspace(-1.0, 6.0, 57)
    for b, method in ((1, None), (3.5, "ngram"), (11, "ngram"), (40, None), (6, "eagle3")):
        want = [model_profile.itl(b, k, method) for k in ks]
        assert model_profile.itls(b, ks, method).tolist() == pytest.approx(want, rel=1e-12)
    rows = np.array([0.0, 1.0, 4.0, 12.0, 12.5, 13.0, 300.0])
    assert cost.forwards(rows, 3).tolist() == pytest.approx([cost.forward(r, 3) for r in rows],
                                                            rel=1e-12)


def _disturbed(robust: bool) -> tuple[OnlineProfile, Verifier]:
    """A model fed 200 steps of batches 1-8 at K = 0-2, then 30 steps where another
    process took the cores (everything 10x slower), then 30 quiet steps again."""
    model = OnlineProfile()
    if not robust:
        model._robust_forward = model._robust_wait = lambda observed, modelled: 1.0
    v = Verifier(model, a=40.0, b=2.5, w=0.5, d={"ngram": 3.0}, e={"ngram": 0.2})
    rng = random.Random(1)

    def steps(n: int) -> None:
        for _ in range(n):
            v.run([("ngram", rng.randint(0, 2))] * rng.randint(1, 8))

    steps(200)
    v.a, v.b, v.w, v.d["ngram"] = 400.0, 25.0, 5.0, 30.0
    steps(30)
    v.a, v.b, v.w, v.d["ngram"] = 40.0, 2.5, 0.5, 3.0
    steps(30)
    return model, v


def test_a_disturbed_stretch_of_steps_barely_moves_the_fit():
    model, _ = _disturbed(robust=True)
    cost = model.cost()
    # Step times of a plain step of 8 and of 8 sequences drafting 2 each: the steps
    # of the stretch, 10x slower than the model, weighed next to nothing.
    plain8, draft8 = 40.0 + 2.5 * 8 + 0.5, 40.0 + 2.5 * 24 + 0.5 + 3.0 + 0.2 * 16
    assert cost.itl(8, 0) == pytest.approx(plain8, rel=0.03)
    assert cost.itl(8, 2, "ngram") == pytest.approx(draft8, rel=0.03)
    # At full weight the same stretch leaves the fit several times off.
    full = _disturbed(robust=False)[0].cost()
    assert full.itl(8, 0) > 2 * plain8 and full.itl(8, 2, "ngram") > 4 * draft8


def test_a_machine_that_stays_busier_is_followed():
    # Twice as slow for good: within 150 steps the fit has moved as far as one that
    # weighs every step alike (whose forgetting sets the pace). Most of the way, not
    # all: the old steps fed up to 24 rows, the new ones 1-8, and a forward that may
    # not fall with rows holds the new rows down toward the old steps past them
    # until those are forgotten.
    def busier(robust: bool) -> float:
        model = OnlineProfile()
        if not robust:
            model._robust_forward = model._robust_wait = lambda observed, modelled: 1.0
        v = Verifier(model, a=40.0, b=2.5, w=0.5, d={"ngram": 3.0}, e={"ngram": 0.2})
        rng = random.Random(1)
        for _ in range(200):
            v.run([("ngram", rng.randint(0, 2))] * rng.randint(1, 8))
        v.a, v.b = 80.0, 5.0
        for _ in range(150):
            v.run([("none", 0)] * rng.randint(1, 8))
        return model.cost().itl(8, 0)

    robust, full = busier(True), busier(False)
    assert robust > 1.6 * (40.0 + 2.5 * 8 + 0.5)
    assert robust == pytest.approx(full, rel=0.05)


def test_robust_weights_fall_with_the_square_of_a_slow_miss():
    weigh = RobustWeight()
    assert weigh(105.0, 100.0) == 1.0  # the mean miss starts at 10 % of the time
    for _ in range(300):
        assert weigh(102.0, 100.0) == 1.0
    # Held at its floor, 5 % of the modelled time: a step up to 10 x 5 ms slower
    # counts in full, one 200 ms slower a sixteenth; a fast step always in full.
    assert weigh(149.0, 100.0) == 1.0
    assert weigh(300.0, 100.0) == pytest.approx((50.0 / 200.0) ** 2, rel=0.1)
    assert weigh(20.0, 100.0) == 1.0


def test_a_fresh_verifiers_slow_first_steps_do_not_make_the_first_model():
    # Half the steps before the first model are a cold start's, 25x slower, at the
    # same batch sizes as the others (a fit with jumps could take a slow stretch at
    # other row counts for the cost of those rows).
    def first_model(reweigh: bool) -> StepCost:
        model = OnlineProfile()
        if not reweigh:
            model._reweigh_warmup = lambda: None
        v = Verifier(model, a=50.0, b=2.0)
        for i in range(MIN_STEPS + 1):
            v.a = 1250.0 if i < MIN_STEPS // 2 else 50.0
            v.run([("none", 0)] * (1 + i % 8))
        return model.cost()

    cost, unweighed = first_model(True), first_model(False)
    for batch in (1, 4, 8):
        assert cost.itl(batch, 0) == pytest.approx(50.0 + 2.0 * batch, rel=0.05)
        assert unweighed.itl(batch, 0) > 5 * (50.0 + 2.0 * batch)


def test_dynamic_k_reads_a_fit_at_most_refit_steps_old():
    model = OnlineProfile()
    v = Verifier(model, a=40.0, b=2.5)
    for _ in range(MIN_STEPS + 2):
        v.run([("none", 0)] * 2)
    # Read every step, as dynamic K does: refitted once every REFIT_STEPS steps, not
    # every step.
    seen = []
    for _ in range(8 * REFIT_STEPS):
        v.run([("none", 0)] * 2)
        profile = model.profile(16, 4)
        if not seen or profile is not seen[-1]:
            seen.append(profile)
    assert 8 <= len(seen) <= 9  # the first carries over from before the loop
    # The machine turns slower: the fit has it within REFIT_STEPS steps (+ 1: a step's
    # responses are merged until the next step arrives, so it is fitted a step late).
    before = model.profile(16, 4).itl(2, 0)
    v.a = 80.0
    for _ in range(REFIT_STEPS + 1):
        v.run([("none", 0)] * 2)
    assert model.profile(16, 4).itl(2, 0) > before + 1.0


def test_calibration_is_what_a_methods_steps_accepted_over_what_was_expected():
    online = OnlineProfile()
    assert online.calibration("eagle3") == 1.0  # nothing seen: as expected
    for _ in range(2000):
        online.calibrate("eagle3", 3.0, 2)
    # The aged counts (1 / (1 - 2^(-1/h)) steps' worth) beside the prior's tokens at 1.
    kept = 1 / (1 - 0.5 ** (1 / CALIBRATION_HALF_LIFE))
    assert online.calibration("eagle3") == pytest.approx(
        (2 * kept + CALIBRATION_PRIOR_TOKENS) / (3 * kept + CALIBRATION_PRIOR_TOKENS), rel=1e-3)
    assert online.calibration("eagle3") < 0.7
    assert online.calibration("ngram") == 1.0  # per method
    # Old evidence fades: steps that accept what was expected take it back to 1.
    for _ in range(4 * int(CALIBRATION_HALF_LIFE)):
        online.calibrate("eagle3", 2.0, 2)
    assert 0.97 < online.calibration("eagle3") < 1.0


def test_plain_batch_sizes_are_those_with_plain_steps_in_the_fits_memory():
    model = OnlineProfile()
    v = Verifier(model, a=10.0, b=1.0, d={"ngram": 0.0}, e={"ngram": 0.0})
    for _ in range(MIN_STEPS):
        v.run([("ngram", 2)] * 16)  # batch 16, every sequence drafting
    for _ in range(PLAIN_STEPS - 1):
        v.run([("ngram", 0)] * 4)
    v.run([("none", 0)] * 4, first=True)  # one row a sequence, but a prefill's
    v.run([("ngram", 1)] * 4)  # drafting
    v.run([("ngram", 2)] * 16)
    assert model.plain_batch_sizes() == frozenset()
    v.run([("none", 0)] * 4)
    v.run([("ngram", 2)] * 16)  # a step is fitted once the next one arrives
    assert model.plain_batch_sizes() == frozenset({4})
    profile = model.profile(16, 4)
    assert profile.measured_plain(4) and not profile.measured_plain(16)
    for _ in range(MEMORY_STEPS - PLAIN_STEPS):
        v.run([("ngram", 2)] * 16)
    assert model.plain_batch_sizes() == frozenset()  # out of the fit's memory


def test_a_size_out_of_memory_is_recalled_while_the_machine_runs_as_it_did():
    # Static-K cells between two of dynamic K push a size's plain steps out of the fit's
    # memory, and measuring it again costs dynamic K a few plain steps each time.
    def run():
        model = OnlineProfile()
        v = Verifier(model, a=10.0, b=1.0, d={"ngram": 0.0}, e={"ngram": 0.0})
        for i in range(MIN_STEPS):
            v.run([("ngram", 2 + i % 2)] * 4)
        for _ in range(PLAIN_STEPS):
            v.run([("none", 0)] * 4)
        for i in range(MEMORY_STEPS):
            v.run([("ngram", 2 + i % 2)] * 4)  # batch 4, every sequence drafting
        return model, v

    model, v = run()
    assert model.plain_batch_sizes() == frozenset()  # out of the fit's memory
    cost = model.cost()
    assert abs(cost.forward(4, 4) - 14.0) <= RECALL_TOLERANCE * 14.0  # priced as it took
    assert model.plain_batch_sizes(cost) == frozenset({4})
    assert model.profile(16, 4).measured_plain(4)
    # The machine speeds up. The fit sees it at 12-16 rows, as jumps past the knots
    # as much as anything: its plain step of 4 moves too little to tell, and stays too
    # dear. The fit the old steps were weighed against prices the new ones too high,
    # and tells.
    v.a = 5.0
    for i in range(MEMORY_STEPS // 4):
        v.run([("ngram", 2 + i % 2)] * 4)
    assert not model.profile(16, 4).measured_plain(4)
    # Slower instead, the plain step of 4 is priced too cheap, which a batch that runs
    # plain on it measures: still recalled.
    model, v = run()
    v.a = 20.0
    for i in range(MEMORY_STEPS // 4):
        v.run([("ngram", 2 + i % 2)] * 4)
    assert model.cost().forward(4, 4) < 24.0 - 1.0  # priced below what it takes now
    assert model.profile(16, 4).measured_plain(4)
    # A size is recalled for RECALL_STEPS only.
    model, v = run()
    for i in range(RECALL_STEPS - MEMORY_STEPS - PLAIN_STEPS - REFIT_STEPS):
        v.run([("ngram", 2 + i % 2)] * 4)
    assert model.profile(16, 4).measured_plain(4)
    for _ in range(2 * REFIT_STEPS):
        v.run([("ngram", 2)] * 4)
    assert not model.profile(16, 4).measured_plain(4)


def test_a_size_in_memory_is_measured_only_while_the_machine_runs_as_it_did():
    # A stack's first cell ran plain at batch 16 on a slow machine; a few hundred steps
    # later the machine is faster and dynamic K drafts at 16. In the fit's memory, the
    # old plain steps are still what it prices plain at 16 by, too dear: the size is
    # measured again rather than read off them.
    def run(faster: float):
        model = OnlineProfile()
        v = Verifier(model, a=20.0, b=4.0, d={"ngram": 0.0}, e={"ngram": 0.0})
        for _ in range(MIN_STEPS):
            v.run([("ngram", 2)] * 4)
        for _ in range(PLAIN_STEPS + 20):
            v.run([("none", 0)] * 16)
        v.a, v.b = 20.0 / faster, 4.0 / faster
        for i in range(MEMORY_STEPS // 2):
            v.run([("ngram", 1 + i % 2)] * 16)  # batch 16, every sequence drafting
        return model, v

    model, v = run(1.0)
    assert model.plain_batch_sizes() == frozenset({16})  # in the fit's memory
    assert model.profile(16, 4).measured_plain(16)  # and the machine as it was
    model, v = run(1 / 1.4)  # slower: plain at 16 priced too cheap, which plain tells
    assert model.profile(16, 4).measured_plain(16)
    model, v = run(1.4)
    assert model.plain_batch_sizes() == frozenset({16})
    before = model.profile(16, 4)
    assert not before.measured_plain(16)
    # Measured again by a few plain steps, which the old ones no longer outweigh.
    for _ in range(PLAIN_STEPS):
        v.run([("none", 0)] * 16)
    for _ in range(REFIT_STEPS + 1):  # fits the last of them, and refits
        v.run([("ngram", 2)] * 16)
    after = model.profile(16, 4)
    assert after.measured_plain(16)
    now = v.a + v.b * 16
    assert before.itl(16, 0) > 1.3 * now  # priced by the old steps
    # (The first steps, batch 4 drafting at 12 rows, are of the slow machine too.)
    assert abs(after.itl(16, 0) - now) < abs(before.itl(16, 0) - now) / 3


def test_a_batch_size_is_measured_in_the_profile_from_its_last_plain_step_on(monkeypatch):
    # BatchK runs a batch of an unmeasured size plain until the profile says otherwise:
    # a profile that waited for the next refit ran up to REFIT_STEPS plain steps more.
    # No refit in this test, so a profile that only a refit updates stays unmeasured.
    monkeypatch.setattr(online_profile, "REFIT_STEPS", 10**6)
    model = OnlineProfile()
    v = Verifier(model, a=10.0, b=1.0, d={"ngram": 0.0}, e={"ngram": 0.0})
    for _ in range(MIN_STEPS):
        v.run([("ngram", 2)] * 16)
    for _ in range(PLAIN_STEPS - 1):
        v.run([("none", 0)] * 4)
    v.run([("ngram", 2)] * 16)  # fits the last of those
    before = model.profile(16, 4)  # fitted now, and cached
    assert not before.measured_plain(4)
    v.run([("none", 0)] * 4)
    v.run([("ngram", 2)] * 16)  # fits it: PLAIN_STEPS plain steps of 4
    after = model.profile(16, 4)
    assert after.measured_plain(4) and not after.measured_plain(16)
    assert after.itl_ms == before.itl_ms  # the same fit: only the measured sizes are new
    assert model.profile(16, 4) is after  # and cached again, not rebuilt every read


def test_the_wait_prices_the_context_a_drafter_takes_in():
    # An EAGLE head takes in the context it has not seen for a sequence: a few rows a
    # step while the sequence drafts every step, its whole prompt and reply so far when
    # it starts after plain steps. The fit tells that cost from the one per sequence.
    model = OnlineProfile()
    rng = random.Random(3)
    for step in range(1, 401):
        batch = rng.choice([1, 4, 8, 16])
        seqs = []  # (K, backlog)
        for _ in range(batch):
            k = rng.choice([0, 2, 4])
            starts = rng.random() < 0.1
            seqs.append((k, 0 if not k else rng.randint(80, 250) if starts else rng.randint(1, 5)))
        asked = [(k, b) for k, b in seqs if k]
        wait = 0.3
        if asked:
            wait += (4.0 + 0.7 * len(asked) + 0.2 * sum(k for k, _ in asked)
                     + 0.5 * max(k for k, _ in asked) + 0.05 * sum(b for _, b in asked))
        rows = sum(1 + k for k, _ in seqs)
        for k, b in seqs:
            model.observe(StepSample(
                replica="v0", step=step, batch_size=batch, num_tokens=rows,
                step_time_ms=20.0 + 2.0 * rows + wait, draft_wait_ms=wait, method="eagle3",
                num_speculative_tokens=k, num_drafted=k, num_accepted=k, prefill=False,
                backlog=b))
    cost = model.cost()
    assert cost.c["eagle3"] == pytest.approx(0.05, abs=0.002)
    assert cost.s["eagle3"] == pytest.approx(0.7, abs=0.1)
    assert cost.d["eagle3"] == pytest.approx(4.0, abs=0.3)
    assert cost.wait({"eagle3": 8}, {"eagle3": 4}, {"eagle3": 2}, {"eagle3": 600}) == \
        pytest.approx(0.3 + 4.0 + 2.8 + 1.6 + 1.0 + 30.0, rel=0.02)
    with pytest.raises(ValueError, match="backlog"):
        StepSample(replica="v0", step=1, batch_size=1, num_tokens=1, step_time_ms=1.0,
                   draft_wait_ms=0.0, method="eagle3", num_speculative_tokens=1,
                   num_drafted=0, num_accepted=0, prefill=False, backlog=-1)


def test_dynamic_k_feeds_no_more_rows_than_the_fit_has_seen_a_little_past():
    """Steps of batch 4 at K = 0..4 (4 to 20 rows) on a forward that costs 1 ms a row up
    to 20 rows and 2.5 ms a row past them: the fit goes on at about 1 ms a row past its
    data, so at batch 14 and acceptance 0.8 drafting 3 deep (56 rows) looks far more
    productive than plain decoding, and is worse than it. The profile prices rows only
    to 1.5 times the most it has seen (30), so dynamic K drafts 16 positions, which pay;
    a step at 30 rows moves the bound to 45, and once every step past 12 rows has left
    the fit's memory, it is back at 20."""

    def truth(rows):
        return 30.0 + 1.0 * min(rows, 20) + 2.5 * max(0, rows - 20)

    model, rng, step = OnlineProfile(), random.Random(7), 0

    def run(batch, ks):
        nonlocal step
        step += 1
        rows = batch + sum(ks)
        for k in ks:
            model.observe(sample(step, batch, rows, truth(rows), 0.0, "ngram", k, k, k))

    for _ in range(300):
        run(4, [rng.randint(0, 4) for _ in range(4)])
    assert model.trusted_rows() == 30.0
    prof = model.profile(max_num_seqs=16, max_num_speculative_tokens=4)
    assert prof.max_draft_rows(14) == 16.0 and prof.max_draft_rows(40) == 0.0
    assert prof.cost.forward(70, 14) < 0.7 * truth(70)  # the slope past the data is wrong

    rates = (0.8,) * 4
    unbounded = FittedProfile(batch_sizes=prof.batch_sizes, ks=prof.ks, itl_ms=prof.itl_ms,
                              acceptance={"ngram": rates}, cost=prof.cost,
                              plain_batch_sizes=prof.plain_batch_sizes | {14})
    bounded = FittedProfile(batch_sizes=prof.batch_sizes, ks=prof.ks, itl_ms=prof.itl_ms,
                            acceptance={"ngram": rates}, cost=prof.cost,
                            plain_batch_sizes=prof.plain_batch_sizes | {14},
                            trusted_rows=prof.trusted_rows)

    def true_goodput(ks):
        tokens = sum(1 + sum(0.8 ** (j + 1) for j in range(k)) for k in ks)
        return tokens / truth(len(ks) + sum(ks))

    plain = true_goodput([0] * 14)
    members = [DynamicK(lambda: unbounded, "ngram", 4) for _ in range(14)]
    free = allocate(unbounded, 14, members)
    assert sum(free) > 40 and true_goodput(free) < plain  # the old choice
    members = [DynamicK(lambda: bounded, "ngram", 4) for _ in range(14)]
    ks = allocate(bounded, 14, members)
    assert sum(ks) == 16 and true_goodput(ks) > plain
    assert true_goodput(ks) > 1.15 * true_goodput(free)
    # A stream's first K, chosen alone, stays within the bound too: 30 rows at batch 14
    # is K = 1 for each.
    assert members[0].next_k(14) == 1

    run(14, [1] * 12 + [2] * 2)  # 30 rows
    run(4, [0] * 4)  # a step is fitted once the next one begins
    assert model.trusted_rows() == 45.0
    assert model.profile(max_num_seqs=16, max_num_speculative_tokens=4).trusted_rows == 45.0
    for _ in range(MEMORY_STEPS):
        run(4, [rng.randint(0, 2) for _ in range(4)])  # at most 12 rows
    assert model.trusted_rows() == 20.0
