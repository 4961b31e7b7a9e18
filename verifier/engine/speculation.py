"""Dynamic K where the step runs, beside the scheduler: each step, every dynamic-K
request's K from that step's real batch and the engine's own measurements.

Our engine calls `choose(rows)` between scheduling and asking the drafters, and
`observe(...)` once the step committed; under vLLM's engine the proposer does, at the
end of each step for the next (verifier/vllm/proposer.py). A step is a list of `Row`s,
so neither engine's types reach in. Nothing travels: no gateway models the verifier
from the responses it sees and sends K back a step late, and any number of gateways
see one controller.

A step's worth is its expected tokens over its time. For a batch of B decoding
sequences whose requests draft n positions in all:

    goodput(n) = (B + sum of reach over the n positions) / (T(R0 + n) + D)

reach_ij = a_i1 ... a_ij x q_i is the chance that request i's draft at position j is
accepted (a: its per-position acceptance rates, q: how often its drafter had drafts
when asked), R0 the rows the step feeds without drafts, T(rows) the measured time of a
step that feeds that many rows, D what waiting for the drafters adds to a step that
drafts (none where every drafting request's drafts are a bet its drafter placed on the
outcome it just had, DraftBet: they are at the verifier already, so on a short GPU step
such requests draft while the others wait for nothing). Reach falls along a request's positions, so the best n positions are the n of
highest reach: walking them in that order finds the best n, and each request's K is
its number of positions taken. n = 0 is plain decoding, chosen where no n pays.

A request's rates are its own aged counts around its method's (the method's rates
weigh as PRIOR_STEPS of the request's steps). T is measured per row count on steps
without prefill, interpolated between measured counts and extended past the largest
with the slope of a line through them; a prefill chunk's rows are left out of the
step's price. What each mechanism here buys was measured by turning it off alone
(bench/ablation.py, docs/design.md section 5); those that bought nothing beyond the
noise were deleted.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    # A request's counts halve over this many of its drafting steps: acceptance comes in
    # runs (a block of the prompt copied, then new text).
    half_life_steps: float = 8.0
    # The method's rates weigh as this many of a request's steps around its own.
    prior_steps: float = 8.0
    # The method's counts (over all its requests) halve over this many drafting steps.
    method_half_life_steps: float = 256.0
    # A step's time at a row count: the newest sample weighs this much.
    cost_weight: float = 0.25
    # A drafter not asked for drafts for this many steps is priced without its wait
    # for one step: a wait measured once, on a cold first step (a drafter
    # taking in its prompts), would otherwise keep it off for good.
    redraft_after_steps: int = 32
    # The acceptance of a method nothing has been measured for.
    default_rate: float = 0.5
    # Each mechanism above can be turned off, for the ablation that keeps it
    # (bench/ablation.py): a request's own rates around its method's, pricing the
    # drafters' wait, redrafting a drafter kept off by its wait.
    request_rates: bool = True
    price_wait: bool = True
    redraft: bool = True
    tree_prices: bool = True


@dataclass(frozen=True, slots=True)
class Row:
    """One sequence of a step."""

    key: int  # the sequence, the same every step
    bound: int  # drafts it may have this step (its request's K, the room left); 0: none
    drafter: str | None = None  # dynamic K with this drafter; None: K stays `bound`
    prefill: bool = False  # a prompt chunk: it drafts nothing
    bet: bool = False  # its drafts are at the verifier already (a bet hit): no wait

    @property
    def dynamic(self) -> bool:
        return self.drafter is not None and self.bound > 0 and not self.prefill


class HoldsDrafts(Protocol):
    """A proposer that may hold a sequence's next drafts already (Proposer, DrafterPool)."""

    def ready_drafts(self, seq_id: int) -> int | None: ...


def ready_row(key: int, bound: int, drafter: str | None, proposer: HoldsDrafts | None,
              prefill: bool = False) -> Row:
    """A step's row, for a dynamic-K sequence with what its proposer already holds:
    drafts a bet or table gave (proposer.ready_drafts) cost no wait, and bound what it
    can draft, so the controller neither prices positions nobody drafted nor counts a
    known "none" (a table's) as a drafter that failed to answer."""
    ready = (proposer.ready_drafts(key)
             if drafter is not None and proposer is not None and not prefill else None)
    return Row(key, bound if ready is None else min(bound, ready), drafter, prefill,
               bet=ready is not None)


