"""The Verifier gRPC service: translates protobuf to the engine's dataclasses and back.

`Generate` is one bidi stream per request: a Start, then optional policy
updates and a cancel; the verifier streams every step's tokens with step
statistics. Bad input ends only that stream, with INVALID_ARGUMENT naming
the field. A client that goes away cancels its request, which frees its KV
and tells its drafter. Shutdown stops admitting, lets requests in flight
finish for a grace period, aborts the rest and closes the drafter streams.

A request that fails on its own in the engine (worker.RequestFailed) ends with
INTERNAL and the REQUEST_FAILED trailing metadata (specdec/server.py), which the
gateway does not replay elsewhere. When the engine can step no more (the
watchdog trips), health goes NOT_SERVING, every request ends with UNAVAILABLE,
which the gateway resumes on another replica, and the process exits with
EXIT_ENGINE_FAILED for its supervisor to restart it. `serve` runs the Verifier API
over vLLM's engine the same way (verifier/vllm/serve.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import grpc
from opentelemetry import trace

from specdec.cache_salt import check_cache_salt
from specdec.pb import common_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.processors import LogitsProcessors
from specdec.sampling import SamplingParams
from specdec.server import (
    ADMITTED,
    REQUEST_FAILED,
    GrpcService,
    generate_message_bytes,
    start_server,
)
from specdec.speculation import (
    SpeculationPolicy,
    acceptance_length,
    method_name,
    method_to_proto,
    reason_name,
    reason_to_proto,
)
from specdec.structured import Grammars
from specdec.telemetry import incoming_context
from specdec.tls import TlsConfig
from verifier.drafter_client import TargetInfo
from verifier.drafting import DrafterPool
from verifier.engine import Engine, FinishReason, Request, StepOutput
from verifier.watchdog import Watchdog, Watched
from verifier.worker import EngineFailed, EngineThread, EngineWorker, RequestFailed

log = logging.getLogger(__name__)
_tracer = trace.get_tracer("specdec.verifier")

MAX_LOGPROBS = 20
EXIT_ENGINE_FAILED = 3  # the exit status after the watchdog tripped

_FINISH = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.EOS: common_pb2.FINISH_REASON_EOS,
    FinishReason.STOP_TOKEN: common_pb2.FINISH_REASON_STOP_TOKEN,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
}


class DrafterLike(Protocol):
    """What a policy needs of the drafter that serves it (ours, and vLLM's path's)."""

    name: str
    method: int  # SpecMethod; UNSPECIFIED until the drafter has been reached


def speculation_policy(method: int, drafter: DrafterLike | None, k: int, auto_k: bool,
                       disabled_reason: int) -> SpeculationPolicy:
    """A Start's policy as a verifier runs it: method (SpecMethod, the deployment's
    default resolved), the drafter serving it (None: none is configured for it) and its
    K, clamped to what the drafter takes. ValueError naming the field of a method no
    build knows."""
    if method == common_pb2.SPEC_METHOD_NONE:
        return SpeculationPolicy("none", 0, False, "request")
    name = method_name(drafter.method or method if drafter is not None else method)
    if name is None or name == "none":
        raise ValueError(f"start.speculation.method: unknown method {method}")
    if drafter is None:
        return SpeculationPolicy(name, k, auto_k, "drafter_unavailable")
    return SpeculationPolicy(name, k, auto_k, reason_name(disabled_reason), drafter.name)


@dataclass(slots=True)
class _Stats:
    prompt_tokens: int
    completion_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Why the latest step that ran without drafts did (DisabledReason).
    plain_reason: int = common_pb2.DISABLED_REASON_NONE


def _field_error(prefix: str, e: ValueError) -> ValueError:
    return ValueError(f"{prefix}.{e}" if not str(e).startswith(prefix) else str(e))


async def admit(messages, context: grpc.aio.ServicerContext, refused: str | None, held: int,
                max_num_waiting: int) -> verifier_pb2.GenerateRequest | None:
    """A Generate stream's first message, once it may run (None: the stream is already
    over); aborts the call otherwise. refused: why this verifier takes no new requests
    (None: it does); held: open streams past the batch. Every open stream is running,
    queued, or about to be: past the batch plus the queue's bound, a new one would
    only wait, and the gateway answers 429."""
    try:
        first = await messages.__anext__()
    except StopAsyncIteration:
        return None
    if first.WhichOneof("kind") != "start":
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            "kind: the first message of Generate must be a start")
    if refused is not None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, refused)
    if max_num_waiting and held >= max_num_waiting:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"the verifier's queue is full ({held} requests waiting, "
                            f"--max-num-waiting {max_num_waiting})")
    return first


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: Engine, pool: DrafterPool, target: TargetInfo, *,
                 model_name: str = "", default_num_speculative_tokens: int = 4,
                 engine_thread: EngineThread | None = None, grammars: Grammars | None = None,
                 max_num_waiting: int = 0):
        """engine_thread: the thread `engine` was built on, to step it there too;
        grammars: compiles structured outputs for the target's tokenizer (None: refused);
        max_num_waiting: requests queued beyond the running batch, past which a new one
        is refused with RESOURCE_EXHAUSTED (0: no limit)."""
        if max_num_waiting < 0:
            raise ValueError(f"max_num_waiting must be >= 0, got {max_num_waiting}")
        self.max_num_waiting = max_num_waiting
        self.engine = engine
        self.grammars = grammars
        self.pool = pool
        self.target = target
        self.model_name = model_name
        self.default_num_speculative_tokens = min(
            default_num_speculative_tokens, engine.config.max_num_speculative_tokens
        )
        self.worker = EngineWorker(engine, engine_thread)
        self._active: dict[str, asyncio.Task | None] = {}
        self._outputs: dict[str, asyncio.Queue] = {}  # each active request's, for fail_all
        self._aborting: set[str] = set()
        self._accepting = True
        self._unavailable = "verifier is shutting down"  # why new requests are refused

    # -- translation -------------------------------------------------------------

    def _processors(self, s: common_pb2.SamplingParams) -> LogitsProcessors | None:
        """The request's logits processors, None when none is active."""
        p = LogitsProcessors.from_proto(s, self.target.vocab_size, "start.sampling")
        if p.min_tokens and s.max_tokens and p.min_tokens > s.max_tokens:
            raise ValueError(f"start.sampling.min_tokens: {p.min_tokens} exceeds max_tokens "
                             f"{s.max_tokens}")
        return p if p.active else None

    async def _grammar(self, s: common_pb2.SamplingParams):
        """The request's grammar matcher, None without structured_output; compiled off
        the event loop."""
        if not s.HasField("structured_output"):
            return None
        field = "start.sampling.structured_output"
        if self.grammars is None:
            raise ValueError(f"{field}: this verifier has no tokenizer to compile grammars with")
        if s.ignore_eos:
            raise ValueError("start.sampling.ignore_eos: a structured output ends where its "
                             "grammar does; it cannot ignore the end of sequence")
        compiled = await self.grammars.compile_off_loop(s.structured_output, field)
        return self.grammars.matcher(compiled)

    def to_request(self, start: verifier_pb2.GenerateRequest.Start
                   ) -> tuple[Request, SpeculationPolicy]:
        """Raise ValueError naming the field for anything the engine cannot run."""
        cfg = self.engine.config
        s = start.sampling
        try:
            sampling = SamplingParams.from_proto(s)
        except ValueError as e:
            raise _field_error("start.sampling", e) from None
        if s.logprobs > MAX_LOGPROBS:
            raise ValueError(f"start.sampling.logprobs: at most {MAX_LOGPROBS}, got {s.logprobs}")
        prompt = list(start.prompt_token_ids)
        if not prompt:
            raise ValueError("start.prompt_token_ids: must not be empty")
        max_tokens = s.max_tokens or cfg.max_model_len - len(prompt)
        if max_tokens <= 0:
            raise ValueError(f"start.prompt_token_ids: {len(prompt)} tokens leave no room "
                             f"under max_model_len {cfg.max_model_len}")
        bad_stop = [t for t in s.stop_token_ids if not 0 <= t < self.target.vocab_size]
        if bad_stop:
            raise ValueError(f"start.sampling.stop_token_ids: {bad_stop[:3]} outside the vocabulary")

        spec = start.speculation
        method = spec.method or self.pool.default_method()
        if spec.num_speculative_tokens > cfg.max_num_speculative_tokens:
            raise ValueError(f"start.speculation.num_speculative_tokens: "
                             f"{spec.num_speculative_tokens} exceeds the maximum "
                             f"{cfg.max_num_speculative_tokens}")
        client = None
        if method != common_pb2.SPEC_METHOD_NONE or spec.drafter:
            try:
                client = self.pool.resolve(method, spec.drafter)
            except ValueError as e:
                raise _field_error("start", e) from None
        k = spec.num_speculative_tokens or self.default_num_speculative_tokens
        if client is not None and client.max_num_speculative_tokens:
            k = min(k, client.max_num_speculative_tokens)
        if client is not None and spec.drafter and method == common_pb2.SPEC_METHOD_UNSPECIFIED:
            method = client.method
        policy = speculation_policy(method, client, k, spec.auto_k, start.disabled_reason)
        request = Request(
            request_id=start.request_id or uuid.uuid4().hex, prompt_token_ids=prompt,
            max_tokens=max_tokens, sampling=sampling, stop_token_ids=frozenset(s.stop_token_ids),
            ignore_eos=s.ignore_eos, num_speculative_tokens=policy.effective_k,
            drafter=policy.drafter, auto_k=policy.auto_k, num_logprobs=s.logprobs,
            processors=self._processors(s), cache_salt=check_cache_salt(start.cache_salt, "start.cache_salt"),
            priority=start.priority)
        try:
            self.engine.validate(request)
        except ValueError as e:
            raise _field_error("start", e) from None
        return request, policy

    def _apply_update(self, request_id: str, policy: SpeculationPolicy,
                      update: verifier_pb2.GenerateRequest.PolicyUpdate) -> SpeculationPolicy:
        policy = policy.updated(update, self.engine.config.max_num_speculative_tokens)
        self.worker.set_num_speculative_tokens(request_id, policy.effective_k, policy.auto_k)
        return policy

    def _response(self, out: StepOutput, policy: SpeculationPolicy, stats: _Stats
                  ) -> verifier_pb2.GenerateResponse:
        stats.completion_tokens += len(out.new_token_ids)
        if out.num_drafted:
            stats.num_drafts += 1
            stats.num_draft_tokens += out.num_drafted
            stats.num_accepted_tokens += out.num_accepted
        step_reason = common_pb2.DISABLED_REASON_NONE
        if not out.num_drafted and out.miss_reason:
            step_reason = reason_to_proto(out.miss_reason)
        elif not out.num_speculative_tokens and not policy.enabled:
            step_reason = reason_to_proto(policy.disabled_reason)
        request_reason = common_pb2.DISABLED_REASON_NONE
        if not policy.enabled or policy.drafter is None:
            request_reason = reason_to_proto(policy.disabled_reason)
        elif not self.pool.clients[policy.drafter].available:
            request_reason = common_pb2.DISABLED_REASON_DRAFTER_UNAVAILABLE
        elif not stats.num_drafts:  # nothing drafted yet: why the steps did not
            request_reason = stats.plain_reason = step_reason or stats.plain_reason
        resp = verifier_pb2.GenerateResponse(
            request_id=out.request_id, token_ids=out.new_token_ids,
            step_stats=common_pb2.StepStats(
                step=out.step, num_speculative_tokens=out.num_speculative_tokens,
                num_drafted=out.num_drafted, num_accepted=out.num_accepted,
                batch_size=out.batch_size, num_tokens=out.num_tokens,
                step_time_ms=out.step_time_ms,
                draft_wait_ms=out.draft_wait_ms, disabled_reason=step_reason),
            usage=common_pb2.Usage(prompt_tokens=stats.prompt_tokens,
                                   completion_tokens=stats.completion_tokens),
            spec_decode=common_pb2.SpecDecodeStats(
                method=method_to_proto(policy.method if policy.drafter is not None else "none"),
                num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
                num_accepted_tokens=stats.num_accepted_tokens,
                acceptance_length=acceptance_length(stats.num_accepted_tokens, stats.num_drafts),
                disabled_reason=request_reason))
        if out.finish_reason is not None:
            resp.finish_reason = (common_pb2.FINISH_REASON_ABORTED if out.request_id in self._aborting
                                  else _FINISH[out.finish_reason])
        for lp in out.logprobs or ():
            resp.logprobs.add(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank, top_logprobs=[
                common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
        return resp

    # -- RPCs --------------------------------------------------------------------

    async def Generate(self, request_iterator, context: grpc.aio.ServicerContext):
        messages = request_iterator.__aiter__()
        first = await admit(messages, context, self._unavailable if not self._accepting else None,
                            len(self._active) - self.engine.config.max_num_seqs,
                            self.max_num_waiting)
        if first is None:
            return
        try:
            request, policy = self.to_request(first.start)
            request.grammar = await self._grammar(first.start.sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        rid = request.request_id
        if rid in self._active:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"start.request_id: {rid!r} is already running")

        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._active[rid] = None
        self._outputs[rid] = outputs
        self.worker.add(request, lambda o: loop.call_soon_threadsafe(outputs.put_nowait, o))
        await context.send_initial_metadata((ADMITTED,))
        errors: asyncio.Queue[ValueError] = asyncio.Queue()

        async def read_updates() -> None:
            nonlocal policy
            async for msg in messages:
                kind = msg.WhichOneof("kind")
                if kind == "cancel":
                    self.worker.cancel(rid)
                elif kind == "policy_update":
                    try:
                        policy = self._apply_update(rid, policy, msg.policy_update)
                    except ValueError as e:
                        await errors.put(e)
                        self.worker.cancel(rid)
                        return
                else:
                    await errors.put(ValueError(f"kind: {kind or 'nothing'} after start"))
                    self.worker.cancel(rid)
                    return

        reader = asyncio.create_task(read_updates())
        self._active[rid] = reader
        stats = _Stats(len(request.prompt_token_ids))
        finished = False
        span = _tracer.start_span(
            "verifier.generate", context=incoming_context(context.invocation_metadata()),
            attributes={"specdec.request_id": rid, "specdec.prompt_tokens": stats.prompt_tokens,
                        "specdec.drafter": policy.drafter or ""})
        try:
            while True:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    finished = True
                    await context.abort(*_status(out))
                if out.finish_reason is not None:
                    finished = True
                    if not errors.empty():
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(errors.get_nowait()))
                yield self._response(out, policy, stats)
                if finished:
                    break
            if rid in self._aborting:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "verifier is shutting down")
        finally:
            span.set_attribute("specdec.completion_tokens", stats.completion_tokens)
            span.set_attribute("specdec.num_accepted_tokens", stats.num_accepted_tokens)
            span.end()
            reader.cancel()
            if not finished:  # the client went away: free its sequence and drafter state
                self.worker.cancel(rid)
            self._active.pop(rid, None)
            self._outputs.pop(rid, None)
            self._aborting.discard(rid)

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    async def Load(self, request, context) -> verifier_pb2.LoadReport:
        cfg = self.engine.config
        load = self.worker.load
        report = verifier_pb2.LoadReport(
            num_running=load.num_running, num_waiting=load.num_waiting,
            num_free_kv_blocks=load.num_free_kv_blocks, kv_block_size=cfg.block_size,
            num_free_kv_tokens=load.num_free_kv_blocks * cfg.block_size,
            num_total_kv_tokens=cfg.num_kv_blocks * cfg.block_size,
            step_time_ema_ms=load.step_time_ema_ms, max_num_seqs=cfg.max_num_seqs,
            max_model_len=cfg.max_model_len,
            max_num_speculative_tokens=cfg.max_num_speculative_tokens, model_name=self.model_name,
            tokenizer=common_pb2.TokenizerFingerprint(vocab_size=self.target.vocab_size,
                                                      hash=self.target.tokenizer_hash),
            prefix_caching_enabled=cfg.enable_prefix_caching,
            prefix_cache_queries=load.prefix_cache.queries,
            prefix_cache_hits=load.prefix_cache.hits,
            prefix_cache_hit_rate=load.prefix_cache.hit_rate,
            engine_times=verifier_pb2.EngineTimes(
                steps=load.times.steps, tokens=load.times.tokens,
                sequences=load.times.sequences, rows=load.times.rows,
                schedule_ms=load.times.schedule_ms, draft_wait_ms=load.times.draft_wait_ms,
                forward_ms=load.times.forward_ms, sample_ms=load.times.sample_ms,
                postprocess_ms=load.times.postprocess_ms, deliver_ms=load.deliver_ms,
                drafter_ms=load.times.drafter_ms),
            speculation_controller=self.engine.controller is not None)
        for c in self.pool.clients.values():
            report.drafters.add(
                name=c.name,
                method=c.method,
                available=c.available,
                max_num_speculative_tokens=min(
                    c.max_num_speculative_tokens, cfg.max_num_speculative_tokens
                ),
                bet_lookups=c.bet_lookups,
                bet_hits=c.bet_hits,
            )
        return report

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self.pool.start_all()
        self.worker.start()

    async def drain(self, grace_s: float) -> None:
        """Stop admitting; wait for requests in flight, then abort what is left."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._active):
            self._aborting.add(rid)
            self.worker.cancel(rid)
        while self._active and loop.time() < deadline + 1.0:
            await asyncio.sleep(0.02)

    def fail_all(self, reason: str) -> None:
        """The engine can step no more: refuse new requests and end every one in flight
        with EngineFailed (UNAVAILABLE), whatever the engine thread is doing."""
        self._accepting = False
        self._unavailable = reason
        for outputs in self._outputs.values():
            outputs.put_nowait(EngineFailed(reason))

    def close(self) -> None:
        self.worker.stop()
        self.pool.close()


def _status(e: BaseException) -> tuple[grpc.StatusCode, str, tuple]:
    """How a request's stream ends for an error from the worker: its input
    (INVALID_ARGUMENT), its own failure (INTERNAL, marked: not worth replaying), the
    engine's (UNAVAILABLE: resume elsewhere), or anything else (INTERNAL)."""
    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e), ()
    if isinstance(e, RequestFailed):
        return grpc.StatusCode.INTERNAL, f"the request failed in the engine: {e}", (REQUEST_FAILED,)
    if isinstance(e, EngineFailed):
        return grpc.StatusCode.UNAVAILABLE, str(e), ()
    return grpc.StatusCode.INTERNAL, str(e), ()


