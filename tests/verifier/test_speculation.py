"""Dynamic K in the verifier (verifier/engine/speculation.py): the controller's choice
from the step's batch, measured step times and acceptance; and the engine with it:
K = 0 asks no drafter, and greedy output stays plain decoding's."""

from __future__ import annotations

import pytest

from specdec.generate import greedy_generate
from tests.tiny import tiny_llama
from tests.verifier.test_engine import GREEDY, VOCAB, ScriptedProposer, run
from verifier.engine import Engine, EngineConfig, Request
from verifier.engine.speculation import (
    ControllerConfig,
    Row,
    SpeculationController,
    StepCost,
    ready_row,
)


def _row(key: int, k: int, auto: bool = True, prefill: bool = False) -> Row:
    return Row(key, 0 if prefill else k, "ngram" if auto else None, prefill)


def _trained(step_ms, acceptance: dict[int, float], k: int = 4, steps: int = 40,
             rows_seen=range(1, 41)) -> SpeculationController:
    """A controller that has seen sequence s accept all of its k drafts at a share
    acceptance[s] of `steps` drafting steps (none at the others, spread evenly), and
    measured steps of every row count in rows_seen at step_ms(rows) just now."""
    c = SpeculationController()
    for t in range(steps):
        rows = [_row(s, k) for s in acceptance]
        outcomes = {s: (k, k if int((t + 1) * rate) > int(t * rate) else 0)
                    for s, rate in acceptance.items()}
        c.observe(rows, outcomes, 1.0, 1.0, len(rows) * (k + 1))
    c.cost = StepCost(c.config.cost_weight)
    for rows in rows_seen:
        c.cost.observe(rows, step_ms(rows))
    c.cost.observe_wait(0, set(), 0.5)
    c.cost.observe_wait(0, {"ngram"}, 1.0)
    return c


def test_a_batch_where_drafting_cannot_pay_runs_plain():
    # A row costs as much as the step's base: a draft pays only if it lands 4 times in 5.
    c = _trained(lambda rows: 5.0 + 5.0 * rows, {0: 0.2, 1: 0.2, 2: 0.4, 3: 0.4})
    assert c.choose([_row(s, 4) for s in range(4)]) == {0: 0, 1: 0, 2: 0, 3: 0}


def test_cheap_rows_and_drafts_that_land_draft_to_the_bound():
    c = _trained(lambda rows: 20.0 + 0.05 * rows, {0: 1.0, 1: 1.0})
    assert c.choose([_row(0, 4), _row(1, 4)]) == {0: 4, 1: 4}


def test_a_mixed_batch_gives_rows_to_the_request_whose_drafts_land():
    """One request copying its prompt (all accepted), one writing new text (none), one
    at a fixed K: the rows go to the first; the fixed one is not chosen for."""
    c = _trained(lambda rows: 10.0 + 1.0 * rows, {0: 1.0, 1: 0.0})
    chosen = c.choose([_row(0, 4), _row(1, 4), _row(2, 3, auto=False)])
    assert chosen[0] > 0 and chosen[1] == 0 and 2 not in chosen


def test_the_first_step_runs_plain_to_price_it():
    c = SpeculationController()
    assert c.choose([_row(0, 4)]) == {0: 0}
    c.observe([_row(0, 4)], {}, 10.0, 0.0, 1)
    assert c.cost.ms == {1: 10.0}


def test_fewer_rows_than_measured_are_priced_along_the_line():
    """Measured from 7 rows up (a fixed-K request has left the batch): 2 rows cost what
    the line through the measured counts says, not 7 rows' time, at which 3 or 5 rows of
    drafts would look free and a plain step of 2 would never be run to tell."""
    c = _trained(lambda rows: 10.0 + 2.0 * rows, {0: 0.2}, rows_seen=range(7, 21))
    assert c.cost.price(2) == pytest.approx(14.0)
    assert c.choose([_row(0, 4), _row(1, 4)]) == {0: 0, 1: 0}


