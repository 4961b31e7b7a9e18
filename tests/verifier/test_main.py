"""`python -m verifier`'s command line: a flag that one engine alone reads is refused,
naming it, when given to the other (never silently ignored); compose's verifier
command, which both engines share, parses on either."""

from __future__ import annotations

import pytest
import yaml

from specdec.launch import COMPOSE_FILE, interpolate, local_services
from verifier.__main__ import ENGINE_FLAGS, parse_args
from verifier.vllm.serve import check_device


@pytest.mark.parametrize("argv", [
    ["--engine", "vllm", "--step-timeout-s", "60"],  # even at its default
    ["--engine", "vllm", "--threads", "2"],
    ["--engine", "vllm", "--attention", "sdpa"],
    ["--engine", "vllm", "--block-size", "32"],
    ["--tensor-parallel-size", "2"],
    ["--engine", "specdec", "--gpu-memory-utilization", "0.9"],
])
def test_a_flag_of_the_other_engine_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    engine = argv[argv.index("--engine") + 1] if "--engine" in argv else "specdec"
    flag = next(a for a in argv if a in ENGINE_FLAGS)
    assert f"error: {flag} does not apply to --engine {engine}" in err


def test_defaults_and_values_that_ask_nothing_pass():
    ours = parse_args(["--threads", "1", "--step-timeout-s", "5", "--block-size", "32"])
    assert (ours.threads, ours.step_timeout_s, ours.block_size) == (1, 5.0, 32)
    assert (ours.tensor_parallel_size, ours.attention, ours.device) == (1, "sdpa", None)
    vllm = parse_args(["--engine", "vllm", "--threads", "0", "--tensor-parallel-size", "2",
                       "--device", "cpu", "--no-cuda-graphs", "--no-enable-prefix-caching"])
    assert (vllm.threads, vllm.tensor_parallel_size, vllm.device) == (0, 2, "cpu")
    assert vllm.step_timeout_s == 60.0 and vllm.block_size == 16  # unread, defaults kept
    assert parse_args(["--tensor-parallel-size", "1"]).tensor_parallel_size == 1


@pytest.mark.parametrize("local", [True, False], ids=["local", "compose-defaults"])
@pytest.mark.parametrize("engine", ["specdec", "vllm"])
def test_composes_verifier_command_parses_on_either_engine(local, engine):
    if local:
        argv = {s.name: s for s in local_services(
            environ={"SPECDEC_MODEL_ROOT": "/m", "EAGLE3_HEAD": "/h",
                     "SPECDEC_ENGINE": engine})}["verifier"].argv[1:]
    else:
        command = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["verifier"]["command"]
        argv = [interpolate(str(a), {"SPECDEC_ENGINE": engine}) for a in command[1:]]
    assert parse_args(argv).engine == engine


def test_device_on_vllm_names_its_platform():
    check_device(None, "cuda")  # not given: vLLM's platform
    check_device("cuda", "cuda")
    for device, platform in [("cuda", "cpu"), ("cuda:1", "cuda"), ("cpu", "cuda")]:
        with pytest.raises(SystemExit, match=f"--device {device}: vLLM here runs on "
                                             f"'{platform}'"):
            check_device(device, platform)


def test_no_unauthenticated_verifier_beyond_loopback(monkeypatch, capsys):
    from verifier.__main__ import main

    monkeypatch.delenv("SPECDEC_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("SPECDEC_ALLOW_UNAUTHENTICATED", raising=False)
    monkeypatch.delenv("SPECDEC_PUBLISHED_HOST", raising=False)
    assert main(["--host", "0.0.0.0", "--port", "0"]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert "specdec-verifier: refusing to serve on 0.0.0.0 without authentication" in err
    assert "SPECDEC_INTERNAL_TOKEN" in err and "--allow-unauthenticated" in err
