"""Admission of one request, shared by the REST and gRPC front ends.

`Gateway.open` validates a tokenized request against the deployment and its
limits, picks the least loaded verifier replica and decides the request's
speculation policy (method, K or dynamic K's bound, off); every error a client
can cause is raised there, before any output. Each step's K under load is the
verifier's to choose (verifier/engine/speculation.py). The returned `Generation` (generation.py)
streams the request's text deltas.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from gateway import tools
from gateway.generation import Generation
from gateway.metrics import GatewayMetrics
from gateway.policy.admission import Deployment, decide
from gateway.policy.shedding import ServiceTimes, expected_wait_s, retry_after_s
from gateway.replicas import NoReplicaError, Replica, ReplicaPool
from gateway.tools import ToolError, ToolRequest
from gateway.types import (
    Delta,
    GatewayError,
    GenerationRequest,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    RequestTimeout,
    SpecDecodeSummary,
    Unavailable,
)
from specdec.pb import verifier_pb2
from specdec.processors import LogitsProcessors
from specdec.speculation import METHODS, SpeculationPolicy, drafter_method
from specdec.structured import Grammars
from specdec.tokenizer import Tokenizer

__all__ = ["Delta", "Gateway", "GatewayConfig", "GatewayError", "Generation",
           "GenerationRequest", "InvalidRequest", "Limits", "ModelNotFound", "Overloaded",
           "RequestTimeout", "SpecDecodeSummary", "Unavailable"]


@dataclass(frozen=True)
class Limits:
    max_prompt_tokens: int = 0  # 0 = only the model's max length applies
    max_tokens: int = 0  # largest max_tokens a request may ask for; 0 = no gateway limit
    max_body_bytes: int = 4 * 1024 * 1024  # REST bodies and gRPC API messages
    # Every stop string is matched against every delta: their number and length bound
    # that work (OpenAI takes 4 stop strings).
    max_stop_strings: int = 32
    max_stop_string_chars: int = 1024
    # Entries of stop_token_ids, logit_bias and bad_words (OpenAI's logit_bias takes 300).
    max_list_items: int = 1024

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_tokens", "max_body_bytes", "max_stop_strings",
                     "max_stop_string_chars", "max_list_items"):
            if getattr(self, name) < 0:
                raise ValueError(f"limits.{name}: must be >= 0")


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str
    # Where the served model comes from, as vLLM's /v1/models reports its --model (the
    # `root` a client such as `vllm bench serve` loads the tokenizer from).
    model_root: str = ""
    default_method: str = "none"
    # K of requests that do not give one: with default_auto_k the bound of their
    # dynamic K, which the verifier chooses each step, else their static K.
    default_num_speculative_tokens: int = 4
    default_auto_k: bool = True
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    # Admission: a request expected to wait longer than this for its first step is
    # refused (429, Retry-After); 0 = never. 60 s keeps a served request on `make run`
    # (16 slots, a few seconds a reply) within a minute and a half of arriving.
    max_queue_time_s: float = 60.0
    # Requests this gateway holds at once (admitted, not finished); past it 429. 0 = no
    # limit. Each costs a stream, a detokenizer and a verifier sequence.
    max_num_requests: int = 1024
    # A request's time from admission to its last token, unless it asks for less
    # (REST `timeout`, the gRPC deadline); 0 = none.
    request_timeout_s: float = 600.0
    # A request whose replicas all failed mid-generation waits this long for one to
    # serve again (the only verifier restarting), then resumes from its tokens so far; a
    # new request arriving while none serves waits as long for one. Long enough for a
    # supervisor's slowest restart and then a verifier's start: Docker's backoff for a
    # service that keeps dying doubles to 1 min, `specdec up`'s to 30 s; at 30 s here, 8
    # of 1960 requests were lost in the soak when faults came 8-10 s apart.
    resume_wait_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("model_name: must not be empty")
        if self.default_method not in METHODS:
            raise ValueError(f"default_method: unknown method {self.default_method!r}")
        if self.default_num_speculative_tokens < 0:
            raise ValueError("default_num_speculative_tokens: must be >= 0")
        if not isinstance(self.default_auto_k, bool):
            raise ValueError(f"default_auto_k: must be a bool, got {self.default_auto_k!r}")
        for name in ("max_queue_time_s", "max_num_requests", "request_timeout_s",
                     "resume_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0")


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer, replicas: ReplicaPool,
                 metrics: GatewayMetrics | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.replicas = replicas
        self.metrics = metrics or GatewayMetrics(config.model_name)
        # Compiles a request's grammar to refuse a bad one before it reaches a verifier.
        self.grammars = Grammars(tokenizer.hf, tokenizer.vocab_size, tokenizer.eos_token_ids)
        self.service_times = ServiceTimes()  # per replica: how long a request holds a slot
        # Requests admitted and not finished, per replica: streams start only when their
        # client reads them, so a burst would otherwise all see an idle replica.
        self.admitted: dict[str, int] = {}
        self.holding = 0  # new requests waiting for a replica to serve (_hold)

    # -- request preparation ------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model and model != self.config.model_name:
            raise ModelNotFound(f"The model `{model}` does not exist; this server serves "
                                f"`{self.config.model_name}`", param="model")

    @cached_property
    def template_renders_tools(self) -> bool:
        """Whether the model's chat template has a tools section of its own."""
        return tools.template_renders_tools(
            lambda messages, fns: self.tokenizer.render_chat(messages, tools=fns))

    def chat_prompt(self, messages: Sequence[dict], tool_request: ToolRequest | None = None
                    ) -> list[int]:
        """The conversation through the chat template. messages: {"role", "content": str,
        "tool_calls"?, "tool_call_id"?}; with `tool_request` its tools go to a template
        that renders them, else into a generic system prompt (gateway/tools.py)."""
        if not messages:
            raise InvalidRequest("messages: must contain at least one message", param="messages")
        native = self.template_renders_tools
        try:
            messages = tools.history(messages, native)
        except ToolError as e:
            raise InvalidRequest(str(e), param=e.param) from None
        fns = None
        if tool_request is not None and native:
            fns = tool_request.tools()
        elif tool_request is not None:
            messages = tools.with_system_prompt(messages, tool_request.functions)
        try:
            return self.tokenizer.apply_chat_template(list(messages), tools=fns)
        except ValueError as e:
            raise InvalidRequest(f"messages: {e}", param="messages") from None
        except Exception as e:  # the template itself raised (e.g. unsupported role order)
            raise InvalidRequest(f"messages: the chat template failed: {e}",
                                 param="messages") from None

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs show it (special tokens included)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

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
        self._check_lists(req)
        try:
            LogitsProcessors.from_proto(req.sampling, vocab, field="sampling")
        except ValueError as e:
            raise InvalidRequest(str(e), param=str(e).split(":")[0]) from None
        if req.sampling.HasField("structured_output"):  # compiled in open(), off the loop
            if req.sampling.ignore_eos:
                raise InvalidRequest("ignore_eos: a structured output ends where its grammar "
                                     "does; it cannot ignore the end of sequence",
                                     param="ignore_eos")
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
        return max_tokens

    def _check_lists(self, req: GenerationRequest) -> None:
        """InvalidRequest naming the field for a list past this server's limits."""
        limits, s = self.config.limits, req.sampling
        if len(req.stop) > limits.max_stop_strings:
            raise InvalidRequest(f"stop: {len(req.stop)} stop strings, over this server's "
                                 f"limit of {limits.max_stop_strings}", param="stop")
        if any(len(x) > limits.max_stop_string_chars for x in req.stop):
            raise InvalidRequest(f"stop: a stop string is over this server's limit of "
                                 f"{limits.max_stop_string_chars} characters", param="stop")
        for name, items in (("stop_token_ids", s.stop_token_ids), ("logit_bias", s.logit_bias),
                            ("bad_words", s.bad_words)):
            if len(items) > limits.max_list_items:
                raise InvalidRequest(f"{name}: {len(items)} entries, over this server's limit "
                                     f"of {limits.max_list_items}", param=name)

    def _decide(self, req: GenerationRequest, replica: Replica) -> SpeculationPolicy:
        report = replica.report
        dep = Deployment(
            default_method=self.config.default_method,
            methods_available=self.replicas.drafter_methods() | replica.drafter_methods(),
            default_num_speculative_tokens=min(
                self.config.default_num_speculative_tokens, report.max_num_speculative_tokens
            ),
            max_num_speculative_tokens=report.max_num_speculative_tokens,
            # A seeded request's text does not depend on K (the verifier keys its
            # noise by position), so it follows the load like any other.
            default_auto_k=self.config.default_auto_k,
        )
        spec = req.speculative
        served = {d.name: drafter_method(d.name, d.method) for d in report.drafters}
        deployed = {m for m in served.values() if m is not None}
        if spec.method not in (None, "none") and spec.method not in deployed:
            # A drafter configured but down still degrades to K = 0 (decide() reports why);
            # one this deployment does not run at all is a mistake in the request.
            raise InvalidRequest(f"speculative.method: this deployment runs no {spec.method} "
                                 f"drafter (it runs: {', '.join(sorted(deployed)) or 'none'})",
                                 param="speculative")
        if spec.drafter is not None:
            if spec.drafter not in served:
                raise InvalidRequest(f"speculative.drafter: unknown drafter {spec.drafter!r} "
                                     f"(configured: {', '.join(served) or 'none'})",
                                     param="speculative")
            method = served[spec.drafter]
            if method is None:
                raise Unavailable(f"speculative.drafter: {spec.drafter!r} has not been reached "
                                  f"yet, so its method is unknown; retry shortly")
            if spec.method not in (None, method):
                raise InvalidRequest(f"speculative.drafter: {spec.drafter!r} drafts with "
                                     f"{method}, not {spec.method}", param="speculative")
            spec = replace(spec, method=method)
        try:
            return decide(spec, dep)
        except ValueError as e:
            raise InvalidRequest(str(e), param="speculative") from None

    # -- generation ---------------------------------------------------------------

    async def open(self, req: GenerationRequest) -> Generation:
        """Validate `req`, pick a replica and the policy; nothing is sent to a verifier yet,
        so every error a client can cause is raised here, before any output."""
        t0 = time.perf_counter()
        request_id = req.request_id or f"req-{uuid.uuid4().hex}"
        # The shorter of the server's limit and the request's own (0 / None: none).
        timeout = min((t for t in (self.config.request_timeout_s, req.timeout_s) if t),
                      default=None)
        try:
            try:
                replica = await self.replicas.choose()
            except NoReplicaError as e:
                replica = await self._hold(str(e), timeout)
            max_tokens = self._validate(req, replica.report)
            if req.sampling.HasField("structured_output"):
                field = req.structured_field or "sampling.structured_output"
                try:
                    await self.grammars.compile_off_loop(req.sampling.structured_output, field)
                except ValueError as e:
                    raise InvalidRequest(str(e), param=field) from None
            policy = self._decide(req, replica)
            self._admit(replica, max_tokens)
        except GatewayError as e:
            self.metrics.request_errors.labels(type(e).__name__).inc()
            raise
        address = replica.address
        self.admitted[address] = self.admitted.get(address, 0) + 1

        def release() -> None:
            self.admitted[address] -= 1

        return Generation(req, request_id, policy, max_tokens, t0, replica, self.replicas,
                          self.tokenizer, self.metrics,
                          deadline=t0 + timeout if timeout else None, release=release,
                          service_times=self.service_times,
                          resume_wait_s=self.config.resume_wait_s)

    async def _hold(self, error: str, timeout: float | None) -> Replica:
        """No replica serves: hold a new request as a resumed one is held, within
        resume_wait_s and its timeout. Past max_num_requests held and admitted
        together, Unavailable at once."""
        wait = self.config.resume_wait_s
        if timeout and wait > 0:
            wait = min(wait, timeout)
        limit = self.config.max_num_requests
        if limit and self.holding + sum(self.admitted.values()) >= limit:
            raise Unavailable(error)
        self.holding += 1
        try:
            return await self.replicas.hold(error, wait, self.metrics.held)
        finally:
            self.holding -= 1

    def _admit(self, replica: Replica, max_tokens: int) -> None:
        """Overloaded (429) where this request would wait past the maximum queue time on
        `replica`, or the gateway holds as many requests as it may. Until a request has
        finished there (a burst at start-up), a request is taken to hold its slot for
        max_tokens steps of the verifier's recent step time."""
        held = sum(self.admitted.values())
        limit = self.config.max_num_requests
        if limit and held >= limit:
            raise Overloaded(f"this server holds {held} requests, its limit; retry later",
                             retry_after_s=1)
        max_wait = self.config.max_queue_time_s
        if not max_wait or replica.report is None:
            return
        load = max(replica.load, self.admitted.get(replica.address, 0))
        service = self.service_times.get(replica.address)
        if service is None and replica.report.step_time_ema_ms > 0:
            service = max_tokens * replica.report.step_time_ema_ms / 1e3
        wait = expected_wait_s(load, max(replica.report.max_num_seqs, 1), service)
        if wait > max_wait:
            raise Overloaded(f"the server is busy: a request now would wait about {wait:.0f} s "
                             f"for its turn (limit {max_wait:.0f} s); retry later",
                             retry_after_s=retry_after_s(wait, max_wait))

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Delta]:
        generation = await self.open(req)
        async for delta in generation.deltas():
            yield delta