def test_one_dear_row_count_does_not_price_the_counts_above_it():
    """2 rows measured slow (28 ms, as after a run of plain steps on a 2-core machine)
    while 3 rows run at 24.7: drafting 2 at this acceptance pays at 3 rows' own price.
    Priced at least as dear as 2 rows (a floor of fewer rows' times, as it was), it did
    not, and the request stayed plain, so 3 rows were not run again to correct it."""
    ms = {1: 21.0, 2: 28.0, 3: 24.7}
    c = _trained(lambda rows: ms.get(rows, 24.7 + 4.0 * (rows - 3)), {0: 0.2}, k=2,
                 rows_seen=range(1, 6))
    assert c.cost.price(3) == pytest.approx(24.7)
    assert c.cost.price(2) == pytest.approx(28.0)
    assert c.choose([_row(0, 2)]) == {0: 2}


def test_acceptance_is_counted_per_position_reached():
    """Each draft accepted one time in two once the drafts before it were: accepted
    counts 0, 1, 2, 3 and 4 of 4 in 8, 4, 2, 1 and 1 of 16 steps. A draft's chance to
    land is then 0.5, 0.25, 0.125, ... by position, and at 1.5 ms a row on a 10 ms step
    the second draft pays (1.75 tokens in 14.5 ms against 1.5 in 13). Counted as tried
    on every drafted position, as they were, the second position's rate (4 + 2 + 1 of
    16, not of 8) already held the chance of reaching it, the product counted it twice,
    and the second draft looked worth 0.125 tokens: K stayed at 1."""
    c = SpeculationController(ControllerConfig(half_life_steps=1e9,
                                               method_half_life_steps=1e9))
    for accepted in ([0] * 8 + [1] * 4 + [2] * 2 + [3, 4]) * 8:
        c.observe([_row(0, 4)], {0: (4, accepted)}, 1.0, 0.0, 5)
    c.cost = StepCost(c.config.cost_weight)
    for rows in range(1, 6):
        c.cost.observe(rows, 10.0 + 1.5 * rows)
    assert c.choose([_row(0, 4)]) == {0: 2}


def test_token_tree_steps_are_priced_apart_from_chains():
    """A token tree's rows cost more than as many rows of chains (its attention runs
    under a mask). Tree steps (4 rows and up, 20 ms a row against 0.5), priced with the
    chain steps, made the rows an ngram request would take look dear and kept it short
    of its bound; priced apart, it drafts to its bound at the chains' own prices, while
    the tree drafter's request, whose drafts land as often, is priced at the trees'."""
    def trained(tree_prices: bool) -> SpeculationController:
        c = SpeculationController(ControllerConfig(tree_prices=tree_prices))
        rows = [_row(0, 4), Row(1, 4, "eagle3")]
        for t in range(40):
            hit = int((t + 1) * 0.6) > int(t * 0.6)
            c.observe(rows, {0: (4, 4 * hit), 1: (4, 4 * hit)}, 1.0, 1.0, 10, trees={1})
        c.cost, c.tree_cost = StepCost(c.config.cost_weight), StepCost(c.config.cost_weight)
        c.cost.observe_wait(0, set(), 0.5)
        c.cost.observe_wait(0, {"ngram", "eagle3"}, 1.0)
        for rows in range(1, 41):
            c.observe([], {}, 20.0 + 0.5 * rows, 0.0, rows)
            if rows >= 4:
                c.observe([], {}, 20.0 + 20.0 * rows, 0.0, rows, trees={1})
        return c

    apart = trained(tree_prices=True)
    assert apart.choose([_row(0, 4)]) == {0: 4}
    assert apart.choose([Row(1, 4, "eagle3")]) == {1: 0}
    assert trained(tree_prices=False).choose([_row(0, 4)])[0] < 4


def test_a_drafters_wait_that_a_short_step_cannot_hide_keeps_it_plain():
    """On a GPU a step is 1-3 ms: a drafter's 2 ms round trip doubles a 2 ms step, and
    drafts that land one time in five do not pay for it; without the wait, rows that
    cost little more would make the same drafts pay."""
    c = _trained(lambda rows: 2.0 + 0.01 * rows, {0: 0.2})
    c.cost.wait_ms["ngram"], c.cost.plain_wait_ms = 2.0, 0.0
    assert c.choose([_row(0, 4)]) == {0: 0}
    c.cost.wait_ms["ngram"] = 0.0
    assert c.choose([_row(0, 4)])[0] > 0


