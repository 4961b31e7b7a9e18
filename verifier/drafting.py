"""The engine's proposer in the service: routes each sequence to its drafter's stream.

Every step sends one message per drafter stream (outcomes of all its
sequences, K = 0 ones included, and the K wanted next), then waits for the
proposals of all streams together, up to one draft deadline, except those a
drafter's bet on the outcome already answered (DraftBet).
"""

from __future__ import annotations

import time

from specdec.pb import common_pb2
from specdec.speculation import DRAFTER_METHODS, METHODS, method_name
from verifier.drafter_client import DrafterClient
from verifier.engine.proposer import FeatureReader, Outcome, Proposal, Proposer
from verifier.engine.sequence import Request


class DrafterPool(Proposer):
    def __init__(self, clients: list[DrafterClient], max_num_speculative_tokens: int,
                 draft_deadline_ms: float):
        self.clients = {c.name: c for c in clients}
        self.max_num_speculative_tokens = max_num_speculative_tokens
        self.deadline_s = draft_deadline_ms / 1e3
        self._owner: dict[int, DrafterClient] = {}
        self._misses: dict[int, str] = {}
        self._step = 0
        self._drafter_ms = 0.0  # the last propose's, as the drafters reported it

    def start_all(self) -> None:
        for c in self.clients.values():
            c.start()

    def close(self) -> None:
        for c in self.clients.values():
            c.close()

    def resolve(self, method: int, name: str) -> DrafterClient | None:
        """The drafter a request gets: by name (ValueError if unknown), else the first
        configured drafter of `method` (by its Info, or named after the method)."""
        if name:
            if name not in self.clients:
                raise ValueError(f"speculation.drafter: unknown drafter {name!r}; "
                                 f"configured: {sorted(self.clients) or 'none'}")
            return self.clients[name]
        for c in self.clients.values():
            # A drafter not reached yet is known by its name (`--drafter ngram=...`).
            if c.method == method or (c.info is None and c.name in DRAFTER_METHODS
                                      and c.name == method_name(method)):
                return c
        return None

    def default_method(self) -> int:
        """The deployment's method: the first configured drafter's."""
        for c in self.clients.values():
            if c.method != common_pb2.SPEC_METHOD_UNSPECIFIED:
                return c.method
            if c.name in DRAFTER_METHODS:
                return METHODS[c.name]
        return common_pb2.SPEC_METHOD_NONE

    # -- Proposer -------------------------------------------------------------

    def start(self, seq_id: int, request: Request) -> None:
        client = self.clients.get(request.drafter) if request.drafter else None
        if client is None:
            return
        self._owner[seq_id] = client
        client.track(seq_id, request.prompt_token_ids, request.sampling,
                     self.max_num_speculative_tokens, tenant=request.cache_salt)

    def propose(self, wanted: dict[int, int], tokens: dict[int, list[int]]) -> dict[int, Proposal]:
        self._step += 1
        per_client: dict[str, dict[int, int]] = {name: {} for name in self.clients}
        self._misses = {}
        for seq_id, k in wanted.items():
            owner = self._owner.get(seq_id)
            if owner is None:
                self._misses[seq_id] = "drafter_unavailable"
            else:
                per_client[owner.name][seq_id] = k
        deadline = time.monotonic() + self.deadline_s
        due = {name: c.send(self._step, per_client[name], deadline)
               for name, c in self.clients.items()}
        out: dict[int, Proposal] = {}
        self._drafter_ms = 0.0
        for name, c in self.clients.items():
            # Drafts a bet placed come back at once; the rest wait for the answer.
            out.update(c.collect(self._step, deadline, per_client[name], due[name]))
            if due[name]:
                # The drafters work at once: the step waited for the slowest.
                self._drafter_ms = max(self._drafter_ms, c.draft_time_ms)
            self._misses.update(c.misses)
        return out

    def drafter_ms(self) -> float:
        return self._drafter_ms

    def ready_drafts(self, seq_id: int) -> int | None:
        owner = self._owner.get(seq_id)
        return None if owner is None else owner.ready_drafts(seq_id)

    def flush(self) -> None:
        self.propose({}, {})

    def advance(self, seq_id: int, outcome: Outcome) -> None:
        owner = self._owner.get(seq_id)
        if owner is not None:
            owner.record(seq_id, outcome)

    def free(self, seq_id: int) -> None:
        owner = self._owner.pop(seq_id, None)
        if owner is not None:
            owner.forget(seq_id)

    def bind_feature_reader(self, read: FeatureReader) -> bool:
        for client in self.clients.values():
            client.read_features = read
        return True

    def hidden_layers(self, seq_id: int) -> tuple[int, ...]:
        owner = self._owner.get(seq_id)
        if owner is None or not owner.available:
            return ()
        return owner.hidden_layers()

    def miss_reason(self, seq_id: int) -> str | None:
        return self._misses.get(seq_id)

    def num_tracked(self, name: str) -> int:
        return sum(1 for c in self._owner.values() if c.name == name)
