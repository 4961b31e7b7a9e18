"""verifier/worker.py: the engine is stepped on the thread it was built on, its
step accounting adds up, a request that makes steps fail is found by stepping
halves of the batch and fails alone, and a broken engine is fatal."""

from __future__ import annotations

import math
import queue
import random
import threading

import pytest

from specdec.generate import greedy_generate
from specdec.sampling import SamplingParams
from tests.tiny import tiny_llama
from verifier.engine import Engine, EngineConfig, FinishReason, Request
from verifier.worker import EngineFailed, EngineThread, EngineWorker, RequestFailed

GREEDY = SamplingParams(temperature=0.0)


def test_steps_run_on_the_thread_that_built_the_engine():
    thread = EngineThread()
    built_on = thread.call(threading.get_ident)
    model = tiny_llama(97, seed=3)
    engine = thread.call(lambda: Engine(model, EngineConfig(max_num_seqs=4, max_model_len=256, num_kv_blocks=64)))
    stepped_on: set[int] = set()
    step = engine.step

    def recording_step(only=None):
        stepped_on.add(threading.get_ident())
        return step(only)

    engine.step = recording_step
    worker = EngineWorker(engine, thread).start()
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    prompt = [5, 17, 3, 88, 41]
    worker.add(Request("r", prompt, 12, SamplingParams(temperature=0.0)), outputs.put)
    tokens: list[int] = []
    while True:
        out = outputs.get(timeout=30)
        tokens += out.new_token_ids
        if out.finish_reason is not None:
            break
    worker.stop()
    assert tokens == greedy_generate(model, [prompt], 12)[0]
    assert stepped_on == {built_on} and built_on != threading.get_ident()
    # 12 tokens: one from the prefill step, then one per decode step
    times = worker.load.times
    assert (times.steps, times.tokens, times.sequences) == (12, 12, 12)
    assert times.forward_ms > 0 and times.busy_ms >= times.forward_ms + times.sample_ms


@pytest.fixture(scope="module")
def model():
    return tiny_llama(97, seed=3)


def _requests(n: int, seed: int, max_tokens: int = 12) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"r{i}", [rng.randrange(97) for _ in range(rng.randint(2, 9))], max_tokens,
                    GREEDY) for i in range(n)]


def _run(worker: EngineWorker, requests: list[Request]) -> dict[str, list[int] | BaseException]:
    """Add every request before the first step (one batch), collect each one's tokens,
    or the error it ended with."""
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    for r in requests:
        worker.add(r, lambda o, rid=r.request_id: outputs.put((rid, o)))
    worker.start()
    got: dict[str, list[int] | BaseException] = {r.request_id: [] for r in requests}
    left = {r.request_id for r in requests}
    while left:
        rid, out = outputs.get(timeout=30)
        if isinstance(out, BaseException):
            got[rid] = out
            left.discard(rid)
            continue
        got[rid] += out.new_token_ids
        if out.finish_reason is not None:
            left.discard(rid)
    worker.stop()
    return got


def _counting_steps(engine: Engine) -> list:
    """Record the `only` argument of every engine.step call."""
    calls: list = []
    step = engine.step

    def counted(only=None):
        calls.append(only)
        return step(only)

    engine.step = counted
    return calls


def _poison(engine: Engine, is_poison, after: int = 3) -> list[str]:
    """The model runner raises, after running the batch (its KV written), whenever a
    poison sequence with `after` tokens of output is in it; returns the raise log."""
    run, raised = engine.runner.run, []

    def poisoned(batch, drafts, proposer):
        out = run(batch, drafts, proposer)
        bad = [item.seq.request.request_id for item in batch
               if is_poison(item.seq.request) and item.seq.num_output >= after]
        if bad:
            raised.append(bad)
            raise RuntimeError(f"poisoned by {bad}")
        return out

    engine.runner.run = poisoned
    return raised


