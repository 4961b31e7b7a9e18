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
        c.cost.observe(0, rows, step_ms(rows))
    c.cost.observe_wait(0, set(), 0.5)
    c.cost.observe_wait(0, {"ngram"}, 1.0)
    c._step = 0  # every row count measured just now: no probe
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


def test_an_unmeasured_plain_step_is_probed_once():
    c = _trained(lambda rows: 10.0 + 0.1 * rows, {0: 1.0}, rows_seen=range(3, 20))
    assert c.choose([_row(0, 4)]) == {0: 0}  # one row: never measured
    c.observe([_row(0, 4)], {}, 10.1, 0.5, 1)
    assert c.choose([_row(0, 4)]) == {0: 4}
    assert c.num_probes == 1


def test_rows_past_what_was_measured_are_not_priced():
    """Measured up to 10 rows: at most 18 (10 + 8) are priced, so a batch of 8 with a
    bound of 4 drafts 10 positions at most, however cheap the line says rows are."""
    c = _trained(lambda rows: 10.0 + 0.01 * rows, {s: 1.0 for s in range(8)},
                 rows_seen=range(1, 11))
    chosen = c.choose([_row(s, 4) for s in range(8)])
    assert sum(chosen.values()) == 10


def test_a_prefill_in_the_step_runs_dynamic_k_plain():
    c = _trained(lambda rows: 20.0 + 0.05 * rows, {0: 1.0})
    assert c.choose([_row(0, 4), _row(1, 0, prefill=True)]) == {0: 0}


def test_config_is_one_frozen_dataclass():
    with pytest.raises(AttributeError):
        ControllerConfig().half_life_steps = 3.0


# -- in the engine -----------------------------------------------------------------

class MadeUpCost(StepCost):
    def observe(self, step: int, rows: int, ms: float) -> None:
        StepCost.observe(self, step, rows, 10.0 + 2.0 * rows)


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