def exit_process(code: int) -> None:
    """Exit now, without joining threads: a stuck engine thread would never join (nor
    give back a logging lock it holds, so only the standard streams are flushed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Servicer(Protocol):
    """What `serve` runs: VerifierServicer over our engine, or vLLM's servicer
    (verifier/vllm/service.py)."""

    target: TargetInfo  # the model's vocabulary, as drafters must match it
    max_model_len: int

    def start(self) -> None: ...

    def fail_all(self, reason: str) -> None:
        """The engine can step no more: refuse new requests, end those in flight with
        UNAVAILABLE."""

    async def drain(self, grace_s: float) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True)
class VerifierService:
    servicer: Servicer
    grpc: GrpcService
    watchdog: Watchdog
    # Called with EXIT_ENGINE_FAILED once the watchdog tripped and the requests in flight
    # were told (exit_process in the CLI; None: stay up, NOT_SERVING, as tests do).
    terminate: Callable[[int], None] | None = None
    exit_grace_s: float = 1.0  # for the UNAVAILABLE statuses to reach the clients

    @property
    def port(self) -> int:
        return self.grpc.port

    async def engine_failed(self, reason: str) -> None:
        """NOT_SERVING, every request in flight ends with UNAVAILABLE, then exit."""
        await self.grpc.set_serving(False)
        self.servicer.fail_all(f"verifier engine failed ({reason})")
        await asyncio.sleep(self.exit_grace_s)
        if self.terminate is not None:
            log.critical("exiting with status %d: %s", EXIT_ENGINE_FAILED, reason)
            self.terminate(EXIT_ENGINE_FAILED)

    async def stop(self, grace_s: float = 5.0) -> None:
        self.watchdog.stop()
        # Requests get most of the grace; the server's own stop the rest.
        await self.grpc.stop(grace_s, drain=lambda: self.servicer.drain(grace_s * 0.6))
        # Joins threads: off the event loop, which may be serving other things.
        await asyncio.to_thread(self.servicer.close)


async def serve(servicer: Servicer, address: str, *, watched: Watched | None = None,
                step_timeout_s: float = 0.0, terminate: Callable[[int], None] | None = None,
                token: str | None = None, tls: TlsConfig | None = None) -> VerifierService:
    """watched: the engine the watchdog reads (default: a VerifierServicer's worker);
    step_timeout_s: its limit on one step (0: none; a failed engine still trips it);
    terminate: see VerifierService.terminate; token: required of every call but
    health's (specdec.server.TokenAuth); tls: serve over TLS."""
    servicer.start()
    service = await start_server(
        address, lambda server: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server),
        ["specdec.v1.Verifier"], token=token, tls=tls,
        max_receive_bytes=generate_message_bytes(servicer.max_model_len,
                                                 servicer.target.vocab_size))
    loop = asyncio.get_running_loop()
    verifier: VerifierService

    def trip(reason: str) -> None:
        asyncio.run_coroutine_threadsafe(verifier.engine_failed(reason), loop)

    if watched is None:
        watched = servicer.worker
    verifier = VerifierService(servicer, service, Watchdog(watched, step_timeout_s, trip),
                               terminate)
    verifier.watchdog.start()
    return verifier
