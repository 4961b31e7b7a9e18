"""The one interface every draft method implements.

The servicer (drafter/service.py) translates the Draft stream into these
calls and nothing else. Sequence keys are opaque and hashable: the servicer
makes them unique per stream, so a method never sees two verifiers'
sequences collide, and it frees every key of a stream that ends.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from specdec.sampling import SamplingParams
from specdec.speculation import DRAFTER_METHODS, method_name
from specdec.tree import check_parents

# Element types hidden states can travel in (specdec/tensor_codec.py).
_WIRE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(slots=True)
class DrafterInfo:
    """What Drafter.Info reports (see InfoResponse in drafter.proto)."""

    method: int  # common_pb2.SpecMethod value
    vocab_size: int
    tokenizer_hash: str = ""  # "" = unknown: the verifier then compares vocab_size only
    model_name: str = ""
    max_num_speculative_tokens: int = 8
    needs_hidden_states: bool = False
    hidden_state_layers: list[int] = field(default_factory=list)  # HF numbering
    hidden_size: int = 0
    hidden_state_dtype: torch.dtype = torch.float32
    target_model_name: str = ""
    returns_probs: bool = False
    supports_pipelining: bool = False
    max_model_len: int = 0  # 0 = unbounded

    def __post_init__(self) -> None:
        if method_name(self.method) not in DRAFTER_METHODS:
            raise ValueError(f"method {self.method} is not a drafting SpecMethod")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0, got {self.vocab_size}")
        if self.max_num_speculative_tokens < 1:
            raise ValueError(
                f"max_num_speculative_tokens must be >= 1, got {self.max_num_speculative_tokens}")
        if self.hidden_state_dtype not in _WIRE_DTYPES:
            raise ValueError(f"hidden_state_dtype {self.hidden_state_dtype} cannot travel on the "
                             f"wire; use one of {_WIRE_DTYPES}")
        if self.needs_hidden_states and (not self.hidden_state_layers or self.hidden_size < 1):
            raise ValueError("a drafter that needs hidden states must name hidden_state_layers "
                             "and a hidden_size >= 1")
        if any(layer < 0 for layer in self.hidden_state_layers):
            raise ValueError(f"hidden_state_layers must be >= 0, got {self.hidden_state_layers}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")


@dataclass(slots=True)
class Draft:
    token_ids: list[int]  # [k] with k <= the K asked for
    probs: torch.Tensor | None = None  # [k, V] q at each drafted position; None = one-hot
    # A token tree instead of a chain (specdec/tree.py, DraftProposal.parents): the
    # parent index of each token, -1 for the root; one-hot drafts only. None = a chain.
    parents: list[int] | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and (
                self.probs.dim() != 2 or self.probs.shape[0] != len(self.token_ids)):
            raise ValueError(f"probs must be [k={len(self.token_ids)}, V], "
                             f"got {list(self.probs.shape)}")
        if self.parents is not None:
            if self.probs is not None:
                raise ValueError("a token tree carries one-hot drafts only (probs must be None)")
            check_parents(self.parents, len(self.token_ids))


@dataclass(slots=True)
class OutcomeTable:
    """The drafts after every outcome of verifying a proposal d (a DraftTable)."""

    # Per accepted count a in 0..len(d): (bonus [B] ascending, lengths [B], drafts
    # [sum(lengths)] concatenated): the drafts after the context + d[:a] + [bonus[i]].
    groups: list[tuple[np.ndarray, np.ndarray, np.ndarray]]
    k: int  # the most drafts an outcome gets
    # For a token a group does not list: the k tokens that followed its latest
    # occurrence in the context (True), or none (False).
    copy_unlisted: bool = False


class DraftMethod(ABC):
    """A draft method. Calls come from one thread at a time (the servicer locks)."""

    #: Registry name (`specdec-drafter --method NAME`).
    name: str = ""
    #: A request's work is a few hundred microseconds of Python (lookups, no model):
    #: the servicer runs it on its event loop, since a hop to a worker thread and back
    #: costs more than the work when the verifier hogs the cores and every wakeup waits.
    light: bool = False

    @abstractmethod
    def info(self) -> DrafterInfo: ...

    @abstractmethod
    def start(self, key: Hashable, prompt_ids: list[int], output_ids: list[int],
              sampling: SamplingParams, max_num_speculative_tokens: int) -> None:
        """Begin tracking a sequence whose context is prompt_ids + output_ids."""

    def scope(self, key: Hashable, tenant: str) -> None:
        """The tenant of a started sequence (DraftEntry.Start.tenant, its request's
        cache_salt): a method that learns across sequences lends a sequence only what it
        learned from its own tenant's, so one caller's acceptance cannot tell what
        another's replies held. A method that learns nothing across sequences has no
        use for it."""
        return

    @abstractmethod
    def advance(self, key: Hashable, num_drafted: int, num_accepted: int, new_token_ids: list[int],
                num_rollback_tokens: int, hidden_states: torch.Tensor | None,
                hidden_start_position: int) -> None:
        """One verifier step's outcome: drop num_rollback_tokens committed tokens, then
        append new_token_ids (the first num_accepted of them were this method's drafts).
        hidden_states: [P, len(info.hidden_state_layers), hidden_size] for positions
        hidden_start_position.. (None unless info.needs_hidden_states)."""

    @abstractmethod
    def propose(self, wanted: dict[Hashable, int]) -> dict[Hashable, Draft]:
        """Drafts continuing each sequence's context, at most K tokens each, for the
        whole batch at once. A key may be missing from the result (nothing to propose)."""

    def propose_after(self, key: Hashable, extra: list[int], k: int) -> list[int] | None:
        """One-hot chain drafts (at most k) continuing the sequence's context as if
        `extra` followed it, leaving the state unchanged: a bet on the verifier's
        outcome (docs/design.md section 2, "Bets"). None: the method places no bets
        (its drafts need the target's hidden states, or carry probabilities)."""
        return None

    def outcome_table(self, key: Hashable, drafts: list[int], k: int) -> OutcomeTable | None:
        """Every outcome of verifying `drafts` at once (DraftTable, docs/design.md
        section 2, "Tables"), leaving the state unchanged. None: the method cannot list
        its outcomes, or its drafts need what only the verifier has."""
        return None

    @abstractmethod
    def free(self, key: Hashable) -> None:
        """Forget a sequence; unknown keys are ignored."""

    def has(self, key: Hashable) -> bool:
        """Whether the method holds state for `key` (the servicer reports others as unknown)."""
        return True
