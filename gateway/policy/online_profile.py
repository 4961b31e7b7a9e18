"""The online ITL model: a deployment's step time learned from the StepStats the
gateway already receives, so dynamic K works without `specdec profile`.

Every response of one verifier step carries the same StepStats, so steps are
deduplicated per replica by their step number: responses of a step are merged
(which methods drafted, how many draft tokens each asked for, whether one of
them completed a prompt) until a later step of that replica arrives, and the
merged step is then fitted once. The step's time splits in two parts the
verifier reports separately, each fitted by least squares with exponential
forgetting (recent steps count most, so the model follows a drafter that moves
or a machine that gets busier):

- the target's forward, step_time_ms - draft_wait_ms = f(num_tokens) + g *
  batch_size, with num_tokens the rows the step fed (prefill chunks, 1 + drafts
  per verify block): f piecewise linear, a + b * rows plus, past each knot of
  ROW_KNOTS (4, 8, 12, 16, 24, ... rows), a change of slope c_j and a jump s_j;
  g the cost of a sequence, whatever its rows (its attention over its own
  context, its sampling and bookkeeping). Rows alone do not tell it: on an AVX2
  EPYC, a plain step of 8 sequences took 118 ms and a step of 3 sequences
  feeding 8 rows 85 ms, and a fit in rows alone, learnt mostly from small
  batches drafting, priced plain steps at batch 8 at 72 ms, so that dynamic K
  turned speculation off for a whole batch of 8-11 where it paid. g is held
  toward 0 by a ridge: while every step feeds (K + 1) rows a sequence (one K)
  rows and sequences cannot be told apart, and the rows take it all. A line is not
  enough: on CPU the projections of up to 12-16 rows stream the weights once
  (nearly flat), then cost about 2 ms a row, then less again as GEMMs fill the
  cores; a line through such steps overstates what a draft row costs at one batch
  size and understates it at another, and dynamic K then picks the wrong K. And a
  bend is not enough either: where the small-rows kernel hands over to oneDNN (past
  12 rows on most CPUs) the 13th row costs what the next four do, and a slope
  from 12 to 16 rows would price 13 rows at a quarter of that. Each c_j and s_j
  is held toward 0 by a ridge, so where the data show no bend or jump (a fixed
  batch and K) the fit stays the line; with rows only at 12 and 16 the ridges
  split a rise between them evenly into slope and jump, and steps at 13-15 rows
  (drafters without a proposal make them) tell the two apart. The fit is
  non-decreasing in rows (each segment's slope, each jump, a and g >= 0): noise and
  a slow tail at some row counts would otherwise bend it down past a knot, and read
  non-decreasing such a bend prices every row past it at its peak. Steps that carry a
  prefill are left out: long chunks would pull the fit with rows that decode never
  feeds, at a cost per row that differs.
- the wait for drafts, draft_wait_ms = w + sum over methods m that drafted in
  the step of (d_m + s_m * sequences asked of m + e_m * draft tokens asked of m
  + h_m * the most asked of one sequence + c_m * context rows it takes in). w is
  the scheduling a plain step pays too; d_m a drafter's fixed cost per step, s_m
  its cost per sequence (its bookkeeping, the hidden states it is sent), e_m per
  draft token, h_m per depth (an EAGLE head runs one forward per drafted position,
  for all its sequences at once), c_m per row of context a sequence's drafter has
  not seen since it last drafted for it (StepSample.backlog: an EAGLE head takes in
  every such position, a few a step while it drafts every step, its whole prompt
  and reply so far when it starts: 70-120 ms for 14-16 sequences of 120-250
  positions, where their later drafting steps waited about 15). Tokens alone do not
  tell it: on the AMD EPYC the eagle3 drafter's wait
  was 3.6 / 6.2 / 11.4 ms at K = 2 for 1 / 3.6 / 12 sequences and 0.4-1.0 ms
  more at K = 4, about 0.7 ms a sequence and 0.2-0.5 a depth, where a line in
  tokens through those steps prices a token at about 0.35 ms at any batch.

Both fits are robust to steps slowed by something else. A step slower than the
model by more than ROBUST_K running mean misses (about twice the modelled time)
counts with weight (ROBUST_K mean misses / its miss)^2, next to nothing when far
off; steps faster than the model count in full (nothing makes a step fast by
accident, so they mean the model is too high). A shared machine has stretches of
disturbed steps (another process on the cores), and a fresh verifier's first
steps are slow (1.3 s a step against 50 ms): at full weight such steps priced a
plain step of 16 at 2 s on a fresh stack, 0.5 s still 600 steps later (against
0.15-0.2), and once, a disturbed stretch at 1.7 s. The first MIN_STEPS steps,
which come before there is a model to weigh them by, are kept and reweighted over
a few rounds when the first model is made. A machine that stays busier moves the
mean miss up by 5 % a step, and the fit then follows it.

From the fit comes an `ItlProfile` on a grid of batch sizes x K:
ITL(B, 0) = f(B) + g*B + w and
ITL(B, k, m) = f(B*(k+1)) + g*B + w + d_m + s_m*B + e_m*B*k + h_m*k,
one table per method that has drafted, and per-method prior acceptance rates
from every request's drafted and accepted counts. Between its grid points it is
read from the fit itself (`FittedProfile`), not interpolated: the rows of a step
where only some sequences draft fall between K's grid points, and a jump there
would be smeared over the whole interval. Until the forward line has
seen MIN_STEPS steps there is no profile (None): callers then keep the static
default K, which is also what produces the first drafting steps to learn from.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from gateway.policy.dynamic_k import NEUTRAL_ACCEPTANCE, OnlineAcceptance, OnlineShare
from gateway.policy.itl_profile import ItlProfile
from gateway.policy.values import check_count, is_number
from specdec.speculation import DRAFTER_METHODS

# Steps of the forward line before a profile is given. Fewer would let the first
# few steps (cold caches, a first long prompt) decide K for everyone.
MIN_STEPS = 20
# Plain decode steps of a batch size (or within an eighth of it) the forward fit must
# have seen, within its memory (MEMORY_STEPS), before dynamic K weighs drafting against
# plain decoding there (FittedProfile.measured_plain; BatchK runs such a batch plain
# first). Otherwise the plain step is read off a fit of other rows and batch sizes:
# after cells at C = 1 and 4 and one at C = 16 with eagle3 K = 2, the fit priced a
# plain step of 16 sequences at 46.7 ms against the 36 it took, so drafting looked
# 2-27 % better than plain; dynamic K drafted all cell long at 0.94 of plain decoding
# and, drafting, never ran the plain step that would have told it.
PLAIN_STEPS = 3
# A size whose plain steps have left the fit's memory still counts as measured, for up
# to RECALL_STEPS steps, while two checks hold, each within RECALL_TOLERANCE: the fit
# prices its plain step no dearer than those steps took, and the fit of their time (the
# one their misses were weighed against) prices the latest RECENT_STEPS steps no dearer
# than they took, so the machine is no faster than then (one-sided: OnlineProfile._holds
# says why). The first alone is circular: where
# no newer step feeds rows near the size's, the old steps are what the fit prices it by.
# Forgotten after 512 steps instead, a batch of 4 measured in a cell of plain decoding
# was measured again after the static-K cells that followed it (eagle3 K = 2, about
# 180 steps drafting at every size): dynamic K's cell opened with 5 plain steps at
# batch 4 and ended with 5 at each of batch 2 and 1, where the two cells that did not
# probe ran 180 steps to their 193-197.
RECALL_STEPS = 8 * 512
RECENT_STEPS = 32
RECALL_TOLERANCE = 0.1
# A size whose plain steps are in the fit's memory but older than this many steps counts
# as measured only while the same checks hold: in memory, the old steps are what the fit
# prices its plain step by. bench.serving's eagle3 cells at C = 16 ran dynamic K about
# 350 steps after the stack's first cell, where plain steps of 16 had taken 87 ms; plain
# steps of 16 took 62 ms by then, the fit priced them at 92 and dynamic K drafted at
# batch 16 at 0.20 tokens/ms where plain made 0.26, and never ran the plain step that
# would have told it.
STALE_STEPS = RECENT_STEPS
# The fit prices a step's forward only up to TRUSTED_ROWS_GROWTH times the most rows
# a decode step in its memory fed, or TRUSTED_ROWS_MARGIN rows more where that is
# more; dynamic K feeds no more (FittedProfile.max_draft_rows), and the bound grows as
# steps near it are measured. Past its data the fit's slope is that of its last
# segments, held by the ridge, and CPU forwards turn dearer a row past a few dozen:
# bench.serving's eagle3 auto cell at C = 16, after cells at C = 1 and 4 (steps of
# at most 20 rows in memory), priced 84 rows (batch 14 at K = 5) at 159 ms, above
# plain decoding by 2 %; the four steps took 250, 206, 195 and (with the head's
# catch-up) 423 ms, at half plain's tokens per ms.
TRUSTED_ROWS_GROWTH = 1.5
TRUSTED_ROWS_MARGIN = 8
# Row counts where the forward's cost per row may change (the hinges of f).
ROW_KNOTS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256)
# Ridge of each change of slope toward 0, in rows^2 as PRIOR_WEIGHT: a bend needs
# steps on both sides of its knot to show. A jump's ridge is on ms: a jump of 4 c ms
# weighs like a change of slope c over the 4 rows to the next knot, so a rise seen
# only at the next knot is split evenly between the two, and steps in between decide.
HINGE_PRIOR_WEIGHT = 1.0
JUMP_PRIOR_WEIGHT = HINGE_PRIOR_WEIGHT / 16
# Ridge of the cost per sequence g toward 0, in sequences^2 as PRIOR_WEIGHT: a
# spread of batch sizes at equal rows over a few dozen steps outweighs it; weaker,
# it took a cost that belonged to the rows while one batch size ran (a test of that).
SEQUENCE_PRIOR_WEIGHT = 64.0
# Weight of the oldest steps: each new step multiplies earlier weights by this, so
# the fit remembers roughly the last 1 / (1 - FORGETTING) = 512 steps.
MEMORY_STEPS = 512
FORGETTING = 1.0 - 1.0 / MEMORY_STEPS
# Prior of the cost per fed row: b = a / PRIOR_ROWS_PER_A. With one batch size and
# one K every step feeds the same rows and b is unidentifiable (any split of the
# step time between a and b fits); the prior then decides the split. 16 matches a
# small model on CPU (a ~40 ms, b ~2.5 ms per row: weights read once per step,
# matmul work per row), and on a GPU, where rows are nearly free, it overstates
# b, which errs toward less speculation under load until the data show better.
PRIOR_ROWS_PER_A = 16.0
# Strength of that prior, in rows^2: (b - a/16)^2 weighs like the squared error of
# PRIOR_WEIGHT steps one row apart; with step times noisy by s ms, b's prior has a
# standard deviation of s / 2 ms a row around a / 16. A spread of a row or two in
# num_tokens over a few dozen steps outweighs it.
PRIOR_WEIGHT = 4.0
# Ridge of the draft-wait coefficients toward 0. A method that has not drafted yet
# is assumed free (any weight > 0 keeps its unseen coefficients at 0), so dynamic K
# tries it and measures it. The per-token cost e is held to 0 harder than the fixed
# d: while a drafter is always asked the same number of tokens the two cannot be told
# apart, and its wait is then taken as fixed, until batch size or K vary.
DRAFT_FIXED_PRIOR_WEIGHT = 1e-3
DRAFT_TOKEN_PRIOR_WEIGHT = PRIOR_WEIGHT
# Its cost per sequence and per depth likewise, until batch sizes and Ks vary.
DRAFT_SEQUENCE_PRIOR_WEIGHT = PRIOR_WEIGHT
DRAFT_DEPTH_PRIOR_WEIGHT = PRIOR_WEIGHT
# And per context row taken in, until sequences start drafting with a backlog.
DRAFT_BACKLOG_PRIOR_WEIGHT = PRIOR_WEIGHT
# The wait fit's coefficients per drafter method: fixed, per sequence, per token,
# per depth, per context row taken in (x[1 + WAIT_TERMS * i + j] for method i).
WAIT_TERMS = 5
# w, the wait of a step that drafts nothing (scheduling), is small; held toward 0 more
# than d, so that while every step drafts (one method at batch 1) the wait counts as
# that drafter's rather than as a cost plain steps would pay too. Plain steps measure it.
WAIT_PRIOR_WEIGHT = 1.0
# The method's rates in the profile: the posterior of all its requests' counts around
# NEUTRAL_ACCEPTANCE worth this many drafting steps, the counts aged with this
# half-life in drafting responses (the workload drifts: other prompts, other users).
ACCEPTANCE_PRIOR_STEPS = 8.0
ACCEPTANCE_HALF_LIFE = 4096.0
# The method's availability in the profile (the share of steps asking it for drafts in
# which it had some), aged alike, around 1 worth this many steps. A request's own
# share starts from it. From 1 instead, requests counted on an ngram drafter that
# answered 65-72 % of the steps asked of it for 75-82 % on average, 85-88 % in their
# first ten steps: at 16 requests starting at once, dynamic K drafted 4 deep for all
# of them (52 rows, 90 ms a step) for 10 tokens where it expected 19. Replayed on the
# same steps, a request's share starting from the method's is within 1 %.
METHOD_AVAILABILITY_PRIOR_STEPS = 8.0
# How the method's drafting steps' accepted drafts compare with what their requests'
# rates expected (DynamicK.calibration): around 1 worth this many expected drafts,
# aged with this half-life in drafting responses. Short: the curse depends on how
# deep the batch drafts, which moves with its size, and a response is worth a few
# tokens, so 256 of them still hold it within a few per cent.
CALIBRATION_PRIOR_TOKENS = 16.0
CALIBRATION_HALF_LIFE = 256.0
# A step slower than modelled by more than ROBUST_K times the running mean absolute
# miss (of the forward or of the draft wait) weighs (ROBUST_K * mean miss / its
# miss)^2: half as far off again as the limit, 0.44; ten times, 0.01. With a mean
# miss of 10 % of the step, only steps twice as slow as modelled lose weight. Step
# times have a long slow tail, and a limit of 4 mean misses, which weighed part of
# it down, made the fit price steps low and dynamic K draft deeper: 0.82 / 0.88 of
# K = 2 at C = 16 in two runs, against 0.95-1.01 in four runs at full weight.
ROBUST_K = 10.0
# The running mean miss, held at least this share of the step's modelled time (and
# ROBUST_FLOOR_MS): on steps the model prices exactly (a quiet machine, one batch
# and K) it would shrink toward 0 and make every change look like an outlier.
ROBUST_FLOOR = 0.05
ROBUST_FLOOR_MS = 0.5
# It starts at this share of the modelled time, and forgets with a half-life of
# about 44 steps. Each step adds its miss clipped at MISS_CLIP times the mean, so the
# mean grows by at most 5 % a step: a disturbed stretch at 10x takes about 50 steps
# to be let in, a machine that stays twice as busy about 15.
ROBUST_START = 0.1
MISS_CLIP = 4.0
ROBUST_FORGETTING = 1.0 - 1.0 / 64
# A step's miss is measured against a fit at most this many steps old.
REFERENCE_STEPS = 8
# Dynamic K reads a fit at most this many steps old. The fit remembers hundreds of
# steps and moves little in a few, but refitting it (and the profile's tables) every
# step took dynamic K's share of the gateway's CPU to 0.03 cores at 4 requests in
# flight (py-spy), on cores the verifier's forward runs on: a process taking 0.03
# of them in bursts slowed a forward of 4 sequences by 3 % (its two threads wait for
# each other at every operation), a cost the step-time model cannot see.
REFIT_STEPS = 4
# Rounds of reweighting the first MIN_STEPS steps when the first model is made, and
# the limit there, in mean misses of ROBUST_START: 40 % slower than modelled. The
# first model is pulled halfway to the slow steps (a cold start can be half of
# them), and a limit of twice the modelled time would never let go of them.
WARMUP_ROUNDS = 6
WARMUP_K = 4.0
# A step number this far below the replica's last one means the verifier restarted.
RESTART_GAP = 1024
# The ITL floor in ms: ItlProfile needs positive times, a fit may reach 0.
MIN_ITL_MS = 0.01


@dataclass(frozen=True, slots=True)
class StepSample:
    """What one response tells about its verifier step and its request's drafting."""

    replica: str  # the verifier's address: step numbers count per verifier
    step: int
    batch_size: int
    num_tokens: int  # rows fed in the whole step
    step_time_ms: float
    draft_wait_ms: float
    method: str  # the request's drafter method, "none" for plain requests
    num_speculative_tokens: int  # K asked of this request's drafter this step
    num_drafted: int
    num_accepted: int
    prefill: bool  # this response completed the request's prompt (its first on a stream)
    # The outcome of the request's latest drafting step before this one (DraftOutcome),
    # None before it has had one on this stream.
    after: int | None = None
    # Where this step asked for drafts: the context positions the drafter had not seen
    # for this request before it (since its last drafting step on this stream, or all
    # of them if none), which it takes in now.
    backlog: int = 0

    def __post_init__(self) -> None:
        for name in ("step", "batch_size", "num_tokens", "num_speculative_tokens",
                     "num_drafted", "num_accepted", "backlog"):
            check_count(f"step sample: {name}", getattr(self, name))
        for name in ("step_time_ms", "draft_wait_ms"):
            value = getattr(self, name)
            if not (is_number(value) and value >= 0):
                raise ValueError(f"step sample: {name} must be a number >= 0, got {value!r}")
        if self.method != "none" and self.method not in DRAFTER_METHODS:
            raise ValueError(f"step sample: unknown method {self.method!r}")
        if self.num_accepted > self.num_drafted:
            raise ValueError(f"step sample: num_accepted ({self.num_accepted}) exceeds "
                             f"num_drafted ({self.num_drafted})")