def test_drafts_a_bet_holds_draft_while_those_that_would_wait_do_not():
    """The same short step and costly round trip, two requests whose drafts land at the
    same rate: the one whose drafts a bet already holds (Row.bet) drafts, since asking
    for it waits for nothing, while the one that would wait for its drafter's answer
    runs plain. Both waiting, both run plain; both held by bets, both draft."""
    c = _trained(lambda rows: 2.0 + 0.01 * rows, {0: 0.4, 1: 0.4})
    c.cost.wait_ms["ngram"], c.cost.plain_wait_ms = 4.0, 0.0
    bet = Row(1, 4, "ngram", bet=True)
    chosen = c.choose([_row(0, 4), bet])
    assert chosen[0] == 0 and chosen[1] > 0
    assert c.choose([_row(0, 4), _row(1, 4)]) == {0: 0, 1: 0}
    both = c.choose([Row(0, 4, "ngram", bet=True), bet])
    assert both[0] > 0 and both[1] > 0


class Holds:
    """A proposer holding, per sequence, how many drafts a bet or table gave."""

    def __init__(self, ready: dict[int, int]):
        self.ready = ready

    def ready_drafts(self, seq_id: int) -> int | None:
        return self.ready.get(seq_id)


def test_drafts_at_hand_bound_the_row_and_a_tables_none_drafts_nothing():
    """A row whose table says "no drafts" asks nobody this step and is not priced or
    counted as a drafter that failed to answer; one holding 2 drafts gets at most 2; a
    row with nothing at hand, a fixed-K row and a prefill keep their bound."""
    holds = Holds({0: 0, 1: 2, 3: 0, 4: 3})
    rows = [ready_row(0, 4, "ngram", holds), ready_row(1, 4, "ngram", holds),
            ready_row(2, 4, "ngram", holds), ready_row(3, 4, None, holds),
            ready_row(4, 0, "ngram", holds, prefill=True)]
    assert [(r.bound, r.bet) for r in rows] == [(0, True), (2, True), (4, False),
                                                (4, False), (0, False)]
    c = _trained(lambda rows: 20.0 + 0.05 * rows, {0: 1.0, 1: 1.0, 2: 1.0})
    assert c.choose(rows) == {1: 2, 2: 4}  # row 0 is no dynamic row this step


def test_a_step_whose_drafts_bets_held_is_not_the_drafters_wait():
    c = SpeculationController()
    for _ in range(20):
        c.observe([Row(0, 4, "ngram", bet=True)], {0: (4, 4)}, 20.0, 0.05, 5)  # a bet's
        c.observe([_row(0, 4)], {0: (2, 1)}, 20.0, 3.0, 3)  # waited for the answer
    assert c.cost.draft_ms({"ngram"}) == pytest.approx(3.0 - 0.05, rel=0.01)


def test_a_drafter_asked_for_nothing_it_had_still_costs_its_wait():
    """A step that asked the drafter waited for it whether or not drafts came back: its
    wait is the drafter's, not a plain step's (which would make asking look free)."""
    c = SpeculationController()
    for _ in range(20):
        c.observe([_row(0, 4)], {0: (0, 0)}, 20.0, 3.0, 1)  # asked, nothing came
        c.observe([_row(0, 4)], {}, 20.0, 0.0, 1)  # not asked
    assert c.cost.plain_wait_ms < 0.01
    assert c.cost.draft_ms({"ngram"}) == pytest.approx(3.0, rel=0.01)


def test_config_is_one_frozen_dataclass():
    with pytest.raises(AttributeError):
        ControllerConfig().half_life_steps = 3.0


# -- in the engine -----------------------------------------------------------------

class MadeUpCost(StepCost):
    """10 ms + 2 ms a row, and no wait for the drafters: a tiny model's (or a fake
    engine's) real step times are noise around a constant, and a real round trip to a
    drafter on a loaded machine can outweigh such a step."""

    def observe(self, rows: int, ms: float) -> None:
        StepCost.observe(self, rows, 10.0 + 2.0 * rows)

    def observe_wait(self, step: int, methods: set[str], ms: float) -> None:
        StepCost.observe_wait(self, step, methods, 0.0)


class CountingProposer(ScriptedProposer):
    def __init__(self, references, error_rate):
        super().__init__(references, error_rate, seed=5)
        self.asked: list[dict[int, int]] = []

    def propose(self, wanted, tokens):
        self.asked.append(dict(wanted))
        return super().propose(wanted, tokens)


