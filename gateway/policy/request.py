"""A request's `speculative` field, parsed and checked."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.policy.values import is_int
from specdec.speculation import METHODS

_K_ERROR = 'speculative.num_speculative_tokens: must be a non-negative integer or "auto"'


@dataclass(frozen=True)
class SpeculativeRequest:
    """A request's `speculative` field: {"method": ..., "num_speculative_tokens": <int> | "auto"}.

    None means "the deployment's default". With `auto` K follows the load (the verifier
    chooses each step's), and `num_speculative_tokens`, when given, is its upper bound.
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    auto: bool = False
    # A configured drafter by name (LoadReport.drafters), for deployments with several
    # drafters of one method; None = the method's default drafter.
    drafter: str | None = None

    def __post_init__(self) -> None:
        if self.drafter is not None and not (isinstance(self.drafter, str) and self.drafter):
            raise ValueError(f"speculative.drafter: must be a non-empty string, "
                             f"got {self.drafter!r}")
        if self.method is not None:
            if not isinstance(self.method, str):
                raise ValueError(f"speculative.method: must be a string, got {self.method!r}")
            if self.method not in METHODS:
                raise ValueError(f"speculative.method: unknown method {self.method!r} "
                                 f"(expected one of {', '.join(METHODS)})")
        k = self.num_speculative_tokens
        if k is not None and not (is_int(k) and k >= 0):
            raise ValueError(f"{_K_ERROR}, got {k!r}")
        if not isinstance(self.auto, bool):
            raise ValueError(f"speculative.auto: must be a bool, got {self.auto!r}")

    @classmethod
    def from_json(cls, obj: object) -> SpeculativeRequest:
        """Parse the OpenAI-extension field; None (absent) gives the defaults."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise ValueError(f"speculative: must be an object or null, got {type(obj).__name__}")
        unknown = [key for key in obj if key not in ("method", "num_speculative_tokens",
                                                     "drafter")]
        if unknown:
            raise ValueError(f"speculative: unknown field(s) {', '.join(map(repr, unknown))} "
                             "(expected method, num_speculative_tokens, drafter)")
        k = obj.get("num_speculative_tokens")
        if isinstance(k, str) and k == "auto":
            return cls(method=obj.get("method"), auto=True, drafter=obj.get("drafter"))
        return cls(method=obj.get("method"), num_speculative_tokens=k,
                   drafter=obj.get("drafter"))