@dataclass(slots=True)
class _Counts:
    """Aged counts of drafted positions tried and accepted, and of drafter answers."""

    tried: list[float]
    accepted: list[float]
    asked: float = 0.0
    answered: float = 0.0

    @classmethod
    def empty(cls, k: int) -> _Counts:
        return cls([0.0] * k, [0.0] * k)

    def add(self, num_drafted: int, num_accepted: int, decay: float) -> None:
        """One step that asked for drafts, num_drafted of them, the first num_accepted
        accepted. A position counts as tried only when every draft before it was
        accepted, so its rate is conditional on reaching it, as `_reach` multiplies
        them: counted on every drafted position, position j's rate would already hold
        the chance of reaching j, and the product would count that chance twice
        (rates 0.8 each: reach 0.8, 0.51, 0.26, 0.11 against 0.8, 0.64, 0.51, 0.41)."""
        self.asked = self.asked * decay + 1
        self.answered = self.answered * decay + (num_drafted > 0)
        for j in range(len(self.tried)):
            self.tried[j] *= decay
            self.accepted[j] *= decay
        for j in range(min(num_drafted, num_accepted + 1, len(self.tried))):
            self.tried[j] += 1
            self.accepted[j] += j < num_accepted

    def rates(self, prior: list[float], weight: float) -> list[float]:
        """Per-position acceptance: the counts around `prior`, which weighs `weight`."""
        return [(a + weight * p) / (t + weight)
                for a, t, p in zip(self.accepted, self.tried, prior, strict=True)]

    def answer_rate(self, prior: float, weight: float) -> float:
        return (self.answered + weight * prior) / (self.asked + weight)


@dataclass(slots=True)
class StepCost:
    """Time of a step without prefill by the rows it feeds, and the drafters' wait."""

    weight: float
    ms: dict[int, float] = field(default_factory=dict)  # rows -> smoothed step ms
    wait_ms: dict[str, float] = field(default_factory=dict)  # drafter -> wait of its steps
    plain_wait_ms: float = 0.0  # the same wait on steps that asked no drafter
    drafted_step: dict[str, int] = field(default_factory=dict)  # drafter -> last step it was asked
    # The measured row counts in order, for `price` (a step prices many row counts), and
    # the slope of the line through them, rebuilt after a step's measurement (None: due).
    _known: list[int] = field(default_factory=list)
    _line_slope: float | None = None

    def _smooth(self, old: float | None, ms: float) -> float:
        return ms if old is None else old + self.weight * (ms - old)

    def observe(self, rows: int, ms: float) -> None:
        if rows not in self.ms:
            bisect.insort(self._known, rows)
        self.ms[rows] = self._smooth(self.ms.get(rows), ms)
        self._line_slope = None

    def observe_wait(self, step: int, methods: set[str], ms: float) -> None:
        if not methods:
            self.plain_wait_ms = self._smooth(self.plain_wait_ms, ms)
        for m in methods:
            self.wait_ms[m] = self._smooth(self.wait_ms.get(m), ms)
            self.drafted_step[m] = step

    def draft_ms(self, methods: set[str]) -> float:
        """What waiting for these methods' drafters adds to a step (they work at once)."""
        return max((max(0.0, self.wait_ms.get(m, 0.0) - self.plain_wait_ms) for m in methods),
                   default=0.0)

    def price(self, rows: int) -> float:
        """Modelled ms of a step of `rows` rows (at least one row count measured): the
        measured times interpolated, and along a line through them past either end.

        Errs cheap rather than dear, as below the fewest rows: a count priced cheap is
        chosen and so measured again, while one priced dear is never run to tell. A
        floor of the most that fewer rows were measured at (more rows never cost less)
        did the opposite: one slow count (2 rows, a step after plain steps, say) priced
        every count above it at least as dear, and those were then rarely run to correct
        it (bench/results/speculation_price.md)."""
        known = self._known
        if self._line_slope is None:
            self._line_slope = self._slope(known)
        cut = bisect.bisect_right(known, rows)  # known[:cut] <= rows < known[cut:]
        if not cut:
            # Fewer rows than any measured: along the line below the fewest. Erring
            # cheap here is safe, erring dear is not: a plain step priced cheap runs
            # and is measured, one priced dear makes drafts look free and never runs.
            return max(1e-3, self.ms[known[0]] - self._line_slope * (known[0] - rows))
        lo = known[cut - 1]
        if lo == rows:
            return self.ms[lo]
        if cut < len(known):
            hi = known[cut]
            return self.ms[lo] + (self.ms[hi] - self.ms[lo]) * (rows - lo) / (hi - lo)
        return self.ms[lo] + self._line_slope * (rows - lo)

    def _slope(self, known: list[int]) -> float:
        """ms per row of the least-squares line through the measured row counts (>= 0)."""
        if len(known) < 2:
            return 0.0
        mean_r = sum(known) / len(known)
        mean_t = sum(self.ms[r] for r in known) / len(known)
        var = sum((r - mean_r) ** 2 for r in known)
        cov = sum((r - mean_r) * (self.ms[r] - mean_t) for r in known)
        return max(0.0, cov / var)


