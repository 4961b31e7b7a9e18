"""One admitted request's stream: from one verifier replica or, after a failure,
resumed on another from the tokens already produced. A request the verifier
failed on its own (INTERNAL with specdec.server.REQUEST_FAILED) is not resumed:
it would fail on any replica; the client gets a 500.

Verifier tokens become text deltas (incremental detokenization, stop strings);
metrics are recorded per step and per request. The request's speculation policy
travels once, in the stream's Start; each step's K within it is the verifier's. Closing the iterator early (a client that went away) cancels the
verifier stream, which frees the sequence in the verifier and its drafter.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry import propagate, trace

from gateway.metrics import GatewayMetrics
from gateway.policy.shedding import ServiceTimes
from gateway.replicas import NoReplicaError, Replica, ReplicaPool
from gateway.types import (
    Delta,
    GatewayError,
    GenerationRequest,
    InvalidRequest,
    Overloaded,
    RequestTimeout,
    SpecDecodeSummary,
    Unavailable,
)
from specdec.detokenizer import IncrementalDetokenizer
from specdec.pb import common_pb2, verifier_pb2
from specdec.server import ADMITTED, is_request_failed
from specdec.speculation import SpeculationPolicy, reason_name, reason_to_proto
from specdec.stop import StopStringMatcher
from specdec.tokenizer import Tokenizer

tracer = trace.get_tracer("specdec.gateway")
log = logging.getLogger(__name__)
# One line per request when it ends (`--log-format json` makes it a JSON object).
request_log = logging.getLogger("gateway.requests")


@dataclass
class _Progress:
    """A request's state across verifier replicas."""

    prompt: list[int]
    max_tokens: int
    generated: list[int] = field(default_factory=list)
    # SpecDecodeStats of streams on replicas that failed, added to the current one's.
    done_drafts: int = 0
    done_draft_tokens: int = 0
    done_accepted: int = 0


# Tries beyond one per replica that a request may make when every replica failed it.
MAX_EXTRA_RESUMES = 2


