"""Python SDK for the gateway's gRPC API (specdec.v1.Gateway).

    from specdec.client import Client
    with Client("127.0.0.1:50050") as client:
        print(client.chat([{"role": "user", "content": "Hi!"}], max_tokens=32).text)
        for chunk in client.generate("Once upon a time", max_tokens=32, stream=True,
                                     speculative={"method": "ngram"}):
            print(chunk.text, end="", flush=True)

Over TLS: `Client("gateway.example:50050", tls=True)` trusts the system's roots,
`ca_certs="ca.pem"` a CA of your own; `certfile` and `keyfile` add a client
certificate where the gateway requires one (mutual TLS). Without them the channel
is plaintext, as on loopback.

`AsyncClient` has the same methods as coroutines / async iterators. Errors are
typed (`InvalidRequestError`, `AuthenticationError`, `UnavailableError`, ...).
A call that fails with UNAVAILABLE before its first message (no replica up
yet, gateway restarting) is retried with backoff; once output has arrived it
is not, since a retry would repeat it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from specdec.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from specdec.server import GRPC_OPTIONS
from specdec.speculation import FINISH_REASONS, method_name, method_to_proto, reason_name
from specdec.structured import KINDS, from_kinds
from specdec.tls import TlsConfig, open_aio_channel, open_channel

# -- errors -------------------------------------------------------------------------

class SpecdecError(Exception):
    """A failed call; `code` is the gRPC status."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.message = message
        self.code = code


class InvalidRequestError(SpecdecError):
    pass


class AuthenticationError(SpecdecError):
    pass


class NotFoundError(SpecdecError):
    pass


class UnavailableError(SpecdecError):
    pass


class DeadlineExceededError(SpecdecError):
    pass


class OverloadedError(SpecdecError):
    """The server refused the request for now (RESOURCE_EXHAUSTED, HTTP's 429): retry
    after a while."""


_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
}


def _error(e: grpc.RpcError) -> SpecdecError:
    code = e.code()  # type: ignore[attr-defined]
    return _ERRORS.get(code, SpecdecError)(f"{code.name}: {e.details()}", code)  # type: ignore[attr-defined]


# -- results ------------------------------------------------------------------------

@dataclass(frozen=True)
class SpecDecode:
    method: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_length: float
    disabled_reason: str | None

    @classmethod
    def from_proto(cls, p: common_pb2.SpecDecodeStats) -> SpecDecode:
        return cls(method_name(p.method) or "unspecified", p.num_drafts, p.num_draft_tokens,
                   p.num_accepted_tokens, p.acceptance_length, reason_name(p.disabled_reason))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class Logprob:
    """A generated token's log-probability (natural log) and its rank among all tokens,
    with the `logprobs` most likely tokens at its position, most likely first."""

    token_id: int
    token: str
    logprob: float
    rank: int
    top_logprobs: list[TopLogprob]

    @classmethod
    def from_proto(cls, p: common_pb2.TokenLogprob) -> Logprob:
        return cls(p.token_id, p.token, p.logprob, p.rank,
                   [TopLogprob(t.token_id, t.token, t.logprob) for t in p.top_logprobs])


