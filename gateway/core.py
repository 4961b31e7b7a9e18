"""One request through the gateway, shared by the REST and gRPC front ends.

`Gateway.generate` validates a tokenized request against the deployment,
picks the least loaded verifier replica, decides the speculation policy
(method, K, auto-disable, dynamic K), streams the verifier's tokens back as
text deltas (incremental detokenization, stop strings), sends K updates
mid-request, and records metrics. A replica that fails mid-request is
replaced: the request resumes on another one from the tokens already
produced, so greedy output is unchanged and nothing is lost. Closing the
iterator early (a client that went away) cancels the verifier stream, which
frees the sequence in the verifier and its drafter.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from opentelemetry import propagate, trace

from gateway.metrics import GatewayMetrics
from gateway.policy import (
    Decision,
    Deployment,
    DynamicK,
    ItlProfile,
    SpeculativeRequest,
    decide,
)
from gateway.replicas import NoReplicaError, Replica, ReplicaPool
from specdec.detokenizer import IncrementalDetokenizer
from specdec.pb import common_pb2, verifier_pb2
from specdec.stop import StopStringMatcher
from specdec.tokenizer import Tokenizer

tracer = trace.get_tracer("specdec.gateway")

METHOD_TO_PROTO = {
    "none": common_pb2.SPEC_METHOD_NONE,
    "ngram": common_pb2.SPEC_METHOD_NGRAM,
    "draft_model": common_pb2.SPEC_METHOD_DRAFT_MODEL,
    "eagle": common_pb2.SPEC_METHOD_EAGLE,
    "eagle3": common_pb2.SPEC_METHOD_EAGLE3,
}
METHOD_FROM_PROTO = {v: k for k, v in METHOD_TO_PROTO.items()}
REASON_TO_PROTO = {
    None: common_pb2.DISABLED_REASON_NONE,
    "request": common_pb2.DISABLED_REASON_REQUEST,
    "queue_size": common_pb2.DISABLED_REASON_QUEUE_SIZE,
    "drafter_unavailable": common_pb2.DISABLED_REASON_DRAFTER_UNAVAILABLE,
    "deadline": common_pb2.DISABLED_REASON_DEADLINE,
    "dynamic_k": common_pb2.DISABLED_REASON_DYNAMIC_K,
    "tokenizer_mismatch": common_pb2.DISABLED_REASON_TOKENIZER_MISMATCH,
    "drafter_max_len": common_pb2.DISABLED_REASON_DRAFTER_MAX_LEN,
}
REASON_FROM_PROTO = {v: k for k, v in REASON_TO_PROTO.items()}
# OpenAI reports "stop" for every natural end that is not the length limit.
FINISH_NAMES = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_EOS: "stop",
    common_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_CANCELLED: "abort",
}


class GatewayError(Exception):
    """An error for the client: HTTP status and gRPC code, OpenAI error type and param."""

    http_status = 500
    grpc_code = grpc.StatusCode.INTERNAL
    error_type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(GatewayError):
    http_status = 400
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    error_type = "invalid_request_error"


class ModelNotFound(GatewayError):
    # 400 rather than OpenAI's 404: an unknown model is a mistake in the request body.
    http_status = 400
    grpc_code = grpc.StatusCode.NOT_FOUND
    error_type = "invalid_request_error"
    code = "model_not_found"


class Unavailable(GatewayError):
    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "service_unavailable"


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 0  # 0 = only the model's max length applies
    max_tokens: int = 0  # largest max_tokens a request may ask for; 0 = no gateway limit
    max_body_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_tokens", "max_body_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"limits.{name}: must be >= 0")


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str
    default_method: str = "none"
    default_k: int = 4
    disable_queue_size: int | None = None
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    # Drafting steps of a request after which its own acceptance rates replace the profile's.
    dynamic_k_warmup_steps: int = 8

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name: must not be empty")
        if self.default_method not in METHOD_TO_PROTO:
            raise ValueError(f"default_method: unknown method {self.default_method!r}")
        if self.default_k < 0:
            raise ValueError("default_k: must be >= 0")
        if self.disable_queue_size is not None and self.disable_queue_size < 0:
            raise ValueError("disable_queue_size: must be >= 0")


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: tuple[int, ...]
    sampling: common_pb2.SamplingParams
    stop: tuple[str, ...] = ()
    speculative: SpeculativeRequest = SpeculativeRequest()
    request_id: str = ""
    # Which request field the prompt came from, for error messages.
    prompt_field: str = "prompt"


@dataclass
class SpecDecodeSummary:
    method: str = "none"
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    disabled_reason: str | None = None

    @property
    def acceptance_length(self) -> float:
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_json(self) -> dict:
        out = {"method": self.method, "num_drafts": self.num_drafts,
               "num_draft_tokens": self.num_draft_tokens,
               "num_accepted_tokens": self.num_accepted_tokens,
               "acceptance_length": round(self.acceptance_length, 4)}
        if self.disabled_reason is not None:
            out["disabled_reason"] = self.disabled_reason
        return out

    def to_proto(self) -> common_pb2.SpecDecodeStats:
        return common_pb2.SpecDecodeStats(
            method=METHOD_TO_PROTO[self.method], num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens,
            acceptance_length=self.acceptance_length,
            disabled_reason=REASON_TO_PROTO.get(self.disabled_reason,
                                                common_pb2.DISABLED_REASON_NONE))


@dataclass
class Delta:
    """What one verifier step added, as the client sees it."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob] = field(default_factory=list)
    # Last delta only: the proto reason, its OpenAI name, usage and speculation summary.
    finish: int = common_pb2.FINISH_REASON_UNSPECIFIED
    usage: common_pb2.Usage | None = None
    spec_decode: SpecDecodeSummary | None = None

    @property
    def finish_reason(self) -> str | None:
        return FINISH_NAMES.get(self.finish) if self.finish else None


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


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer, replicas: ReplicaPool,
                 metrics: GatewayMetrics | None = None, profile: ItlProfile | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.replicas = replicas
        self.metrics = metrics or GatewayMetrics()
        self.profile = profile

    # -- request preparation ------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model and model != self.config.model_name:
            raise ModelNotFound(f"The model `{model}` does not exist; this server serves "
                                f"`{self.config.model_name}`", param="model")

    def chat_prompt(self, messages: Sequence[dict]) -> list[int]:
        if not messages:
            raise InvalidRequest("messages: must contain at least one message", param="messages")
        try:
            return self.tokenizer.apply_chat_template(list(messages))
        except ValueError as e:
            raise InvalidRequest(f"messages: {e}", param="messages") from None
        except Exception as e:  # the template itself raised (e.g. unsupported role order)
            raise InvalidRequest(f"messages: the chat template failed: {e}",
                                 param="messages") from None

    def text_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def _validate(self, req: GenerationRequest, report: verifier_pb2.LoadReport) -> int:
        """Check the request against limits and the model; returns its max_tokens."""
        prompt, pf = req.prompt_token_ids, req.prompt_field
        if not prompt:
            raise InvalidRequest(f"{pf}: the prompt is empty", param=pf)
        vocab = report.tokenizer.vocab_size or self.tokenizer.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequest(f"{pf}: token ids {bad[:3]} are outside the vocabulary "
                                 f"(size {vocab})", param=pf)
        limits = self.config.limits
        if limits.max_prompt_tokens and len(prompt) > limits.max_prompt_tokens:
            raise InvalidRequest(f"{pf}: the prompt has {len(prompt)} tokens, over this "
                                 f"server's limit of {limits.max_prompt_tokens}", param=pf)
        max_len = report.max_model_len
        requested = req.sampling.max_tokens
        if limits.max_tokens and requested > limits.max_tokens:
            raise InvalidRequest(f"max_tokens: {requested} is over this server's limit of "
                                 f"{limits.max_tokens}", param="max_tokens")
        if len(prompt) >= max_len:
            raise InvalidRequest(f"{pf}: this model's maximum context length is {max_len} "
                                 f"tokens, and the prompt has {len(prompt)}", param=pf)
        if requested and len(prompt) + requested > max_len:
            raise InvalidRequest(
                f"max_tokens: this model's maximum context length is {max_len} tokens; the "
                f"prompt has {len(prompt)} and max_tokens asks for {requested} more",
                param="max_tokens")
        max_tokens = requested or max_len - len(prompt)
        if limits.max_tokens:
            max_tokens = min(max_tokens, limits.max_tokens)
        if req.speculative.auto and self.profile is None:
            raise InvalidRequest("speculative.num_speculative_tokens: \"auto\" needs a profiled "
                                 "ITL table, and this gateway has none (run `specdec profile`)",
                                 param="speculative")
        return max_tokens

    def _decide(self, req: GenerationRequest, replica: Replica) -> Decision:
        report = replica.report
        dep = Deployment(
            default_method=self.config.default_method,
            methods_available=self.replicas.drafter_methods() | replica.drafter_methods(),
            default_k=min(self.config.default_k, report.max_num_speculative_tokens),
            k_max=report.max_num_speculative_tokens,
            disable_queue_size=self.config.disable_queue_size)
        try:
            return decide(req.speculative, dep, num_running=replica.load)
        except ValueError as e:
            raise InvalidRequest(str(e), param="speculative") from None

    # -- generation ---------------------------------------------------------------

    async def open(self, req: GenerationRequest) -> Generation:
        """Validate `req`, pick a replica and the policy; nothing is sent to a verifier yet,
        so every error a client can cause is raised here, before any output."""
        t0 = time.perf_counter()
        request_id = req.request_id or f"req-{uuid.uuid4().hex}"
        try:
            try:
                replica = await self.replicas.choose()
            except NoReplicaError as e:
                raise Unavailable(str(e)) from None
            max_tokens = self._validate(req, replica.report)
            decision = self._decide(req, replica)
        except GatewayError as e:
            self.metrics.request_errors.labels(type(e).__name__).inc()
            raise
        if decision.disabled_reason is not None:
            self.metrics.disabled.labels(decision.disabled_reason).inc()
        return Generation(self, req, request_id, decision, max_tokens, t0, replica)

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        generation = await self.open(req)
        async for delta in generation.deltas():
            yield delta


