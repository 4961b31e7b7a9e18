"""What every service and the SDK say about speculation, kept once.

The catalogue of speculation methods, of the reasons speculation is off, and of how a
generation finishes: each name (the REST API's, the CLI's, the metrics' labels) beside
its value on the wire (common.proto). A request's speculation policy, in the one form
every service passes on, and the acceptance length a request reports.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from specdec.pb import common_pb2, verifier_pb2

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


@dataclass(frozen=True, slots=True)
class SpeculationPolicy:
    """A request's speculation, as the gateway decides it at admission, as it rides in
    the Generate stream's Start (common.proto SpeculationPolicy, and Start's
    disabled_reason), and as the verifier runs it, its drafter resolved and its K
    clamped to what the drafter and the engine take, once, at its entry.

    method: "none" or a drafter method; num_speculative_tokens: K, or with auto_k its
    bound (the verifier chooses each step's K within it); disabled_reason: why
    speculation is off (a DISABLED_REASONS name; None: on); drafter: a configured
    drafter's name (the gateway: None = the method's first; the verifier: the one
    serving it, None = none)."""

    method: str = "none"
    num_speculative_tokens: int = 0
    auto_k: bool = False
    disabled_reason: str | None = None
    drafter: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculation.method: unknown method {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"speculation.num_speculative_tokens: must be an int >= 0, "
                             f"got {k!r}")
        if self.method == "none" and k:
            raise ValueError(f"speculation.num_speculative_tokens: method 'none' needs 0, "
                             f"got {k}")
        if not isinstance(self.auto_k, bool):
            raise ValueError(f"speculation.auto_k: must be a bool, got {self.auto_k!r}")
        if self.disabled_reason is not None and self.disabled_reason not in DISABLED_REASONS:
            raise ValueError(f"speculation.disabled_reason: unknown reason "
                             f"{self.disabled_reason!r}")

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None and self.method != "none"

    @property
    def effective_k(self) -> int:
        """K the verifier's engine runs it with: its K while speculation is on and a
        drafter serves it, else 0."""
        return self.num_speculative_tokens if self.enabled and self.drafter is not None else 0

    def to_proto(self) -> common_pb2.SpeculationPolicy:
        return common_pb2.SpeculationPolicy(
            method=method_to_proto(self.method), drafter=self.drafter or "",
            num_speculative_tokens=self.num_speculative_tokens, auto_k=self.auto_k)

    def updated(self, update: verifier_pb2.GenerateRequest.PolicyUpdate,
                max_num_speculative_tokens: int) -> SpeculationPolicy:
        """The policy after a PolicyUpdate; ValueError naming the field it cannot take."""
        policy = self
        if update.HasField("num_speculative_tokens"):
            if update.num_speculative_tokens > max_num_speculative_tokens:
                raise ValueError(f"policy_update.num_speculative_tokens: "
                                 f"{update.num_speculative_tokens} exceeds the maximum "
                                 f"{max_num_speculative_tokens}")
            policy = replace(policy, num_speculative_tokens=update.num_speculative_tokens)
        if update.HasField("enabled"):
            if update.enabled and self.method == "none":
                raise ValueError("policy_update.enabled: the request's method is none")
            reason = None if update.enabled else (
                reason_name(update.disabled_reason) or "request")
            policy = replace(policy, disabled_reason=reason)
        if update.HasField("auto_k"):
            policy = replace(policy, auto_k=update.auto_k)
        return policy
