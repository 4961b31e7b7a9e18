"""A request as the engine sees it, and its per-sequence state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specdec.sampling import SamplingParams


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens or max model length reached
    EOS = "eos"
    STOP_TOKEN = "stop_token"
    CANCELLED = "cancelled"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    num_speculative_tokens: int = 0  # K wanted; 0 = plain decoding
    drafter: str | None = None  # the proposer's name for this request's drafter; None = none
    # Dynamic K: num_speculative_tokens is a bound, and the engine's speculation
    # controller (where it has one) chooses K within it every step.
    auto_k: bool = False
    num_logprobs: int = 0  # > 0: return each token's logprob and this many top alternatives
    # The output's grammar (specdec.structured.GrammarState), at the tokens emitted so far.
    grammar: object | None = None
    # Logits processors (specdec.processors.LogitsProcessors); None when none is active.
    processors: object | None = None
    # vLLM's cache_salt: the request shares cached KV (and its drafter's learned replies)
    # only with requests of the same salt; "" = the shared default.
    cache_salt: str = ""
    # vLLM's priority: waiting requests are admitted lowest value first (the scheduler).
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt_token_ids must not be empty")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {self.max_tokens}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.num_logprobs < 0:
            raise ValueError(f"num_logprobs must be >= 0, got {self.num_logprobs}")
        self.stop_token_ids = frozenset(self.stop_token_ids)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Sequence:
    seq_id: int
    request: Request
    tokens: list[int]  # prompt + output so far
    status: Status = Status.WAITING
    num_computed: int = 0  # leading tokens whose KV is in the cache
    finish_reason: FinishReason | None = None
    num_drafted: int = 0  # totals for statistics
    num_accepted: int = 0
    # Whether admission may start from KV the prefix cache holds (see Engine.add_request).
    use_prefix_cache: bool = True
    # Its drafter reads the target's hidden states: the cache keeps them beside the KV,
    # and admission takes only blocks that carry them.
    wants_features: bool = False
    # Leading positions taken from the cache whose features the drafter has not had yet.
    cached_features: int = 0

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def in_prefill(self) -> bool:
        """More than the last token still lacks KV: the next step is a (chunked) prefill."""
        return self.num_computed < len(self.tokens) - 1
