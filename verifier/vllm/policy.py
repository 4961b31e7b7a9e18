"""A request's speculation on its way into vLLM's engine: keys of SamplingParams.extra_args.

vLLM hands a custom proposer no request ids and no per-request options; the proposer
reads each request's SamplingParams from the model runner (verifier/vllm/proposer.py)
and its policy from these keys. They are flat because `vllm serve` clients set them
with `vllm_xargs`, which takes flat values only:

    "vllm_xargs": {"specdec_method": "ngram", "specdec_num_speculative_tokens": 2}

Policy changes of a running request (the gateway's PolicyUpdates, dynamic K) cannot
ride in extra_args, which vLLM copies into its engine once; the verifier service sends
them to the proposer over vLLM's collective RPC (verifier/vllm/worker.py), naming the
request by KEY_REQUEST_ID, since vLLM appends a suffix of its own to request ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specdec.cache_salt import check_cache_salt
from specdec.speculation import METHODS

KEY_METHOD = "specdec_method"  # "none", "ngram", ...; absent = the deployment's default
KEY_DRAFTER = "specdec_drafter"  # a configured drafter's name; absent = the method's first
KEY_NUM_SPECULATIVE_TOKENS = "specdec_num_speculative_tokens"  # K; 0 = tracked, no drafts
KEY_REQUEST_ID = "specdec_request_id"  # the name policy updates use; absent = vLLM's id
# true: K is a bound, and the proposer's speculation controller chooses each step's K
# within it (ProposerConfig.speculation_controller); absent = the deployment's default.
KEY_AUTO_K = "specdec_auto_k"
# The request's cache_salt, for its drafter (DraftEntry.Start.tenant); vLLM's own prefix
# cache reads the prompt's cache_salt.
KEY_CACHE_SALT = "specdec_cache_salt"


@dataclass(frozen=True, slots=True)
class RequestPolicy:
    """What one request asks of speculation; None fields take the deployment's defaults."""

    method: str | None = None
    drafter: str | None = None
    num_speculative_tokens: int | None = None
    request_id: str | None = None
    auto_k: bool | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"{KEY_METHOD}: unknown method {self.method!r} "
                             f"(expected one of {', '.join(METHODS)})")
        k = self.num_speculative_tokens
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"{KEY_NUM_SPECULATIVE_TOKENS}: must be an int >= 0, got {k!r}")
        if self.auto_k is not None and not isinstance(self.auto_k, bool):
            raise ValueError(f"{KEY_AUTO_K}: must be true or false, got {self.auto_k!r}")
        if self.cache_salt is not None:
            if not isinstance(self.cache_salt, str):
                raise ValueError(f"{KEY_CACHE_SALT}: must be a string, got {self.cache_salt!r}")
            check_cache_salt(self.cache_salt, KEY_CACHE_SALT)

    @classmethod
    def from_extra_args(cls, extra_args: Mapping[str, Any] | None) -> RequestPolicy:
        """The policy in a request's extra_args (None: all defaults); ValueError naming
        the key for a value it cannot be."""
        args = extra_args or {}
        k = args.get(KEY_NUM_SPECULATIVE_TOKENS)
        if isinstance(k, float) and k.is_integer():  # JSON numbers may arrive as floats
            k = int(k)
        return cls(method=args.get(KEY_METHOD), drafter=args.get(KEY_DRAFTER) or None,
                   num_speculative_tokens=k, request_id=args.get(KEY_REQUEST_ID),
                   auto_k=args.get(KEY_AUTO_K), cache_salt=args.get(KEY_CACHE_SALT) or None)

    def to_extra_args(self) -> dict[str, Any]:
        values = {KEY_METHOD: self.method, KEY_DRAFTER: self.drafter,
                  KEY_NUM_SPECULATIVE_TOKENS: self.num_speculative_tokens,
                  KEY_REQUEST_ID: self.request_id, KEY_AUTO_K: self.auto_k,
                  KEY_CACHE_SALT: self.cache_salt}
        return {key: value for key, value in values.items() if value is not None}
