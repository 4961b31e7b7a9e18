"""bench/serving.py (`make run` against `vllm serve`): the workload, the statistics, the
breakdown, the table; and one reduced run of our stack and our engine in process."""

from __future__ import annotations

import json

import pytest
import torch

from bench import serving


def test_workload_and_percentiles():
    prompts = serving.prompts_by_name()
    assert [p.name for p in prompts] == list(serving.PROMPT_NAMES)
    assert serving.workload(prompts, 1, 8) == [prompts[i % 6] for i in range(8)]
    assert len(serving.workload(prompts, 16, 8)) == 48  # three waves of 16
    assert len(serving.workload(prompts, 4, 16)) == 16
    xs = [float(i) for i in range(1, 101)]
    assert serving.percentile(xs, 50) == 50.0 and serving.percentile(xs, 99) == 99.0
    assert serving.percentile([3.0], 99) == 3.0 and serving.percentile([], 50) is None


def test_cell_stats_count_tokens_latencies_and_acceptance():
    replies = [serving.Reply("ab", 10, 0.2, [0.01, 0.03], 2.0),
               serving.Reply("cd", 30, 0.4, [0.02], None)]
    s = serving.cell_stats(replies, wall_s=2.0)
    assert s["tok_s"] == 20.0 and s["tokens"] == 40
    assert s["ttft_ms_p50"] == pytest.approx(200.0) and s["ttft_ms_p99"] == pytest.approx(400.0)
    assert s["itl_ms_p50"] == pytest.approx(20.0) and s["itl_ms_p99"] == pytest.approx(30.0)
    assert s["acceptance_length"] == 2.0 and s["texts"] == ["ab", "cd"]


def test_summary_takes_the_median_repeat_and_counts_identical_replies():
    def cell(tok_s, texts):
        return {"tok_s": tok_s, "texts": texts}

    cells = {"ours plain": {"1": [cell(10.0, ["a", "b"])]},
             "vllm plain": {"1": [cell(30.0, ["a", "x"]), cell(12.0, ["a", "b"]),
                                  cell(20.0, ["a", "b"])]},
             "vllm ngram K=4": {"1": [cell(15.0, ["a", "y"])]}}
    s = serving.summarise(cells, {"1": ["a", "b"]})
    assert s["vllm plain"]["1"]["tok_s"] == 20.0
    assert s["vllm plain"]["1"]["tok_s_runs"] == [30.0, 12.0, 20.0]
    assert (s["vllm plain"]["1"]["identical"], s["vllm plain"]["1"]["requests"]) == (2, 2)
    assert "texts" not in s["ours plain"]["1"]
    # A reply that differs is kept with plain's, the others are not.
    assert s["vllm ngram K=4"]["1"]["identical"] == 1
    assert s["vllm ngram K=4"]["1"]["differing"] == [{"request": 1, "reply": "y", "plain": "b"}]
    assert "differing" not in s["vllm plain"]["1"]
    assert serving.best(s, "vllm ", "1") == ("vllm plain", 20.0)