@dataclass
class _Step:
    """One verifier step, merged over the responses seen of it."""

    number: int
    batch_size: int
    num_tokens: int
    step_time_ms: float
    draft_wait_ms: float
    prefill: bool
    asked: dict[str, int] = field(default_factory=dict)  # method -> draft tokens asked
    sequences: dict[str, int] = field(default_factory=dict)  # method -> sequences asked
    depth: dict[str, int] = field(default_factory=dict)  # method -> most asked of one
    backlog: dict[str, int] = field(default_factory=dict)  # method -> context rows taken in

    @property
    def plain(self) -> bool:
        """A plain decode step: one row a sequence, no prompt in it."""
        return not self.prefill and self.num_tokens == self.batch_size

    def merge(self, s: StepSample) -> None:
        self.prefill |= s.prefill
        if s.method != "none" and s.num_speculative_tokens:
            self.asked[s.method] = self.asked.get(s.method, 0) + s.num_speculative_tokens
            self.sequences[s.method] = self.sequences.get(s.method, 0) + 1
            self.depth[s.method] = max(self.depth.get(s.method, 0), s.num_speculative_tokens)
            self.backlog[s.method] = self.backlog.get(s.method, 0) + s.backlog


class ForgettingLeastSquares:
    """Least squares with exponential forgetting and a Gaussian prior on theta.

    Minimises sum_t w^(T-t) (y_t - x_t . theta)^2 + (theta - mean)' P (theta - mean);
    P may be singular (a prior on a combination of coefficients only) as long as
    P plus the data's scatter is not.
    """

    def __init__(self, prior_mean: np.ndarray, prior_precision: np.ndarray, forgetting: float):
        n = len(prior_mean)
        if prior_precision.shape != (n, n):
            raise ValueError(f"prior_precision must be {n}x{n}, got {prior_precision.shape}")
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.prior_mean = np.asarray(prior_mean, dtype=np.float64)  # [n]
        self.prior_precision = np.asarray(prior_precision, dtype=np.float64)  # [n, n]
        self.forgetting = forgetting
        self.scatter = np.zeros((n, n))  # [n, n] sum of w x x'
        self.moment = np.zeros(n)  # [n] sum of w x y
        self.count = 0

    def empty(self) -> ForgettingLeastSquares:
        """A fit with the same prior and forgetting and no steps."""
        return ForgettingLeastSquares(self.prior_mean, self.prior_precision, self.forgetting)

    def add(self, x: np.ndarray, y: float, weight: float = 1.0) -> None:
        self.scatter *= self.forgetting
        self.moment *= self.forgetting
        self.scatter += weight * np.outer(x, x)
        self.moment += (weight * y) * x
        self.count += 1

    def forget(self, x: np.ndarray, weight: float, weighted_y: float) -> None:
        """Takes out steps added at features x: their weights now (forgetting applied)
        summed, and each weight times its y summed."""
        self.scatter -= weight * np.outer(x, x)
        self.moment -= weighted_y * x

    def solve_non_negative(self, signed: Iterable[int],
                           basis: np.ndarray | None = None) -> np.ndarray:
        """theta with each coefficient of `signed` >= 0: one that comes out negative is
        pinned to 0 and the rest solved again, until none is left. With `basis` [n, n]
        (invertible) the same least squares is solved in u, theta = basis @ u, and
        `signed` names u's coefficients."""
        a = self.scatter + self.prior_precision  # [n, n]
        r = self.moment + self.prior_precision @ self.prior_mean  # [n]
        if basis is not None:
            a, r = basis.T @ a @ basis, basis.T @ r
        signed = tuple(signed)
        pinned: set[int] = set()
        u = _solve_pinned(a, r, pinned)
        while negative := {i for i in signed if i not in pinned and u[i] < 0}:
            pinned |= negative
            u = _solve_pinned(a, r, pinned)
        return u if basis is None else basis @ u


