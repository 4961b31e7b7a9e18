"""Where draft tokens come from, as the engine sees it.

The engine asks for proposals before a step and reports every step's
outcome after it, K = 0 steps included, so a drafter's state never lags.
The gRPC drafter client and in-process test drafters implement this.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]  # [K] drafted tokens following the sequence's current tokens
    probs: torch.Tensor | None = None  # [K, V] draft distribution; None = one-hot (greedy)


class Proposer(ABC):
    @abstractmethod
    def start(self, seq_id: int, prompt_ids: list[int], max_k: int) -> None:
        """Begin tracking a sequence."""

    @abstractmethod
    def propose(self, wanted: dict[int, int], tokens: dict[int, list[int]]) -> dict[int, Proposal]:
        """wanted: seq_id -> K for this step; tokens: seq_id -> all tokens so far.
        Returns proposals for the sequences it could serve in time; a missing
        or shorter proposal only lowers that sequence's K this step."""

    @abstractmethod
    def advance(self, seq_id: int, num_drafted: int, num_accepted: int, new_tokens: list[int]) -> None:
        """Outcome of one step: new_tokens = accepted drafts + the sampled token."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Forget a finished or cancelled sequence."""