def test_dynamic_k_is_paired_with_the_best_static_k_of_its_own_repeat():
    def cell(runs):
        return {"1": {"tok_s": sorted(runs)[len(runs) // 2], "tok_s_runs": runs}}

    # The machine slows in repeat 2: medians would mix repeats, pairs do not.
    s = {"ours ngram auto": cell([30.0, 15.0, 27.0]), "ours ngram K=2": cell([25.0, 20.0, 30.0]),
         "ours ngram K=4": cell([20.0, 12.0, 36.0])}
    r = serving.paired_ratios(s, "ours ngram auto", ["ours ngram K=2", "ours ngram K=4"], "1")
    assert r == pytest.approx([30 / 25, 15 / 20, 27 / 36])
    assert serving.geomean(r) == pytest.approx((1.2 * 0.75 * 0.75) ** (1 / 3))
    for x in s.values():
        x["1"].update({"ttft_ms_p50": 100.0, "ttft_ms_p99": 150.0, "itl_ms_p50": 20.0,
                       "itl_ms_p99": 40.0, "acceptance_length": 2.0, "identical": 8,
                       "requests": 8})

    def render() -> str:
        return serving.render({
            "model": "M", "device_name": "CPU", "cpus": 2, "versions": {"torch": "2"},
            "config": {"concurrency": [1], "requests": 8, "max_tokens": 8, "repeats": 3,
                       "prompts": ["a"]},
            "load_average_1min": [0.1, 0.2], "wall_s": 60.0, "summary": s,
            "unavailable": {}, "notes": []})

    # Medians: auto 27 against K = 2's 25 and plain's 20; pairs as above.
    s["ours plain"] = {"1": {**s["ours ngram K=2"]["1"], "tok_s": 20.0,
                             "acceptance_length": None}}
    text = render()
    assert "| ngram (ngram auto) | 0.88 [0.75, 1.20] (n = 3) |" in text
    # Against one K, the run's best by its median (K = 2's 25 over K = 4's 20), in each
    # repeat: 30 / 25, 15 / 20, 27 / 30.
    best, r = serving.paired_with_best(s, "ours ngram auto",
                                       ["ours ngram K=2", "ours ngram K=4"], "1")
    assert best == "ours ngram K=2"
    assert r == pytest.approx([30 / 25, 15 / 20, 27 / 30])
    g = (1.2 * 0.75 * 0.9) ** (1 / 3)
    assert f"| ngram (ngram auto) | {g:.2f} [0.75, 1.20] against K=2 |" in text
    assert "| ngram (ngram auto) | 1.08 (K=2) | 1.35 |" in text
    del s["ours plain"]  # an ours-only run still compares with static K
    assert "| ngram (ngram auto) | 1.08 (K=2) | - |" in render()
    # A static K without every repeat gives no pairs.
    s["ours ngram K=4"] = cell([20.0, 12.0])
    assert serving.paired_ratios(s, "ours ngram auto", ["ours ngram K=2", "ours ngram K=4"],
                                 "1") == []
    assert serving.paired_ratios(s, "ours eagle3 auto", ["ours eagle3 K=2"], "1") == []
    assert serving.paired_with_best(s, "ours ngram auto", ["ours ngram K=2", "ours ngram K=4"],
                                    "1") is None


def test_vllm_iteration_lines_give_its_step_time(tmp_path):
    log = tmp_path / "vllm.log"
    lines = [f"(EngineCore pid=1) INFO 11-25 [loggers.py:200] Iteration({i}): {c} context "
             f"requests, {c * 50} context tokens, {g} generation requests, {g} generation "
             f"tokens, iteration elapsed time: {ms:.2f} ms, CPU KV cache usage: 1.0%"
             for i, (c, g, ms) in enumerate([(1, 0, 80.0), (0, 4, 20.0), (0, 4, 30.0)])]
    log.write_text("noise\n" + "\n".join(lines) + "\n")
    got = serving._vllm_iterations(log, 0, log.stat().st_size, wall_s=0.5)
    assert got["steps"] == 3
    assert got["step_ms"]["iteration"] == pytest.approx(130.0 / 3)
    assert got["engine_busy"] == pytest.approx(0.26)
    assert got["batch_mean"] == pytest.approx(3.0)
    assert got["rows_per_step"] == pytest.approx((50 + 4 + 4) / 3)  # context + generation tokens


def test_breakdown_divides_engine_time_by_steps_and_cpu_by_wall():
    probe = serving.Probe({})
    engine = {"steps": 10, "tokens": 20, "sequences": 40, "rows": 70, "schedule_ms": 1.0, "draft_wait_ms": 2.0,
              "forward_ms": 30.0, "sample_ms": 4.0, "postprocess_ms": 3.0, "deliver_ms": 1.0,
              "drafter_ms": 0.5}
    a = {"cpu_s": {"verifier": 1.0, "gateway": 0.5},
         "engine": {k: 0 for k in engine}, "bets": (100, 30)}
    b = {"cpu_s": {"verifier": 2.0, "gateway": 0.6}, "engine": engine, "bets": (140, 40)}
    got = probe.breakdown(a, b, wall_s=0.5)
    assert got["bet_hit_rate"] == 0.25  # the cell's own lookups and hits
    assert got["cpu_share"] == {"verifier": 2.0, "gateway": 0.2}
    assert got["steps"] == 10 and got["tokens_per_step"] == 2.0 and got["batch_mean"] == 4.0
    assert got["rows_per_step"] == 7.0
    assert got["step_ms"]["forward"] == 3.0 and got["step_ms"]["deliver"] == 0.1
    # The drafters' own time is part of the draft wait: reported apart, counted once.
    assert "drafter" not in got["step_ms"] and got["drafter_ms"] == 0.05
    assert got["engine_busy"] == pytest.approx(40.0 / 1e3 / 0.5)


def test_render_names_a_missing_vllm_and_the_ratios():
    def cell(tok_s, **extra):
        return {"tok_s": tok_s, "ttft_ms_p50": 100.0, "ttft_ms_p99": 150.0,
                "itl_ms_p50": 20.0, "itl_ms_p99": 40.0, "acceptance_length": None,
                "identical": 2, "requests": 2, **extra}

    result = {
        "model": "M", "device_name": "CPU", "cpus": 2, "versions": {"torch": "2"},
        "config": {"concurrency": [1], "requests": 2, "max_tokens": 8, "repeats": 1,
                   "prompts": ["a", "b"]},
        "load_average_1min": [0.1, 0.2], "wall_s": 60.0,
        "summary": {"ours plain": {"1": cell(10.0)}, "ours ngram K=4": {"1": cell(15.0, draft_size=3.5)},
                    "engine plain": {"1": cell(12.5, step_ms_p50=50.0)}},
        "unavailable": {"vllm plain": "no peers venv", "vllm ngram K=4": "no peers venv"},
        "notes": ["a note"],
    }
    text = serving.render(result)
    assert "| vllm plain | unavailable: no peers venv" in text
    assert "| ours ngram K=4 | 15.0 | 100 | 150 | 20.0 | 40.0 | - | 3.50 | 2/2 |" in text
    assert "| `make run` plain / engine | 0.80 |" in text
    assert "| ours best / vLLM best (its own methods) | - |" in text
    assert "greedy" in text and "sampled" not in text
    result["config"]["temperature"] = 0.7
    assert "sampled at temperature 0.7 (unseeded: replies not compared)" in serving.render(result)


def test_a_vllm_engine_verifier_reports_steps_and_tokens_only():
    probe = serving.Probe({})
    zero = {"steps": 0, "tokens": 0, "sequences": 0, "rows": 0, "forward_ms": 0.0}
    got = probe.breakdown({"cpu_s": {}, "engine": zero},
                          {"cpu_s": {}, "engine": {**zero, "steps": 4, "tokens": 10}}, 1.0)
    assert got == {"cpu_share": {}, "steps": 4, "tokens_per_step": 2.5}


def test_render_compares_the_two_engines_of_the_embedded_default():
    def cell(tok_s, identical=2):
        return {"tok_s": tok_s, "ttft_ms_p50": 100.0, "ttft_ms_p99": 150.0,
                "itl_ms_p50": 20.0, "itl_ms_p99": 40.0, "acceptance_length": None,
                "identical": identical, "requests": 2}

    result = {
        "model": "M", "device_name": "CPU", "cpus": 2, "versions": {"torch": "2"},
        "config": {"concurrency": [1], "requests": 2, "max_tokens": 8, "repeats": 1,
                   "prompts": ["a", "b"]},
        "load_average_1min": [0.1, 0.2], "wall_s": 60.0, "startup_s": {},
        "summary": {"ours plain": {"1": cell(10.0)}, "ours default": {"1": cell(15.0)},
                    "ours-vllm plain": {"1": cell(20.0, identical=1)},
                    "ours-vllm default": {"1": cell(30.0)},
                    "vllm plain": {"1": cell(25.0)}, "vllm ngram dynamic": {"1": cell(12.0)}},
        "unavailable": {"vllm remote suffix K=4": "no stamp"}, "preload": {},
        "vllm_binding": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}, "alternated": True,
        "vllm_binding_search": {"chosen": "b", "env": {"VLLM_CPU_OMP_THREADS_BIND": "0-1"},
                                "search": "plain, C=1", "searched": {"a": 21.8, "b": 30.7,
                                                                     "c": "failed: x"}},
    }
    result["notes"] = serving.notes(result)
    text = serving.render(result)
    assert "| ours-vllm plain | 20.0 | 100 | 150 | 20.0 | 40.0 | - | - | 1/2 |" in text
    assert "| vllm remote suffix K=4 | unavailable: no stamp" in text
    assert "| vLLM's engine / ours, plain | 2.00 |" in text
    assert "| default / plain, vLLM's engine | 1.50 |" in text
    assert "| vLLM's engine behind our gateway / `vllm serve`, plain | 0.80 |" in text
    assert "| vLLM's engine, plain: replies same as ours plain | 1/2 |" in text
    assert "| ours best / vLLM best (its own methods) | 0.60 (ours default / vllm plain) |" in text  # ours-vllm apart
    assert "`vllm remote suffix K=4` = `--speculative-config" in text
    # configuration to configuration, with the binding vLLM ran at and how it was chosen
    assert "| dynamic K: ours default / its dynamic SD | 1.25 (ours default / vllm ngram " \
           "dynamic) |" in text
    assert "| ngram K=4 / its ngram K=4 | - |" in text
    assert "thread binding: VLLM_CPU_OMP_THREADS_BIND=0-1 (the fastest of those searched, " \
           "plain, C=1: a 21.8 tok/s; b 30.7 tok/s; c failed: x)" in text
    assert "Systems alternated" in text


@pytest.mark.slow
@pytest.mark.model
def test_a_reduced_run_of_our_stack_and_engine(tmp_path):
    out = tmp_path / "serving.json"
    threads = torch.get_num_threads()
    try:
        serving.main(["--quick", "--systems", "ours,engine", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    s = result["summary"]
    assert set(s) == {f"ours {n}" for n in serving.OURS} | {"engine plain"}
    for name in s:
        for c, requests in (("1", 2), ("4", 4)):
            assert s[name][c]["tok_s"] > 0
            # greedy: every configuration, and the engine in process, give plain's text
            assert s[name][c]["identical"] == s[name][c]["requests"] == requests, \
                (name, c, s[name][c].get("differing"))
    b = s["ours plain"]["1"]["breakdown"]
    assert b["tokens_per_step"] == pytest.approx(1.0, abs=0.3)  # plain: one token a step
    assert b["rows_per_step"] >= b["batch_mean"]  # a row per sequence, prefill chunks more
    assert b["step_ms"]["forward"] > 0 and b["cpu_share"]["verifier"] > 0
    assert s["ours ngram K=4"]["1"]["acceptance_length"] >= 1.0
    assert "| ours default |" in out.with_suffix(".md").read_text()


def test_vllms_best_is_of_its_own_methods():
    """A `vllm remote` row drafts with our drafter service: it is not vLLM at its best."""
    summary = {"ours plain": {"4": {"tok_s": 90.0}}, "vllm plain": {"4": {"tok_s": 60.0}},
               "vllm ngram K=4": {"4": {"tok_s": 80.0}},
               "vllm remote suffix K=4": {"4": {"tok_s": 120.0}}}
    assert serving.best(summary, "vllm ", "4") == ("vllm ngram K=4", 80.0)
    assert serving.best(summary, "ours ", "4") == ("ours plain", 90.0)


def test_vllms_modes_take_turns_a_fresh_server_each_repeat(monkeypatch, tmp_path):
    """vLLM's modes alternate ABBA..., one repeat per fresh server, and each mode's
    repeats are gathered under its name; without alternation each mode's repeats run
    on one server."""
    import argparse
    import contextlib

    started: list = []

    @contextlib.contextmanager
    def fake_server(python, model_dir, log, spec, timeout_s, binding, drafters=None,
                    settings=None, environ=None):
        started.append(spec)
        yield "http://x", type("Proc", (), {"pid": 1})(), 0.5

    async def fake_drive(base, configs, prompts, args, label, probe, after=None):
        (mode,) = configs
        return {mode: {"1": [{"mode": mode, "repeat": r} for r in range(args.repeats)]}}

    monkeypatch.setattr(serving, "vllm_unavailable", lambda python: None)
    monkeypatch.setattr(serving, "vllm_server", fake_server)
    monkeypatch.setattr(serving, "drive", fake_drive)
    monkeypatch.setattr(serving, "Probe", lambda *a, **k: None)
    args = argparse.Namespace(peers_python="python", vllm_timeout_s=1, vllm_binding={},
                              configs={"vllm": ["plain", "ngram K=4"]}, repeats=3,
                              alternate=True)
    cells, startup, unavailable = serving.run_vllm(args, tmp_path, [], tmp_path)
    ngram = serving.VLLM["ngram K=4"]
    assert started == [None, ngram, ngram, None, None, ngram]
    assert {n: len(by_c["1"]) for n, by_c in cells.items()} == {"vllm plain": 3,
                                                               "vllm ngram K=4": 3}
    assert set(startup) == {"vllm plain", "vllm ngram K=4"} and not unavailable
    started.clear()
    cells, _, _ = serving.run_vllm(argparse.Namespace(**{**vars(args), "alternate": False}),
                                   tmp_path, [], tmp_path)
    assert started == [None, ngram]
    assert {n: len(by_c["1"]) for n, by_c in cells.items()} == {"vllm plain": 3,
                                                               "vllm ngram K=4": 3}


def test_the_binding_search_measures_the_mode_asked_for(monkeypatch, tmp_path):
    """--vllm-binding-mode: each candidate binding runs `vllm serve` in that mode (its
    speculative config and environment), and the record names the mode searched."""
    import argparse
    import contextlib

    started: list = []

    @contextlib.contextmanager
    def fake_server(python, model_dir, log, spec, timeout_s, binding, drafters=None,
                    settings=None, environ=None):
        started.append((spec, binding, environ))
        yield "http://x", None, 0.5

    async def fake_cell(client, requests, concurrency, max_tokens, temperature):
        return {"tok_s": 10.0 + len(started)}  # the last binding tried is the fastest

    async def fake_one(*a, **k):
        return None

    for var in serving.fair.BINDING_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(serving, "vllm_server", fake_server)
    monkeypatch.setattr(serving, "run_cell", fake_cell)
    monkeypatch.setattr(serving, "stream_one", fake_one)
    prompts = serving.prompts_by_name()
    args = argparse.Namespace(peers_python="python", vllm_timeout_s=1, max_tokens=8,
                              vllm_binding_name="search", vllm_binding_mode="ngram K=4 numba omp")
    got = serving.search_vllm_binding(args, tmp_path, prompts, tmp_path)
    candidates = serving.fair.vllm_bindings()
    assert started == [(serving.VLLM["ngram K=4 numba omp"], env,
                        serving.VLLM_ENV["ngram K=4 numba omp"]) for env in candidates.values()]
    assert got["chosen"] == list(candidates)[-1] and got["env"] == list(candidates.values())[-1]
    assert got["search"] == f"`vllm serve` ngram K=4 numba omp, C=1, {len(prompts)} requests"
