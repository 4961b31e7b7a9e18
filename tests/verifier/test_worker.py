"""verifier/worker.py: the engine is stepped on the thread it was built on, and its
step accounting adds up."""

from __future__ import annotations

import queue
import threading

from specdec.generate import greedy_generate
from specdec.sampling import SamplingParams
from tests.tiny import tiny_llama
from verifier.engine import Engine, EngineConfig, Request
from verifier.worker import EngineThread, EngineWorker


def test_steps_run_on_the_thread_that_built_the_engine():
    thread = EngineThread()
    built_on = thread.call(threading.get_ident)
    model = tiny_llama(97, seed=3)
    engine = thread.call(lambda: Engine(model, EngineConfig(max_num_seqs=4, max_model_len=256, num_kv_blocks=64)))
    stepped_on: set[int] = set()
    step = engine.step

    def recording_step():
        stepped_on.add(threading.get_ident())
        return step()

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