def _solve_pinned(a: np.ndarray, r: np.ndarray, pinned: set[int]) -> np.ndarray:
    """The x of a x = r [n] with the coefficients in `pinned` held at 0."""
    x = np.zeros(len(r))
    free = [i for i in range(len(r)) if i not in pinned]
    if free:
        sub = np.ix_(free, free)
        try:
            # Symmetric and positive definite once the prior and a few steps are in: a
            # factorisation, a quarter of lstsq's time (the gateway refits often).
            x[free] = np.linalg.solve(a[sub], r[free])
        except np.linalg.LinAlgError:  # singular: the least-norm solution
            x[free] = np.linalg.lstsq(a[sub], r[free], rcond=None)[0]
    return x


def _miss_floor(modelled: float) -> float:
    """The least mean miss of a step modelled at `modelled` ms (ROBUST_FLOOR)."""
    return max(ROBUST_FLOOR * abs(modelled), ROBUST_FLOOR_MS)


def robust_weight(observed: float, modelled: float, mean_miss: float,
                  k: float = ROBUST_K) -> float:
    """The weight of a step the model priced at `modelled` ms that took `observed`,
    against a mean miss of `mean_miss` ms: full up to k mean misses slower."""
    limit = k * max(mean_miss, _miss_floor(modelled))
    slower = observed - modelled
    return 1.0 if slower <= limit else (limit / slower) ** 2