@pytest.mark.parametrize("n", [2, 8, 16])
def test_a_poison_request_fails_alone_and_the_others_are_unchanged(model, n):
    requests = _requests(n, seed=n)
    config = EngineConfig(max_num_seqs=16, max_model_len=128, block_size=4, num_kv_blocks=256)
    clean = _run(EngineWorker(Engine(model, config)), requests)
    assert clean == dict(zip([r.request_id for r in requests],
                             greedy_generate(model, [r.prompt_token_ids for r in requests], 12),
                             strict=True))

    engine = Engine(model, config)
    poison = f"r{n // 2}"
    raised = _poison(engine, lambda r: r.request_id == poison)
    calls = _counting_steps(engine)
    worker = EngineWorker(engine)
    got = _run(worker, requests)
    assert isinstance(got[poison], RequestFailed)
    assert f"RuntimeError: poisoned by ['{poison}']" in str(got[poison])
    assert {rid: out for rid, out in got.items() if rid != poison} == \
        {rid: out for rid, out in clean.items() if rid != poison}
    # Halves of halves: two steps a level, log2(n) levels, then it is out of the batch.
    assert len([c for c in calls if c is not None]) == 2 * math.ceil(math.log2(n))
    assert len(raised) == 1 + math.ceil(math.log2(n))  # the batch, then one half a level
    assert worker.fatal is None
    assert engine.cache.num_free_blocks == 256 and not engine.has_work()


def test_a_request_failing_as_its_step_commits_fails_alone(model):
    """A failure in one sequence's postprocess (here its appends) needs no search: the
    step's other sequences commit and go on."""
    requests = _requests(4, seed=5)
    engine = Engine(model, EngineConfig(max_model_len=128, block_size=4, num_kv_blocks=128))
    append = engine._append

    def failing_append(seq, new):
        if seq.request.request_id == "r1" and seq.num_output >= 2:
            raise ValueError("token not allowed by the grammar")
        return append(seq, new)

    engine._append = failing_append
    calls = _counting_steps(engine)
    got = _run(EngineWorker(engine), requests)
    assert isinstance(got["r1"], RequestFailed) and "not allowed" in str(got["r1"])
    want = greedy_generate(model, [r.prompt_token_ids for r in requests], 12)
    assert [got[f"r{i}"] for i in (0, 2, 3)] == [want[0], want[2], want[3]]
    assert all(c is None for c in calls)  # no step was retried
    assert engine.cache.num_free_blocks == 128


def test_a_broken_engine_is_fatal(model):
    """Every step raises: the search ends as soon as fatal_after requests failed alone
    with no step succeeding between, and every request ends with EngineFailed (they
    can resume elsewhere), none with RequestFailed."""
    engine = Engine(model, EngineConfig(max_model_len=128, block_size=4, num_kv_blocks=128))
    raised = _poison(engine, lambda r: True, after=0)
    calls = _counting_steps(engine)
    worker = EngineWorker(engine, fatal_after=2)
    got = _run(worker, _requests(4, seed=6))
    assert all(isinstance(out, EngineFailed) for out in got.values()), got
    assert isinstance(worker.fatal, RuntimeError)
    # 4 -> 2 + 2 -> the second half's 1 + 1: the two singles fail alone, in a row.
    assert len(calls) == 5 and len(raised) == 5


def test_a_lone_bad_request_is_not_fatal(model):
    """One request at a time, each failing alone with a success between: not fatal."""
    engine = Engine(model, EngineConfig(max_model_len=128, block_size=4, num_kv_blocks=128))
    _poison(engine, lambda r: r.request_id.startswith("bad"), after=0)
    worker = EngineWorker(engine, fatal_after=2).start()
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    ends = []
    for rid in ["bad0", "good", "bad1", "good2"]:
        worker.add(Request(rid, [1, 2, 3], 3, GREEDY), outputs.put)
        while True:
            out = outputs.get(timeout=30)
            if isinstance(out, BaseException) or out.finish_reason is not None:
                ends.append(type(out).__name__ if isinstance(out, BaseException)
                            else out.finish_reason)
                break
    worker.stop()
    assert ends == ["RequestFailed", FinishReason.LENGTH, "RequestFailed", FinishReason.LENGTH]
    assert worker.fatal is None
