"""What every service and the SDK say about speculation, kept once.

The catalogue of speculation methods, of the reasons speculation is off, and of how a
generation finishes: each name (the REST API's, the CLI's, the metrics' labels) beside
its value on the wire (common.proto). And the acceptance length a request reports.
"""

from __future__ import annotations

from specdec.pb import common_pb2

# Method name -> SpecMethod. "none" is plain decoding, a choice of the gateway; the
# others are what a drafter can be.
METHODS: dict[str, int] = {
    "none": common_pb2.SPEC_METHOD_NONE,
    "ngram": common_pb2.SPEC_METHOD_NGRAM,
    "draft_model": common_pb2.SPEC_METHOD_DRAFT_MODEL,
    "eagle": common_pb2.SPEC_METHOD_EAGLE,
    "eagle3": common_pb2.SPEC_METHOD_EAGLE3,
    "suffix": common_pb2.SPEC_METHOD_SUFFIX,
}
DRAFTER_METHODS: tuple[str, ...] = tuple(name for name in METHODS if name != "none")

# Why speculation is off for a request or a step -> DisabledReason. On the wire
# DISABLED_REASON_NONE means "not off"; here that is None.
DISABLED_REASONS: dict[str, int] = {
    "request": common_pb2.DISABLED_REASON_REQUEST,
    "queue_size": common_pb2.DISABLED_REASON_QUEUE_SIZE,
    "drafter_unavailable": common_pb2.DISABLED_REASON_DRAFTER_UNAVAILABLE,
    "deadline": common_pb2.DISABLED_REASON_DEADLINE,
    "dynamic_k": common_pb2.DISABLED_REASON_DYNAMIC_K,
    "tokenizer_mismatch": common_pb2.DISABLED_REASON_TOKENIZER_MISMATCH,
    "drafter_max_len": common_pb2.DISABLED_REASON_DRAFTER_MAX_LEN,
    "engine_sampling": common_pb2.DISABLED_REASON_ENGINE_SAMPLING,
}

# FinishReason -> OpenAI's finish_reason: "stop" for every natural end that is not
# the length limit, "abort" for an end the client or the server forced.
FINISH_REASONS: dict[int, str] = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_EOS: "stop",
    common_pb2.FINISH_REASON_STOP_TOKEN: "stop",
    common_pb2.FINISH_REASON_STOP_STRING: "stop",
    common_pb2.FINISH_REASON_CANCELLED: "abort",
    common_pb2.FINISH_REASON_ABORTED: "abort",
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}

_METHOD_NAMES = {value: name for name, value in METHODS.items()}
_REASON_NAMES = {value: name for name, value in DISABLED_REASONS.items()}


def method_to_proto(name: str | None) -> int:
    """SpecMethod of a method name; None (no choice) is SPEC_METHOD_UNSPECIFIED."""
    if name is None:
        return common_pb2.SPEC_METHOD_UNSPECIFIED
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r} (expected one of {', '.join(METHODS)})")
    return METHODS[name]


def method_name(value: int) -> str | None:
    """The name of a SpecMethod value; None for SPEC_METHOD_UNSPECIFIED and for values
    this build does not know (a newer peer's)."""
    return _METHOD_NAMES.get(value)


def drafter_method(name: str, method: int) -> str | None:
    """The method a configured drafter (LoadReport.drafters) serves: its reported one, or
    before it was first reached (no method yet) the method it is named after
    (`--drafter ngram=...`); None when neither says."""
    reported = method_name(method)
    if reported is None:
        return name if name in DRAFTER_METHODS else None
    return reported if reported in DRAFTER_METHODS else None


def reason_to_proto(name: str | None) -> int:
    """DisabledReason of a reason name; None (speculation on) is DISABLED_REASON_NONE."""
    if name is None:
        return common_pb2.DISABLED_REASON_NONE
    if name not in DISABLED_REASONS:
        raise ValueError(f"unknown disabled reason {name!r} "
                         f"(expected one of {', '.join(DISABLED_REASONS)})")
    return DISABLED_REASONS[name]


def reason_name(value: int) -> str | None:
    """The name of a DisabledReason value; None for DISABLED_REASON_NONE and unknown ones."""
    return _REASON_NAMES.get(value)


def acceptance_length(num_accepted_tokens: int, num_drafts: int) -> float:
    """Tokens per speculative step, as a request reports it (SpecDecodeStats): each of
    num_drafts steps emits its accepted drafts plus one token of the target's own; 0
    before any step has drafted."""
    return 1 + num_accepted_tokens / num_drafts if num_drafts else 0.0