@dataclass(slots=True)
class _Position:
    reach: float
    index: int  # of the row in the step's list of dynamic-K rows
    method: str


class SpeculationController:
    def __init__(self, config: ControllerConfig | None = None):
        self.config = config or ControllerConfig()
        self.cost = StepCost(self.config.cost_weight)
        # Steps that verified a token tree, priced apart: a tree's rows run attention
        # under a mask on torch's path and cost more than as many rows of chains (an
        # EAGLE-3 tree of 5 rows 33 ms against about 27 for 5 rows of chains on SmolLM2
        # here), and priced with chain steps they made the rows every drafter of chains
        # would take look dear.
        self.tree_cost = StepCost(self.config.cost_weight)
        self._tree_drafters: set[str] = set()  # drafters whose latest drafts were a tree
        self._counts: dict[int, _Counts] = {}  # seq_id -> its counts
        self._method_counts: dict[str, _Counts] = {}
        self._step = 0

    # -- choosing --------------------------------------------------------------

    def choose(self, rows: list[Row]) -> dict[int, int]:
        """The K of every dynamic-K row of the step, within its bound: key -> K."""
        self._step += 1
        dynamic = [row for row in rows if row.dynamic]
        if not dynamic:
            return {}
        return self._choose(rows, dynamic)

    def _choose(self, rows: list[Row], dynamic: list[Row]) -> dict[int, int]:
        cfg = self.config
        if not self.cost.ms:
            return {row.key: 0 for row in dynamic}  # the first step: plain, to price it
        decoding = [row for row in rows if not row.prefill]
        base_rows = len(decoding) + sum(row.bound for row in decoding if row.drafter is None)
        priors: dict[str, tuple[list[float] | None, float]] = {}
        positions = sorted(
            (_Position(reach, i, row.drafter)
             for i, row in enumerate(dynamic) for reach in self._reach(row, priors)),
            key=lambda p: -p.reach)
        tokens = float(len(decoding))  # each decoding sequence's own token
        # The drafters whose wait the step is priced with: not those not asked for a
        # while, tried again at no wait (see the config).
        fresh: set[str] = set()
        if cfg.price_wait:
            fresh = {row.drafter for row in dynamic
                     if not cfg.redraft
                     or self._step - self.cost.drafted_step.get(row.drafter, self._step)
                     <= cfg.redraft_after_steps}
        plain = tokens / self.cost.price(base_rows)
        taken, best = self._walk(positions, dynamic, tokens, base_rows, fresh, plain)
        if any(row.bet for row in dynamic):
            # Drafts bets hold alone: a step that waits for no drafter. The walk over all
            # positions may pay the wait before the positions that avoid it.
            held = [p for p in positions if dynamic[p.index].bet]
            held_taken, held_best = self._walk(held, dynamic, tokens, base_rows, fresh, plain)
            if held_best > best:
                taken = held_taken
        ks = [0] * len(dynamic)
        for p in taken:
            ks[p.index] += 1
        return {row.key: k for row, k in zip(dynamic, ks, strict=True)}

    def _walk(self, positions: list[_Position], dynamic: list[Row], tokens: float,
              base_rows: int, fresh: set[str], best: float) -> tuple[list[_Position], float]:
        """The best first n of `positions` (by reach) and their goodput, against `best`
        for none: each drafter's wait counts once a position needs its answer."""
        best_n = 0
        methods: set[str] = set()
        wait = 0.0  # draft_ms of the methods met so far: it changes only with them
        cost = self.cost
        for n, p in enumerate(positions, start=1):
            tokens += p.reach
            if p.method not in methods and not dynamic[p.index].bet:
                methods.add(p.method)
                wait = self.cost.draft_ms(methods & fresh)
            if p.method in self._tree_drafters and self.config.tree_prices \
                    and self.tree_cost.ms:
                cost = self.tree_cost  # from here on the step verifies a tree
            worth = tokens / (cost.price(base_rows + n) + wait)
            if worth > best:
                best_n, best = n, worth
        return positions[:best_n], best

    def _reach(self, row: Row, priors: dict[str, tuple[list[float] | None, float]]
               ) -> list[float]:
        """[K] the chance that each of the sequence's next K drafts is accepted. priors:
        method -> its rates and answer rate, filled as met (the same for every row of a
        step)."""
        k, cfg, method = row.bound, self.config, row.drafter
        if method not in priors:
            method_counts = self._method_counts.get(method)
            if method_counts is None:
                priors[method] = None, 1.0
            else:  # the method's rates over all its requests, around the default
                priors[method] = (
                    method_counts.rates([cfg.default_rate] * len(method_counts.tried), 1.0),
                    method_counts.answer_rate(1.0, 1.0))
        prior, answer_prior = priors[method]
        if prior is None:  # nothing measured for the method
            prior = [cfg.default_rate] * k
        counts = self._counts.get(row.key) if cfg.request_rates else None
        if counts is None:
            rates, answered = _widen(prior, k), answer_prior
        else:
            counts = _fit(counts, k)
            rates = counts.rates(_widen(prior, len(counts.tried)), cfg.prior_steps)
            answered = counts.answer_rate(answer_prior, cfg.prior_steps)
        reach, out = answered, []
        for a in rates[:k]:
            reach *= a
            out.append(reach)
        return out

    # -- learning --------------------------------------------------------------

    def observe(self, rows: list[Row], outcomes: dict[int, tuple[int, int]], step_ms: float,
                draft_wait_ms: float, fed: int, trees: Collection[int] = ()) -> None:
        """A committed step of these rows (as chosen: bounds, drafters): outcomes[key] =
        (drafted, accepted) of each row that asked for drafts; step_ms its time without
        the drafters' wait; fed the rows it fed the model; trees the keys of the rows
        whose drafts formed a token tree."""
        for row in rows:
            if row.drafter is not None and row.key in outcomes and outcomes[row.key][0]:
                if row.key in trees:
                    self._tree_drafters.add(row.drafter)
                else:
                    self._tree_drafters.discard(row.drafter)
        if not any(row.prefill for row in rows):
            (self.tree_cost if trees and self.config.tree_prices
             else self.cost).observe(fed, step_ms)
        # A step that asked a drafter waited for it whether or not drafts came; drafts a
        # bet held needed no wait.
        drafting = {row.drafter for row in rows
                    if row.drafter is not None and row.key in outcomes and not row.bet}
        self.cost.observe_wait(self._step, drafting, draft_wait_ms)
        cfg = self.config
        decay = 0.5 ** (1 / cfg.half_life_steps)
        method_decay = 0.5 ** (1 / cfg.method_half_life_steps)
        for row in rows:
            if row.key not in outcomes or row.drafter is None:
                continue
            drafted, accepted = outcomes[row.key]
            counts = _fit(self._counts.setdefault(row.key, _Counts.empty(row.bound)), row.bound)
            counts.add(drafted, accepted, decay)
            method = _fit(self._method_counts.setdefault(row.drafter, _Counts.empty(row.bound)),
                          row.bound)
            method.add(drafted, accepted, method_decay)

    def forget(self, seq_id: int) -> None:
        self._counts.pop(seq_id, None)


def _widen(rates: list[float], k: int) -> list[float]:
    """rates extended to k positions with the last of them (or cut to k)."""
    return rates[:k] + [rates[-1] if rates else 0.5] * (k - len(rates))


def _fit(counts: _Counts, k: int) -> _Counts:
    """counts with room for k positions."""
    grow = [0.0] * (k - len(counts.tried))
    counts.tried.extend(grow)
    counts.accepted.extend(grow)
    return counts