class Generation:
    """One admitted request: its deltas, streamed from one replica or, after a failure,
    resumed on another."""

    def __init__(self, req: GenerationRequest, request_id: str, policy: SpeculationPolicy,
                 max_tokens: int, t0: float, replica: Replica, replicas: ReplicaPool,
                 tokenizer: Tokenizer, metrics: GatewayMetrics, *,
                 deadline: float | None = None, release: Callable[[], None] | None = None,
                 service_times: ServiceTimes | None = None, resume_wait_s: float = 0.0):
        """deadline: time.perf_counter() by which the last token must be in (None: no
        limit); release: called once when the generation is over, read or not;
        service_times: fed how long the request held its replica's slot; resume_wait_s:
        how long a request whose replicas all failed waits for one to serve again."""
        self.deadline = deadline
        self.resume_wait_s = resume_wait_s
        self._opened: tuple[Replica, grpc.aio.StreamStreamCall] | None = None  # by start()
        self._release = release
        self.service_times = service_times
        self.replicas = replicas
        self.metrics = metrics
        self.replica = replica
        self.opened_at = 0.0  # time.monotonic() its current stream opened
        self.req = req
        self.request_id = request_id
        self.policy = policy
        self.progress = _Progress(list(req.prompt_token_ids), max_tokens)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids=req.prompt_token_ids)
        self.stop = StopStringMatcher(req.stop)
        self.t0 = t0
        self.t_first: float | None = None
        self.t_last: float | None = None
        # The current stream's cumulative SpecDecodeStats (streams restart counting).
        self.spec = common_pb2.SpecDecodeStats()
        self.enabled = policy.enabled and policy.num_speculative_tokens > 0
        self.summary = SpecDecodeSummary(method=policy.method,
                                         disabled_reason=policy.disabled_reason)

    def _start(self, replica: Replica) -> verifier_pb2.GenerateRequest:
        p, d = self.progress, self.policy
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.req.sampling)
        sampling.max_tokens = p.max_tokens - len(p.generated)
        # With auto_k K is a bound: the verifier chooses each step's K within it.
        speculation = d.to_proto()
        reason = reason_to_proto(d.disabled_reason)
        if d.method != "none" and d.method not in replica.drafter_methods():
            # Known method without a drafter on this replica: run plainly, say why.
            speculation.method = common_pb2.SPEC_METHOD_NONE
            speculation.drafter = ""
            self.summary.disabled_reason = "drafter_unavailable"
        self.enabled = reason == common_pb2.DISABLED_REASON_NONE and d.num_speculative_tokens > 0
        return verifier_pb2.GenerateRequest(start=verifier_pb2.GenerateRequest.Start(
            request_id=self.request_id, prompt_token_ids=p.prompt + p.generated,
            sampling=sampling, speculation=speculation, disabled_reason=reason,
            cache_salt=self.req.cache_salt, priority=self.req.priority))

    async def deltas(self) -> AsyncIterator[Delta]:
        metrics = self.metrics
        with tracer.start_as_current_span("gateway.generate") as span:
            span.set_attribute("specdec.request_id", self.request_id)
            span.set_attribute("specdec.method", self.policy.method)
            span.set_attribute("specdec.num_speculative_tokens",
                               self.policy.num_speculative_tokens)
            metrics.running.inc()
            status = "cancelled"  # the client went away before the end
            try:
                async for delta in self._stream(self.replica):
                    if delta.finish:
                        status = "ok"
                    yield delta
            except GatewayError as e:
                status = f"error: {type(e).__name__}"
                metrics.request_errors.labels(type(e).__name__).inc()
                span.set_status(trace.Status(trace.StatusCode.ERROR, e.message))
                raise
            finally:
                metrics.running.dec()
                self.close()
                if status == "ok" and self.service_times is not None \
                        and self.t_first is not None and self.t_last is not None:
                    self.service_times.observe(self.replica.address, self.t_last - self.t_first)
                fields = self.log_fields(status)
                request_log.info("request %s", json.dumps(fields), extra={"fields": fields})

    def close(self) -> None:
        """The request is over (or will never be read): its admission slot is free, and
        a stream start() opened that was never read is cancelled."""
        if self._opened is not None:
            replica, call = self._opened
            self._opened = None
            replica.stream_ended(self.opened_at)
            call.cancel()
        release, self._release = self._release, None
        if release is not None:
            release()

    def log_fields(self, status: str) -> dict:
        s, now = self.summary, time.perf_counter()
        return {
            "id": self.request_id, "status": status, "method": self.policy.method,
            "num_speculative_tokens": self.policy.num_speculative_tokens,
            "auto_k": self.policy.auto_k, "disabled_reason": s.disabled_reason,
            "prompt_tokens": len(self.req.prompt_token_ids),
            "completion_tokens": len(self.progress.generated),
            "acceptance_length": round(s.acceptance_length, 3) if s.num_drafts else None,
            "ttft_ms": (round(1e3 * (self.t_first - self.t0), 1)
                        if self.t_first is not None else None),
            "e2e_ms": round(1e3 * (now - self.t0), 1), "verifier": self.replica.address,
        }

    async def _stream(self, replica: Replica) -> AsyncIterator[Delta]:
        failed: list[Replica] = []
        while True:
            resumable = False
            try:
                async for delta in self._stream_on(replica):
                    yield delta
                return
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequest(e.details() or "invalid request") from None
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise RequestTimeout(self._timeout_message()) from None
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # The verifier's queue is full: the gateway's own estimate lagged.
                    raise Overloaded(f"verifier {replica.address}: {e.details()}",
                                     retry_after_s=1) from None
                if is_request_failed(e):
                    # It failed alone in the verifier: it would fail on any replica.
                    raise GatewayError(f"verifier {replica.address}: {e.details()}") from None
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                                grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED,
                                grpc.StatusCode.ABORTED):
                    raise GatewayError(f"verifier {replica.address}: {code.name}: "
                                       f"{e.details()}") from None
                error = f"verifier {replica.address} failed: {code.name}: {e.details()}"
                resumable = True
            except _ReplicaAborted as e:
                error = f"verifier {replica.address} aborted the request: {e}"
                resumable = True
            if resumable:
                self._rebase(self.spec)
                self.spec = common_pb2.SpecDecodeStats()
                failed.append(replica)
                replica.healthy = False
                replica.error = error
                try:
                    replica = await self.replicas.choose(exclude=failed)
                except NoReplicaError:
                    replica = await self._wait_for_replica(error, len(failed))
                if self.progress.generated:
                    self.metrics.resumed.inc()

    async def start(self) -> None:
        """Open the stream on the chosen replica and wait until the verifier has taken the
        request (its ADMITTED initial metadata), so that a refusal (its queue full, a bad
        request) is this request's error before the caller's response begins: a
        streamed reply's 200 and headers. A replica that fails here is left to the
        resume path, as a failure mid-stream is."""
        if self._opened is not None:
            return
        call = await self._open(self.replica)
        md = await call.initial_metadata()
        if ADMITTED in [tuple(item) for item in md or ()] or not call.done():
            self._opened = (self.replica, call)
            return
        code, details = await call.code(), await call.details()
        self.replica.inflight -= 1
        call.cancel()
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidRequest(details or "invalid request")
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise Overloaded(f"verifier {self.replica.address}: {details}", retry_after_s=1)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise RequestTimeout(self._timeout_message())

    async def _open(self, replica: Replica) -> grpc.aio.StreamStreamCall:
        """A Generate stream on `replica` with the request's Start written."""
        metadata: dict[str, str] = {}
        propagate.inject(metadata)
        timeout = None
        if self.deadline is not None:
            # The RPC carries the request's deadline: the verifier drops the sequence
            # when it passes, whatever this process is doing.
            timeout = self.deadline - time.perf_counter()
            if timeout <= 0:
                raise RequestTimeout(self._timeout_message())
        call = replica.stub.Generate(metadata=(*metadata.items(), *replica.auth),
                                     timeout=timeout)
        self.opened_at = replica.stream_opened()
        try:
            await call.write(self._start(replica))
        except BaseException:
            replica.inflight -= 1
            call.cancel()
            raise
        return call

    async def _stream_on(self, replica: Replica) -> AsyncIterator[Delta]:
        if self._opened is not None and self._opened[0] is replica:
            call = self._opened[1]  # start() opened it
            self._opened = None
        else:
            call = await self._open(replica)
        try:
            while True:
                resp = await call.read()
                if resp == grpc.aio.EOF:
                    # The stream ended without a final message: the replica went away.
                    raise _ReplicaAborted("stream ended without a finish reason")
                if resp.finish_reason == common_pb2.FINISH_REASON_ABORTED:
                    raise _ReplicaAborted("the verifier is shutting down")
                delta = self._on_response(resp)
                if self.stop.matched is not None and not delta.finish:
                    # A stop string ended the text: stop the verifier too.
                    await call.write(verifier_pb2.GenerateRequest(
                        cancel=verifier_pb2.GenerateRequest.Cancel()))
                    self._finish(delta, common_pb2.FINISH_REASON_STOP_STRING, resp)
                if delta.finish:
                    yield delta
                    return
                if delta.text or delta.token_ids:
                    yield delta
        finally:
            replica.stream_ended(self.opened_at)
            # Frees the sequence in the verifier if the stream is still open (client gone,
            # stop string, error); a no-op on a stream that already ended.
            call.cancel()

    def _on_response(self, resp: verifier_pb2.GenerateResponse) -> Delta:
        now = time.perf_counter()
        metrics = self.metrics
        ids = list(resp.token_ids)
        if ids:
            if self.t_last is None:
                self.t_first = now
                metrics.ttft.observe(now - self.t0)
                # The step that gave the first token began its step time before this
                # response: the prefill; the rest of the wait was queueing.
                prefill = min(now - self.t0, resp.step_stats.step_time_ms / 1e3)
                metrics.prefill_time.observe(prefill)
                metrics.queue_time.observe(now - self.t0 - prefill)
            else:
                for _ in ids:
                    metrics.itl.observe((now - self.t_last) / len(ids))
            self.t_last = now
        self.progress.generated.extend(ids)
        self.spec = resp.spec_decode
        step = resp.step_stats
        if ids and self.policy.method != "none":
            metrics.k_chosen.labels(self.summary.method).observe(step.num_speculative_tokens)
        if step.disabled_reason and self.policy.method != "none":
            metrics.plain_steps.labels(reason_name(step.disabled_reason)).inc()
        if step.num_drafted:
            method = self.summary.method
            metrics.num_drafts.labels(method).inc()
            metrics.num_draft_tokens.labels(method).inc(step.num_drafted)
            metrics.num_accepted_tokens.labels(method).inc(step.num_accepted)
            for pos in range(1, step.num_accepted + 1):
                metrics.accepted_per_pos.labels(method, str(pos)).inc()
        text = self.stop.feed(self.detok.add(ids)) if ids else ""
        delta = Delta(text=text, token_ids=ids, logprobs=list(resp.logprobs))
        if resp.finish_reason:
            self._finish(delta, resp.finish_reason, resp)
        return delta

    def _finish(self, delta: Delta, finish: int, resp: verifier_pb2.GenerateResponse) -> None:
        if finish != common_pb2.FINISH_REASON_STOP_STRING:
            delta.text += self.stop.feed(self.detok.flush())
            delta.text += self.stop.flush()
            if self.stop.matched is not None:
                finish = common_pb2.FINISH_REASON_STOP_STRING
        delta.finish = finish
        p = self.progress
        spec = resp.spec_decode
        s = self.summary
        s.num_drafts = p.done_drafts + spec.num_drafts
        s.num_draft_tokens = p.done_draft_tokens + spec.num_draft_tokens
        s.num_accepted_tokens = p.done_accepted + spec.num_accepted_tokens
        if spec.method == common_pb2.SPEC_METHOD_NONE and s.num_drafts == 0 \
                and s.disabled_reason is None and self.policy.method != "none":
            s.disabled_reason = reason_name(spec.disabled_reason) or "drafter_unavailable"
        elif spec.disabled_reason and s.disabled_reason is None \
                and (not self.enabled or not s.num_drafts):
            s.disabled_reason = reason_name(spec.disabled_reason)
        delta.usage = common_pb2.Usage(prompt_tokens=len(self.req.prompt_token_ids),
                                       completion_tokens=len(p.generated))
        delta.spec_decode = s
        m = self.metrics
        elapsed = time.perf_counter() - self.t0
        m.e2e.observe(elapsed)
        n = len(p.generated)
        if n > 1 and self.t_first is not None and self.t_last is not None:
            m.tpot.observe((self.t_last - self.t_first) / (n - 1))
        if self.t_first is not None and self.t_last is not None:
            m.decode_time.observe(self.t_last - self.t_first)
        m.request_prompt_tokens.observe(len(self.req.prompt_token_ids))
        m.request_generation_tokens.observe(n)
        m.prompt_tokens.inc(len(self.req.prompt_token_ids))
        m.generation_tokens.inc(n)
        if s.num_drafts:
            m.acceptance_length.labels(s.method).observe(s.acceptance_length)
        if s.disabled_reason is not None:
            m.disabled.labels(s.disabled_reason).inc()
        m.requests.labels(s.method, delta.finish_reason or "abort").inc()

    async def _wait_for_replica(self, error: str, failures: int) -> Replica:
        """Every replica failed this request: hold it until one serves again (the only
        verifier restarting, say), within resume_wait_s and the request's deadline. A
        replica that failed it may take it again once healthy, but a request that keeps
        failing gives up after a few tries rather than loop."""
        wait = self.resume_wait_s
        if self.deadline is not None:
            wait = min(wait, self.deadline - time.perf_counter())
        if wait <= 0 or failures > len(self.replicas.replicas) + MAX_EXTRA_RESUMES:
            raise Unavailable(f"{error}; no other verifier replica to resume on")
        return await self.replicas.hold(error, wait, self.metrics.held)

    def _timeout_message(self) -> str:
        limit = (self.deadline or self.t0) - self.t0
        return (f"the request timed out after {limit:.0f} s with "
                f"{len(self.progress.generated)} tokens generated")

    def _rebase(self, spec: common_pb2.SpecDecodeStats) -> None:
        p = self.progress
        p.done_drafts += spec.num_drafts
        p.done_draft_tokens += spec.num_draft_tokens
        p.done_accepted += spec.num_accepted_tokens


class _ReplicaAborted(Exception):
    pass
