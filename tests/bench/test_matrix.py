"""The compatibility matrix (bench/matrix.py): its reduced CPU form runs with no
failed cell, and its checks do fail a verifier that is not exact."""

from __future__ import annotations

import json

import pytest
import torch

from bench import matrix
from verifier.sampling import sampler


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> matrix.Matrix:
    settings = matrix.Settings(random_requests=1000, random_requests_batch1=300)
    return matrix.build_matrix(tmp_path_factory.mktemp("matrix"), settings)


def accept_all(logits, draft_ids, draft_probs, num_drafts, metadata, position_keys=None,
               target_argmax=None):
    """A broken rejection sampler: every draft is accepted. The token after the drafts
    is still sampled correctly from p (a seeded request's at its position), so only the
    acceptance rule is wrong."""
    last = (num_drafts + 1).cumsum(0) - 1  # [B] each request's last row
    if position_keys is not None:
        position_keys = [None if key is None else (key[0], key[1] + n)
                         for key, n in zip(position_keys, num_drafts.tolist(), strict=True)]
    final, _ = sampler.rejection_sample(logits.index_select(0, last), draft_ids[:0], None,
                                          torch.zeros_like(num_drafts), metadata, position_keys)
    out = torch.full((len(num_drafts), int(num_drafts.max()) + 1), -1, dtype=torch.int64)
    start = 0
    for i, n in enumerate(num_drafts.tolist()):
        out[i, :n] = draft_ids[start: start + n]
        out[i, n] = final[i, 0]
        start += n
    return out, num_drafts.clone()


def accept_all_greedy(argmax, drafts):
    """The same broken rule on the engine's all-greedy path (rejection.greedy_chains):
    every draft is kept, then the argmax of the row after them."""
    token_ids, row = [], 0
    for chain in drafts:
        token_ids.append([*chain, argmax[row + len(chain)]])
        row += len(chain) + 1
    return token_ids, [len(chain) for chain in drafts]


def test_reduced_matrix_has_no_failed_cell(tmp_path):
    out = tmp_path / "matrix.json"
    threads = torch.get_num_threads()
    try:
        assert matrix.main(["--reduced", "--quiet", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # main sets its own; leave other tests theirs
    result = json.loads(out.read_text())
    cells = result["cells"]
    ran = [c for c in cells if c["status"] != "n/a"]
    assert [c for c in cells if c["status"] == "fail"] == []
    assert {c["drafter"] for c in ran} == set(matrix.DRAFTERS)
    assert {c["sampling"] for c in ran} == {"greedy", "random"}
    for c in ran:
        if c["drafter"] != "none":
            assert c["metrics"]["drafted"] > 0, c
    md = out.with_suffix(".md").read_text()
    assert result["meta"]["summary"] in md and "| ngram | greedy | static |" in md


@pytest.mark.parametrize("drafter", ["ngram", "draft_model"])
def test_a_sampler_that_accepts_every_draft_fails_greedy_cells(built, drafter, monkeypatch):
    dims = matrix.Dims(drafter, "greedy", "static", 8, "float32", "sdpa", False)
    assert matrix.run_cell(built, dims).status == "pass"
    monkeypatch.setattr("verifier.engine.engine.rejection_sample", accept_all)
    monkeypatch.setattr("verifier.engine.engine.greedy_chains", accept_all_greedy)
    cell = matrix.run_cell(built, dims)
    assert cell.status == "fail" and "below the plain token" in cell.note


def test_a_sampler_that_accepts_every_draft_fails_random_cells(built, monkeypatch):
    monkeypatch.setattr("verifier.engine.engine.rejection_sample", accept_all)
    # Without drafts the broken sampler is the real one: the check passes.
    plain = matrix.run_cell(built, matrix.Dims("none", "random", "0", 8, "float32", "sdpa", False))
    assert plain.status == "pass", plain.note
    cell = matrix.run_cell(built, matrix.Dims("eagle3", "random", "static", 8, "float32", "sdpa",
                                              False))
    assert cell.status == "fail", cell.metrics
    assert cell.metrics["p_value"] < matrix.P_MIN
    assert cell.metrics["p_value_second_seed"] < matrix.P_MIN


def test_greedy_check_tells_near_ties_from_real_divergences(built):
    world = built.greedy
    model = world.target("float32", "sdpa", "cpu")
    prompts = world.prompts[:2]
    run = matrix.run_requests(model, matrix.greedy_requests(prompts, 0), 2, None, False, False, 0)
    assert matrix.check_greedy(model, prompts, run.outputs, None, 1e-4) == ("pass", "")
    assert matrix.check_greedy(model, prompts, run.outputs, run.outputs, 1e-4) == ("pass", "")
    wrong = [list(o) for o in run.outputs]
    wrong[1][5] = (wrong[1][5] + 1) % matrix.GREEDY_VOCAB  # the reference leaves the argmax
    status, note = matrix.check_greedy(model, prompts, run.outputs, wrong, 1e-4)
    assert status == "fail" and note.startswith("request 1 token 5:")
    # The same divergence within a (huge) tolerance is a near tie: warn, not pass.
    assert matrix.check_greedy(model, prompts, run.outputs, wrong, 1e3)[0] == "warn"
    status, note = matrix.check_greedy(model, prompts, wrong, None, 1e-4)
    assert status == "fail" and "below the argmax" in note


def test_chi_square_rejects_a_wrong_law():
    gen = torch.Generator().manual_seed(0)
    law = torch.softmax(torch.randn(2, 64, generator=gen, dtype=torch.float64), dim=-1)
    n = 3000
    exact = torch.stack([torch.bincount(torch.multinomial(p, n, True, generator=gen),
                                        minlength=64) for p in law])
    assert matrix.chi_square_p_value(exact, law * n) > matrix.P_MIN
    assert matrix.chi_square_p_value(exact.flip(1), law * n) < matrix.P_MIN
    leaked = exact.clone()
    leaked[0, 0] += 1
    assert matrix.chi_square_p_value(leaked, law.index_fill(1, torch.tensor([0]), 0) * n) == 0.0


def test_cells_that_cannot_run_here_are_not_applicable():
    cpu = matrix.Dims("ngram", "greedy", "static", 8, "float32", "sdpa", True)
    assert matrix.not_applicable(cpu, "cpu") == "n/a (no GPU)"
    assert matrix.not_applicable(cpu, "cuda") is None
    fp8 = matrix.Dims("ngram", "greedy", "static", 8, "fp8-kv", "sdpa", False)
    assert matrix.not_applicable(fp8, "cpu").startswith("n/a (not supported")
    dims = list(matrix.grid(reduced=False))
    rows = 1 + 2 * (len(matrix.DRAFTERS) - 1)  # none at K=0; each drafter static and dynamic
    assert len(dims) == len(set(dims)) == rows * 2 * len(matrix.DTYPES) * 2 * 2 * len(
        matrix.ATTENTION_BACKENDS)


def test_suffix_drafts_for_sampled_requests_follow_the_target(built):
    # Suffix decoding's drafts come from the request's own context and from past replies
    # (the global tree fills up across the cell's requests): its first tokens must still
    # follow the target's law.
    cell = matrix.run_cell(built, matrix.Dims("suffix", "random", "static", 8, "float32", "sdpa",
                                              False))
    assert cell.status == "pass", cell.note
    assert cell.metrics["drafted"] > 0 and cell.metrics["p_value"] > matrix.P_MIN
