"""How the Verifier service fails, in-process on loopback: a request that fails
alone in the engine ends with INTERNAL marked REQUEST_FAILED (not to be replayed)
while the others are untouched; a broken engine or a stuck step trips the
watchdog: health NOT_SERVING, requests end with UNAVAILABLE (to resume
elsewhere) and the process exits with status 3 (the exit is injected here)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from specdec.generate import greedy_generate
from specdec.pb import verifier_pb2_grpc
from specdec.server import check_health, is_request_failed
from tests.loop_thread import LoopThread
from tests.ports import free_port
from tests.tiny import tiny_llama
from tests.verifier.test_service import generate, run_concurrently, start_msg
from verifier.drafter_client import TargetInfo
from verifier.drafting import DrafterPool
from verifier.engine import Engine, EngineConfig
from verifier.service import EXIT_ENGINE_FAILED, VerifierServicer, serve
from verifier.vllm.serve import EngineLiveness
from verifier.watchdog import Watchdog
from verifier.worker import EngineWorker

VOCAB = 97
POISON = 96  # a prompt starting with this token makes its steps fail


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=1)


class Verifier:
    """A verifier without drafters whose process exit is recorded, not taken."""

    def __init__(self, loop: LoopThread, model, step_timeout_s: float = 0.0):
        self.loop = loop
        cfg = model.config
        pool = DrafterPool([], 4, 100.0)
        self.engine = Engine(model, EngineConfig(max_num_seqs=8, max_model_len=256,
                                                 num_kv_blocks=64, max_num_speculative_tokens=4),
                             pool)
        servicer = VerifierServicer(self.engine, pool,
                                    TargetInfo(VOCAB, "", cfg.hidden_size, cfg.num_layers))
        self.exits: list[int] = []
        self.service = loop.run(serve(servicer, "127.0.0.1:0", step_timeout_s=step_timeout_s,
                                      terminate=self.exits.append))
        self.service.exit_grace_s = 0.05
        self.address = f"127.0.0.1:{self.service.port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)

    def serving(self) -> bool:
        return check_health(self.address, "specdec.v1.Verifier")

    def close(self) -> None:
        self.channel.close()
        self.loop.run(self.service.stop(1.0))


def _poison(engine: Engine, stuck: threading.Event | None = None, after: int = 0) -> list:
    """Steps with a poison sequence (`after` tokens into its output) raise after the
    forward; with `stuck`, every step waits for it instead."""
    run, calls = engine.runner.run, []

    def poisoned(batch, drafts, proposer):
        calls.append(len(batch))
        if stuck is not None:
            stuck.wait(30)
        out = run(batch, drafts, proposer)
        if any(item.seq.request.prompt_token_ids[0] == POISON and item.seq.num_output >= after
               for item in batch):
            raise RuntimeError("poisoned")
        return out

    engine.runner.run = poisoned
    return calls


def _error(stub, prompt, max_tokens=20) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, start_msg(prompt, max_tokens), timeout=30)
    return e.value


def _wait(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_request_that_fails_alone_is_marked_and_the_others_go_on(loop, model):
    v = Verifier(loop, model)
    try:
        _poison(v.engine, after=3)
        prompts = [[5, 17, 3], [POISON, 4, 9, 12], [8, 8, 1, 2, 60], [33, 2]]

        def one(prompt):
            try:
                return generate(v.stub, start_msg(prompt, 20), timeout=30)[0]
            except grpc.RpcError as e:
                return e

        results = run_concurrently(one, [(p,) for p in prompts])
        err = results[1]
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INTERNAL
        assert is_request_failed(err) and "RuntimeError: poisoned" in err.details()
        want = greedy_generate(model, prompts, 20)
        assert [results[i] for i in (0, 2, 3)] == [want[0], want[2], want[3]]
        # One bad request is not the replica's fault: it keeps serving.
        assert v.serving() and v.exits == [] and v.service.servicer.worker.fatal is None
        assert generate(v.stub, start_msg(prompts[0], 5))[0] == want[0][:5]
    finally:
        v.close()


def test_a_broken_engine_trips_the_watchdog(loop, model):
    v = Verifier(loop, model)
    try:
        run = v.engine.runner.run

        def broken(batch, drafts, proposer):
            run(batch, drafts, proposer)
            raise RuntimeError("device lost")

        v.engine.runner.run = broken  # every step raises
        # The first request to fail alone might be a bad one ...
        first = _error(v.stub, [1, 2])
        assert first.code() == grpc.StatusCode.INTERNAL and is_request_failed(first)
        assert v.serving() and v.exits == []
        # ... the second in a row, with nothing succeeding between, says the engine is.
        second = _error(v.stub, [1, 2, 3])
        assert second.code() == grpc.StatusCode.UNAVAILABLE and not is_request_failed(second)
        assert "device lost" in second.details()
        assert _wait(lambda: v.exits == [EXIT_ENGINE_FAILED])
        assert not v.serving()
        refused = _error(v.stub, [1, 2, 3])
        assert refused.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine failed" in refused.details()
    finally:
        v.close()


def test_a_stuck_step_trips_the_watchdog(loop, model):
    v = Verifier(loop, model, step_timeout_s=0.3)
    release = threading.Event()
    try:
        calls = _poison(v.engine, stuck=release)
        t0 = time.monotonic()
        err = _error(v.stub, [1, 2, 3])
        # The step is still stuck: only the watchdog can have ended the request.
        assert not release.is_set() and calls == [1]
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "0.3 s" in err.details()
        assert time.monotonic() - t0 < 10
        assert _wait(lambda: v.exits == [EXIT_ENGINE_FAILED])
        assert not v.serving()
    finally:
        release.set()
        v.close()


def test_the_watchdog_reads_the_worker(model):
    worker = EngineWorker(Engine(model, EngineConfig(max_model_len=128, num_kv_blocks=16)))
    dog = Watchdog(worker, step_timeout_s=5.0, on_trip=lambda reason: None)
    assert dog.check() is None
    worker.step_started = time.monotonic() - 1.0
    assert dog.check() is None
    worker.step_started = time.monotonic() - 6.0
    assert dog.check() == "a step has run for more than 5 s"
    assert Watchdog(worker, 0.0, lambda reason: None).check() is None  # 0: no limit
    worker.fatal = RuntimeError("CUDA error: an illegal memory access")
    assert dog.check() == "engine failed: RuntimeError: CUDA error: an illegal memory access"


def test_the_watchdog_reads_vllms_engine():
    """--engine vllm: AsyncLLM.errored (its engine core died, or its output loop) trips it;
    vLLM's steps are not timed here (they run in its engine core)."""
    engine = SimpleNamespace(errored=False, dead_error=RuntimeError("EngineCore died"))
    dog = Watchdog(EngineLiveness(engine), step_timeout_s=5.0, on_trip=lambda reason: None)
    assert dog.check() is None
    engine.errored = True
    assert dog.check() == "engine failed: RuntimeError: EngineCore died"


def test_the_cli_exits_with_status_3_when_a_step_overruns(smollm2_dir):
    """The process as deployed: any step overruns --step-timeout-s 1e-6, so the first
    poll that finds one running trips the watchdog; the request ends with UNAVAILABLE
    and the process exits with status 3, for its supervisor to restart it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "verifier", "--model", str(smollm2_dir), "--port", str(port),
         "--max-num-seqs", "2", "--max-model-len", "512", "--threads", "1",
         "--step-timeout-s", "1e-6"],
        env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    address = f"127.0.0.1:{port}"
    try:
        assert _wait(lambda: check_health(address, timeout_s=1) or proc.poll() is not None,
                     timeout_s=120)
        with grpc.insecure_channel(address) as channel:
            err = _error(verifier_pb2_grpc.VerifierStub(channel), list(range(100, 140)), 400)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "for more than 1e-06 s" in err.details()
        assert proc.wait(timeout=30) == EXIT_ENGINE_FAILED
        assert "watchdog: a step has run for more than" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
