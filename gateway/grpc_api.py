"""The gateway's gRPC API (specdec.v1.Gateway): Generate and Chat, for the SDK."""

from __future__ import annotations

import asyncio
import hmac
import uuid

import grpc

from gateway import tools
from gateway.choices import MAX_CHOICES, choice_requests, merged
from gateway.core import Delta, Gateway, GatewayError, GenerationRequest, InvalidRequest
from gateway.policy.request import SpeculativeRequest
from gateway.tools import ToolCall, ToolCallParser, ToolError, ToolRequest
from specdec.cache_salt import check_cache_salt
from specdec.json_depth import parse_json
from specdec.pb import common_pb2, gateway_pb2, gateway_pb2_grpc
from specdec.speculation import method_name


def speculative_from_proto(p: common_pb2.SpeculationPolicy) -> SpeculativeRequest:
    method = method_name(p.method)
    if method is None and p.method != common_pb2.SPEC_METHOD_UNSPECIFIED:
        raise InvalidRequest(f"speculation.method: unknown value {p.method}")
    return SpeculativeRequest(method=method,
                              num_speculative_tokens=p.num_speculative_tokens or None,
                              auto=p.auto_k, drafter=p.drafter or None)


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, gateway: Gateway):
        self.gw = gateway

    async def _check_auth(self, context: grpc.aio.ServicerContext) -> None:
        key = self.gw.config.api_key
        if not key:
            return
        md = dict(context.invocation_metadata() or ())
        scheme, _, token = str(md.get("authorization", "")).partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                                 key.encode()):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or invalid API key (metadata authorization: Bearer <key>)")

    def _requests(self, model: str, prompt: list[int], sampling: common_pb2.SamplingParams,
                  stop, speculation: common_pb2.SpeculationPolicy, request_id: str,
                  prompt_field: str, n: int, tool_request: ToolRequest | None = None,
                  timeout_s: float | None = None, cache_salt: str = "", priority: int = 0
                  ) -> list[GenerationRequest]:
        """The request's choices, checked. timeout_s: the call's deadline, if it has one."""
        self.gw.check_model(model)
        try:
            check_cache_salt(cache_salt)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        limit = self.gw.config.limits.max_tokens
        if limit and sampling.max_tokens > limit:
            raise InvalidRequest(f"sampling.max_tokens: {sampling.max_tokens} is over this "
                                 f"server's limit of {limit}")
        if sampling.HasField("temperature") and sampling.temperature < 0:
            raise InvalidRequest("sampling.temperature: must be >= 0")
        if sampling.HasField("top_p") and not 0 < sampling.top_p <= 1:
            raise InvalidRequest("sampling.top_p: must be in (0, 1]")
        if n > MAX_CHOICES:
            raise InvalidRequest(f"n: at most {MAX_CHOICES}, got {n}")
        structured_field = ("sampling.structured_output"
                            if sampling.HasField("structured_output") else None)
        if tool_request is not None:
            sampling = _copy(sampling)
            try:
                structured_field = tools.constrain(tool_request, sampling, structured_field)
            except ToolError as e:
                raise InvalidRequest(str(e)) from None
        # Choices need an id to suffix; the same form the gateway would make up.
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        req = GenerationRequest(tuple(prompt), sampling, tuple(stop),
                                speculative_from_proto(speculation), request_id,
                                prompt_field=prompt_field, structured_field=structured_field,
                                timeout_s=timeout_s, cache_salt=cache_salt, priority=priority)
        return choice_requests([req], max(n, 1))

    async def _run(self, reqs: list[GenerationRequest], stream: bool, context, make,
                   names: frozenset[str] | None = None):
        """Every choice admitted before any runs; then streamed deltas, each tagged with
        its choice, or one whole message per choice in index order. With `names`, each
        choice's text is parsed for calls of those functions: a call leaves the text
        and comes whole in the message that completes it (make's last argument)."""
        generations = []
        try:
            for r in reqs:
                generations.append(await self.gw.open(r))
            ids = [g.request_id for g in generations]
            if stream:
                parsers = [ToolCallParser(names) if names is not None else None
                           for _ in generations]
                async for i, delta in merged([g.deltas() for g in generations]):
                    calls: list[ToolCall] = []
                    parser = parsers[i]
                    if parser is not None:
                        events = parser.step(delta.text, bool(delta.finish))
                        delta.text = "".join(e for e in events if isinstance(e, str))
                        calls = [e for e in events if isinstance(e, ToolCall)]
                        if delta.finish:
                            delta.finish = _finish(delta, parser.calls)
                    if delta.text or delta.token_ids or delta.finish or calls:
                        yield make(ids[i], i, delta, calls)
                return
            wholes = [Delta() for _ in generations]
            async for i, delta in merged([g.deltas() for g in generations]):
                whole = wholes[i]
                whole.text += delta.text
                whole.token_ids += delta.token_ids
                whole.logprobs += delta.logprobs
                whole.finish, whole.usage, whole.spec_decode = (delta.finish, delta.usage,
                                                                delta.spec_decode)
            for i, whole in enumerate(wholes):
                calls = []
                if names is not None:
                    content, calls = tools.parse(whole.text, names)
                    whole.text = content or ""
                    whole.finish = _finish(whole, len(calls))
                yield make(ids[i], i, whole, calls)
        except GatewayError as e:
            for g in generations:  # a choice never read is over too
                g.close()
            await context.abort(e.grpc_code, e.message)

    def _fill(self, msg, delta: Delta):
        msg.token_ids.extend(delta.token_ids)
        for lp in delta.logprobs:
            out = msg.logprobs.add()
            out.CopyFrom(lp)
            out.token = self.gw.token_text(lp.token_id)
            for top in out.top_logprobs:
                top.token = self.gw.token_text(top.token_id)
        msg.model = self.gw.config.model_name
        if delta.finish:
            msg.finish_reason = delta.finish
            msg.usage.CopyFrom(delta.usage)
            msg.spec_decode.CopyFrom(delta.spec_decode.to_proto())
        return msg

    async def Generate(self, request: gateway_pb2.GatewayGenerateRequest, context):
        await self._check_auth(context)
        try:
            kind = request.WhichOneof("prompt")
            if kind == "text":
                # Off the event loop: a long prompt takes a while to tokenize.
                prompt = await asyncio.to_thread(self.gw.text_prompt, request.text)
            elif kind == "token_ids":
                prompt = list(request.token_ids.ids)
            else:
                raise InvalidRequest("prompt: set text or token_ids")
            reqs = self._requests(request.model, prompt, request.sampling, request.stop,
                                  request.speculation, request.request_id, kind or "prompt",
                                  request.n, timeout_s=context.time_remaining(),
                                  cache_salt=request.cache_salt, priority=request.priority)
        except GatewayError as e:
            await context.abort(e.grpc_code, e.message)

        def make(rid: str, index: int, delta: Delta, calls: list[ToolCall]
                 ) -> gateway_pb2.GatewayGenerateResponse:
            return self._fill(gateway_pb2.GatewayGenerateResponse(
                request_id=rid, text=delta.text, index=index), delta)

        async for msg in self._run(reqs, request.stream, context, make):
            yield msg

    async def Chat(self, request: gateway_pb2.ChatRequest, context):
        await self._check_auth(context)
        try:
            messages = []
            for i, m in enumerate(request.messages):
                if m.role not in ("system", "user", "assistant", "tool"):
                    raise InvalidRequest(f"messages[{i}].role: must be system, user, assistant "
                                         f"or tool, got {m.role!r}")
                messages.append({
                    "role": m.role, "content": m.content, "tool_call_id": m.tool_call_id or None,
                    "tool_calls": [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}}
                                   for c in m.tool_calls] or None})
            tool_request = _tool_request(request)
            prompt = await asyncio.to_thread(self.gw.chat_prompt, messages, tool_request)
            reqs = self._requests(request.model, prompt, request.sampling, request.stop,
                                  request.speculation, request.request_id, "messages",
                                  request.n, tool_request, timeout_s=context.time_remaining(),
                                  cache_salt=request.cache_salt, priority=request.priority)
        except GatewayError as e:
            await context.abort(e.grpc_code, e.message)

        def make(rid: str, index: int, delta: Delta, calls: list[ToolCall]
                 ) -> gateway_pb2.ChatResponse:
            msg = gateway_pb2.ChatResponse(request_id=rid, content=delta.text, index=index)
            msg.tool_calls.extend(gateway_pb2.ToolCall(id=c.id, name=c.name,
                                                       arguments=c.arguments) for c in calls)
            return self._fill(msg, delta)

        names = tool_request.names if tool_request is not None and tool_request.parses else None
        async for msg in self._run(reqs, request.stream, context, make, names):
            yield msg


