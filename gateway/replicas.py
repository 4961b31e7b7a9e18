"""Verifier replicas as the gateway sees them: one channel each, their last
Load report, and a least-loaded choice among the healthy ones. A replica is
healthy while its Load answers and its gRPC health says SERVING: a verifier
whose engine failed, or that is shutting down, says NOT_SERVING while it still
answers Load.

A replica's load is the larger of what it last reported (running + waiting),
less the streams of this gateway that ended since that report was asked for, and
the streams this gateway has open on it: reports lag by a poll interval, and a
burst of requests arriving within one interval must not all pick the same
replica (nor all pass the auto-disable threshold); and one request following
another must not count the one that just ended (at one request in flight, every
dynamic-K request opened counting a batch of 2, a size plain decoding had never
been measured at, and so ran its first step plain).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.types import Unavailable
from specdec.pb import verifier_pb2, verifier_pb2_grpc
from specdec.server import GRPC_OPTIONS, token_metadata
from specdec.speculation import drafter_method
from specdec.tls import TlsConfig, open_aio_channel

log = logging.getLogger(__name__)

VERIFIER_SERVICE = "specdec.v1.Verifier"  # the name its health is reported under


class NoReplicaError(RuntimeError):
    """No verifier replica can take a request now."""


class Replica:
    def __init__(self, address: str, fingerprint: tuple[int, str] | None = None,
                 token: str | None = None, tls: TlsConfig | None = None):
        self.address = address
        self.auth = token_metadata(token)  # the verifiers' internal token, if they have one
        self.tls = tls
        # grpc.aio channels belong to the event loop that creates them: made in connect().
        self.channel: grpc.aio.Channel | None = None
        self.stub: verifier_pb2_grpc.VerifierStub | None = None
        self.health: health_pb2_grpc.HealthStub | None = None
        self.report: verifier_pb2.LoadReport | None = None
        self.healthy = False
        self.error = "not polled yet"
        self.inflight = 0  # Generate streams this gateway has open on it
        self._fingerprint = fingerprint
        # time.monotonic() of each of this gateway's streams on it that the latest report
        # counts (opened before it was asked for) and that ended since it was asked for.
        self._ended: collections.deque[float] = collections.deque()
        self._report_asked = 0.0  # time.monotonic() the latest report was asked for

    @property
    def _reported(self) -> int:
        """The latest report's sequences, less this gateway's that have ended since."""
        reported = self.report.num_running + self.report.num_waiting if self.report else 0
        return reported - len(self._ended)

    @property
    def load(self) -> int:
        """Sequences on the replica now, as far as this gateway can tell."""
        return max(self._reported, self.inflight)

    def stream_opened(self) -> float:
        """One more of this gateway's streams is open on it; returns its time.monotonic(),
        for stream_ended."""
        self.inflight += 1
        return time.monotonic()

    def stream_ended(self, opened: float) -> None:
        """One of this gateway's streams on it, opened at time.monotonic() `opened`, is
        over (it counted in `inflight`)."""
        self.inflight -= 1
        if opened < self._report_asked:
            self._ended.append(time.monotonic())

    def drafter_methods(self) -> frozenset[str]:
        """Methods some drafter of this replica serves (available or not right now)."""
        if self.report is None:
            return frozenset()
        return frozenset(m for d in self.report.drafters
                         if (m := drafter_method(d.name, d.method)) is not None)

    def connect(self) -> None:
        if self.channel is None:
            self.channel = open_aio_channel(self.address, self.tls, GRPC_OPTIONS)
            self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
            self.health = health_pb2_grpc.HealthStub(self.channel)

    async def refresh(self, timeout_s: float = 2.0) -> None:
        self.connect()
        asked = time.monotonic()
        try:
            health, report = await asyncio.gather(
                self.health.Check(health_pb2.HealthCheckRequest(service=VERIFIER_SERVICE),
                                  timeout=timeout_s),
                self.stub.Load(verifier_pb2.LoadRequest(), timeout=timeout_s,
                               metadata=self.auth))
        except grpc.RpcError as e:
            self._mark(False, f"Load or health check failed: "
                              f"{e.code().name} {e.details()}")  # type: ignore[attr-defined]
            return
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            self._mark(False, "health: " + health_pb2.HealthCheckResponse.ServingStatus.Name(
                health.status))
            return
        if self._fingerprint is not None:
            vocab, digest = self._fingerprint
            theirs = report.tokenizer
            # An empty hash means that side could not fingerprint (padded vocabulary).
            if theirs.vocab_size != vocab or (theirs.hash and digest and theirs.hash != digest):
                self._mark(False, f"tokenizer mismatch: verifier has vocab {theirs.vocab_size} "
                                  f"hash {theirs.hash[:12]}, gateway vocab {vocab} hash {digest[:12]}")
                return
        self.took_report(report, asked)
        self._mark(True, "")

    def took_report(self, report: verifier_pb2.LoadReport, asked: float) -> None:
        """The replica's Load report, asked for at time.monotonic() `asked`."""
        self.report, self._report_asked = report, asked
        while self._ended and self._ended[0] < asked:  # counted out of this report
            self._ended.popleft()

    def _mark(self, healthy: bool, error: str) -> None:
        if healthy != self.healthy or error != self.error:
            if healthy:
                log.info("verifier %s is up", self.address)
            else:
                log.warning("verifier %s unusable: %s", self.address, error)
        self.healthy, self.error = healthy, error

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