@dataclass(frozen=True)
class ToolCall:
    """A call the reply made: `arguments` is the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        """The call as an assistant message's tool_calls entry, for the history."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Chunk:
    """One streamed message: text and token ids added since the previous one, of choice
    `index` (0 unless the request asked for n > 1)."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[Logprob]
    # Last chunk of its choice only:
    finish_reason: str | None = None
    usage: Usage | None = None
    spec_decode: SpecDecode | None = None
    index: int = 0
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls this chunk completes


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: Usage | None
    spec_decode: SpecDecode | None
    logprobs: list[Logprob] = field(default_factory=list)
    index: int = 0
    tool_calls: list[ToolCall] = field(default_factory=list)


def _chunk(msg: Any) -> Chunk:
    text = msg.content if isinstance(msg, gateway_pb2.ChatResponse) else msg.text
    last = msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    return Chunk(msg.request_id, text, list(msg.token_ids),
                 [Logprob.from_proto(lp) for lp in msg.logprobs],
                 FINISH_REASONS.get(msg.finish_reason) if last else None,
                 Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens) if last else None,
                 SpecDecode.from_proto(msg.spec_decode) if last else None, msg.index,
                 [ToolCall(c.id, c.name, c.arguments)
                  for c in getattr(msg, "tool_calls", ())])


def _completions(chunks: Sequence[Chunk], n: int) -> Completion | list[Completion]:
    """The whole reply: a Completion, or with n > 1 one per choice in index order."""
    by_index: dict[int, list[Chunk]] = {}
    for c in chunks:
        by_index.setdefault(c.index, []).append(c)
    out = []
    for index in sorted(by_index):
        got = by_index[index]
        last = got[-1]
        out.append(Completion(last.request_id, "".join(c.text for c in got),
                              [t for c in got for t in c.token_ids], last.finish_reason,
                              last.usage, last.spec_decode,
                              [lp for c in got for lp in c.logprobs], index,
                              [t for c in got for t in c.tool_calls]))
    return out if n > 1 else out[0]


# -- requests -----------------------------------------------------------------------

def _speculation(spec: Mapping[str, Any] | None) -> common_pb2.SpeculationPolicy:
    if spec is None:
        return common_pb2.SpeculationPolicy()
    unknown = set(spec) - {"method", "num_speculative_tokens", "drafter"}
    if unknown:
        raise InvalidRequestError(f"speculative: unknown keys {sorted(unknown)}")
    try:
        method = method_to_proto(spec.get("method"))
    except (TypeError, ValueError):  # TypeError: an unhashable value
        raise InvalidRequestError(
            f"speculative.method: unknown method {spec.get('method')!r}") from None
    k = spec.get("num_speculative_tokens")
    policy = common_pb2.SpeculationPolicy(method=method, drafter=spec.get("drafter") or "")
    if k == "auto":
        policy.auto_k = True
    elif k is not None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise InvalidRequestError('speculative.num_speculative_tokens: a non-negative '
                                      'integer or "auto"')
        if k == 0:
            policy.method = common_pb2.SPEC_METHOD_NONE
        policy.num_speculative_tokens = k
    return policy


def _sampling(max_tokens: int = 0, temperature: float | None = None, top_p: float | None = None,
              top_k: int = 0, min_p: float = 0.0, seed: int | None = None,
              stop_token_ids: Sequence[int] = (), ignore_eos: bool = False,
              logprobs: int = 0, structured_output: Mapping[str, Any] | None = None,
              presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
              repetition_penalty: float | None = None,
              logit_bias: Mapping[int, float] | None = None, min_tokens: int = 0,
              allowed_token_ids: Sequence[int] = ()) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams(max_tokens=max_tokens, top_k=top_k, min_p=min_p,
                                  stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                  logprobs=logprobs, presence_penalty=presence_penalty,
                                  frequency_penalty=frequency_penalty,
                                  logit_bias=dict(logit_bias or {}), min_tokens=min_tokens,
                                  allowed_token_ids=list(allowed_token_ids))
    if repetition_penalty is not None:
        s.repetition_penalty = repetition_penalty
    if structured_output:
        # vLLM's structured_outputs form: one of json, json_object, regex, choice, grammar.
        try:
            spec = from_kinds(structured_output, "structured_output")
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        if spec is None:
            raise InvalidRequestError(f"structured_output: exactly one of {', '.join(KINDS)}")
        s.structured_output.CopyFrom(spec)
    if temperature is not None:
        s.temperature = temperature
    if top_p is not None:
        s.top_p = top_p
    if seed is not None:
        s.seed = seed
    return s


def _check_n(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidRequestError(f"n: a positive integer, got {n!r}")
    return n


def generate_request(prompt: str | Sequence[int], *, model: str = "", stop: Sequence[str] = (),
                     speculative: Mapping[str, Any] | None = None, stream: bool = False,
                     request_id: str = "", n: int = 1, cache_salt: str = "", priority: int = 0,
                     **sampling: Any) -> gateway_pb2.GatewayGenerateRequest:
    """cache_salt: vLLM's: the request shares cached prefixes, and what drafters learn
    across requests, only with requests of the same salt. priority: vLLM's: waiting
    requests are admitted lowest value first."""
    req = gateway_pb2.GatewayGenerateRequest(
        model=model, sampling=_sampling(**sampling), stop=list(stop),
        speculation=_speculation(speculative), stream=stream, request_id=request_id,
        n=_check_n(n), cache_salt=cache_salt, priority=priority)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def chat_request(messages: Sequence[Mapping[str, Any]], *, model: str = "",
                 stop: Sequence[str] = (), speculative: Mapping[str, Any] | None = None,
                 stream: bool = False, request_id: str = "", n: int = 1, cache_salt: str = "",
                 priority: int = 0, tools: Sequence[Mapping[str, Any]] | None = None,
                 tool_choice: str | Mapping[str, Any] | None = None,
                 parallel_tool_calls: bool | None = None, **sampling: Any
                 ) -> gateway_pb2.ChatRequest:
    """messages as OpenAI's: {"role", "content"}, an assistant's "tool_calls" (OpenAI's
    dicts or ToolCall), a tool message's "tool_call_id". tools as OpenAI's
    ({"type": "function", "function": {"name", "description", "parameters"}});
    tool_choice "none", "auto", "required", a function's name in
    {"type": "function", "function": {"name": ...}}. cache_salt and priority as
    generate_request's."""
    req = gateway_pb2.ChatRequest(
        model=model, messages=[_message(m, i) for i, m in enumerate(messages)],
        sampling=_sampling(**sampling), stop=list(stop), speculation=_speculation(speculative),
        stream=stream, request_id=request_id, n=_check_n(n), cache_salt=cache_salt,
        priority=priority)
    for i, tool in enumerate(tools or ()):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or tool.get("type") != "function":
            raise InvalidRequestError(f'tools[{i}]: {{"type": "function", "function": {{...}}}}')
        params = fn.get("parameters")
        req.tools.add(name=str(fn.get("name", "")), description=fn.get("description") or "",
                      parameters_json=json.dumps(params) if params is not None else "")
    if isinstance(tool_choice, str):
        req.tool_choice.mode = tool_choice
    elif isinstance(tool_choice, Mapping):
        name = (tool_choice.get("function") or {}).get("name")
        if not isinstance(name, str):
            raise InvalidRequestError('tool_choice: {"type": "function", "function": '
                                      '{"name": ...}}')
        req.tool_choice.function = name
    elif tool_choice is not None:
        raise InvalidRequestError(f"tool_choice: a string or an object, got {tool_choice!r}")
    if parallel_tool_calls is not None:
        req.parallel_tool_calls = parallel_tool_calls
    return req