class RobustWeight:
    """Weights of one fit's steps as they come (robust_weight), against the running
    mean absolute miss."""

    def __init__(self) -> None:
        self.mean_miss: float | None = None  # ms

    def __call__(self, observed: float, modelled: float) -> float:
        floor = _miss_floor(modelled)
        if self.mean_miss is None:
            self.mean_miss = max(ROBUST_START * abs(modelled), floor)
        weight = robust_weight(observed, modelled, self.mean_miss)
        clip = MISS_CLIP * max(self.mean_miss, floor)
        self.mean_miss = (ROBUST_FORGETTING * self.mean_miss
                          + (1.0 - ROBUST_FORGETTING) * min(abs(observed - modelled), clip))
        return weight


_STARTS = (0, *ROW_KNOTS)  # where each segment of the forward starts
# theta = _SLOPE_BASIS @ u: the forward's coefficients (a, b, changes of slope c_j,
# jumps, g) from (a, b, the slope of each later segment, jumps, g), c_j = slope_j -
# slope_{j-1}. [3 + 2 * knots, 3 + 2 * knots]
_SLOPE_BASIS = np.eye(3 + 2 * len(ROW_KNOTS)) - np.diag(
    [0.0] + [1.0] * len(ROW_KNOTS) + [0.0] * (1 + len(ROW_KNOTS)), k=-1)
_START_ARRAY = np.array(_STARTS, dtype=np.float64)


@dataclass(frozen=True)
class StepCost:
    """The fitted step time in ms: forward f(rows) + g * sequences, f(rows) = a + b *
    rows + sum_j hinges[j] * max(0, rows - ROW_KNOTS[j]) + sum_j jumps[j] * [rows >
    ROW_KNOTS[j]], read non-decreasing (OnlineProfile fits it so; in a cost made by
    hand a negative slope counts as flat, a negative jump as none); plus the draft wait w (plain steps too)
    and per drafting method d[m] + s[m] * sequences + e[m] * draft tokens + h[m] *
    depth (the most drafts asked of one sequence) + c[m] * backlog (the context rows
    it takes in)."""

    a: float
    b: float
    w: float
    d: dict[str, float]
    e: dict[str, float]
    hinges: tuple[float, ...] = (0.0,) * len(ROW_KNOTS)  # change of slope at each knot
    jumps: tuple[float, ...] = (0.0,) * len(ROW_KNOTS)  # rise just past each knot
    g: float = 0.0  # cost of each sequence in the batch, whatever its rows
    s: dict[str, float] = field(default_factory=dict)  # a drafter's wait per sequence
    h: dict[str, float] = field(default_factory=dict)  # a drafter's wait per depth
    c: dict[str, float] = field(default_factory=dict)  # ... per context row taken in

    def __post_init__(self) -> None:
        # Segment j runs from _STARTS[j] (exclusive) to ROW_KNOTS[j]: its value at
        # the start (jump included) and its slope, read non-decreasing, so that
        # forward() is a lookup (dynamic K reads it hundreds of times a step).
        bases, slopes = [self.a], [max(self.b, 0.0)]
        slope = self.b
        for j, knot in enumerate(ROW_KNOTS):
            bases.append(bases[-1] + slopes[-1] * (knot - _STARTS[j]) + max(self.jumps[j], 0.0))
            slope += self.hinges[j]
            slopes.append(max(slope, 0.0))
        object.__setattr__(self, "_bases", tuple(bases))
        object.__setattr__(self, "_slopes", tuple(slopes))
        object.__setattr__(self, "_base_array", np.array(bases))  # [segments]
        object.__setattr__(self, "_slope_array", np.array(slopes))  # [segments]

    def forward(self, rows: float, sequences: float = 0.0) -> float:
        """ms of a forward feeding `rows` rows for `sequences` sequences (f(rows) alone
        by default)."""
        t = self.g * sequences
        if rows <= 0:
            return t + self.a
        j = bisect.bisect_left(ROW_KNOTS, rows)  # ROW_KNOTS[j - 1] < rows <= ROW_KNOTS[j]
        return t + self._bases[j] + self._slopes[j] * (rows - _STARTS[j])

    def forwards(self, rows: np.ndarray, sequences: float | np.ndarray = 0.0) -> np.ndarray:
        """forward() at many row counts (any shape, broadcast with sequences; ms)."""
        rows = np.asarray(rows, dtype=np.float64)
        j = np.searchsorted(ROW_KNOTS, rows, side="left")  # as bisect_left in forward()
        t = self._base_array[j] + self._slope_array[j] * (rows - _START_ARRAY[j])
        return np.where(rows <= 0, self.a, t) + self.g * sequences

    def itls(self, batch_size: float | np.ndarray, ks: np.ndarray,
             method: str | None = None) -> np.ndarray:
        """itl() at many K, and one or many batch sizes (broadcast together)."""
        batch_size = np.asarray(batch_size, dtype=np.float64)
        ks = np.asarray(ks, dtype=np.float64)
        t = self.forwards(batch_size * (ks + 1), batch_size) + self.w
        if method in self.d:
            t = t + np.where(ks > 0, self.drafter_waits(method, batch_size, batch_size * ks,
                                                        ks), 0.0)
        return np.maximum(t, MIN_ITL_MS)

    def drafter_waits(self, method: str, sequences: float | np.ndarray,
                      tokens: float | np.ndarray, depth: float | np.ndarray,
                      backlog: float | np.ndarray = 0.0) -> np.ndarray:
        """ms `method` adds to the wait of steps asking it for `tokens` drafts over
        `sequences` sequences, at most `depth` of one, taking in `backlog` context rows
        (broadcast together; it is asked)."""
        return (self.d.get(method, 0.0) + self.s.get(method, 0.0) * np.asarray(sequences)
                + self.e.get(method, 0.0) * np.asarray(tokens)
                + self.h.get(method, 0.0) * np.asarray(depth)
                + self.c.get(method, 0.0) * np.asarray(backlog))

    def wait(self, asked: dict[str, int], sequences: dict[str, int],
             depth: dict[str, int], backlog: dict[str, int] | None = None) -> float:
        """ms of a step's draft wait, asked[m] draft tokens asked of each drafting m
        over sequences[m] sequences, at most depth[m] of one, taking in backlog[m]
        context rows."""
        backlog = backlog or {}
        return self.w + sum(float(self.drafter_waits(m, sequences[m], n, depth[m],
                                                     backlog.get(m, 0)))
                            for m, n in asked.items())

    def itl(self, batch_size: float, k: float, method: str | None = None) -> float:
        t = self.forward(batch_size * (k + 1), batch_size) + self.w
        if k > 0 and method in self.d:
            t += float(self.drafter_waits(method, batch_size, batch_size * k, k))
        return max(t, MIN_ITL_MS)