class ReplicaPool:
    """All configured verifier replicas, polled for load in the background."""

    def __init__(self, addresses: Iterable[str], fingerprint: tuple[int, str] | None = None,
                 token: str | None = None, tls: TlsConfig | None = None,
                 poll_interval_s: float = 0.5):
        self.replicas = [Replica(a, fingerprint, token, tls) for a in addresses]
        if not self.replicas:
            raise ValueError("at least one verifier address is needed")
        self.poll_interval_s = poll_interval_s
        self._task: asyncio.Task | None = None
        self._tie = itertools.count()

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._poll())

    async def refresh(self) -> None:
        await asyncio.gather(*(r.refresh() for r in self.replicas))

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            await self.refresh()

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas if r.healthy]

    async def choose(self, exclude: Iterable[Replica] = ()) -> Replica:
        """The least loaded healthy replica not in `exclude` (round robin among equals)."""
        excluded = set(map(id, exclude))
        candidates = [r for r in self.healthy() if id(r) not in excluded]
        if not candidates:
            # The background poll may be a step behind a replica that just came back.
            await asyncio.gather(*(r.refresh() for r in self.replicas if id(r) not in excluded))
            candidates = [r for r in self.healthy() if id(r) not in excluded]
        if not candidates:
            reasons = "; ".join(f"{r.address}: {r.error}" for r in self.replicas
                                if id(r) not in excluded) or "all tried"
            raise NoReplicaError(f"no verifier available ({reasons})")
        start = next(self._tie) % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda r: r.load)

    async def wait_for_any(self, timeout_s: float) -> Replica:
        """A healthy replica, waiting up to timeout_s for one to come (back) up: a
        restarted verifier serves again at its address once its health check passes.
        NoReplicaError when none did."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await self.choose()
            except NoReplicaError:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                await asyncio.sleep(min(self.poll_interval_s, left))

    async def hold(self, error: str, wait_s: float, held) -> Replica:
        """A request no replica can take now (the only verifier restarting, say) held
        until one serves, up to wait_s, and counted in `held`: Unavailable naming
        `error` when none came."""
        if wait_s <= 0:
            raise Unavailable(error)
        held.inc()
        try:
            return await self.wait_for_any(wait_s)
        except NoReplicaError:
            raise Unavailable(f"{error}; no verifier replica came back within "
                              f"{wait_s:.0f} s") from None

    def reference(self) -> verifier_pb2.LoadReport | None:
        """A healthy replica's report, for limits shared by the deployment (max model len)."""
        for r in self.healthy():
            if r.report is not None:
                return r.report
        return None

    def drafter_methods(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for r in self.healthy():
            out |= r.drafter_methods()
        return out

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(r.close() for r in self.replicas))