class Generation:
    """One admitted request: its deltas, streamed from one replica or, after a failure,
    resumed on another."""

    def __init__(self, gw: Gateway, req: GenerationRequest, request_id: str, decision: Decision,
                 max_tokens: int, t0: float, replica: Replica):
        self.gw = gw
        self.replica = replica
        self.req = req
        self.request_id = request_id
        self.decision = decision
        self.progress = _Progress(list(req.prompt_token_ids), max_tokens)
        self.detok = IncrementalDetokenizer(gw.tokenizer, prompt_ids=req.prompt_token_ids)
        self.stop = StopStringMatcher(req.stop)
        self.t0 = t0
        self.t_first: float | None = None
        self.t_last: float | None = None
        # The current stream's cumulative SpecDecodeStats (streams restart counting).
        self.spec = common_pb2.SpecDecodeStats()
        self.dynamic = (DynamicK(gw.profile, decision.method, decision.k,
                                 warmup_steps=gw.config.dynamic_k_warmup_steps)
                        if decision.auto_k and gw.profile is not None and decision.k > 0 else None)
        self.k = decision.k
        self.enabled = decision.disabled_reason is None and decision.k > 0
        self.summary = SpecDecodeSummary(method=decision.method,
                                         disabled_reason=decision.disabled_reason)

    def _start(self, replica: Replica) -> verifier_pb2.GenerateRequest:
        p, d = self.progress, self.decision
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(self.req.sampling)
        sampling.max_tokens = p.max_tokens - len(p.generated)
        speculation = common_pb2.SpeculationPolicy(method=METHOD_TO_PROTO[d.method])
        reason = common_pb2.DISABLED_REASON_NONE
        if d.method != "none":
            if self.dynamic is not None:
                self.k = self.dynamic.next_k(replica.load + 1)
            speculation.num_speculative_tokens = self.k
            if d.disabled_reason is not None:
                reason = REASON_TO_PROTO[d.disabled_reason]
            elif self.k == 0:  # dynamic K chose plain decoding for the first step
                reason = common_pb2.DISABLED_REASON_DYNAMIC_K
                speculation.num_speculative_tokens = d.k
            speculation.auto_k = self.dynamic is not None
        if d.method != "none" and d.method not in replica.drafter_methods():
            # Known method without a drafter on this replica: run plainly, say why.
            speculation.method = common_pb2.SPEC_METHOD_NONE
            self.summary.disabled_reason = "drafter_unavailable"
        self.enabled = reason == common_pb2.DISABLED_REASON_NONE and self.k > 0
        return verifier_pb2.GenerateRequest(start=verifier_pb2.GenerateRequest.Start(
            request_id=self.request_id, prompt_token_ids=p.prompt + p.generated,
            sampling=sampling, speculation=speculation, disabled_reason=reason))

    async def deltas(self) -> AsyncIterator[Delta]:
        metrics = self.gw.metrics
        with tracer.start_as_current_span("gateway.generate") as span:
            span.set_attribute("specdec.request_id", self.request_id)
            span.set_attribute("specdec.method", self.decision.method)
            span.set_attribute("specdec.num_speculative_tokens", self.decision.k)
            metrics.running.inc()
            try:
                async for delta in self._stream(self.replica):
                    yield delta
            except GatewayError as e:
                metrics.request_errors.labels(type(e).__name__).inc()
                span.set_status(trace.Status(trace.StatusCode.ERROR, e.message))
                raise
            finally:
                metrics.running.dec()

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
                    replica = await self.gw.replicas.choose(exclude=failed)
                except NoReplicaError:
                    raise Unavailable(f"{error}; no other verifier replica to resume on") from None
                if self.progress.generated:
                    self.gw.metrics.resumed.inc()

    async def _stream_on(self, replica: Replica) -> AsyncIterator[Delta]:
        metadata: dict[str, str] = {}
        propagate.inject(metadata)
        call = replica.stub.Generate(metadata=tuple(metadata.items()))
        replica.inflight += 1
        try:
            await call.write(self._start(replica))
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
                update = self._next_policy(resp)
                if update is not None:
                    await call.write(update)
                if delta.text or delta.token_ids:
                    yield delta
        finally:
            replica.inflight -= 1
            # Frees the sequence in the verifier if the stream is still open (client gone,
            # stop string, error); a no-op on a stream that already ended.
            call.cancel()

    def _on_response(self, resp: verifier_pb2.GenerateResponse) -> Delta:
        now = time.perf_counter()
        metrics = self.gw.metrics
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
            s.disabled_reason = REASON_FROM_PROTO.get(spec.disabled_reason) or "drafter_unavailable"
        elif spec.disabled_reason and s.disabled_reason is None and not self.enabled:
            s.disabled_reason = REASON_FROM_PROTO.get(spec.disabled_reason)
        delta.usage = common_pb2.Usage(prompt_tokens=len(self.req.prompt_token_ids),
                                       completion_tokens=len(p.generated))
        delta.spec_decode = s
        m = self.gw.metrics
        elapsed = time.perf_counter() - self.t0
        m.e2e.observe(elapsed)
        n = len(p.generated)
        if n > 1 and self.t_first is not None and self.t_last is not None:
            m.tpot.observe((self.t_last - self.t_first) / (n - 1))
        m.prompt_tokens.inc(len(self.req.prompt_token_ids))
        m.generation_tokens.inc(n)
        if s.num_drafts:
            m.acceptance_length.labels(s.method).observe(s.acceptance_length)
        m.requests.labels(s.method, delta.finish_reason or "abort").inc()

    def _next_policy(self, resp: verifier_pb2.GenerateResponse
                     ) -> verifier_pb2.GenerateRequest | None:
        """Dynamic K: observe this step's acceptance, pick the next step's K."""
        if self.dynamic is None or self.decision.disabled_reason is not None:
            return None
        step = resp.step_stats
        if step.num_drafted:
            self.dynamic.observe(step.num_drafted, step.num_accepted)
        k = self.dynamic.next_k(max(step.batch_size, 1))
        if k == (self.k if self.enabled else 0):
            return None
        self.gw.metrics.k_updates.inc()
        update = verifier_pb2.GenerateRequest.PolicyUpdate()
        if k == 0:
            update.enabled = False
            update.disabled_reason = common_pb2.DISABLED_REASON_DYNAMIC_K
            self.enabled = False
        else:
            update.num_speculative_tokens = k
            if not self.enabled:
                update.enabled = True
            self.k, self.enabled = k, True
        return verifier_pb2.GenerateRequest(policy_update=update)

    def _rebase(self, spec: common_pb2.SpecDecodeStats) -> None:
        p = self.progress
        p.done_drafts += spec.num_drafts
        p.done_draft_tokens += spec.num_draft_tokens
        p.done_accepted += spec.num_accepted_tokens


class _ReplicaAborted(Exception):
    pass

