"""OpenAI-compatible REST front end (FastAPI): chat completions, completions,
models, health and Prometheus metrics, and vLLM's utility endpoints (/tokenize,
/detokenize, /version, /ping).

Request bodies are parsed here rather than by FastAPI's automatic
validation, because clients of the OpenAI API expect status 400 with an
`{"error": {...}}` body naming the offending parameter, not FastAPI's 422.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import time
import uuid
from collections.abc import AsyncIterator, Collection
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from gateway import tools
from gateway.choices import MAX_CHOICES, choice_requests, merged
from gateway.core import (
    Delta,
    Gateway,
    GatewayError,
    GenerationRequest,
    InvalidRequest,
    Overloaded,
)
from gateway.policy.request import SpeculativeRequest
from gateway.structured import StructuredOutputError, from_openai
from gateway.tools import ToolCall, ToolCallParser, ToolError, ToolRequest
from gateway.types import SpecDecodeSummary
from specdec.cache_salt import MAX_CACHE_SALT_CHARS
from specdec.json_depth import parse_json
from specdec.pb import common_pb2
from specdec.processors import LogitsProcessors

MAX_TOP_LOGPROBS = 20
# Largest integer the wire carries for counts (uint32 fields, signed-safe).
_MAX_COUNT = 2**31 - 1

# Fields of vLLM's and OpenAI's APIs that would change the output and that this server
# does not implement yet, with the value that means "off". A request that sets one to
# anything else is refused with 400 naming it, never served as if it had not asked.
# `functions` / `function_call` are OpenAI's deprecated forms of `tools` / `tool_choice`.
_NOT_IMPLEMENTED: dict[str, object] = {
    "guided_whitespace_pattern": None, "functions": None, "function_call": None,
    "logits_processors": None,
    "prompt_logprobs": None, "use_beam_search": False, "length_penalty": 1.0,
    "include_stop_str_in_output": False, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "truncate_prompt_tokens": None,
    "add_generation_prompt": True, "continue_final_message": False, "chat_template": None,
    "chat_template_kwargs": None, "documents": None, "prediction": None,
    "min_completion_tokens": None,
    # vLLM's chat echo of the last message.
    "echo": False,
}
# Values that mean "off" besides the one above (an empty list or object, ...).
_OFF_TOO = ([], {}, {"type": "text"}, "none")
# How often a non-streamed request checks that its client is still there.
_DISCONNECT_POLL_S = 0.25


class _Body(BaseModel):
    # Unknown fields are accepted and ignored, as OpenAI-compatible servers do: clients
    # send fields (user, metadata, ...) that do not change generation.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=_MAX_COUNT)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1, le=_MAX_COUNT)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, lt=2**64)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    # Seconds from admission to the last token (this API's extension); the server's
    # default applies when it is longer.
    timeout: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0, le=_MAX_COUNT)
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    speculative: dict[str, Any] | None = None
    # vLLM's: scopes the prefix cache and what drafters learn across requests
    # (specdec/cache_salt.py).
    cache_salt: str | None = Field(None, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's: logprobs name their tokens "token_id:<id>" (for tokens that are no text
    # of their own, such as a byte of a multi-byte character).
    return_tokens_as_token_ids: bool = False
    # vLLM's: the verifier admits waiting requests lowest value first.
    priority: int = Field(0, ge=-(2**31), lt=2**31)


class _Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers


class ChatBody(_Body):
    messages: list[_Message]
    max_completion_tokens: int | None = Field(None, ge=1, le=_MAX_COUNT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # The request's tools, checked once by chat_request (tools, tool_choice, ...).
    _tools: ToolRequest | None = PrivateAttr(None)


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[_Message] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's completions default; chat has none (the model's max length applies).
    max_tokens: int | None = Field(16, ge=1, le=_MAX_COUNT)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _error_response(status: int, message: str, error_type: str, param: str | None = None,
                    code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param, code), status_code=status)


def _from_gateway_error(e: GatewayError) -> JSONResponse:
    response = _error_response(e.http_status, e.message, e.error_type, e.param, e.code)
    if isinstance(e, Overloaded):
        response.headers["Retry-After"] = str(e.retry_after_s)
    return response


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ())]
    # Union members show up in the location ("stop.str"); the field is what matters.
    field = ".".join(x for x in loc if not x.startswith(("str", "list[", "dict[", "function")))
    return f"{field or 'body'}: {err.get('msg', 'invalid value')}", (loc[0] if loc else None)


def _text_content(content: str | list[dict[str, Any]] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequest(f"messages[{index}].content: only text parts are supported",
                                 param="messages")
        parts.append(part["text"])
    return "".join(parts)


class OpenAIFrontend:
    def __init__(self, gateway: Gateway):
        self.gw = gateway
        self.model = gateway.config.model_name
        self.created = int(time.time())

    # -- parsing ------------------------------------------------------------------

    async def _parse(self, request: Request, cls: type[_Body]) -> _Body:
        limit = self.gw.config.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _TooLarge(limit)
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise _TooLarge(limit)
        # Off the event loop: a body of megabytes takes tens of ms to parse, and every
        # stream this gateway serves would stall meanwhile.
        return await asyncio.to_thread(_decode_body, bytes(raw), cls)

    def _sampling(self, body: _Body, max_tokens: int | None, num_logprobs: int) -> common_pb2.SamplingParams:
        s = common_pb2.SamplingParams(max_tokens=max_tokens or 0, ignore_eos=body.ignore_eos,
                                      logprobs=num_logprobs)
        self._processors(body, s, max_tokens)
        if body.temperature is not None:
            s.temperature = body.temperature
        if body.top_p is not None:
            s.top_p = body.top_p
        if body.top_k is not None and body.top_k > 0:
            s.top_k = body.top_k
        if body.min_p:
            s.min_p = body.min_p
        if body.seed is not None:
            s.seed = body.seed
        vocab = self.gw.tokenizer.vocab_size
        for t in body.stop_token_ids or ():
            if not 0 <= t < vocab:
                raise InvalidRequest(f"stop_token_ids: {t} is outside the vocabulary",
                                     param="stop_token_ids")
        s.stop_token_ids.extend(body.stop_token_ids or ())
        return s

    def _processors(self, body: _Body, s: common_pb2.SamplingParams,
                    max_tokens: int | None) -> None:
        """The body's logits processors into `s`, checked (400 naming the field)."""
        s.presence_penalty = body.presence_penalty
        s.frequency_penalty = body.frequency_penalty
        if body.repetition_penalty is not None:
            s.repetition_penalty = body.repetition_penalty
        for key, bias in (body.logit_bias or {}).items():
            try:
                s.logit_bias[int(key)] = bias
            except (ValueError, OverflowError):
                raise InvalidRequest(f"logit_bias: keys are token ids, got {key!r}",
                                     param="logit_bias") from None
        s.min_tokens = body.min_tokens
        if max_tokens is not None and body.min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens: {body.min_tokens} exceeds max_tokens "
                                 f"{max_tokens}", param="min_tokens")
        tok = self.gw.tokenizer
        for word in body.bad_words or ():
            # As vLLM: the word as it would start the text, and after a space.
            for text in {word, " " + word.lstrip()}:
                ids = tok.encode(text)
                if ids:
                    s.bad_words.add(ids=ids)
        s.allowed_token_ids.extend(body.allowed_token_ids or ())
        try:
            LogitsProcessors.from_proto(s, tok.vocab_size, field="")
        except ValueError as e:
            raise InvalidRequest(str(e), param=str(e).split(":")[0]) from None

    @staticmethod
    def _structured(body: _Body, sampling: common_pb2.SamplingParams) -> str | None:
        """Puts the body's structured output into `sampling`; the field it came from."""
        try:
            structured, field = from_openai(body.model_extra or {})
        except StructuredOutputError as e:
            raise InvalidRequest(str(e), param=e.param) from None
        if structured is not None:
            sampling.structured_output.CopyFrom(structured)
        return field

    def _common(self, body: _Body) -> tuple[tuple[str, ...], SpeculativeRequest]:
        self.gw.check_model(body.model)
        for name, value in (body.model_extra or {}).items():
            if name in _NOT_IMPLEMENTED and value != _NOT_IMPLEMENTED[name] \
                    and not any(value == off and type(value) is type(off) for off in _OFF_TOO):
                raise InvalidRequest(f"{name}: not supported by this server yet (it would "
                                     f"change the output, so it is refused rather than "
                                     f"ignored)", param=name)
        stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
        try:
            spec = SpeculativeRequest.from_json(body.speculative)
        except ValueError as e:
            raise InvalidRequest(str(e), param="speculative") from None
        return stop, spec

    def chat_request(self, body: ChatBody) -> GenerationRequest:
        stop, spec = self._common(body)
        if body.max_tokens is not None and body.max_completion_tokens is not None \
                and body.max_tokens != body.max_completion_tokens:
            raise InvalidRequest("max_tokens and max_completion_tokens differ; send one",
                                 param="max_completion_tokens")
        num_logprobs = 0
        if body.logprobs:
            # The verifier reports the chosen token's logprob only with at least one
            # alternative; extra ones are trimmed to top_logprobs when rendering.
            num_logprobs = max(body.top_logprobs or 0, 1)
        elif body.top_logprobs:
            raise InvalidRequest("top_logprobs: needs logprobs=true", param="top_logprobs")
        body._tools = tool_request = _tool_request(body.model_extra or {})
        prompt = self._chat_prompt(body.messages, tool_request)
        sampling = self._sampling(body, body.max_completion_tokens or body.max_tokens,
                                  num_logprobs)
        try:
            structured_field = tools.constrain(tool_request, sampling,
                                               self._structured(body, sampling))
        except ToolError as e:
            raise InvalidRequest(str(e), param=e.param) from None
        return GenerationRequest(tuple(prompt), sampling, stop, spec, prompt_field="messages",
                                 structured_field=structured_field,
                                 request_id=f"chatcmpl-{uuid.uuid4().hex}",
                                 timeout_s=body.timeout, cache_salt=body.cache_salt or "",
                                 priority=body.priority)

    def _chat_prompt(self, messages: list[_Message], tool_request: ToolRequest | None
                     ) -> list[int]:
        return self.gw.chat_prompt(
            [{"role": "system" if m.role == "developer" else m.role,
              "content": _text_content(m.content, i), "tool_calls": m.tool_calls,
              "tool_call_id": m.tool_call_id} for i, m in enumerate(messages)], tool_request)

    def chat_requests(self, body: ChatBody) -> list[GenerationRequest]:
        """The request's choices: n copies of its conversation."""
        _check_best_of(body)
        return choice_requests([self.chat_request(body)], body.n)

    def completion_requests(self, body: CompletionBody) -> list[GenerationRequest]:
        """The request's choices: n per prompt of the list, in order (choice index =
        prompt index * n + i, as vLLM numbers them)."""
        _check_best_of(body)
        stop, spec = self._common(body)
        if body.echo and body.logprobs is not None:
            raise InvalidRequest("echo: with logprobs it needs the prompt's logprobs, which "
                                 "this server does not compute", param="echo")
        if body.suffix:
            raise InvalidRequest("suffix: not supported", param="suffix")
        prompts = body.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]
        if len(prompts) * body.n > MAX_CHOICES:
            raise InvalidRequest(f"prompt: {len(prompts)} prompts x n={body.n} is over "
                                 f"{MAX_CHOICES} choices per request", param="prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        num_logprobs = body.logprobs if body.logprobs else (1 if body.logprobs == 0 else 0)
        reqs = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, list) and any(not isinstance(t, int) for t in prompt):
                raise InvalidRequest(f"prompt[{i}]: token ids must be integers", param="prompt")
            ids = self.gw.text_prompt(prompt) if isinstance(prompt, str) else list(prompt)
            sampling = self._sampling(body, body.max_tokens, num_logprobs)
            reqs.append(GenerationRequest(
                tuple(ids), sampling, stop, spec,
                prompt_field="prompt" if len(prompts) == 1 else f"prompt[{i}]",
                structured_field=self._structured(body, sampling),
                request_id=rid if len(prompts) == 1 else f"{rid}-p{i}", timeout_s=body.timeout,
                cache_salt=body.cache_salt or "", priority=body.priority))
        return choice_requests(reqs, body.n)

    # -- rendering ----------------------------------------------------------------

    def _token(self, token_id: int, as_id: bool) -> str:
        """A token as logprobs name it: its text, or "token_id:<id>" (vLLM's
        return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if as_id else self.gw.token_text(token_id)

    def chat_logprobs(self, logprobs: list[common_pb2.TokenLogprob], top: int,
                      as_ids: bool = False) -> dict:
        content = []
        for lp in logprobs:
            tok = self._token(lp.token_id, as_ids)
            content.append({
                "token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
                "top_logprobs": [
                    {"token": (t := self._token(a.token_id, as_ids)), "logprob": a.logprob,
                     "bytes": list(t.encode())} for a in lp.top_logprobs[:top]]})
        return {"content": content}

    def completion_logprobs(self, logprobs: list[common_pb2.TokenLogprob], top: int,
                            offset: int, as_ids: bool = False) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        for lp in logprobs:
            tokens.append(self._token(lp.token_id, as_ids))
            values.append(lp.logprob)
            tops.append({self._token(a.token_id, as_ids): a.logprob
                         for a in lp.top_logprobs[:top]})
            offsets.append(offset)  # into the text, whatever the tokens are called
            offset += len(self.gw.token_text(lp.token_id))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    @staticmethod
    def usage(delta: Delta) -> dict:
        u = delta.usage
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                "total_tokens": u.prompt_tokens + u.completion_tokens}

    # -- handlers -----------------------------------------------------------------

    async def _admit(self, request: Request, cls: type[_Body], build):
        """Parse, translate (`build`: the request's choices) and admit every choice:
        (body, generations), or the error response of the first step that refuses it.
        Nothing reaches a verifier before every choice is admitted."""
        opened = []
        try:
            body = await self._parse(request, cls)
            # Tokenizing and rendering the chat template off the event loop, likewise.
            for r in await asyncio.to_thread(build, body):
                opened.append(await self.gw.open(r))
            if body.stream:
                # A streamed reply's 200 goes out with its first event: wait until the
                # verifier has taken every choice, so a refusal is still a 429 / 400.
                for g in opened:
                    await g.start()
            return body, opened
        except GatewayError as e:
            for g in opened:  # admitted choices of a refused request never run
                g.close()
            return _from_gateway_error(e)
        except _TooLarge as e:
            return e.response()

    async def chat(self, request: Request) -> Response:
        admitted = await self._admit(request, ChatBody, self.chat_requests)
        if isinstance(admitted, Response):
            return admitted
        body, generations = admitted
        rid = _response_id(generations)  # the id in every log and trace
        top = body.top_logprobs or 0
        # Function names whose calls the output is parsed for (None: plain text).
        names = body._tools.names if body._tools is not None and body._tools.parses else None
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return _sse(_usage_as_it_goes(
                self._chat_chunks(generations, rid, body.logprobs, top, include_usage, names,
                                  body.return_tokens_as_token_ids), body, generations, 1))
        try:
            wholes = await _collect(request, [g.deltas() for g in generations])
        except GatewayError as e:
            return _from_gateway_error(e)
        if wholes is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        finals = [last for _, _, last in wholes]
        choices = []
        for i, (text, logprobs, last) in enumerate(wholes):
            message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
            finish = last.finish_reason
            if names is not None:
                content, calls = tools.parse(message["content"], names)
                if calls:
                    message = {"role": "assistant", "content": content,
                               "tool_calls": [c.to_json() for c in calls]}
                    finish = tools.finish_reason(finish, len(calls))
            choices.append({
                "index": i, "message": message,
                "logprobs": (self.chat_logprobs(logprobs, top, body.return_tokens_as_token_ids)
                             if body.logprobs else None),
                "finish_reason": finish})
            if len(wholes) > 1:
                choices[-1]["spec_decode"] = last.spec_decode.to_json()
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": self.model, "choices": choices, "usage": _usage(finals, 1),
            "spec_decode": _spec_decode([d.spec_decode for d in finals])})

    async def _chat_chunks(self, generations: list, rid: str, want_logprobs: bool,
                           top: int, include_usage: bool,
                           names: Collection[str] | None, as_ids: bool) -> AsyncIterator[dict]:
        """Chunks as OpenAI streams them; with `names`, the output's tool calls as
        tool-call deltas (a call's id, type and name, then its arguments), the text a call
        might start held back until it is known (gateway/tools.py)."""
        created = int(time.time())
        n = len(generations)
        parsers = [ToolCallParser(names) if names is not None else None for _ in range(n)]

        def chunk(index: int, delta: dict, finish: str | None = None,
                  logprobs: dict | None = None) -> dict:
            return {"id": rid, "object": "chat.completion.chunk", "created": created,
                    "model": self.model,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                 "finish_reason": finish}]}

        finals: list[Delta | None] = [None] * n
        started = [False] * n
        async for i, delta in merged([g.deltas() for g in generations]):
            if not started[i]:
                # The role chunk comes with the choice's first output, as vLLM sends it:
                # clients (`vllm bench serve` among them) time the first token from the
                # first chunk, which sent at admission would be the prompt's queue and
                # prefill left out of it.
                started[i] = True
                yield chunk(i, {"role": "assistant", "content": ""})
            lp = self.chat_logprobs(delta.logprobs, top, as_ids) if want_logprobs else None
            parser = parsers[i]
            if parser is None:
                events: list[str | ToolCall] = [delta.text] if delta.text else []
            else:
                events = parser.step(delta.text, bool(delta.finish))
            calls = parser.calls if parser is not None else 0  # this choice's, so far
            pieces = _delta_pieces(events, calls - sum(isinstance(e, ToolCall) for e in events))
            # The last text rides on the final chunk, as without tools.
            tail = pieces.pop() if delta.finish and pieces and "content" in pieces[-1] else {}
            for k, piece in enumerate(pieces):
                yield chunk(i, piece, None, lp if k == 0 else None)
            if delta.finish:
                finals[i] = delta
                finish = tools.finish_reason(delta.finish_reason, calls)
                out = chunk(i, tail, finish, None if pieces else lp)
                out["spec_decode"] = delta.spec_decode.to_json()
                yield out
            elif lp and not pieces:
                yield chunk(i, {"content": ""}, None, lp)
        if include_usage and all(finals):
            yield {"id": rid, "object": "chat.completion.chunk", "created": created,
                   "model": self.model, "choices": [], "usage": _usage(finals, 1),
                   "spec_decode": _spec_decode([d.spec_decode for d in finals])}

    async def completions(self, request: Request) -> Response:
        admitted = await self._admit(request, CompletionBody, self.completion_requests)
        if isinstance(admitted, Response):
            return admitted
        body, generations = admitted
        rid = _response_id(generations)
        prompts = len(generations) // body.n
        want_logprobs = body.logprobs is not None
        top = body.logprobs or 0
        echo = [self._prompt_text(g) if body.echo else "" for g in generations]
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            return _sse(_usage_as_it_goes(
                self._completion_chunks(generations, rid, want_logprobs, top, include_usage,
                                        echo, prompts, body.return_tokens_as_token_ids),
                body, generations, prompts))
        try:
            wholes = await _collect(request, [g.deltas() for g in generations])
        except GatewayError as e:
            return _from_gateway_error(e)
        if wholes is None:
            return Response(status_code=499)
        finals = [last for _, _, last in wholes]
        choices = []
        for i, (text, logprobs, last) in enumerate(wholes):
            choices.append({
                "index": i, "text": echo[i] + "".join(text),
                "logprobs": (self.completion_logprobs(logprobs, top, 0,
                                                      body.return_tokens_as_token_ids)
                             if want_logprobs else None),
                "finish_reason": last.finish_reason})
            if len(wholes) > 1:
                choices[-1]["spec_decode"] = last.spec_decode.to_json()
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": int(time.time()),
            "model": self.model, "choices": choices, "usage": _usage(finals, prompts),
            "spec_decode": _spec_decode([d.spec_decode for d in finals])})

    def _prompt_text(self, generation) -> str:
        return self.gw.tokenizer.decode(list(generation.req.prompt_token_ids))

    async def _completion_chunks(self, generations: list, rid: str, want_logprobs: bool,
                                 top: int, include_usage: bool, echo: list[str],
                                 prompts: int, as_ids: bool) -> AsyncIterator[dict]:
        created = int(time.time())
        n = len(generations)
        offsets = [0] * n
        finals: list[Delta | None] = [None] * n

        def chunk(i: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
            return {"id": rid, "object": "text_completion", "created": created,
                    "model": self.model,
                    "choices": [{"index": i, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish}]}

        for i, text in enumerate(echo):
            if text:
                yield chunk(i, text, None, None)
        async for i, delta in merged([g.deltas() for g in generations]):
            if not (delta.text or delta.finish or (want_logprobs and delta.logprobs)):
                continue
            lp = (self.completion_logprobs(delta.logprobs, top, offsets[i], as_ids)
                  if want_logprobs else None)
            out = chunk(i, delta.text, lp, delta.finish_reason)
            offsets[i] += len(delta.text)
            if delta.finish:
                finals[i] = delta
                out["spec_decode"] = delta.spec_decode.to_json()
            yield out
        if include_usage and all(finals):
            yield {"id": rid, "object": "text_completion", "created": created,
                   "model": self.model, "choices": [], "usage": _usage(finals, prompts),
                   "spec_decode": _spec_decode([d.spec_decode for d in finals])}

    def _model_card(self) -> dict:
        # vLLM's model card: `root` and `parent` too (`vllm bench serve` reads root).
        return {"id": self.model, "object": "model", "created": self.created,
                "owned_by": "specdec", "root": self.gw.config.model_root or self.model,
                "parent": None,
                "max_model_len": (r.max_model_len if (r := self.gw.replicas.reference()) else None)}

    async def models(self) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model_by_id(self, request: Request) -> Response:
        try:
            self.gw.check_model(request.path_params["model_id"])
        except GatewayError as e:
            return _from_gateway_error(e)
        return JSONResponse(self._model_card())

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a prompt, or chat messages through the chat template."""
        try:
            body = await self._parse(request, TokenizeBody)
            self.gw.check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise InvalidRequest("prompt: send either prompt or messages", param="prompt")
            if body.messages is not None and not body.add_generation_prompt:
                raise InvalidRequest("add_generation_prompt: only true is supported",
                                     param="add_generation_prompt")
            # Templating and tokenizing a long text take milliseconds: off the event loop.
            ids = await asyncio.to_thread(self._tokenize_ids, body)
        except _TooLarge as e:
            return e.response()
        except GatewayError as e:
            return _from_gateway_error(e)
        report = self.gw.replicas.reference()
        return JSONResponse({"count": len(ids), "tokens": list(ids), "token_strs": None,
                             "max_model_len": report.max_model_len if report else None})

    def _tokenize_ids(self, body: TokenizeBody) -> list[int]:
        if body.messages is not None:
            return self._chat_prompt(body.messages, _tool_request({"tools": body.tools}))
        return self.gw.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._parse(request, DetokenizeBody)
            self.gw.check_model(body.model)
            vocab = self.gw.tokenizer.vocab_size
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                raise InvalidRequest(f"tokens: {bad[:3]} are outside the vocabulary (size "
                                     f"{vocab})", param="tokens")
        except _TooLarge as e:
            return e.response()
        except GatewayError as e:
            return _from_gateway_error(e)
        return JSONResponse({"prompt": self.gw.tokenizer.decode(body.tokens)})

    async def version(self) -> JSONResponse:
        return JSONResponse({"version": _version()})

    async def ping(self) -> Response:
        # vLLM's liveness probe: 200 while a verifier can serve, 503 otherwise.
        return Response(status_code=200 if self.gw.replicas.healthy() else 503)

    async def health(self) -> Response:
        healthy = self.gw.replicas.healthy()
        if not healthy:
            return JSONResponse({"status": "unavailable", "verifiers": [
                {"address": r.address, "error": r.error} for r in self.gw.replicas.replicas]},
                status_code=503)
        return JSONResponse({"status": "ok", "verifiers": [
            {"address": r.address, "healthy": r.healthy} for r in self.gw.replicas.replicas]})

    async def metrics(self) -> Response:
        m = self.gw.metrics
        for r in self.gw.replicas.replicas:
            if r.report is not None:
                m.observe_verifier(r.address, r.report)
        return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


class _TooLarge(Exception):
    def __init__(self, limit: int):
        super().__init__(limit)
        self.limit = limit

    def response(self) -> JSONResponse:
        return _error_response(413, f"the request body is over this server's limit of "
                               f"{self.limit} bytes", "invalid_request_error")


async def _collect(request: Request, streams: list[AsyncIterator[Delta]]
                   ) -> list[tuple[list[str], list[common_pb2.TokenLogprob], Delta]] | None:
    """Whole non-streamed completions, one per choice, or None if the client went away
    first. Starlette does not cancel a handler whose client disconnects, so this watches
    for it: a request nobody will read must not keep its sequences running in the
    verifier."""
    n = len(streams)
    text: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[common_pb2.TokenLogprob]] = [[] for _ in range(n)]
    last: list[Delta | None] = [None] * n

    async def consume() -> None:
        async for i, delta in merged(streams):
            text[i].append(delta.text)
            logprobs[i].extend(delta.logprobs)
            last[i] = delta

    task = asyncio.create_task(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                task.result()  # raises what a generation raised
                return [(text[i], logprobs[i], last[i]) for i in range(n)]
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()  # closes the generations, which cancels the verifier streams
            await asyncio.gather(task, return_exceptions=True)


def _response_id(generations: list) -> str:
    """The response's id: the request id ("chatcmpl-<hex>", "cmpl-<hex>") without the
    suffixes of a prompt ("-p<i>") or a choice ("-<i>")."""
    return "-".join(generations[0].request_id.split("-")[:2])


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def events() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
        except GatewayError as e:
            # Headers are gone already; OpenAI streams report late errors as an event.
            body = error_body(e.message, e.error_type, e.param, e.code)
            yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _version() -> str:
    try:
        return importlib.metadata.version("specdec")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def create_app(gateway: Gateway) -> FastAPI:
    front = OpenAIFrontend(gateway)
    app = FastAPI(title="specdec gateway", docs_url=None, redoc_url=None, openapi_url=None)
    api_key = gateway.config.api_key

    def authenticated(handler):
        # A plain wrapper rather than an HTTP middleware: Starlette's middleware wraps
        # streaming bodies in a way that hides a client's disconnect from the handler.
        async def check(request: Request) -> Response:
            if api_key:
                scheme, _, token = request.headers.get("authorization", "").partition(" ")
                # compare_digest: the time taken must not reveal how much of the key matched.
                if scheme.lower() != "bearer" or not hmac.compare_digest(
                        token.strip().encode(), api_key.encode()):
                    return _error_response(401, "missing or invalid API key (send "
                                           "`Authorization: Bearer <key>`)",
                                           "invalid_request_error", code="invalid_api_key")
            return await handler(request)
        return check

    async def models(request: Request) -> Response:
        return await front.models()

    app.add_api_route("/v1/chat/completions", authenticated(front.chat), methods=["POST"])
    app.add_api_route("/v1/completions", authenticated(front.completions), methods=["POST"])
    app.add_api_route("/v1/models", authenticated(models), methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", authenticated(front.model_by_id), methods=["GET"])
    app.add_api_route("/tokenize", authenticated(front.tokenize), methods=["POST"])
    app.add_api_route("/detokenize", authenticated(front.detokenize), methods=["POST"])
    app.add_api_route("/version", front.version, methods=["GET"])
    app.add_api_route("/ping", front.ping, methods=["GET", "POST"])
    app.add_api_route("/health", front.health, methods=["GET"])
    app.add_api_route("/metrics", front.metrics, methods=["GET"])
    app.state.frontend = front
    return app


def _tool_request(extra: dict[str, Any]) -> ToolRequest | None:
    try:
        return tools.from_openai(extra)
    except ToolError as e:
        raise InvalidRequest(str(e), param=e.param) from None


def _delta_pieces(events: list[str | ToolCall], first_index: int) -> list[dict]:
    """Stream deltas of a choice's parsed events: text runs as content; each tool call
    (numbered from `first_index` in its choice) as OpenAI streams one, its id, type and
    name first, then its arguments."""
    pieces: list[dict] = []
    index = first_index
    for e in events:
        if isinstance(e, str):
            if pieces and "content" in pieces[-1]:
                pieces[-1]["content"] += e
            else:
                pieces.append({"content": e})
            continue
        pieces.append({"tool_calls": [{"index": index, "id": e.id, "type": "function",
                                       "function": {"name": e.name, "arguments": ""}}]})
        pieces.append({"tool_calls": [{"index": index,
                                       "function": {"arguments": e.arguments}}]})
        index += 1
    return pieces


def _decode_body(raw: bytes, cls: type[_Body]) -> _Body:
    try:
        obj = parse_json(raw, "the body")
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    if not isinstance(obj, dict):
        raise InvalidRequest("the body must be a JSON object")
    try:
        return cls.model_validate(obj)
    except ValidationError as e:
        msg, param = _validation_message(e)
        raise InvalidRequest(msg, param=param) from None


def _check_best_of(body: _Body) -> None:
    # best_of > n ranks extra samples by likelihood and returns the best: not implemented.
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequest(f"best_of: only best_of = n is supported (got best_of="
                             f"{body.best_of}, n={body.n})", param="best_of")
    if body.n > MAX_CHOICES:
        raise InvalidRequest(f"n: at most {MAX_CHOICES}", param="n")


def _spec_decode(summaries: list) -> dict:
    """The request's spec_decode over its choices: counts summed."""
    if len(summaries) == 1:
        return summaries[0].to_json()
    first = summaries[0]
    total = SpecDecodeSummary(method=first.method, disabled_reason=first.disabled_reason)
    for s in summaries:
        total.num_drafts += s.num_drafts
        total.num_draft_tokens += s.num_draft_tokens
        total.num_accepted_tokens += s.num_accepted_tokens
    return total.to_json()


async def _usage_as_it_goes(chunks: AsyncIterator[dict], body: _Body, generations: list,
                            prompts: int) -> AsyncIterator[dict]:
    """The chunks, each with the usage so far when the request asks for it (vLLM's
    stream_options.continuous_usage_stats, with include_usage): prompt tokens once per
    prompt, completion tokens received so far over every choice."""
    options = body.stream_options or {}
    if not (options.get("include_usage") and options.get("continuous_usage_stats")):
        async for c in chunks:
            yield c
        return
    per_prompt = len(generations) // prompts
    prompt_tokens = sum(len(generations[i * per_prompt].req.prompt_token_ids)
                        for i in range(prompts))
    done = 0
    async for c in chunks:
        if c.get("choices"):
            # A role chunk carries no tokens (it leads its choice's first output, which
            # the generation already counts): the usage before it.
            if "role" not in c["choices"][0]["delta"]:
                done = sum(len(g.progress.generated) for g in generations)
            c["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": done,
                          "total_tokens": prompt_tokens + done}
        yield c


def _usage(finals: list[Delta], prompts: int) -> dict:
    """Prompt tokens once per prompt (its n choices share it), completion tokens summed."""
    per_prompt = len(finals) // prompts
    prompt_tokens = sum(finals[i * per_prompt].usage.prompt_tokens for i in range(prompts))
    completion = sum(d.usage.completion_tokens for d in finals)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}
