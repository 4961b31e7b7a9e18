"""Dynamic K as a table of K by outcome: the levels, what a table yields in the long
run, and the level chosen for the load."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.policy.itl_profile import ItlProfile
from gateway.policy.online_profile import FittedProfile, OnlineProfile, StepCost, StepSample
from gateway.policy.outcome_table import (
    _mean_rows,
    choose_table,
    table_of_level,
    table_yield,
    tables_spread,
    tables_yield,
)
from specdec.speculation import DraftOutcome


def test_levels():
    assert table_of_level(1, 8) == (2, 1, 1, 1)
    assert table_of_level(2, 8) == (4, 2, 1, 1)
    assert table_of_level(3, 8) == (6, 3, 2, 2)
    assert table_of_level(3, 4) == (4, 3, 2, 2)  # never past the bound
    with pytest.raises(ValueError, match="level and bound"):
        table_of_level(0, 8)


def test_a_table_yields_what_its_outcomes_lead_to():
    sure = [(1.0,)] * 4
    # Every draft accepted: the request stays after "all accepted" and drafts its K.
    assert table_yield((4, 2, 1, 1), sure, [1.0] * 4) == pytest.approx((5.0, 4.0))
    # A drafter that never has drafts: one token a step, no rows.
    assert table_yield((4, 2, 1, 1), sure, [0.0] * 4) == pytest.approx((1.0, 0.0))
    # Never accepted: it stays after "none accepted", drafting that entry's K for nothing.
    assert table_yield((4, 2, 3, 1), [(0.0,)] * 4, [1.0] * 4) == pytest.approx((1.0, 3.0))
    # Two outcomes alternating: after all accepted (K = 2, both accepted half the time)
    # and after none (K = 1, never accepted), each half the time in the long run.
    rates = [(0.5, 1.0), (0.5,), (0.0,), (0.0,)]
    tokens, rows = table_yield((2, 1, 1, 1), rates, [1.0] * 4)
    # From "all": all accepted w.p. 0.5 (2 drafts), none w.p. 0.5; from "none": none.
    # The chain ends after "none" for good: 1 token and 1 row a step.
    assert (tokens, rows) == pytest.approx((1.0, 1.0))


def test_tables_scored_at_once_are_each_scored_alone():
    rng = np.random.default_rng(0)
    rates = [tuple(rng.uniform(0.1, 0.95, size=8)) for _ in DraftOutcome]
    available = list(rng.uniform(0.3, 1.0, size=4))
    tables = [table_of_level(level, 8) for level in range(1, 9)] + [(1, 5, 2, 7)]
    tokens, rows = tables_yield(tables, rates, available)
    for i, table in enumerate(tables):
        # One chain at a time, by the definition: pi = pi P, sum(pi) = 1.
        moves = np.zeros((4, 4))
        gain, drafted = np.ones(4), np.zeros(4)
        for s in DraftOutcome:
            k, q = table[s], available[s]
            reach = np.cumprod(rates[s][:k])
            moves[s] = [q * reach[-1], q * (reach[0] - reach[-1]), q * (1 - reach[0]), 1 - q]
            gain[s] += q * reach.sum()
            drafted[s] = q * k
        pi = np.linalg.matrix_power(moves, 4096)[0]  # every row of P^n tends to pi
        assert tokens[i] == pytest.approx(pi @ gain)
        assert rows[i] == pytest.approx(pi @ drafted)
    # Each level drafts more rows than the one below it.
    assert np.all(np.diff(rows[:8]) > 0)


def test_a_chain_with_two_ends_is_scored_between_them():
    # Drafts always accepted, and never offered after a step that had none: a request
    # stays after "all accepted" or after "no drafts", whichever it reaches first, so
    # the chain has no single long run (its balance equations are singular).
    tokens, rows = tables_yield([(4, 2, 1, 1), (2, 1, 1, 1)], [(1.0,)] * 4,
                                [1.0, 1.0, 1.0, 0.0])
    assert np.all((1.0 < tokens) & (tokens < [5.0, 3.0]))  # between its two ends
    assert tokens == pytest.approx(1.0 + rows)  # every row drafted is accepted


def profile(per_row: float) -> ItlProfile:
    """Step time 20 ms plus per_row ms for each draft row of every sequence."""
    ks = tuple(range(9))
    return ItlProfile(batch_sizes=(1, 16), ks=ks,
                      itl_ms=(tuple(20 + per_row * k for k in ks),
                              tuple(20 + per_row * 16 * k for k in ks)))


def test_the_level_follows_the_price_of_a_row():
    rates = [(0.9,), (0.7,), (0.4,), (0.5,)]
    available = [1.0, 0.9, 0.8, 0.6]

    def choose(per_row, batch):
        return choose_table(profile(per_row), batch, batch, "ngram", 8,
                            lambda s: rates[s], lambda s: available[s])

    levels = [choose(per_row, batch) for per_row, batch in
              ((0.01, 1), (0.3, 1), (0.3, 4), (0.3, 16), (1.0, 16))]
    assert levels[-1] is None  # a row of 16 costs 16 ms: plain decoding
    depth = [0 if t is None else t[1] for t in levels]  # the level (K after some)
    assert depth == sorted(depth, reverse=True) and depth[0] >= 2, levels
    # Deeper after a run than after a miss, whatever the level.
    assert all(t[0] >= t[1] >= t[2] == t[3] for t in levels if t is not None)


def test_the_online_model_learns_the_rates_after_each_outcome():
    online = OnlineProfile()

    def sample(step, after, drafted, accepted):
        online.observe(StepSample(replica="r", step=step, batch_size=1, num_tokens=5,
                                  step_time_ms=20.0, draft_wait_ms=1.0, method="ngram",
                                  num_speculative_tokens=4, num_drafted=drafted,
                                  num_accepted=accepted, prefill=False, after=after))

    for step in range(1, 300, 3):
        sample(step, DraftOutcome.ALL_ACCEPTED, 4, 4)
        sample(step + 1, DraftOutcome.NONE_ACCEPTED, 4, 0)
        sample(step + 2, DraftOutcome.NO_DRAFTS, 0, 0)
    after_all = online.rates_after("ngram", DraftOutcome.ALL_ACCEPTED, 4)
    after_none = online.rates_after("ngram", DraftOutcome.NONE_ACCEPTED, 4)
    overall = online.rates("ngram", 4)
    assert all(a > 0.9 for a in after_all) and after_none[0] < 0.1, (after_all, after_none)
    assert after_none[0] < overall[0] < after_all[0]
    # An outcome never followed reads the method's rates and share over all steps.
    assert online.rates_after("ngram", DraftOutcome.SOME_ACCEPTED, 4) == overall
    assert online.availability_after("ngram", DraftOutcome.SOME_ACCEPTED) == \
        online.availability("ngram")
    assert online.availability_after("ngram", DraftOutcome.NO_DRAFTS) < 0.1
    assert online.availability_after("ngram", DraftOutcome.ALL_ACCEPTED) > 0.9


def test_a_table_pays_for_the_steps_it_drafts_past_a_jump_in_step_time():
    # One sequence: 20 ms plus 0.2 a draft row, and 30 ms more from 7 draft rows on
    # (a kernel's limit). Drafts are good, so deep tables pay, up to that jump.
    def jumped(jump: float) -> ItlProfile:
        ks = tuple(range(9))
        row = tuple(20 + 0.2 * k + (jump if k >= 7 else 0.0) for k in ks)
        return ItlProfile(batch_sizes=(1, 16), ks=ks, itl_ms=(row, tuple(16 * t for t in row)))

    rates, available = [(0.9,)] * 4, [1.0] * 4

    def choose(profile: ItlProfile) -> tuple[int, int, int, int] | None:
        return choose_table(profile, 1, 1, "ngram", 8, lambda s: rates[s],
                            lambda s: available[s])

    assert choose(jumped(0.0))[DraftOutcome.ALL_ACCEPTED] == 8
    # A table drafting 8 after a run lands past the jump in every step after one, though
    # its mean rows stay below it: it is priced at what its steps cost.
    _, spread = tables_spread([table_of_level(4, 8)], rates, available)
    assert spread[0] @ np.arange(9) < 7 and spread[0, 8] > 0.3
    assert max(choose(jumped(30.0))) <= 6


def test_a_table_drafts_no_more_rows_than_the_fit_prices_from_its_steps():
    """The online model's profile prices rows only a little past those its steps fed
    (FittedProfile.max_draft_rows): a table whose mean draft rows pass that bound is not
    chosen, the deepest level within it is, and none where no level is."""
    cost = StepCost(a=20.0, b=0.05, w=0.0, d={"ngram": 0.0}, e={"ngram": 0.0})
    sizes, ks = (1, 2, 4, 8, 16), tuple(range(9))
    rates = [(0.9,), (0.7,), (0.4,), (0.5,)]
    available = [1.0, 0.9, 0.8, 0.6]

    def choose(trusted):
        prof = FittedProfile(batch_sizes=sizes, ks=ks,
                             itl_ms=tuple(tuple(cost.itl(b, k) for k in ks) for b in sizes),
                             cost=cost, trusted_rows=trusted)
        return choose_table(prof, 4, 4, "ngram", 8, lambda s: rates[s],
                            lambda s: available[s])

    free = choose(float("inf"))
    assert free is not None and free[1] >= 4  # rows nearly free: deep
    _, spread = tables_spread([free], rates, available)
    assert 4 * float(_mean_rows(spread)[0]) > 12
    bounded = choose(16.0)  # 12 draft rows at batch 4
    assert bounded is not None and bounded[1] < free[1]
    _, spread = tables_spread([bounded], rates, available)
    assert 4 * float(_mean_rows(spread)[0]) <= 12
    assert choose(4.0) is None  # no draft row within the bound
