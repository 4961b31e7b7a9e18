"""bench/fair.py: a busy machine refuses the run, and vLLM's binding is the fastest
one measured."""

from __future__ import annotations

import pytest

from bench import fair


def test_a_run_waits_for_the_load_to_fall_then_starts():
    loads = iter([1.9, 1.4, 0.6])
    slept = []
    load = fair.wait_until_idle(cpus=2, wait_s=60, loadavg=lambda: next(loads),
                                sleep=slept.append)
    assert load == 0.6 and len(slept) == 2


def test_a_machine_that_stays_busy_refuses_the_run():
    with pytest.raises(fair.Busy, match=r"load average 1\.50 on 2 cores"):
        fair.wait_until_idle(cpus=2, wait_s=0, loadavg=lambda: 1.5, sleep=lambda s: None)


def test_the_fastest_binding_is_chosen_and_a_failing_one_recorded():
    candidates = {"a": {"X": "1"}, "b": {"X": "2"}, "c": {"X": "3"}}

    def measure(env):
        if env["X"] == "3":
            raise RuntimeError("exited with code 1")
        return {"1": 21.8, "2": 30.7}[env["X"]]

    name, env, tried = fair.best_binding(measure, candidates)
    assert (name, env) == ("b", {"X": "2"})
    assert tried["a"] == 21.8 and tried["c"].startswith("failed: exited")
    with pytest.raises(RuntimeError, match="no binding"):
        fair.best_binding(lambda env: 1 / 0, candidates)


def test_a_binding_the_environment_sets_is_taken_as_given():
    assert fair.given_binding({"OMP_NUM_THREADS": "2"}) is None
    assert fair.given_binding({"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2",
                               "PATH": "/bin"}) == {"VLLM_CPU_OMP_THREADS_BIND": "0-1",
                                                    "OMP_NUM_THREADS": "2"}
    assert fair.vllm_bindings(2)["cores 0-1, none reserved"] == {
        "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def test_a_recording_run_exits_on_a_busy_machine_or_marks_its_record(monkeypatch):
    def busy():
        raise fair.Busy("the machine is busy")

    monkeypatch.setattr(fair, "wait_until_idle", busy)
    with pytest.raises(SystemExit, match="the machine is busy"):
        fair.refuse_if_busy(allow_busy=False)
    assert fair.refuse_if_busy(allow_busy=True) == "the machine is busy"
    monkeypatch.setattr(fair, "wait_until_idle", lambda: 0.1)
    assert fair.refuse_if_busy(allow_busy=False) is None


def test_runs_of_vllms_own_ngram_before_numbas_own_pool_carry_a_caveat():
    modes = ["plain", "ngram K=4", "remote ngram K=4"]
    caveat = fair.numba_caveat({}, modes)
    assert caveat is not None and "ngram K=4" in caveat and "remote" not in caveat
    assert fair.numba_caveat({"vllm_numba_layer": "workqueue"}, modes) is None
    assert fair.numba_caveat({"vllm_numba_layer": "omp"}, modes) is not None
    # Ours as vLLM's proposer, and vLLM without ngram, ran no numba lookups of vLLM's.
    assert fair.numba_caveat({}, ["plain", "remote ngram K=4"]) is None