@pytest.mark.parametrize("error_rate", [0.0, 1.0], ids=["oracle", "random"])
def test_engine_with_the_controller_keeps_greedy_exact(error_rate):
    """Dynamic-K requests beside a fixed-K one, the controller choosing their K each
    step: every reply is plain decoding's; drafts that never land end with steps that
    ask the drafter for nothing for them, drafts that always land keep being asked
    for. The step times the controller learns are made up (10 ms + 2 ms a row): a tiny
    model's real ones are noise around a constant."""
    model = tiny_llama(VOCAB, seed=0)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5], [8, 9, 7, 9]]
    plain = greedy_generate(model, prompts, 40)
    refs = {i: p + c for i, (p, c) in enumerate(zip(prompts, plain, strict=True))}
    proposer = CountingProposer(refs, error_rate)
    engine = Engine(model, EngineConfig(max_num_seqs=8, max_model_len=128, block_size=4,
                                        num_kv_blocks=256, speculation_controller=True),
                    proposer)
    engine.controller.cost = MadeUpCost(engine.controller.config.cost_weight)
    requests = [Request(f"r{i}", p, 40, GREEDY, num_speculative_tokens=4, drafter="d",
                        auto_k=i < 2) for i, p in enumerate(prompts)]
    out = run(engine, requests)
    for r, want in zip(requests, plain, strict=True):
        assert out[r.request_id] == want
    dynamic = [sum(k for s, k in wanted.items() if s < 2) for wanted in proposer.asked]
    if error_rate == 1.0:
        assert sum(dynamic[-10:]) == 0 and sum(dynamic) > 0
    else:  # most of the 2 x 40 tokens came from drafts
        assert sum(dynamic) >= 40
    # The fixed-K request is asked for drafts on every step it decodes but its last.
    assert sum(1 for wanted in proposer.asked if wanted.get(2) == 4) >= 6


def test_a_drafter_kept_off_by_its_wait_is_tried_again_after_a_while():
    """One drafting step's wait of 100 ms (a cold drafter taking in its prompt) keeps a
    request plain, but not for good: after redraft_after_steps plain steps it drafts
    once more, and the wait measured then decides."""
    c = _trained(lambda rows: 10.0 + 0.1 * rows, {0: 1.0})
    for _ in range(20):
        c.cost.observe_wait(c._step, {"ngram"}, 100.0)
    waits = c.config.redraft_after_steps
    chosen = [c.choose([_row(0, 4)])[0] for _ in range(waits + 1)]
    assert chosen[:waits] == [0] * waits and chosen[-1] == 4


def test_steps_past_the_queue_size_draft_nothing():
    """disable_queue_size=2: while the engine holds 3 requests (one of them dynamic K)
    no drafter is asked for anything and every output says queue_size; once one has
    finished the other two draft again. Replies stay plain decoding's."""
    model = tiny_llama(VOCAB, seed=0)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5], [8, 9, 7, 9]]
    lengths = [30, 30, 10]
    plain = [greedy_generate(model, [p], n)[0] for p, n in zip(prompts, lengths, strict=True)]
    refs = {i: p + c for i, (p, c) in enumerate(zip(prompts, plain, strict=True))}
    proposer = CountingProposer(refs, 0.0)
    engine = Engine(model, EngineConfig(max_num_seqs=8, max_model_len=128, block_size=4,
                                        num_kv_blocks=256, speculation_controller=True,
                                        disable_queue_size=2), proposer)
    requests = [Request(f"r{i}", p, n, GREEDY, num_speculative_tokens=4, drafter="d",
                        auto_k=i == 0)
                for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
    for r in requests:
        engine.add_request(r)
    out = {r.request_id: [] for r in requests}
    reasons: list[tuple[int, set]] = []  # (requests held, plain reasons of the step)
    while engine.has_work():
        held = engine.num_running + engine.num_waiting
        outputs = engine.step()
        reasons.append((held, {o.miss_reason for o in outputs}))
        for o in outputs:
            out[o.request_id] += o.new_token_ids
            assert held <= 2 or o.num_drafted == 0
    assert [out[r.request_id] for r in requests] == plain
    # (A request's last token is never drafted for: None beside queue_size.)
    assert all("queue_size" in reason and reason <= {"queue_size", None}
               for held, reason in reasons[1:] if held == 3)
    assert not any(wanted for wanted in proposer.asked[:9])  # 3 held: nothing asked
    assert any(wanted for wanted in proposer.asked[10:])  # 2 held: drafting again
    with pytest.raises(ValueError, match="disable_queue_size"):
        EngineConfig(disable_queue_size=-1)
