"""Runs the engine on its own thread and talks to asyncio through queues.

The engine is single-threaded by design. Commands (add, cancel, K updates)
queue up and run between steps, in order; every StepOutput goes to the
sink its request registered. A step that raises aborts the requests in
flight (their sinks get the exception) instead of killing the service.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from specdec.models.prefix_cache import PrefixCacheStats
from verifier.engine import Engine, Request, StepOutput, StepTimes

log = logging.getLogger(__name__)

Sink = Callable[[StepOutput | BaseException], None]
T = TypeVar("T")


class EngineThread:
    """The one OS thread that loads the model and then runs every step.

    On CPU, a model loaded on one thread and stepped on another ran its forward 1.4x
    slower (SmolLM2-135M float32, 2 torch threads, batch 1: 55 against 39 ms a step;
    bench/serving.py's breakdown showed it as the verifier's whole loss against the
    engine in process): each thread that enters a parallel region gets OpenMP teams
    of its own, and the loading thread's stay behind to compete with the stepping
    thread's. So the verifier builds its engine here and the worker loop runs here
    too."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="engine")

    def call(self, fn: Callable[[], T]) -> T:
        """Run fn on the engine thread and return its result (blocks the caller)."""
        return self._pool.submit(fn).result()

    def submit(self, fn: Callable[[], None]) -> Future:
        return self._pool.submit(fn)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    num_running: int
    num_waiting: int
    num_free_kv_blocks: int
    step_time_ema_ms: float
    prefix_cache: PrefixCacheStats  # a copy of the scheduler's cumulative counts
    times: StepTimes  # the engine's, as of this snapshot
    deliver_ms: float  # cumulative: handing step outputs to the requests' sinks


class EngineWorker:
    def __init__(self, engine: Engine, thread: EngineThread | None = None):
        """thread: the EngineThread the engine was built on (its loop runs there);
        None: a thread of its own."""
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stopped = threading.Event()
        self._engine_thread = thread
        self._thread = (threading.Thread(target=self._run, name="engine", daemon=True)
                        if thread is None else None)
        self._loop: Future | None = None
        self._deliver_ms = 0.0
        self.load = self._snapshot()

    def start(self) -> EngineWorker:
        if self._thread is not None:
            self._thread.start()
        else:
            self._loop = self._engine_thread.submit(self._run)
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout=30)
        elif self._loop is not None:
            self._loop.exception(timeout=30)
            self._engine_thread.shutdown()

    # -- commands (any thread) ---------------------------------------------------

    def add(self, request: Request, sink: Sink) -> None:
        def add() -> None:
            try:
                self.engine.add_request(request)
            except ValueError as e:  # validated before, but the engine has the last word
                sink(e)
                return
            self._sinks[request.request_id] = sink
        self._commands.put(add)

    def cancel(self, request_id: str) -> None:
        def cancel() -> None:
            out = self.engine.cancel(request_id)
            sink = self._sinks.pop(request_id, None)
            self.load = self._snapshot()  # before the sink: the client sees itself gone
            if out is not None and sink is not None:
                sink(out)
        self._commands.put(cancel)

    def set_num_speculative_tokens(self, request_id: str, k: int) -> None:
        def update() -> None:
            if request_id in self._sinks:
                self.engine.set_num_speculative_tokens(request_id, k)
        self._commands.put(update)

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread between steps."""
        self._commands.put(fn)

    # -- engine thread -----------------------------------------------------------

    def _run(self) -> None:
        while not self._stopped.is_set():
            # Block for commands only while idle; otherwise take what is queued.
            block = not self.engine.has_work()
            while True:
                try:
                    cmd = self._commands.get(block=block)
                except queue.Empty:
                    break
                if cmd is None:
                    return
                cmd()
                block = False
            if not self.engine.has_work():
                if self.engine.proposer is not None:
                    self.engine.proposer.flush()
                self.load = self._snapshot()
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - one bad step must not end the service
                log.exception("engine step failed; aborting the requests in flight")
                for request_id, sink in list(self._sinks.items()):
                    self.engine.cancel(request_id)
                    sink(e)
                self._sinks.clear()
                outputs = []
            t0 = time.perf_counter()
            self.load = self._snapshot()  # before the outputs: a finished client sees itself gone
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if out.finish_reason is not None:
                    self._sinks.pop(out.request_id, None)
                if sink is not None:
                    sink(out)
            self._deliver_ms += (time.perf_counter() - t0) * 1e3

    def _snapshot(self) -> LoadSnapshot:
        prefix = self.engine.scheduler.prefix_cache_stats
        return LoadSnapshot(self.engine.num_running, self.engine.num_waiting,
                            self.engine.cache.num_free_blocks, self.engine.step_time_ema_ms,
                            PrefixCacheStats(prefix.queries, prefix.hits),
                            dataclasses.replace(self.engine.times), self._deliver_ms)
