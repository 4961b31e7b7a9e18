"""bench/verifier.py: the weight-bandwidth floor its GPU tables report."""

import pytest

from bench import verifier


def _result(device: str, name: str) -> dict:
    return {"device": device, "device_name": name, "num_parameters": 1_000_000_000,
            "dtype": "bfloat16",
            "forward": [{"batch": 1, "decode_median_ms": 3.0}, {"batch": 1, "decode_median_ms": 1.2},
                        {"batch": 16, "decode_median_ms": 4.5}]}


def test_floor_is_weight_bytes_over_the_gpus_bandwidth():
    # 1e9 bfloat16 weights = 2 GB at an H100 SXM's 3.35 TB/s.
    floor = verifier.bandwidth_floor_ms(_result("cuda", "NVIDIA H100 80GB HBM3"))
    assert floor == pytest.approx(2e9 / 3.35e12 * 1e3)
    lines = verifier.bandwidth_floor_lines(_result("cuda", "NVIDIA H200"))
    # Each batch against the floor with its fastest decode step (1.2 ms of the two at batch 1).
    assert f"| 1 | 1.20 | {2e9 / 4.8e12 * 1e3:.2f} | 2.9x |" in lines
    assert any(line.startswith("| 16 | 4.50 |") for line in lines)


def test_no_floor_off_a_known_gpu():
    assert verifier.bandwidth_floor_ms(_result("cpu", "AMD EPYC")) is None
    assert verifier.bandwidth_floor_ms(_result("cuda", "Some Future GPU")) is None
    assert verifier.bandwidth_floor_lines(_result("cpu", "AMD EPYC")) == []


def test_kernel_time_is_per_step_longest_first():
    got = verifier.top_kernels({"gemm": 3000.0, "rmsnorm": 500.0, "attn": 1500.0, "idle": 0.0},
                               iters=5, top=2)
    assert got["total_ms"] == pytest.approx(1.0)  # 5000 µs over 5 steps
    assert got["top"] == [{"kernel": "gemm", "ms": pytest.approx(0.6)},
                          {"kernel": "attn", "ms": pytest.approx(0.3)}]
    result = {"forward": [{"batch": 1, "mode": "graphs", "decode_median_ms": 1.5}],
              "kernels": [{"batch": 1, **got}]}
    assert "| 1 | 1.00 | 1.50 | gemm 0.600; attn 0.300 |" in verifier.kernel_lines(result)
    assert verifier.kernel_lines({"forward": [], "kernels": []}) == []
