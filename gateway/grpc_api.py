"""The gateway's gRPC API (specdec.v1.Gateway): Generate and Chat, for the SDK."""

from __future__ import annotations

import hmac
import uuid

import grpc

from gateway.choices import MAX_CHOICES, choice_requests, merged
from gateway.core import Delta, Gateway, GatewayError, GenerationRequest, InvalidRequest
from gateway.policy.request import SpeculativeRequest
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
                  prompt_field: str, n: int) -> list[GenerationRequest]:
        """The request's choices, checked."""
        self.gw.check_model(model)
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
        # Choices need an id to suffix; the same form the gateway would make up.
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        req = GenerationRequest(tuple(prompt), sampling, tuple(stop),
                                speculative_from_proto(speculation), request_id,
                                prompt_field=prompt_field)
        return choice_requests([req], max(n, 1))

    async def _run(self, reqs: list[GenerationRequest], stream: bool, context, make):
        """Every choice admitted before any runs; then streamed deltas, each tagged with
        its choice, or one whole message per choice in index order."""
        try:
            generations = [await self.gw.open(r) for r in reqs]
            ids = [g.request_id for g in generations]
            if stream:
                async for i, delta in merged([g.deltas() for g in generations]):
                    if delta.text or delta.token_ids or delta.finish:
                        yield make(ids[i], i, delta)
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
                yield make(ids[i], i, whole)
        except GatewayError as e:
            await context.abort(e.grpc_code, e.message)

    def _fill(self, msg, delta: Delta):
        msg.token_ids.extend(delta.token_ids)
        for lp in delta.logprobs:
            out = msg.logprobs.add()
            out.CopyFrom(lp)
            out.token = self._token_text(lp.token_id)
            for top in out.top_logprobs:
                top.token = self._token_text(top.token_id)
        msg.model = self.gw.config.model_name
        if delta.finish:
            msg.finish_reason = delta.finish
            msg.usage.CopyFrom(delta.usage)
            msg.spec_decode.CopyFrom(delta.spec_decode.to_proto())
        return msg

    def _token_text(self, token_id: int) -> str:
        return self.gw.tokenizer.decode([token_id], skip_special_tokens=False)

    async def Generate(self, request: gateway_pb2.GatewayGenerateRequest, context):
        await self._check_auth(context)
        try:
            kind = request.WhichOneof("prompt")
            if kind == "text":
                prompt = self.gw.text_prompt(request.text)
            elif kind == "token_ids":
                prompt = list(request.token_ids.ids)
            else:
                raise InvalidRequest("prompt: set text or token_ids")
            reqs = self._requests(request.model, prompt, request.sampling, request.stop,
                                  request.speculation, request.request_id, kind or "prompt",
                                  request.n)
        except GatewayError as e:
            await context.abort(e.grpc_code, e.message)

        def make(rid: str, index: int, delta: Delta) -> gateway_pb2.GatewayGenerateResponse:
            return self._fill(gateway_pb2.GatewayGenerateResponse(
                request_id=rid, text=delta.text, index=index), delta)

        async for msg in self._run(reqs, request.stream, context, make):
            yield msg

    async def Chat(self, request: gateway_pb2.ChatRequest, context):
        await self._check_auth(context)
        try:
            messages = []
            for i, m in enumerate(request.messages):
                if m.role not in ("system", "user", "assistant"):
                    raise InvalidRequest(f"messages[{i}].role: must be system, user or "
                                         f"assistant, got {m.role!r}")
                messages.append({"role": m.role, "content": m.content})
            prompt = self.gw.chat_prompt(messages)
            reqs = self._requests(request.model, prompt, request.sampling, request.stop,
                                  request.speculation, request.request_id, "messages",
                                  request.n)
        except GatewayError as e:
            await context.abort(e.grpc_code, e.message)

        def make(rid: str, index: int, delta: Delta) -> gateway_pb2.ChatResponse:
            return self._fill(gateway_pb2.ChatResponse(request_id=rid, content=delta.text,
                                                       index=index), delta)

        async for msg in self._run(reqs, request.stream, context, make):
            yield msg
