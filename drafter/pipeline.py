"""Pipelined drafting (docs/design.md section 2): draft the next block while the verifier verifies.

Right after answering a step, the drafter bets that every draft of a greedy
proposal d (k tokens) will be accepted and that the target's bonus token will
be its own next guess g. It advances the sequence by d + [g] and drafts the
next block P at once, off the critical path (the verifier is busy with its
forward meanwhile). The bet is kept under (round, accepted count = k, bonus
= g). When the outcome arrives:

- hit (the next Advance has round + 1, accepts all k and its bonus is g):
  the method's state is already right and P is the answer; no draft work
  on the critical path;
- miss: the k + 1 guessed tokens are rolled back (num_rollback_tokens, which
  every method supports) and the real outcome is applied as usual.

Only one-hot (greedy) proposals are pipelined: a sampled draft's q would
need the same random stream twice. Methods opt in with
DrafterInfo.supports_pipelining.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass, field

from drafter.method import Draft, DraftMethod


@dataclass(slots=True)
class Guess:
    round: int  # the round of the Advance that would confirm it
    drafts: list[int]  # d, the proposal answered
    bonus: int  # g, the bonus token bet on
    block: list[int]  # P, the next proposal, drafted ahead
    cost_ms: float = 0.0  # its share of the pre-drafting pass

    @property
    def num_guessed_tokens(self) -> int:
        return len(self.drafts) + 1


# A verifier's next step waits for the pass drafting ahead to finish, so when bets
# keep missing, pre-drafting only adds its cost to the critical path. Below this hit
# rate over the last WINDOW settled bets, pre-drafting pauses, except for one probe
# pass every PROBE_EVERY steps, which notices when the drafts become good again.
MIN_HIT_RATE = 0.3
WINDOW = 32
PROBE_EVERY = 16


@dataclass(slots=True)
class PipelineStats:
    hits: int = 0
    misses: int = 0
    predraft_ms: float = 0.0  # time spent drafting ahead (while the verifier verifies)
    # Pre-drafting time of the hits: an upper bound on what left the critical path (the
    # verifier may still have waited for a pass slower than its own step).
    saved_ms: float = 0.0
    skipped: int = 0  # steps where pre-drafting paused for a low hit rate
    recent: list[bool] = field(default_factory=list)  # last WINDOW outcomes, oldest first

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def record(self, hit: bool) -> None:
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        self.recent.append(hit)
        del self.recent[:-WINDOW]

    def worth_it(self) -> bool:
        """Whether to draft ahead this step (always, until a window of outcomes says no)."""
        if len(self.recent) < WINDOW or sum(self.recent) >= MIN_HIT_RATE * WINDOW:
            return True
        self.skipped += 1
        return self.skipped % PROBE_EVERY == 0


def predraft(method: DraftMethod, bets: dict[Hashable, tuple[int, list[int], int]],
             stats: PipelineStats) -> dict[Hashable, Guess]:
    """bets: key -> (round just answered, greedy drafts d, K of the next block).
    Advances each sequence by d + [g] and drafts the next block; returns the guesses."""
    t0 = time.perf_counter()
    for key, (_, drafts, _) in bets.items():
        # As if the verifier accepted every draft; the bonus comes next.
        method.advance(key, len(drafts), len(drafts), list(drafts), 0, None, 0)
    firsts = method.propose({key: 1 for key in bets})
    guesses: dict[Hashable, Guess] = {}
    for key, (round_, drafts, _) in bets.items():
        first = firsts.get(key)
        if first is None or not first.token_ids:
            method.advance(key, 0, 0, [], len(drafts), None, 0)  # nothing to bet on: undo
            continue
        bonus = first.token_ids[0]
        method.advance(key, 1, 1, [bonus], 0, None, 0)
        guesses[key] = Guess(round_ + 1, list(drafts), bonus, [])
    blocks = method.propose({key: bets[key][2] for key in guesses})
    for key, guess in guesses.items():
        block = blocks.get(key)
        guess.block = list(block.token_ids) if block is not None else []
    elapsed = (time.perf_counter() - t0) * 1e3
    stats.predraft_ms += elapsed
    for guess in guesses.values():  # what a hit saves: its share of this pass
        guess.cost_ms = elapsed / len(guesses)
    return guesses


def resolve(method: DraftMethod, key: Hashable, guess: Guess, round_: int, new_token_ids: list[int],
            num_rollback_tokens: int, stats: PipelineStats) -> Draft | None:
    """Settle a bet against the real Advance. Returns the ready block on a hit (the
    method's state already matches); on a miss, undoes the guess and returns None,
    and the caller applies the Advance as usual."""
    if (round_ == guess.round and num_rollback_tokens == 0
            and new_token_ids == [*guess.drafts, guess.bonus]):
        stats.record(True)
        stats.saved_ms += guess.cost_ms
        return Draft(guess.block)
    stats.record(False)
    method.advance(key, 0, 0, [], guess.num_guessed_tokens, None, 0)
    return None
