"""Where draft tokens come from, as the engine sees it.

The engine calls `propose` once per step (with an empty `wanted` when no
sequence speculates, so pending outcomes still reach the drafters) and
reports every step's outcome after it, K = 0 steps included, so a drafter's
state never lags. The gRPC drafter pool and in-process test drafters
implement this.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from verifier.engine.sequence import Request


@dataclass(slots=True)
class Proposal:
    token_ids: list[int]  # [K] drafted tokens following the sequence's current tokens
    probs: torch.Tensor | None = None  # [K, V] draft distribution; None = one-hot (greedy)
    # A token tree (specdec/tree.py): parents[i] is token i's parent index, -1 for the
    # root; None = a chain. One-hot drafts only.
    parents: list[int] | None = None


@dataclass(slots=True)
class Outcome:
    """One step's result for one sequence, as its drafter needs it."""

    num_drafted: int  # draft tokens of the last proposal the target scored
    num_accepted: int  # leading ones accepted
    new_token_ids: list[int]  # accepted drafts + the sampled token; [] for a partial prefill chunk
    # [P, len(hidden_layers(seq)), hidden] for positions hidden_start.. that the
    # target computed and kept; None unless the sequence's drafter wants them.
    hidden_states: torch.Tensor | None = None
    hidden_start: int = 0
    # Instead of hidden_states, for a proposer that reads the KV cache's feature store
    # (bind_feature_reader): the rows of this many positions from hidden_start are there.
    hidden_kept: int = 0


# (seq_id, start, num) -> [num, len(layers) * hidden]: the feature rows of positions
# start..start+num-1, or None where the sequence no longer holds them (preempted,
# finished, or some positions computed without them).
FeatureReader = Callable[[int, int, int], torch.Tensor | None]


class Proposer(ABC):
    @abstractmethod
    def start(self, seq_id: int, request: Request) -> None:
        """Begin tracking a sequence (its prompt, sampling and drafter choice are in `request`)."""

    @abstractmethod
    def propose(self, wanted: dict[int, int], tokens: dict[int, list[int]]) -> dict[int, Proposal]:
        """wanted: seq_id -> K for this step (may be empty); tokens: seq_id -> all
        tokens so far of the wanted sequences. Returns proposals for the sequences
        it could serve in time; a missing or shorter proposal only lowers that
        sequence's K this step."""

    @abstractmethod
    def advance(self, seq_id: int, outcome: Outcome) -> None:
        """Outcome of one step for a sequence that goes on running."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Forget a finished or cancelled sequence."""

    def flush(self) -> None:
        """Deliver pending outcomes and frees now; the engine calls it when it goes
        idle, since no further step would carry them. In-process proposers have none."""
        return None

    def hidden_layers(self, seq_id: int) -> tuple[int, ...]:
        """Target layers (HF numbering) whose hidden states the sequence's drafter wants."""
        return ()

    def bind_feature_reader(self, read: FeatureReader) -> bool:
        """Whether the proposer takes outcomes of plain (K = 0) steps with their hidden
        rows left in the KV cache's feature store (Outcome.hidden_kept), reading them
        with `read` when it needs them, on the engine's thread. The engine calls this
        once. A sequence that does not draft keeps every step's rows until it drafts
        again (drafter_client.py): copied out a step at a time, they took a batch of
        16 about 1 ms a step (3 %) more than plain requests."""
        return False

    def ready_drafts(self, seq_id: int) -> int | None:
        """How many drafts for the sequence's next step are at hand already, without
        waiting for its drafter (a bet or table on the outcome it just had: DraftBet,
        DraftTable; 0 where a table says none), or None where they are not."""
        return None

    def drafter_ms(self) -> float:
        """ms the drafters say they spent on the last `propose` (the slowest one where
        several answered); 0 for a proposer with nothing to report (in process: its time
        is all of the engine's draft wait)."""
        return 0.0

    def miss_reason(self, seq_id: int) -> str | None:
        """Why the last `propose` returned nothing for a sequence that wanted K > 0:
        "deadline" or "drafter_unavailable"; None when it did propose."""
        return None