def _copy(sampling: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
    out = common_pb2.SamplingParams()
    out.CopyFrom(sampling)
    return out


def _finish(delta: Delta, calls: int) -> int:
    """The proto finish reason, TOOL_CALLS where the reply ended on its own after calls
    (as tools.finish_reason decides it for REST)."""
    if tools.finish_reason(delta.finish_reason, calls) == "tool_calls":
        return common_pb2.FINISH_REASON_TOOL_CALLS
    return delta.finish


def _tool_request(request: gateway_pb2.ChatRequest) -> ToolRequest | None:
    """ChatRequest's tools, tool_choice and parallel_tool_calls, checked as REST's are."""
    extra: dict = {}
    if request.tools:
        functions = []
        for i, f in enumerate(request.tools):
            fn: dict = {"name": f.name}
            if f.description:
                fn["description"] = f.description
            if f.parameters_json:
                try:
                    fn["parameters"] = parse_json(f.parameters_json, f"tools[{i}].parameters_json")
                except ValueError as e:
                    raise InvalidRequest(str(e)) from None
            functions.append({"type": "function", "function": fn})
        extra["tools"] = functions
    kind = request.tool_choice.WhichOneof("choice")
    if kind == "mode":
        extra["tool_choice"] = request.tool_choice.mode
    elif kind == "function":
        extra["tool_choice"] = {"type": "function",
                                "function": {"name": request.tool_choice.function}}
    if request.HasField("parallel_tool_calls"):
        extra["parallel_tool_calls"] = request.parallel_tool_calls
    try:
        return tools.from_openai(extra)
    except ToolError as e:
        raise InvalidRequest(str(e)) from None