def forward_features(rows: float, sequences: float) -> np.ndarray:
    """[3 + 2 * len(ROW_KNOTS)]: 1, rows, the hinge max(0, rows - knot) of each knot,
    whether rows is past each knot, and the sequences."""
    return np.array([1.0, rows, *(max(0.0, rows - k) for k in ROW_KNOTS),
                     *(float(rows > k) for k in ROW_KNOTS), sequences])


@dataclass(frozen=True)
class FittedProfile(ItlProfile):
    """The online model's ItlProfile: its tables for whoever reads them (and JSON),
    and ITL read from the fitted cost itself at any batch size and K, within the
    grid's edges, rather than interpolated between grid points."""

    cost: StepCost = field(kw_only=True, compare=False, hash=False, repr=False)
    # Batch sizes with PLAIN_STEPS plain decode steps in the fit's memory.
    plain_batch_sizes: frozenset[int] = field(default=frozenset(), kw_only=True,
                                              compare=False, hash=False, repr=False)
    # The most rows a step may feed and be priced by the fit (trusted_rows()).
    trusted_rows: float = field(default=math.inf, kw_only=True, compare=False, hash=False,
                                repr=False)

    def measured_plain(self, batch_size: int) -> bool:
        near = batch_size // 8  # a step of 40 sequences tells one of 37 closely enough
        return any(abs(b - batch_size) <= near for b in self.plain_batch_sizes)

    def max_draft_rows(self, batch_size: float) -> float:
        return max(self.trusted_rows - batch_size, 0.0)

    def _checked_table(self, name: str, table: object) -> tuple[tuple[float, ...], ...]:
        # Written by OnlineProfile.profile from the fit, every entry >= MIN_ITL_MS: the
        # model is rebuilt every step, and checking each entry again cost a third of it.
        return tuple(tuple(row) for row in table)

    def itl(self, batch_size: float, k: float, method: str | None = None) -> float:
        if not (math.isfinite(batch_size) and math.isfinite(k)):
            raise ValueError(f"itl: batch_size and k must be finite, got {batch_size}, {k}")
        batch_size = min(max(batch_size, self.batch_sizes[0]), self.batch_sizes[-1])
        k = min(max(k, self.ks[0]), self.ks[-1])
        return self.cost.itl(batch_size, k, method if method in self.method_itl_ms else None)

    def itls(self, batch_size: float, ks: np.ndarray, method: str | None = None) -> np.ndarray:
        ks = np.asarray(ks, dtype=np.float64)
        if not (math.isfinite(batch_size) and np.isfinite(ks).all()):
            raise ValueError(f"itls: batch_size and ks must be finite, got {batch_size}, {ks}")
        batch_size = min(max(batch_size, self.batch_sizes[0]), self.batch_sizes[-1])
        ks = np.clip(ks, self.ks[0], self.ks[-1])
        return self.cost.itls(batch_size, ks, method if method in self.method_itl_ms else None)

    def drafter_waits(self, method: str, sequences: np.ndarray, tokens: np.ndarray,
                      depth: np.ndarray, backlog: np.ndarray | float = 0.0
                      ) -> np.ndarray | None:
        if method not in self.method_itl_ms:
            return None
        return np.where(np.asarray(sequences) > 0,
                        self.cost.drafter_waits(method, sequences, tokens, depth, backlog),
                        0.0)


