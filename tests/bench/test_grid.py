"""bench/grid.py: the workload definition, the summary and the table; and one
reduced run over the real stack and transformers."""

import json

import pytest
import torch

from bench import grid
from bench.prompts import PROMPTS


def test_workload_is_at_least_one_full_wave_of_cycled_prompts():
    prompts = list(PROMPTS[:5])
    assert grid.workload(prompts, 1, 8) == [prompts[i % 5] for i in range(8)]
    sixteen = grid.workload(prompts, 16, 8)
    assert len(sixteen) == 16 and sixteen[5] is prompts[0]
    assert grid.waves(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert grid.waves(list(range(3)), 16) == [[0, 1, 2]]


def test_configs_cover_every_drafter_at_every_k_and_auto():
    cfgs = grid.configs(["ngram", "eagle3"], [2, 4])
    assert cfgs["plain"] == {"method": "none"}
    assert cfgs["eagle3 K=4"] == {"method": "eagle3", "num_speculative_tokens": 4}
    assert cfgs["ngram auto"] == {"method": "ngram", "num_speculative_tokens": "auto"}
    assert len(cfgs) == 1 + 2 * 3


def _cell(tokens, wall, texts=None, token_ids=None, al=None):
    return {"tokens": tokens, "wall_s": wall, "ttft_ms": 10.0, "acceptance_length": al,
            "texts": texts, "token_ids": token_ids}


def test_summary_compares_with_plain_at_the_same_concurrency():
    cells = {
        "plain": {"1": [_cell(100, 10.0, ["a", "b"])], "4": [_cell(100, 5.0, ["a", "b"])]},
        "ngram K=2": {"1": [_cell(100, 5.0, ["a", "b"], al=2.0),
                            _cell(100, 2.5, ["a", "b"], al=3.0)],
                      "4": [_cell(100, 10.0, ["a", "x"], al=1.5)]},
        # peers come back as token ids; `decode` turns them into text
        "vllm plain": {"4": [_cell(90, 3.0, token_ids=[[1], [2]])]},
    }
    reference = {c: runs[-1]["texts"] for c, runs in cells["plain"].items()}
    s = grid.summarise(cells, reference, decode=lambda ids: "ab"[ids[0] - 1])
    assert s["plain"]["1"]["vs_plain"] == 1.0
    assert s["ngram K=2"]["1"]["tok_s"] == pytest.approx((20 + 40) / 2)
    assert s["ngram K=2"]["1"]["vs_plain"] == pytest.approx(3.0)
    assert s["ngram K=2"]["1"]["acceptance_length"] == pytest.approx(2.5)
    assert s["ngram K=2"]["4"]["vs_plain"] == pytest.approx(0.5)
    assert s["ngram K=2"]["4"]["identical"] == 1 and s["ngram K=2"]["4"]["requests"] == 2
    assert s["vllm plain"]["4"]["identical"] == 2
    assert s["vllm plain"]["4"]["vs_plain"] == pytest.approx(30 / 20)


def _result(summary, unavailable=None):
    return {"model": "m", "device_name": "cpu", "cpus": 2, "versions": {"torch": "t"},
            "load_average_1min": [1.0, 1.0], "wall_s": 60.0, "plot": None, "notes": ["n"],
            "unavailable": unavailable or {},
            "config": {"concurrency": [1, 4], "methods": ["ngram"], "max_tokens": 8,
                       "requests": 2, "repeats": 1, "threads": 1},
            "summary": summary}


def test_table_names_unavailable_peers_and_rates_dynamic_k_against_best_static():
    def cell(tok_s, plain):
        return {"tok_s": tok_s, "vs_plain": tok_s / plain, "acceptance_length": None,
                "identical": 2, "requests": 2}

    summary = {"plain": {"1": cell(10, 10), "4": cell(20, 20)},
               "ngram K=2": {"1": cell(15, 10), "4": cell(30, 20)},
               "ngram K=4": {"1": cell(18, 10), "4": cell(24, 20)},
               "ngram auto": {"1": cell(18, 10), "4": cell(27, 20)},
               "transformers plain": {"1": cell(9, 10), "4": cell(16, 20)}}
    text = grid.render(_result(summary, {"vllm": "no peers venv"}))
    assert "| vllm plain | unavailable: no peers venv |" in text
    assert "| ours ngram K=4 | 18.0 | 1.80x | - | 2/2 | 24.0 | 1.20x | - | 2/2 |" in text
    assert "| transformers plain | 9.0 | 0.90x" in text
    assert "| ngram | 1.00 (best K=4) | 0.90 (best K=2) |" in text


@pytest.mark.slow
@pytest.mark.model
def test_a_reduced_grid_runs_the_real_stack_and_transformers(tmp_path):
    out = tmp_path / "grid.json"
    threads = torch.get_num_threads()
    try:
        grid.main(["--quick", "--systems", "ours,transformers", "--out", str(out)])
    finally:
        # main() sets this process's torch threads (transformers runs here); tests that
        # follow compare float32 logits with tolerances measured at the default count.
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    s = result["summary"]
    assert set(s) == {"plain", "ngram K=2", "ngram auto", "transformers plain",
                      "transformers prompt lookup"}
    for name in ("plain", "ngram K=2", "ngram auto", "transformers plain"):
        for c, requests in (("1", 2), ("4", 4)):
            assert s[name][c]["tok_s"] > 0
            # greedy: every system gives plain decoding's text
            assert s[name][c]["identical"] == s[name][c]["requests"] == requests
    assert set(s["transformers prompt lookup"]) == {"1"}
    assert s["ngram K=2"]["1"]["acceptance_length"] >= 1.0
    assert "| ours ngram auto |" in out.with_suffix(".md").read_text()
