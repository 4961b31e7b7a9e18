"""`python -m drafter`: argument checks, and a real process that serves and stops on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter.__main__ import build_method, build_parser, main
from drafter.ngram import NgramMethod
from drafter.service import SERVICE_NAME
from specdec.pb import common_pb2, drafter_pb2, drafter_pb2_grpc
from specdec.server import GRPC_OPTIONS
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("argv", "message"), [
    (["--method", "eagle9"], "invalid choice: 'eagle9' (choose from "),
    ([], "the following arguments are required: --method"),
    (["--method", "ngram", "--model", "/m"], "--model does not apply to method 'ngram'"),
    (["--method", "ngram", "--lookup-min", "2"], "--lookup-min does not apply to method 'ngram'"),
    (["--method", "eagle3", "--no-cuda-graphs"],
     "--no-cuda-graphs does not apply to method 'eagle3'"),
    (["--method", "ngram", "--ngram-min", "3", "--ngram-max", "2"], "min_n=3, max_n=2"),
    (["--method", "ngram", "--max-num-speculative-tokens", "0"], "max_num_speculative_tokens"),
    (["--method", "ngram", "--port", "70000"], "--port 70000 is not in 0..65535"),
    (["--method", "ngram", "--threads", "-1"], "--threads -1 is negative"),
    (["--method", "ngram", "--target", "/nonexistent/model"],
     "--target /nonexistent/model: not a directory"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "usage: specdec-drafter" in err
    assert message in err


def test_options_reach_the_method():
    args = build_parser().parse_args(["--method", "ngram", "--ngram-min", "2", "--ngram-max", "5",
                                      "--max-num-speculative-tokens", "6"])
    method = build_method(args)
    assert isinstance(method, NgramMethod)
    assert (method.min_n, method.max_n) == (2, 5)
    info = method.info()
    assert info.max_num_speculative_tokens == 6
    assert (info.vocab_size, info.tokenizer_hash) == (0, "")  # no --target: any tokenizer


@pytest.mark.model
def test_target_sets_the_tokenizer_fingerprint(smollm2_dir):
    from specdec.tokenizer import Tokenizer

    method = build_method(build_parser().parse_args(["--method", "ngram",
                                                     "--target", str(smollm2_dir)]))
    info = method.info()
    assert (info.vocab_size, info.tokenizer_hash) == Tokenizer.from_dir(smollm2_dir).fingerprint()
    assert info.vocab_size > 0 and len(info.tokenizer_hash) == 64


def test_process_serves_health_and_info_then_stops_on_sigterm():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "drafter", "--method", "ngram", "--port", str(port),
         "--max-num-speculative-tokens", "5"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 60
            status = None
            while status != health_pb2.HealthCheckResponse.SERVING:
                assert proc.poll() is None, f"drafter exited early: {proc.stdout.read()}"
                assert time.monotonic() < deadline, "drafter never reported SERVING"
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME),
                                          timeout=1).status
                except grpc.RpcError:
                    time.sleep(0.1)
            info = drafter_pb2_grpc.DrafterStub(channel).Info(drafter_pb2.InfoRequest(), timeout=5)
        assert info.method == common_pb2.SPEC_METHOD_NGRAM
        assert info.max_num_speculative_tokens == 5

        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - stopped < 5  # no open streams: no grace period to wait out
        log = proc.stdout.read()
        assert f"drafter ngram serving on 127.0.0.1:{port}" in log
        assert "drafter stopped" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_no_unauthenticated_drafter_beyond_loopback(monkeypatch, capsys):
    monkeypatch.delenv("SPECDEC_INTERNAL_TOKEN", raising=False)
    monkeypatch.delenv("SPECDEC_ALLOW_UNAUTHENTICATED", raising=False)
    monkeypatch.delenv("SPECDEC_PUBLISHED_HOST", raising=False)
    assert main(["--method", "ngram", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "specdec-drafter: refusing to serve on 0.0.0.0 without authentication" in err
    assert "SPECDEC_INTERNAL_TOKEN" in err