def _message(m: Mapping[str, Any], i: int) -> gateway_pb2.ChatMessage:
    msg = gateway_pb2.ChatMessage(role=m["role"], content=m.get("content") or "",
                                  tool_call_id=m.get("tool_call_id") or "")
    for j, call in enumerate(m.get("tool_calls") or ()):
        if isinstance(call, ToolCall):
            call = call.to_openai()
        fn = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping):
            raise InvalidRequestError(f"messages[{i}].tool_calls[{j}]: a ToolCall or "
                                      f'{{"id", "function": {{"name", "arguments"}}}}')
        args = fn.get("arguments", "{}")
        msg.tool_calls.add(id=call.get("id") or "", name=fn.get("name") or "",
                           arguments=args if isinstance(args, str) else json.dumps(args))
    return msg


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _tls(tls: bool, ca_certs: str | None, certfile: str | None,
         keyfile: str | None) -> TlsConfig | None:
    """TLS when asked for or when any of its files is given; plaintext otherwise."""
    if not (tls or ca_certs or certfile or keyfile):
        return None
    return TlsConfig(certfile, keyfile, ca_certs)


# -- clients ------------------------------------------------------------------------

class Client:
    """Blocking client. `generate` / `chat` return a Completion (with n > 1 a list of
    them, one per choice), or with stream=True an iterator of Chunks (`index` says
    whose choice)."""

    def __init__(self, address: str = "127.0.0.1:50050", *, api_key: str | None = None,
                 timeout_s: float | None = None, max_retries: int = 3,
                 retry_backoff_s: float = 0.25, tls: bool = False,
                 ca_certs: str | None = None, certfile: str | None = None,
                 keyfile: str | None = None):
        self._channel = open_channel(address, _tls(tls, ca_certs, certfile, keyfile),
                                     GRPC_OPTIONS)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._metadata = _metadata(api_key)
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s

    def generate(self, prompt: str | Sequence[int], *, stream: bool = False, **kw: Any):
        req = generate_request(prompt, stream=stream, **kw)
        return self._call(self._stub.Generate, req, stream)

    def chat(self, messages: Sequence[Mapping[str, str]], *, stream: bool = False, **kw: Any):
        req = chat_request(messages, stream=stream, **kw)
        return self._call(self._stub.Chat, req, stream)

    def _call(self, rpc, req, stream: bool):
        chunks = self._stream(rpc, req)
        return chunks if stream else _completions(list(chunks), req.n)

    def _stream(self, rpc, req) -> Iterator[Chunk]:
        attempt = 0
        while True:
            received = False
            call = rpc(req, timeout=self.timeout_s, metadata=self._metadata)
            try:
                for msg in call:
                    received = True
                    yield _chunk(msg)
                return
            except grpc.RpcError as e:
                if (e.code() != grpc.StatusCode.UNAVAILABLE or received  # type: ignore[attr-defined]
                        or attempt >= self.max_retries):
                    raise _error(e) from None
            finally:
                call.cancel()  # an abandoned iterator frees the request on the server
            time.sleep(self.retry_backoff_s * 2 ** attempt)
            attempt += 1

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client: `await generate(...)` / `await chat(...)` return what Client's
    do, or with stream=True an async iterator of Chunks. Create it inside the event
    loop."""

    def __init__(self, address: str = "127.0.0.1:50050", *, api_key: str | None = None,
                 timeout_s: float | None = None, max_retries: int = 3,
                 retry_backoff_s: float = 0.25, tls: bool = False,
                 ca_certs: str | None = None, certfile: str | None = None,
                 keyfile: str | None = None):
        self._channel = open_aio_channel(address, _tls(tls, ca_certs, certfile, keyfile),
                                         GRPC_OPTIONS)
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._metadata = _metadata(api_key)
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s

    async def generate(self, prompt: str | Sequence[int], *, stream: bool = False, **kw: Any):
        req = generate_request(prompt, stream=stream, **kw)
        return await self._call(self._stub.Generate, req, stream)

    async def chat(self, messages: Sequence[Mapping[str, str]], *, stream: bool = False,
                   **kw: Any):
        req = chat_request(messages, stream=stream, **kw)
        return await self._call(self._stub.Chat, req, stream)

    async def _call(self, rpc, req, stream: bool):
        chunks = self._stream(rpc, req)
        if stream:
            return chunks
        return _completions([c async for c in chunks], req.n)

    async def _stream(self, rpc, req) -> AsyncIterator[Chunk]:
        attempt = 0
        while True:
            received = False
            call = rpc(req, timeout=self.timeout_s, metadata=self._metadata)
            try:
                async for msg in call:
                    received = True
                    yield _chunk(msg)
                return
            except grpc.RpcError as e:
                if (e.code() != grpc.StatusCode.UNAVAILABLE or received  # type: ignore[attr-defined]
                        or attempt >= self.max_retries):
                    raise _error(e) from None
            finally:
                call.cancel()  # an abandoned iterator frees the request on the server
            await asyncio.sleep(self.retry_backoff_s * 2 ** attempt)
            attempt += 1

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
