"""A draft method run inside the verifier's process, as a Proposer.

It drives the method exactly as the drafter service does (start with the request's
sampling, advance with the engine's outcomes and hidden states, q passed along),
without the wire: for benchmarks that separate the split's cost from the
drafting itself, and for tests of the methods against the engine.
"""

from __future__ import annotations

from drafter.method import DraftMethod
from verifier.engine import Request
from verifier.engine.proposer import Outcome, Proposal, Proposer


class InProcessProposer(Proposer):
    """A draft method in process, as the drafter service drives it: the request's
    sampling (sampling drafters shape q by it), q passed along, hidden states from
    the engine's outcomes."""

    def __init__(self, method: DraftMethod, max_num_speculative_tokens: int):
        self.method = method
        self.max_num_speculative_tokens = max_num_speculative_tokens
        info = method.info()
        self.layers = tuple(info.hidden_state_layers) if info.needs_hidden_states else ()

    def start(self, seq_id: int, request: Request) -> None:
        self.method.start(
            seq_id,
            list(request.prompt_token_ids),
            [],
            request.sampling,
            self.max_num_speculative_tokens,
        )

    def propose(self, wanted: dict[int, int], tokens: dict[int, list[int]]) -> dict[int, Proposal]:
        drafts = self.method.propose(wanted) if wanted else {}
        return {key: Proposal(d.token_ids, d.probs, d.parents) for key, d in drafts.items()}

    def advance(self, seq_id: int, outcome: Outcome) -> None:
        self.method.advance(seq_id, outcome.num_drafted, outcome.num_accepted,
                            outcome.new_token_ids, 0, outcome.hidden_states, outcome.hidden_start)

    def free(self, seq_id: int) -> None:
        self.method.free(seq_id)

    def hidden_layers(self, seq_id: int) -> tuple[int, ...]:
        return self.layers
