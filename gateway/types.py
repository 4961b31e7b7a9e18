"""Types the gateway's front ends and its request path share: requests, deltas,
speculation summaries, errors with their HTTP and gRPC mappings, enum names."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from gateway.policy.request import SpeculativeRequest
from specdec.pb import common_pb2
from specdec.speculation import FINISH_REASONS, acceptance_length, method_to_proto, reason_to_proto


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
    # 404 as OpenAI and vLLM answer it: the SDK raises NotFoundError, which clients catch.
    http_status = 404
    grpc_code = grpc.StatusCode.NOT_FOUND
    error_type = "invalid_request_error"
    code = "model_not_found"


class Unavailable(GatewayError):
    http_status = 503
    grpc_code = grpc.StatusCode.UNAVAILABLE
    error_type = "service_unavailable"


class Overloaded(GatewayError):
    """Refused at admission: it would wait too long (or the gateway holds too many).
    429 with Retry-After, as OpenAI's rate limits answer; the SDKs back off and retry."""

    http_status = 429
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    error_type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTimeout(GatewayError):
    """The request ran past its timeout (the request's own or the server's default)."""

    http_status = 504
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    error_type = "timeout_error"


@dataclass(frozen=True)
class GenerationRequest:
    prompt_token_ids: tuple[int, ...]
    sampling: common_pb2.SamplingParams
    stop: tuple[str, ...] = ()
    speculative: SpeculativeRequest = SpeculativeRequest()
    request_id: str = ""
    # Which request field the prompt came from, for error messages.
    prompt_field: str = "prompt"
    # Which request field sampling.structured_output came from, for error messages.
    structured_field: str | None = None
    # Seconds from admission to the last token; None = the server's default.
    timeout_s: float | None = None
    # vLLM's cache_salt (specdec/cache_salt.py); "" = none.
    cache_salt: str = ""
    # vLLM's priority: the verifier admits waiting requests lowest value first.
    priority: int = 0


@dataclass
class SpecDecodeSummary:
    method: str = "none"
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    disabled_reason: str | None = None

    @property
    def acceptance_length(self) -> float:
        return acceptance_length(self.num_accepted_tokens, self.num_drafts)

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
            method=method_to_proto(self.method), num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens, num_accepted_tokens=self.num_accepted_tokens,
            acceptance_length=self.acceptance_length,
            disabled_reason=reason_to_proto(self.disabled_reason))


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
        return FINISH_REASONS.get(self.finish) if self.finish else None
