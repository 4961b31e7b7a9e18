"""Watches an engine from a thread of its own and trips, once, when it can step no
more: it failed for good (`fatal`: our EngineWorker's broken engine or dead loop,
vLLM's dead engine core) or one step has run longer than `step_timeout_s` (a hung
device, a deadlock). The service then goes NOT_SERVING, ends the requests in
flight with UNAVAILABLE (the gateway resumes them on another replica) and exits
non-zero for its supervisor to start it afresh (verifier/service.py).

A stuck step cannot be interrupted from outside, so the thread that watches it
must not be the one that runs it, nor the event loop (a step stuck in Python code
holding the GIL would still let this thread run between its bytecodes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class Watched(Protocol):
    """What the watchdog reads of an engine: verifier.worker.EngineWorker, or vLLM's
    (verifier/vllm/serve.py)."""

    @property
    def fatal(self) -> BaseException | None:
        """Why the engine failed for good; None while it has not."""

    @property
    def step_started(self) -> float | None:
        """time.monotonic() the running step started at; None between steps."""


class Watchdog:
    def __init__(self, engine: Watched, step_timeout_s: float,
                 on_trip: Callable[[str], None], poll_s: float = 0.1):
        """step_timeout_s: longest a step may run (0: no limit; the first steps on a
        GPU compile kernels and capture graphs, so leave room); on_trip(reason) is
        called once, on the watchdog's thread."""
        if step_timeout_s < 0:
            raise ValueError(f"step_timeout_s must be >= 0, got {step_timeout_s}")
        self.engine = engine
        self.step_timeout_s = step_timeout_s
        self.on_trip = on_trip
        self.poll_s = poll_s
        self.reason: str | None = None  # why it tripped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def check(self) -> str | None:
        """Why the engine can step no more, or None while it can."""
        fatal = self.engine.fatal
        if fatal is not None:
            return f"engine failed: {type(fatal).__name__}: {fatal}"
        started = self.engine.step_started
        if (self.step_timeout_s and started is not None
                and time.monotonic() - started > self.step_timeout_s):
            return f"a step has run for more than {self.step_timeout_s:g} s"
        return None

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            reason = self.check()
            if reason is not None:
                self.reason = reason
                log.critical("watchdog: %s", reason)
                self.on_trip(reason)
                return