class OnlineProfile:
    """The step-time model of one deployment, fitted from every response's StepStats.

    Shared by all replicas (one deployment runs one model on one kind of machine);
    steps are deduplicated per replica.
    """

    def __init__(self, min_steps: int = MIN_STEPS):
        check_count("online profile: min_steps", min_steps)
        self.min_steps = min_steps
        self._pending: dict[str, _Step] = {}  # replica -> its latest step, still merging
        # Forward: theta = (a, b, c_1..c_n, s_1..s_n, g); the prior is on b - a/16 (a
        # is free), on each change of slope c_j, each jump s_j and g toward 0.
        knots = len(ROW_KNOTS)
        n = 3 + 2 * knots
        v = np.zeros(n)
        v[:2] = (-1.0 / PRIOR_ROWS_PER_A, 1.0)
        precision = PRIOR_WEIGHT * np.outer(v, v)
        precision[2:, 2:] += np.diag([HINGE_PRIOR_WEIGHT] * knots + [JUMP_PRIOR_WEIGHT] * knots
                                     + [SEQUENCE_PRIOR_WEIGHT])
        self._forward = ForgettingLeastSquares(np.zeros(n), precision, FORGETTING)
        # Draft wait: theta = (w, then d_m, s_m, e_m, h_m for each drafter method), ridge
        # toward 0.
        n = 1 + WAIT_TERMS * len(DRAFTER_METHODS)
        precision = np.diag([WAIT_PRIOR_WEIGHT] + [DRAFT_FIXED_PRIOR_WEIGHT,
                                                   DRAFT_SEQUENCE_PRIOR_WEIGHT,
                                                   DRAFT_TOKEN_PRIOR_WEIGHT,
                                                   DRAFT_DEPTH_PRIOR_WEIGHT,
                                                   DRAFT_BACKLOG_PRIOR_WEIGHT]
                            * len(DRAFTER_METHODS))
        self._wait = ForgettingLeastSquares(np.zeros(n), precision, FORGETTING)
        self._robust_forward, self._robust_wait = RobustWeight(), RobustWeight()
        self._reference_cost: StepCost | None = None
        self._reference_age = 0
        self._warmup: list[_Step] = []  # the steps before the first model, reweighted then
        self.acceptance: dict[str, OnlineAcceptance] = {}  # method -> all its requests' counts
        # method -> its steps asked for drafts, and those it had some in (aged per such
        # response), over all its requests
        self._answers: dict[str, OnlineShare] = {}
        # (method, DraftOutcome of the request's previous drafting step) -> the counts of
        # the steps after it, over all requests (outcome_table.py)
        self._after: dict[tuple[str, int], OnlineAcceptance] = {}
        self._answers_after: dict[tuple[str, int], OnlineShare] = {}
        # method -> the accepted drafts of its requests' steps, and those their rates
        # expected when the steps were chosen
        self._calibration: dict[str, OnlineShare] = {}
        self._cost: StepCost | None = None
        self._stale = 0  # steps added since _cost was fitted
        self._profiles: dict[tuple[int, int], ItlProfile] = {}  # grid -> profile of _cost
        # batch size -> (num_steps after it, its forward ms) of each of its latest
        # PLAIN_STEPS plain decode steps
        self._plain: dict[int, list[tuple[int, float]]] = {}
        # batch size -> (once measured) the fit its plain steps were weighed against, the
        # mean of their forward ms and num_steps then
        self._recall: dict[int, tuple[StepCost, float, int]] = {}
        # batch size -> its plain decode steps in the forward fit, summed: (their weights,
        # their weights times their forward ms, num_steps then), forgetting applied up to
        # then; taken out of the fit where they are found stale (_fit)
        self._plain_fit: dict[int, tuple[float, float, int]] = {}
        # (rows, sequences, forward ms) of the latest RECENT_STEPS decode steps
        self._recent: deque[tuple[int, int, float]] = deque(maxlen=RECENT_STEPS)
        # rows -> num_steps after the latest decode step that fed them; and the most of
        # them, as of the latest _most_rows() or since (never below the true most)
        self._rows_seen: dict[int, int] = {}
        self._rows_max = 0

    @property
    def num_steps(self) -> int:
        """Steps in the forward fit (prefill steps excluded)."""
        return self._forward.count

    def observe(self, s: StepSample) -> None:
        """One response: its request's acceptance now, its step once the step is complete."""
        if s.method != "none" and s.num_drafted:
            acc = self.acceptance.setdefault(s.method, OnlineAcceptance(ACCEPTANCE_HALF_LIFE))
            acc.age()
            acc.update(s.num_drafted, s.num_accepted)
        if s.method != "none" and s.num_speculative_tokens and not s.prefill:
            answers = self._answers.setdefault(s.method, OnlineShare(ACCEPTANCE_HALF_LIFE))
            answers.update(True, s.num_drafted > 0)
            if s.after is not None:
                key = (s.method, s.after)
                self._answers_after.setdefault(key, OnlineShare(ACCEPTANCE_HALF_LIFE)).update(
                    True, s.num_drafted > 0)
                if s.num_drafted:
                    acc = self._after.setdefault(key, OnlineAcceptance(ACCEPTANCE_HALF_LIFE))
                    acc.age()
                    acc.update(s.num_drafted, s.num_accepted)
        pending = self._pending.get(s.replica)
        if pending is not None and s.step == pending.number:
            pending.merge(s)
            return
        if pending is not None and pending.number - RESTART_GAP < s.step < pending.number:
            return  # a late response of a step already fitted
        if pending is not None:
            self._fit(pending)
        step = _Step(s.step, s.batch_size, s.num_tokens, s.step_time_ms, s.draft_wait_ms,
                     s.prefill)
        step.merge(s)
        self._pending[s.replica] = step

    def _reference(self) -> StepCost | None:
        """The model a step's miss is measured against: the latest fit when dynamic K
        has read it, else one at most REFERENCE_STEPS old (a deployment without dynamic
        K reads none, and a refit every step would cost its gateway 0.4 ms a step)."""
        if self._cost is not None or self._reference_cost is None \
                or self._reference_age >= REFERENCE_STEPS:
            self._reference_cost, self._reference_age = self.cost(), 0
        self._reference_age += 1
        return self._reference_cost

    def _fit(self, step: _Step) -> None:
        cost = self._reference()  # None before MIN_STEPS: every step at full weight
        if step.plain and cost is not None and self._stale_plain(step.batch_size, cost):
            # A plain step of a size whose earlier ones are of a machine that has changed
            # speed since: in the fit, those would outweigh the few new ones for hundreds
            # of steps (the fit prices the size's plain step by them: STALE_STEPS), so
            # they are taken out and the new ones measure it.
            self._forget_plain(step.batch_size)
            self._plain.pop(step.batch_size, None)
            self._recall.pop(step.batch_size, None)
        self._add(step, cost, self._robust_wait, self._robust_forward)
        if not step.prefill:
            self._recent.append((step.num_tokens, step.batch_size,
                                 step.step_time_ms - step.draft_wait_ms))
            if step.num_tokens > self._rows_max:
                # The profiles' bound grows from this step on. Compared with the running
                # most rather than _most_rows(), which scans every row count a step.
                self._profiles.clear()
                self._rows_max = step.num_tokens
            self._rows_seen[step.num_tokens] = self.num_steps
        if step.plain:
            seen = self._plain.setdefault(step.batch_size, [])
            was_measured = _measured(seen, self.num_steps)
            seen.append((self.num_steps, step.step_time_ms - step.draft_wait_ms))
            del seen[:-PLAIN_STEPS]
            measured = _measured(seen, self.num_steps)
            if cost is not None and measured:
                took = sum(ms for _, ms in seen) / len(seen)
                self._recall[step.batch_size] = (cost, took, self.num_steps)
            if measured and not was_measured:
                # Newly measured: the profiles say so from this step on, not from the next
                # refit. BatchK runs a batch of an unmeasured size plain until its profile
                # says so: read at refits only, the last eagle3 request of a bench.serving
                # cell at C = 4 ran 8 plain steps to measure batch 1 where 5 do now (the
                # fit's step of lag and the update's way to the verifier take the other
                # two), each at about half the tokens of one drafting.
                self._profiles.clear()
        if cost is None:
            self._warmup.append(step)
            if self.num_steps >= self.min_steps:
                self._reweigh_warmup()
        self._stale += 1
        if self._stale >= REFIT_STEPS:
            self._cost = None
            self._profiles.clear()

    def _add(self, step: _Step, cost: StepCost | None, weigh_wait, weigh_forward) -> None:
        """One step into both fits, weighed against `cost` (at full weight without)."""
        x = np.zeros(1 + WAIT_TERMS * len(DRAFTER_METHODS))
        x[0] = 1.0
        for m, asked in step.asked.items():
            i = 1 + WAIT_TERMS * DRAFTER_METHODS.index(m)
            x[i:i + WAIT_TERMS] = (1.0, step.sequences[m], asked, step.depth[m],
                                   step.backlog.get(m, 0))
        self._wait.add(x, step.draft_wait_ms, 1.0 if cost is None else
                       weigh_wait(step.draft_wait_ms,
                                  cost.wait(step.asked, step.sequences, step.depth,
                                            step.backlog)))
        if not step.prefill:
            forward = step.step_time_ms - step.draft_wait_ms
            weight = 1.0 if cost is None else weigh_forward(
                forward, cost.forward(step.num_tokens, step.batch_size))
            self._forward.add(forward_features(step.num_tokens, step.batch_size), forward,
                              weight)
            if step.plain:
                w, wy, at = self._plain_fit.get(step.batch_size, (0.0, 0.0, 0))
                decay = FORGETTING ** (self._forward.count - at)
                self._plain_fit[step.batch_size] = (decay * w + weight,
                                                    decay * wy + weight * forward,
                                                    self._forward.count)

    def _forget_plain(self, batch_size: int) -> None:
        """Takes a size's plain decode steps so far out of the forward fit."""
        w, wy, at = self._plain_fit.pop(batch_size, (0.0, 0.0, 0))
        decay = FORGETTING ** (self._forward.count - at)
        self._forward.forget(forward_features(batch_size, batch_size), decay * w, decay * wy)

    def _stale_plain(self, batch_size: int, cost: StepCost,
                     recent: np.ndarray | None = None) -> bool:
        """Whether a size's plain steps, its latest at least STALE_STEPS old, fail the
        recall checks (_holds) against `cost` (the fit now)."""
        recall = self._recall.get(batch_size)
        return recall is not None and self.num_steps - recall[2] >= STALE_STEPS \
            and not self._holds(batch_size, cost, recent)

    def _holds(self, batch_size: int, cost: StepCost, recent: np.ndarray | None = None) -> bool:
        """The recall checks of a size's plain steps (RECALL_STEPS): `cost` (the fit
        now) prices its plain step no dearer than they took, and the fit they were
        weighed against prices the latest RECENT_STEPS steps (`recent`, else read) no
        dearer than those took (the machine is no faster than then), each within
        RECALL_TOLERANCE.

        One-sided: a plain step priced too cheap makes plain decoding look better than
        it is, and a batch that then runs plain measures it; where drafting wins even
        so, it wins. One priced too dear hides plain decoding where it is best, and
        nothing but a probe tells. Two-sided, the checks failed on an eagle3 cell at
        C = 4 that ran slower than the cells before it (drift of the machine, and
        tracing): 14 plain steps to measure sizes again in two cells of 175, each at
        0.07 tokens/ms where drafting made 0.11."""
        then, took, _ = self._recall[batch_size]
        if recent is None:
            if not self._recent:
                return True
            recent = np.array(self._recent, dtype=np.float64)  # [steps, (rows, seqs, ms)]
        took_now = float(recent[:, 2].sum())
        priced_then = float(then.forwards(recent[:, 0], recent[:, 1]).sum())
        return cost.forward(batch_size, batch_size) - took <= RECALL_TOLERANCE * took \
            and priced_then - took_now <= RECALL_TOLERANCE * took_now

    def _reweigh_warmup(self) -> None:
        """Refit the first steps with weights from the model they make, a few rounds
        over: each round's model is nearer the ordinary steps, and weighs the slow
        ones less. (A fresh verifier's first steps can be half of them, at 25x the
        others' time.) The limit is WARMUP_K mean misses of ROBUST_START.
        A slow stretch that the fit's jumps can explain by its rows (all of it past
        a knot, the ordinary steps below) is taken for the cost of those rows."""
        steps, self._warmup = self._warmup, []
        first_wait, first_forward = self._wait, self._forward

        def weigh(observed: float, modelled: float) -> float:
            return robust_weight(observed, modelled, ROBUST_START * abs(modelled), WARMUP_K)

        for _ in range(WARMUP_ROUNDS):
            self._cost = None
            cost = self.cost()
            self._wait, self._forward = first_wait.empty(), first_forward.empty()
            self._plain_fit = {}
            for step in steps:
                self._add(step, cost, weigh, weigh)
        self._cost, self._reference_cost = None, None  # refitted from the last round's weights
        self._profiles.clear()

    def cost(self) -> StepCost | None:
        """The fitted cost, None before MIN_STEPS forward steps."""
        if self.num_steps < self.min_steps:
            return None
        if self._cost is None:
            # A row never makes a step faster, a step is never free and no knot makes
            # the next row cheaper: a negative a, g, jump or slope of any segment (noise,
            # a narrow spread of rows, or jumps trading against slopes where every step
            # sits on a knot) is pinned to 0 and the rest refitted, until none is left.
            # Read as 0 instead, a jump the fit needed negative would leave every row
            # past it too dear, and so would a segment's negative slope: eagle3 at K = 4
            # fed 18-20 rows at batch 4, 49 / 47 / 46 ms on average, and the fit's jump
            # of 8.7 ms past 16 rows with a slope of -0.9 ms a row, read flat, priced
            # all three at 49 ms and every row past them too; dynamic K then drafted less
            # than K = 4 where K = 4 was faster. The pins are on the segments' slopes
            # (u = a, b, the slope of each segment, the jumps, g).
            knots = len(ROW_KNOTS)
            theta = self._forward.solve_non_negative(range(3 + 2 * knots), _SLOPE_BASIS)
            a, b = theta[0], theta[1]
            hinges = tuple(float(c) for c in theta[2:2 + knots])
            jumps = tuple(float(s) for s in theta[2 + knots:2 + 2 * knots])
            # The same for the wait: no term of it makes a step faster.
            wait = self._wait.solve_non_negative(range(len(self._wait.moment)))
            d, s, e, h, c = {}, {}, {}, {}, {}
            for i, m in enumerate(DRAFTER_METHODS):
                j = 1 + WAIT_TERMS * i
                if self._wait.scatter[j, j] > 0:  # the method has drafted
                    d[m], s[m], e[m], h[m], c[m] = (float(v) for v in wait[j:j + WAIT_TERMS])
            self._stale = 0
            self._cost = StepCost(float(a), float(b), float(wait[0]), d, e, hinges,
                                  jumps, float(theta[-1]), s, h, c)
        return self._cost

    def rates(self, method: str, max_num_speculative_tokens: int) -> tuple[float, ...]:
        """Prior acceptance of `method` for dynamic K: its requests' rates so far,
        around NEUTRAL_ACCEPTANCE while they are few."""
        acc = self.acceptance.get(method, OnlineAcceptance())
        return acc.rates((NEUTRAL_ACCEPTANCE,), ACCEPTANCE_PRIOR_STEPS,
                         max(max_num_speculative_tokens, 1))

    def rates_after(self, method: str, outcome: int,
                    max_num_speculative_tokens: int) -> tuple[float, ...]:
        """`method`'s rates in the steps after a drafting step of a request ended in
        `outcome` (DraftOutcome), around its rates over all steps while they are few."""
        acc = self._after.get((method, outcome), OnlineAcceptance())
        most = max(max_num_speculative_tokens, 1)
        return acc.rates(self.rates(method, most), ACCEPTANCE_PRIOR_STEPS, most)

    def availability_after(self, method: str, outcome: int) -> float:
        """The share of steps asking `method` for drafts after a drafting step that
        ended in `outcome` in which it had some, around its share over all steps."""
        answers = self._answers_after.get((method, outcome))
        prior = self.availability(method)
        return prior if answers is None else answers.share(prior, METHOD_AVAILABILITY_PRIOR_STEPS)

    def calibrate(self, method: str, expected: float, accepted: int) -> None:
        """One drafting step of a `method` request: its rates expected `expected`
        accepted drafts of the K it asked, and it accepted `accepted`."""
        self._calibration.setdefault(method, OnlineShare(CALIBRATION_HALF_LIFE)).add(
            expected, accepted)

    def calibration(self, method: str) -> float:
        """The accepted drafts of `method`'s steps over those their requests' rates
        expected, around 1 while they are few."""
        counts = self._calibration.get(method)
        return 1.0 if counts is None else counts.share(1.0, CALIBRATION_PRIOR_TOKENS)

    def calibrations(self) -> dict[str, float]:
        """calibration() of every method that has had a drafting step under dynamic K."""
        return {m: self.calibration(m) for m in self._calibration}

    def plain_batch_sizes(self, cost: StepCost | None = None) -> frozenset[int]:
        """Batch sizes with PLAIN_STEPS plain decode steps in the forward fit's memory;
        with `cost` (the fit now), only those measured within RECENT_STEPS steps or
        passing the recall checks (RECALL_STEPS), also those out of memory that pass."""
        now = self.num_steps
        sizes = {b for b, seen in self._plain.items() if _measured(seen, now)}
        if cost is None or not self._recent:
            return frozenset(sizes)
        # In memory is not enough where the machine has changed speed since (STALE_STEPS).
        recent = np.array(self._recent, dtype=np.float64)  # [steps, (rows, sequences, ms)]
        kept = {b for b in sizes if not self._stale_plain(b, cost, recent)}
        recalled = {b for b, (_, _, at) in self._recall.items()
                    if b not in sizes and now - at < RECALL_STEPS and self._holds(b, cost, recent)}
        return frozenset(kept | recalled)

    def _most_rows(self) -> int:
        """The most rows a decode step in the fit's memory fed (0: none yet)."""
        now = self.num_steps
        stale = [r for r, at in self._rows_seen.items() if now - at >= MEMORY_STEPS]
        for r in stale:
            del self._rows_seen[r]
        self._rows_max = max(self._rows_seen, default=0)
        return self._rows_max

    def trusted_rows(self) -> float:
        """The most rows a step may feed and be priced by the fit: TRUSTED_ROWS_GROWTH
        times the most its memory's decode steps fed, or TRUSTED_ROWS_MARGIN more."""
        most = self._most_rows()
        return float(max(TRUSTED_ROWS_GROWTH * most, most + TRUSTED_ROWS_MARGIN))

    def availability(self, method: str) -> float:
        """The share of steps asking `method` for drafts in which it had some, over all
        its requests so far, around 1 while they are few."""
        answers = self._answers.get(method)
        return 1.0 if answers is None else answers.share(1.0, METHOD_AVAILABILITY_PRIOR_STEPS)

    def profile(self, max_num_seqs: int, max_num_speculative_tokens: int) -> ItlProfile | None:
        """The model as an ItlProfile over batch sizes 1, 2, 4, ... max_num_seqs and
        K 0..max_num_speculative_tokens; None before MIN_STEPS steps."""
        max_num_seqs = max(max_num_seqs, 1)
        key = (max_num_seqs, max_num_speculative_tokens)
        made = self._profiles.get(key)
        if made is not None:
            # Every dynamic-K response reads it, some five times a choice: a profile made
            # is the current one (a refit or a newly measured size clears them all).
            return made
        check_count("online profile: max_num_speculative_tokens", max_num_speculative_tokens)
        cost = self.cost()
        if cost is None:
            return None
        batch_sizes = batch_grid(max_num_seqs)
        ks = tuple(range(max_num_speculative_tokens + 1))

        grid = np.array(ks, dtype=np.float64)[None, :]  # [1, ks]
        sizes = np.array(batch_sizes, dtype=np.float64)[:, None]  # [batch sizes, 1]

        def table(method: str | None) -> tuple[tuple[float, ...], ...]:
            return tuple(map(tuple, cost.itls(sizes, grid, method).tolist()))

        made = self._profiles[key] = FittedProfile(
            batch_sizes=batch_sizes, ks=ks, itl_ms=table(None),
            acceptance={m: self.rates(m, max_num_speculative_tokens)
                        for m in self.acceptance},
            method_itl_ms={m: table(m) for m in cost.d},
            availability={m: self.availability(m) for m in self._answers}, cost=cost,
            plain_batch_sizes=self.plain_batch_sizes(cost), trusted_rows=self.trusted_rows())
        return made


def _measured(seen: list[tuple[int, float]], now: int) -> bool:
    """Whether a batch size's latest plain decode steps (the fit's step count after
    each and its ms, OnlineProfile._plain) are PLAIN_STEPS in the fit's memory at
    step `now`."""
    return len(seen) >= PLAIN_STEPS and now - seen[0][0] < MEMORY_STEPS


def batch_grid(max_num_seqs: int) -> tuple[int, ...]:
    """Every batch size up to 16, then 16, 24, 32, 48, ... and max_num_seqs itself:
    ITL bends at the row knots, and the profile interpolates linearly between its
    batch sizes, so the small ones, where a decode step's rows pass the first
    knots, are all on the grid."""
    sizes = list(range(1, min(max_num_seqs, 16) + 1))
    while sizes[-1] < max_num_seqs:
        nxt = sizes[-1] * 3 // 2 if sizes[-1] & (sizes[-1] - 1) == 0 else sizes[-1] * 4 // 3
        sizes.append(min(nxt, max_num_seqs))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return tuple(sizes)
