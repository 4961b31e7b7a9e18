"""Admission: how one request starts, from its `speculative` field and what the
deployment runs: its SpeculationPolicy (the method, K or its bound, whether
speculation is off). Load is the verifier's to act on, step by step (auto-disable by
queue size, dynamic K)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.policy.request import SpeculativeRequest
from gateway.policy.values import check_count
from specdec.speculation import METHODS, SpeculationPolicy


@dataclass(frozen=True)
class Deployment:
    """What this gateway's deployment offers; `methods_available` are the drafters now up."""

    default_method: str
    methods_available: frozenset[str]
    default_num_speculative_tokens: int  # static K, or dynamic K's bound with default_auto_k
    max_num_speculative_tokens: int
    # Requests that do not give num_speculative_tokens get dynamic K ("auto"), bounded
    # by default_num_speculative_tokens; False: that K, static.
    default_auto_k: bool = False

    def __post_init__(self) -> None:
        if self.default_method not in METHODS:
            raise ValueError(f"deployment: default_method {self.default_method!r} is unknown "
                             f"(expected one of {', '.join(METHODS)})")
        object.__setattr__(self, "methods_available", frozenset(self.methods_available))
        unknown = sorted(self.methods_available - set(METHODS))
        if unknown:
            raise ValueError(f"deployment: methods_available has unknown method(s) {unknown}")
        check_count(
            "deployment: default_num_speculative_tokens", self.default_num_speculative_tokens
        )
        check_count("deployment: max_num_speculative_tokens", self.max_num_speculative_tokens)
        if self.default_num_speculative_tokens > self.max_num_speculative_tokens:
            raise ValueError(f"deployment: default_num_speculative_tokens "
                             f"({self.default_num_speculative_tokens}) must not exceed "
                             f"max_num_speculative_tokens ({self.max_num_speculative_tokens})")
        if not isinstance(self.default_auto_k, bool):
            raise ValueError(f"deployment: default_auto_k must be a bool, "
                             f"got {self.default_auto_k!r}")


def decide(req: SpeculativeRequest, dep: Deployment) -> SpeculationPolicy:
    """Admission policy for one request (its drafter by name, if it names one)."""
    method = req.method or dep.default_method
    requested_k = req.num_speculative_tokens
    # Checked first: a K no deployment setting allows is a mistake even when unused.
    if requested_k is not None and requested_k > dep.max_num_speculative_tokens:
        raise ValueError(f"speculative.num_speculative_tokens: {requested_k} exceeds this "
                         f"deployment's maximum of {dep.max_num_speculative_tokens}")
    if method == "none" or requested_k == 0:
        return SpeculationPolicy("none", 0, False, "request")
    if method not in dep.methods_available:
        # Better a plain answer than an error: the drafter may only be restarting.
        return SpeculationPolicy(method, 0, False, "drafter_unavailable", req.drafter)
    auto = req.auto or (requested_k is None and dep.default_auto_k)
    if requested_k is not None:
        k = requested_k
    else:
        # An explicit "auto" may go to the verifier's maximum; the deployment's default
        # stays within the K it would run statically.
        k = dep.max_num_speculative_tokens if req.auto else dep.default_num_speculative_tokens
    return SpeculationPolicy(method, k, auto, None, req.drafter)
