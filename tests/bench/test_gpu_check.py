"""bench/gpu_check.py: the one command a GPU session runs, smoke-tested on CPU (a tiny
model, the fused kernels under Triton's interpreter), and its time-budget skipping."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_check

ROOT = Path(__file__).resolve().parents[2]


def errors(obj: object, path: str = "") -> list[str]:
    """Where in the result an error was recorded."""
    if isinstance(obj, dict):
        here = [path] if "error" in obj else []
        return here + [p for k, v in obj.items() for p in errors(v, f"{path}/{k}")]
    if isinstance(obj, list):
        return [p for i, v in enumerate(obj) for p in errors(v, f"{path}/{i}")]
    return []


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    # The interpreter must be on before triton is imported: the child's environment.
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--tiny", "--device", "cpu", "--out", str(out),
         "--budget-s", "240"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc, out


@pytest.mark.slow
def test_tiny_run_measures_every_section(tiny_run):
    proc, out = tiny_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "gpu_check.json").read_text())
    sections = result["sections"]
    assert list(sections) == [s.name for s in gpu_check.SECTIONS]
    assert not errors(sections), errors(sections)
    assert not [n for n, v in sections.items() if "skipped" in v]

    steps = sections["steps"]["configs"]
    assert list(steps) == list(gpu_check.CONFIGS)
    for cell in (c for row in steps.values() for c in row.values()):
        assert cell["decode"]["wall"]["median_ms"] > 0
        assert cell["verify"]["device"]["median_ms"] > 0
    assert result["decode_over_floor_b1"] > 0 and result["decode_over_floor_none_b1"] > 0
    assert set(result["verify_over_decode_k4"]) == {"b1", "b2"}

    # float32: every fusion picks the tokens the unfused path picks, and a verify
    # block's rows agree with decode steps'.
    accuracy = sections["accuracy"]
    assert set(accuracy["configs"]) == {*gpu_check.FUSIONS, "all"}
    for c in (*accuracy["configs"].values(), *accuracy["verify_vs_decode"].values()):
        assert c["greedy_agreement"] == 1.0
        assert c["max_abs_logit_diff"] < 1e-3

    spec = sections["spec"]
    assert spec["all_equal_to_plain"]
    for runs in (spec["runs"], spec["exact_float32"]):
        assert {(r["batch"], r["k"]) for r in runs} == {(b, k) for b in (1, 2) for k in (0, 2, 4)}
        assert all(r["equal_to_plain"] and r["acceptance_length"] > 1 for r in runs if r["k"])

    kernels = sections["kernels"]
    assert {"none_b1", "all_b2"} <= set(kernels)
    assert kernels["all_b1"]["kernels_per_step"] > 0 and len(kernels["all_b1"]["top"]) == 10
    assert sections["compile_baseline"]["b1"]["greedy_agreement"] == 1.0
    assert sections["draft_token"]["ratio_wall"] > 0

    table = (out / "gpu_check.md").read_text().splitlines()
    assert 10 < len(table) < 40
    assert table[0].startswith("# GPU check: tiny float32")


def tiny_bench() -> gpu_check.Bench:
    return gpu_check.Bench(gpu_check.Settings.tiny_run(torch.device("cpu"), "inductor"),
                           {"sections": {}})


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_section_that_does_not_fit_the_budget_is_skipped():
    clock = FakeClock()
    ran = []

    def section(name: str, seconds: float) -> gpu_check.Section:
        def run(bench):
            ran.append(name)
            clock.now += seconds
            return {"ran": True}
        return gpu_check.Section(name, run, cuda_s=30, tiny_s=30)

    def broken(bench):
        raise RuntimeError("no kernel image")

    sections = [section("a", 50), gpu_check.Section("b", broken, 1, 1), section("c", 40),
                section("d", 1)]
    bench = tiny_bench()
    saved = []
    gpu_check.run_sections(sections, bench, budget_s=100, save=lambda r: saved.append(dict(r)),
                           clock=clock)
    got = bench.result["sections"]
    # a: 50 s, b raises, c: 40 s, leaving 10 s for d, whose estimate is 30 s.
    assert ran == ["a", "c"]
    assert got["a"]["ran"] and got["c"]["ran"]
    assert got["b"]["error"]["type"] == "RuntimeError"
    assert "no kernel image" in got["b"]["error"]["message"]
    assert got["d"] == {"skipped": "time", "estimate_s": 30, "remaining_s": 10.0}
    assert len(saved) == 4  # the JSON is rewritten after every section


def test_fits():
    assert gpu_check.fits(150, 150) and not gpu_check.fits(150, 149.9)


def test_a_section_past_the_budget_is_interrupted():
    def slow(bench):
        import time

        time.sleep(5)
        return {}

    bench = tiny_bench()
    gpu_check.run_sections([gpu_check.Section("slow", slow, 0, 0)], bench, budget_s=0.2,
                           save=lambda r: None)
    assert bench.result["sections"]["slow"]["error"]["type"] == "OutOfTime"


def test_error_rate_gives_the_acceptance_length():
    for k in (2, 4, 8):
        a = 1 - gpu_check.error_rate_for(2.2, k)
        assert sum(a**i for i in range(k + 1)) == pytest.approx(2.2)


@pytest.mark.parametrize(("name", "kind"), [
    ("nvjet_sm90_tst_128x8_64x12_4x1_v_bz_TNT", "gemm"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_k", "attention"),
    ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel",
     "copy/index"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>",
     "elementwise"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, MeanOps>", "reduce"),
    ("_add_rms_norm_kernel", "triton:_add_rms_norm_kernel"),
    ("Memcpy HtoD (Pageable -> Device)", "copy/index"),
    ("void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<64, 64, 256>",
     "attention"),
])
def test_kernel_kinds(name, kind):
    assert gpu_check.kernel_kind(name, gpu_check.fused_kernel_names()) == kind
