"""bench/ablation.py (the speculation controller's ablation): each ablation turns one
mechanism off, and cells are compared at the run's own step prices."""

from __future__ import annotations

import dataclasses

import pytest

from bench import ablation
from drafter.ngram import NgramMethod
from specdec.launch import LocalService


def test_each_ablation_turns_off_one_mechanism_of_the_whole_controller():
    whole = dataclasses.asdict(ablation.WHOLE)
    for name, config in ablation.ABLATIONS.items():
        changed = {k: v for k, v in dataclasses.asdict(config).items() if whole[k] != v}
        assert list(changed.values()) == [False], name
    assert ablation.CONFIGS["plain"] == (0, None)
    assert ablation.CONFIGS["controller"] == (None, ablation.WHOLE)


def _cell(tokens, steps, tok_s, replies):
    return {"tokens": tokens, "step_log": steps, "tok_s": tok_s, "tokens_per_step": 1.0,
            "rows_per_step": 1.0, "replies": replies, "draft_wait_ms": 0.5,
            "draft_wait_median_ms": 0.5, "bet_lookups": 4, "bet_hits": 1}


def test_cells_are_priced_at_the_median_step_time_of_their_row_count():
    """Plain ran on a slow machine (its one-row steps took 40 ms, the others' 20): priced,
    every one-row step costs the median of all of them, so the drift goes and what the
    drafts cost stays."""
    plain = _cell(10, [(1, 40.0, 0.0)] * 10, 25.0, [[1, 2]])
    drafting = _cell(10, [(1, 20.0, 1.0)] * 2 + [(3, 30.0, 1.0)] * 4, 80.0, [[1, 2]])
    other = _cell(10, [(1, 20.0, 0.0)] * 10, 50.0, [[1, 3]])
    prices = ablation.priced({"plain": [plain], "K=2": [drafting], "controller": [other]})
    one_row = 20.0  # the median over 22 one-row steps, 12 of them at 20 ms
    assert prices["plain"] == [pytest.approx(1e3 * 10 / (10 * one_row))]
    assert prices["K=2"] == [pytest.approx(1e3 * 10 / (2 * (one_row + 1) + 4 * (30.0 + 1)))]
    s = ablation.summarise({"chat": {"1": {"plain": [plain], "K=2": [drafting],
                                           "controller": [other]}}})["chat"]["1"]
    assert s["plain"]["vs_plain"] == 1.0 and s["K=2"]["vs_plain"] == pytest.approx(3.2)
    assert s["controller"]["priced_vs_plain"] == pytest.approx(1.0)
    assert s["K=2"]["same"] == "1/1" and s["controller"]["same"] == "0/1"
    assert s["K=2"]["bet_hit_rate"] == 0.25


def test_a_variant_is_the_drafter_on_a_port_of_its_own_with_its_flags():
    svc = LocalService("ngram", ("specdec-drafter", "--method", "ngram", "--host", "127.0.0.1",
                                 "--port", "5"), "127.0.0.1:5", ())
    v = ablation._variant(svc, "min2")
    port = v.argv[v.argv.index("--port") + 1]
    assert v.name == "ngram-min2" and v.health == f"127.0.0.1:{port}" and port != "5"
    assert v.argv == (*svc.argv[:-1], port, "--ngram-min", "2")
    assert ablation.CONFIGS["controller min2"] == ablation.CONFIGS["controller"]
    assert ablation.VARIANT_OF["K=4 min2"] == "min2"


def test_the_in_process_variant_drafts_with_the_services_method_and_flags():
    svc = LocalService("ngram", ("specdec-drafter", "--method", "ngram", "--ngram-min", "2",
                                 "--port", "5"), "127.0.0.1:5", ())
    method = ablation._method_of(svc)
    assert isinstance(method, NgramMethod) and (method.min_n, method.max_n) == (2, 4)
    assert ablation.VARIANT_OF["K=2 in process"] == "in process"
    assert ablation.CONFIGS["K=2 in process"] == ablation.CONFIGS["K=2"]
