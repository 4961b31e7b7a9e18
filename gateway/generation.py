"""One admitted request's stream: from one verifier replica or, after a failure,
resumed on another from the tokens already produced. A request the verifier
failed on its own (INTERNAL with specdec.server.REQUEST_FAILED) is not resumed:
it would fail on any replica; the client gets a 500.

Verifier tokens become text deltas (incremental detokenization, stop strings);
dynamic K sends PolicyUpdates mid-request; metrics are recorded per step and per
request. Closing the iterator early (a client that went away) cancels the
verifier stream, which frees the sequence in the verifier and its drafter.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
from opentelemetry import propagate, trace

from gateway.metrics import GatewayMetrics
from gateway.policy.admission import Decision
from gateway.policy.batch_k import BatchKs
from gateway.policy.dynamic_k import OUTCOME_TABLE_METHODS, DynamicK
from gateway.policy.online_profile import OnlineProfile, StepSample
from gateway.policy.outcome_table import TABLE_REFRESH_STEPS, Table, choose_table
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
from specdec.speculation import (
    DraftOutcome,
    k_by_outcome_to_proto,
    method_to_proto,
    reason_name,
    reason_to_proto,
)
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

    def __init__(self, req: GenerationRequest, request_id: str, decision: Decision,
                 dynamic: DynamicK | None, max_tokens: int, t0: float, replica: Replica,
                 replicas: ReplicaPool, tokenizer: Tokenizer, metrics: GatewayMetrics,
                 online_profile: OnlineProfile | None = None, *, deadline: float | None = None,
                 release: Callable[[], None] | None = None,
                 service_times: ServiceTimes | None = None, resume_wait_s: float = 0.0,
                 batches: BatchKs | None = None, admitted: dict[str, int] | None = None):
        """deadline: time.perf_counter() by which the last token must be in (None: no
        limit); release: called once when the generation is over, read or not;
        service_times: fed how long the request held its replica's slot; resume_wait_s:
        how long a request whose replicas all failed waits for one to serve again;
        batches: each replica's dynamic-K requests, which choose their K together;
        admitted: requests admitted and not finished, per replica address (this one
        included), which a burst's streams see before the replica does."""
        self.deadline = deadline
        self.resume_wait_s = resume_wait_s
        self._opened: tuple[Replica, grpc.aio.StreamStreamCall] | None = None  # by start()
        self._release = release
        self.service_times = service_times
        self.replicas = replicas
        self.metrics = metrics
        self.replica = replica
        self.online_profile = online_profile  # fed every response's step statistics
        self.first_on_stream = True  # the next response is the stream's first (its prefill)
        self.opened_at = 0.0  # time.monotonic() its current stream opened
        # Context positions this stream's drafter has seen: up to the start of the latest
        # step that asked it for drafts (the verifier sends it the rest with its next
        # request for drafts).
        self.drafter_seen = 0
        self.prefilled = False  # the latest response was a stream's first
        self.req = req
        self.request_id = request_id
        self.decision = decision
        self.progress = _Progress(list(req.prompt_token_ids), max_tokens)
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids=req.prompt_token_ids)
        self.stop = StopStringMatcher(req.stop)
        self.t0 = t0
        self.t_first: float | None = None
        self.t_last: float | None = None
        # The current stream's cumulative SpecDecodeStats (streams restart counting).
        self.spec = common_pb2.SpecDecodeStats()
        self.dynamic = dynamic  # None: K stays decision.num_speculative_tokens
        self.batches = batches
        self.admitted = admitted
        # With dynamic K, the K of the steps before it has a profile to choose by.
        self.num_speculative_tokens = (decision.num_speculative_tokens
                                       if decision.first_k is None else decision.first_k)
        self.enabled = decision.disabled_reason is None and decision.num_speculative_tokens > 0
        self.tables = False  # K by outcome on the current stream (set as it opens)
        self.outcome_table: tuple[int, int, int, int] | None = None  # the one it has
        # The outcome (DraftOutcome) of the stream's latest drafting step, as the
        # verifier keeps it for K by outcome.
        self.after: int | None = None
        self.summary = SpecDecodeSummary(method=decision.method,
                                         disabled_reason=decision.disabled_reason)

    def _start(self, replica: Replica) -> verifier_pb2.GenerateRequest:
        p, d = self.progress, self.decision
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.req.sampling)
        sampling.max_tokens = p.max_tokens - len(p.generated)
        speculation = common_pb2.SpeculationPolicy(method=method_to_proto(d.method),
                                                   drafter=self.req.speculative.drafter or "")
        reason = common_pb2.DISABLED_REASON_NONE
        # The verifier chooses each step's K within the request's bound itself.
        delegated = (d.auto_k and self.dynamic is None and replica.report is not None
                     and replica.report.speculation_controller)
        if d.method != "none":
            if delegated:
                self.num_speculative_tokens = d.num_speculative_tokens
            if self.dynamic is not None:
                # The batch it joins: a burst's requests are all admitted before their
                # streams open one by one, and the first to open, choosing K for an idle
                # replica, drafted deep at its prefill (at 16 requests, a first drafting
                # step of 100 ms while the drafter took in every prompt).
                batch = replica.joining()
                if self.admitted is not None:
                    batch = max(batch, self.admitted.get(replica.address, 0))
                k = self.dynamic.next_k(batch)
                if k and replica.unanswered - {id(self)}:
                    # Streams opened before it have had no response yet: a burst, whose
                    # requests open one by one, each counting those admitted so far, and
                    # prefill together. Plain first; from its first response on, K is
                    # chosen with the batch known (BatchK). Opened with K for the few
                    # admitted, a burst of 16 had 7 first drafting steps at once, the
                    # drafter taking in 7 prompts (70-110 ms) while the batch waited.
                    k = 0
                if k and self.dynamic.batch is not None \
                        and self.dynamic.batch.runs_plain(self.dynamic):
                    # The batch it joins runs plain: so does it, until the batch chooses
                    # with it. Opened with its own K, each new eagle3 stream of a batch of
                    # 4 running plain drafted one step alone, its head taking in its
                    # prompt (20-36 ms of draft wait), and went plain at the next.
                    k = 0
                if k is not None:  # None: no profile yet, the decision's K until there is
                    self.num_speculative_tokens = k
            speculation.num_speculative_tokens = self.num_speculative_tokens
            if d.disabled_reason is not None:
                reason = reason_to_proto(d.disabled_reason)
            elif self.num_speculative_tokens == 0:  # dynamic K chose plain decoding first
                reason = common_pb2.DISABLED_REASON_DYNAMIC_K
                speculation.num_speculative_tokens = d.num_speculative_tokens
            speculation.auto_k = self.dynamic is not None or delegated
        if d.method != "none" and d.method not in replica.drafter_methods():
            # Known method without a drafter on this replica: run plainly, say why.
            speculation.method = common_pb2.SPEC_METHOD_NONE
            speculation.drafter = ""
            self.summary.disabled_reason = "drafter_unavailable"
        self.enabled = reason == common_pb2.DISABLED_REASON_NONE and self.num_speculative_tokens > 0
        return verifier_pb2.GenerateRequest(start=verifier_pb2.GenerateRequest.Start(
            request_id=self.request_id, prompt_token_ids=p.prompt + p.generated,
            sampling=sampling, speculation=speculation, disabled_reason=reason))

    async def deltas(self) -> AsyncIterator[Delta]:
        metrics = self.metrics
        with tracer.start_as_current_span("gateway.generate") as span:
            span.set_attribute("specdec.request_id", self.request_id)
            span.set_attribute("specdec.method", self.decision.method)
            span.set_attribute("specdec.num_speculative_tokens",
                               self.decision.num_speculative_tokens)
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
            replica.unanswered.discard(id(self))
            call.cancel()
        if self.dynamic is not None:
            self.dynamic.leave()
        release, self._release = self._release, None
        if release is not None:
            release()

    def log_fields(self, status: str) -> dict:
        s, now = self.summary, time.perf_counter()
        return {
            "id": self.request_id, "status": status, "method": self.decision.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            "auto_k": self.dynamic is not None, "disabled_reason": s.disabled_reason,
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
            except _UpdateLost as e:
                # Not the replica's failure: go on there, from what has come out. If it
                # did fail, opening the new stream says so.
                log.info("request %s: a policy update found its stream ended (%s); "
                         "going on from %d tokens", self.request_id, e,
                         len(self.progress.generated))
                error = None
                resumable = True
            if resumable:
                self._rebase(self.spec)
                self.spec = common_pb2.SpecDecodeStats()
                if error is None:  # the same replica
                    self.metrics.resumed.inc()
                    continue
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
        self.replica.unanswered.discard(id(self))
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
        replica.unanswered.add(id(self))
        self.first_on_stream = True
        self.drafter_seen = 0
        # K by outcome: where dynamic K runs a method it suits, on a verifier that takes it
        # (a new stream starts without one).
        self.outcome_table = None
        self.after = None
        self.tables = (self.dynamic is not None and self.decision.method in OUTCOME_TABLE_METHODS
                       and replica.report is not None and replica.report.k_by_outcome_supported)
        if self.dynamic is not None and self.batches is not None:
            self.dynamic.join(self.batches.of(replica.address))
        try:
            await call.write(self._start(replica))
        except BaseException:
            replica.inflight -= 1
            replica.unanswered.discard(id(self))
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
                self._observe_step(replica, resp)
                delta = self._on_response(resp)
                if self.stop.matched is not None and not delta.finish:
                    # A stop string ended the text: stop the verifier too.
                    await call.write(verifier_pb2.GenerateRequest(
                        cancel=verifier_pb2.GenerateRequest.Cancel()))
                    self._finish(delta, common_pb2.FINISH_REASON_STOP_STRING, resp)
                if delta.finish:
                    yield delta
                    return
                update = self._next_policy(resp)
                broken = None
                if update is not None:
                    try:
                        await call.write(update)
                    except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
                        # The stream ended while this update was on its way, most often
                        # because the verifier has just finished the request and its last
                        # responses are still in flight: the write fails ("Internal error
                        # from Core") and every read then reports that failure. What this
                        # response brought still goes out; the request goes on where it
                        # is. (Raised before the yield, it took this response's text with
                        # it: a reply missing a token in the middle.)
                        broken = e
                if delta.text or delta.token_ids:
                    yield delta
                if broken is not None:
                    raise _UpdateLost(str(broken)) from broken
        finally:
            replica.stream_ended(self.opened_at)
            replica.unanswered.discard(id(self))
            # Frees the sequence in the verifier if the stream is still open (client gone,
            # stop string, error); a no-op on a stream that already ended.
            call.cancel()

    def _observe_step(self, replica: Replica, resp: verifier_pb2.GenerateResponse) -> None:
        """Hand the response's step statistics to the online step-time model."""
        step = resp.step_stats
        first, self.first_on_stream = self.first_on_stream, False
        self.prefilled = first
        replica.unanswered.discard(id(self))
        method = self.decision.method
        if resp.spec_decode.method == common_pb2.SPEC_METHOD_NONE:
            method = "none"  # the verifier runs it plainly (no drafter on this replica)
        # The context before this step's tokens; a step that asked for drafts had the
        # drafter take in all of it.
        p = self.progress
        context = len(p.prompt) + len(p.generated)
        backlog = 0
        if method != "none" and step.num_speculative_tokens:
            backlog, self.drafter_seen = context - self.drafter_seen, context
        if self.dynamic is not None:
            new = len(resp.token_ids)
            self.dynamic.backlog = context + new - self.drafter_seen
            self.dynamic.fresh = new
            self.dynamic.remaining = p.max_tokens - len(p.generated) - new
        if self.online_profile is None or not step.step:
            return  # no step behind this response (a cancel's or abort's answer)
        self.online_profile.observe(StepSample(
            replica=replica.address, step=step.step, batch_size=step.batch_size,
            num_tokens=step.num_tokens, step_time_ms=step.step_time_ms,
            draft_wait_ms=step.draft_wait_ms, method=method,
            num_speculative_tokens=step.num_speculative_tokens if method != "none" else 0,
            num_drafted=step.num_drafted, num_accepted=step.num_accepted, prefill=first,
            after=self.after, backlog=backlog))
        if step.num_speculative_tokens and not first:
            self.after = DraftOutcome.of(step.num_drafted, step.num_accepted)

    def _on_response(self, resp: verifier_pb2.GenerateResponse) -> Delta:
        now = time.perf_counter()
        metrics = self.metrics
        ids = list(resp.token_ids)
        if ids:
            if self.t_last is None:
                self.t_first = now
                metrics.ttft.observe(now - self.t0)
            else:
                for _ in ids:
                    metrics.itl.observe((now - self.t_last) / len(ids))
            self.t_last = now
        self.progress.generated.extend(ids)
        self.spec = resp.spec_decode
        step = resp.step_stats
        if step.disabled_reason and self.decision.method != "none":
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
                and s.disabled_reason is None and self.decision.method != "none":
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
        self.metrics.held.inc()
        try:
            return await self.replicas.wait_for_any(wait)
        except NoReplicaError:
            raise Unavailable(f"{error}; no verifier replica came back within "
                              f"{wait:.0f} s") from None

    def _timeout_message(self) -> str:
        limit = (self.deadline or self.t0) - self.t0
        return (f"the request timed out after {limit:.0f} s with "
                f"{len(self.progress.generated)} tokens generated")

    def _next_policy(self, resp: verifier_pb2.GenerateResponse
                     ) -> verifier_pb2.GenerateRequest | None:
        """Dynamic K: observe this step's acceptance, pick the next step's K."""
        if self.dynamic is None or self.decision.disabled_reason is not None:
            return None
        step = resp.step_stats
        if not step.step:
            return None  # no step behind this response
        if step.num_speculative_tokens and not self.prefilled and not self.tables \
                and self.online_profile is not None:
            # What the request's rates expected of this step's K (before they learn of
            # it: near what they were when it was chosen), against what it accepted.
            self.online_profile.calibrate(
                self.dynamic.method, self.dynamic.expected_accepted(step.num_speculative_tokens),
                step.num_accepted)
        self.dynamic.observe(step.num_drafted, step.num_accepted,
                             asked=step.num_speculative_tokens > 0)
        k, table = None, None
        if self.tables:
            chosen = self._next_table(step)
            if chosen is None:
                return None
            k, table = chosen
        if table is None:
            # One K a step: no table, or the method's rates make tables lose to plain
            # decoding. This request's own rates may still say drafting pays (a reply
            # copying its prompt), and its drafting steps teach the method's rates again:
            # without them a method found not to pay would never be tried again.
            k = self.dynamic.next_k(max(step.batch_size, 1), step.step)
            if k is None:
                return None
        if k == (self.num_speculative_tokens if self.enabled else 0) and \
                (k == 0 or table == self.outcome_table):
            return None
        self.metrics.k_updates.inc()
        update = verifier_pb2.GenerateRequest.PolicyUpdate()
        if k == 0:
            update.enabled = False
            update.disabled_reason = common_pb2.DISABLED_REASON_DYNAMIC_K
            self.enabled = False
        else:
            update.num_speculative_tokens = k  # without a table, clears the verifier's
            if table is not None:
                k_by_outcome_to_proto(table, update.k_by_outcome)
            if not self.enabled:
                update.enabled = True
            self.num_speculative_tokens, self.enabled = k, True
            self.outcome_table = table
        return verifier_pb2.GenerateRequest(policy_update=update)

    def _next_table(self, step: common_pb2.StepStats) -> tuple[int, Table | None] | None:
        """K by outcome (outcome_table.py): the table of the best level for this step's
        batch, chosen once for all its members of the method (and kept while the batch's
        size and members stay, for TABLE_REFRESH_STEPS steps), and its K for a stream's
        first drafting step (after some accepted: the level); (0, None) for plain
        decoding; None while there is no profile."""
        profile = self.dynamic.profile()
        if profile is None or self.online_profile is None:
            return None
        method, online, batch = self.dynamic.method, self.online_profile, self.dynamic.batch
        bound = self.dynamic.max_num_speculative_tokens
        size, members = max(step.batch_size, 1), batch.count(method) if batch else 1
        key = (method, size, members)
        chosen = batch.tables.get(key) if batch is not None else None
        if chosen is not None and 0 <= step.step - chosen[0] < TABLE_REFRESH_STEPS:
            table = chosen[1]
        elif batch is not None and batch.probe(profile, size, step.step):
            table = None  # plain first, to be measured at this size
        else:
            table = choose_table(profile, size, members, method, bound,
                                 lambda s: online.rates_after(method, s, bound),
                                 lambda s: online.availability_after(method, s))
            if batch is not None:
                # Choices old enough to be chosen again are done with.
                batch.tables = {k: v for k, v in batch.tables.items()
                                if 0 <= step.step - v[0] < TABLE_REFRESH_STEPS}
                batch.tables[key] = (step.step, table)
        return (0, None) if table is None else (table[DraftOutcome.SOME_ACCEPTED], table)

    def _rebase(self, spec: common_pb2.SpecDecodeStats) -> None:
        p = self.progress
        p.done_drafts += spec.num_drafts
        p.done_draft_tokens += spec.num_draft_tokens
        p.done_accepted += spec.num_accepted_tokens


class _ReplicaAborted(Exception):
    pass


class _UpdateLost(Exception):
    """A policy update could not be written: the stream had ended (see _stream_on)."""
