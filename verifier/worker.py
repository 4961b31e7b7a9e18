"""Runs the engine on its own thread and talks to asyncio through queues.

The engine is single-threaded by design. Commands (add, cancel, K updates)
queue up and run between steps, in order; every StepOutput goes to the
sink its request registered.

A step that raises is undone by the engine (StepFailed) and run again for
halves of its requests, each half that succeeds delivering its outputs as any
step does, until the requests that fail alone are found: those end with
RequestFailed, the others go on, in O(log n) extra steps for one bad request in
a batch of n. When `fatal_after` requests in a row fail alone, with no step
succeeding in between (every request of a batch fails alone, or one request
after another does), the engine itself is broken (a device error, say): the
worker stops stepping, sets `fatal` and ends every request in flight with
EngineFailed, for the watchdog (verifier/watchdog.py) to take the replica down.
So does anything else that escapes the loop.
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
from verifier.engine import Engine, NoTokenAllowed, Request, StepFailed, StepOutput, StepTimes

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


class RequestFailed(Exception):
    """The request's own processing raised (it failed alone, or while its step
    committed): it ends with this error and the others go on. Replaying it on another
    replica would fail there too."""


class EngineFailed(Exception):
    """The engine can step no more (broken, dead or stuck): every request in flight
    ends with this; another replica can resume them."""


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
    def __init__(self, engine: Engine, thread: EngineThread | None = None, *,
                 fatal_after: int = 2):
        """thread: the EngineThread the engine was built on (its loop runs there);
        None: a thread of its own. fatal_after: requests failing alone in a row, no
        step succeeding in between, that mean the engine is broken (2: a batch whose
        every request fails alone, or two requests one after the other; a lone bad
        request fails alone and the next one succeeds)."""
        if fatal_after < 1:
            raise ValueError(f"fatal_after must be >= 1, got {fatal_after}")
        self.engine = engine
        self.fatal_after = fatal_after
        self.fatal: BaseException | None = None  # why the engine can step no more
        self.step_started: float | None = None  # time.monotonic() of the step running now
        self._failed_alone = 0  # requests failed alone since a step last succeeded
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

    def set_num_speculative_tokens(self, request_id: str, k: int, auto_k: bool = False) -> None:
        def update() -> None:
            if request_id in self._sinks:
                self.engine.set_num_speculative_tokens(request_id, k, auto_k)
        self._commands.put(update)

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread between steps."""
        self._commands.put(fn)

    # -- engine thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            self._steps()
        except Exception as e:  # noqa: BLE001 - the engine is in an unknown state
            log.exception("the engine loop died")
            self.fatal = e
        if self.fatal is not None:
            error = EngineFailed(f"engine failed: {type(self.fatal).__name__}: {self.fatal}")
            sinks, self._sinks = self._sinks, {}
            for sink in sinks.values():
                sink(error)

    def _steps(self) -> None:
        while not self._stopped.is_set() and self.fatal is None:
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
                self._deliver(self._step())
            except StepFailed as failed:
                self._isolate(failed)

    def _step(self, only: set[str] | None = None) -> list[StepOutput]:
        """engine.step, watched: step_started is set while it runs."""
        steps = self.engine.num_steps
        self.step_started = time.monotonic()
        try:
            outputs = self.engine.step(only)
        finally:
            self.step_started = None
        if self.engine.num_steps > steps:
            self._failed_alone = 0
        return outputs

    def _isolate(self, failed: StepFailed) -> None:
        """Step halves of a failed step's requests, and halves of the halves that fail,
        until the requests that fail alone are found; they end with RequestFailed."""
        log.error("a step of %d requests failed; finding those that fail alone",
                  len(failed.request_ids), exc_info=failed.__cause__)
        alone: dict[str, BaseException | None] = {}
        groups = [failed]
        while groups and self.fatal is None:
            group = groups.pop()
            ids = group.request_ids
            if len(ids) == 1:
                alone[ids[0]] = group.__cause__
                self._failed_alone += 1
                if self._failed_alone >= self.fatal_after:
                    self.fatal = group.__cause__ or group
                continue
            for half in (ids[: len(ids) // 2], ids[len(ids) // 2:]):
                try:
                    self._deliver(self._step(set(half)))
                except StepFailed as e:
                    groups.append(e)
        if self.fatal is not None:
            log.critical("%d requests in a row failed alone: the engine is broken",
                         self._failed_alone)
            return  # every request in flight ends with EngineFailed, these included
        for request_id, cause in alone.items():
            log.error("request %s fails alone (%r); ending it", request_id, cause)
            self.engine.cancel(request_id)
        self.load = self._snapshot()  # before the sinks: a failed client sees itself gone
        for request_id, cause in alone.items():
            sink = self._sinks.pop(request_id, None)
            if sink is not None:
                sink(RequestFailed(f"{type(cause).__name__}: {cause}"))

    def _deliver(self, outputs: list[StepOutput]) -> None:
        t0 = time.perf_counter()
        self.load = self._snapshot()  # before the outputs: a finished client sees itself gone
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if out.finish_reason is not None:
                self._sinks.pop(out.request_id, None)
            if sink is not None:
                if out.error is None or isinstance(out.error, NoTokenAllowed):
                    sink(out if out.error is None else out.error)  # the client's error
                else:
                    sink(RequestFailed(f"{type(out.error).__name__}: {out.error}"))
        self._deliver_ms += (time.perf_counter() - t0) * 1e3

    def _snapshot(self) -> LoadSnapshot:
        prefix = self.engine.scheduler.prefix_cache_stats
        return LoadSnapshot(self.engine.num_running, self.engine.num_waiting,
                            self.engine.cache.num_free_blocks, self.engine.step_time_ema_ms,
                            PrefixCacheStats(prefix.queries, prefix.hits),
                            dataclasses.replace(self.engine.times), self._deliver_ms)
