"""Dynamic K over a replica's whole batch: one choice for all the dynamic-K requests
running on it, each step, rather than one per request.

Why not per request: a request choosing alone scores each k by its own goodput
AL_i(k) / ITL(B, k), the step time of a batch where every sequence drafts k. That
is right only when all requests are alike. They are not: an ngram drafter copying
a prompt's block is accepted nearly always while the one beside it writes new text,
and under load a row of the forward costs the whole batch. What a step is worth is
the batch's tokens over the step's time,

    G = (B + sum over drafted positions (i, j) of reach_ij) / T(B, n),

with B sequences, n draft rows in all and reach_ij = c_m * a_i1 * ... * a_ij the
chance that request i's position j is accepted (its rates, as DynamicK keeps them,
scaled by c_m, what its method's steps accept over what such rates expected:
DynamicK.calibration). A
position's worth does not depend on the others', and reach falls along j, so the
best set of n rows is the n positions of highest reach (each request's first
positions first), and the best n is found by walking them in that order: O(B K)
evaluations of T per step.

T comes from the same profile a request reads (a `specdec profile` table or the
online model), at the batch's mean K: T(B, n) = ITL(B, n / B), plus for each
drafter method its own cost over the shared table at its rows. A drafter's fixed
cost per step is then paid once, however many requests it drafts for. The online
model prices a drafter's wait itself, from the tokens, sequences and depth asked of
it after each prefix (`ItlProfile.drafter_waits`): an EAGLE head's cost grows with
the sequences it drafts for and its depth far more than with its tokens. And with
the context it takes in: a member's drafter takes in, at its first drafting step,
every position it has not seen (Member.catch_up: an EAGLE head's whole prompt and
reply so far after plain steps), priced spread over the steps the member may have
left, which it pays once for. Unpriced, a batch of 14 that the model found 2 % better
drafting waited 118 ms at its first drafting step for the head to take in 14
contexts, and went back to plain decoding.

A drafter may have nothing to propose (an ngram drafter without a match: request i
gets its k_i rows with probability q_i, its availability), so a step's rows are
random, and the forward's time is taken as its expectation over them, not its value
at the mean rows. Step time is not straight in rows: on CPU the small-rows kernel
holds up to 12 rows and a step of 13 costs far more, and CUDA graphs pad a step to
the next captured size. Ks whose mean rows sit just below such a step, but whose
rows often land past it, then cost what they cost, rather than what their mean would.

Requests outside the choice (static K, plain, another gateway's) count as one row
each: B is the step's batch size as the verifier reports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gateway.policy.goodput import rate_at
from gateway.policy.itl_profile import ItlProfile


class Member(Protocol):
    """A dynamic-K request as the batch sees it (dynamic_k.DynamicK)."""

    method: str
    max_num_speculative_tokens: int

    def rates(self) -> Sequence[float]: ...

    def availability(self) -> float: ...

    def calibration(self) -> float: ...

    def catch_up(self) -> float: ...


def step_time(profile: ItlProfile, batch_size: float, rows: dict[str, float]) -> float:
    """Modelled ms of a step of `batch_size` sequences with rows[method] draft rows."""
    return float(step_times(profile, batch_size,
                            {method: np.array([n]) for method, n in rows.items()})[0])


def step_times(profile: ItlProfile, batch_size: float,
               rows: dict[str, np.ndarray]) -> np.ndarray:
    """step_time of n steps at once: rows[method] [n] -> [n] ms (rows empty: one plain
    step, [1])."""
    total = sum(rows.values()) if rows else np.zeros(1)
    return profile.itls(batch_size, total / batch_size) + _drafters_cost(profile, batch_size,
                                                                         rows)


def _drafters_cost(profile: ItlProfile, batch_size: float,
                   rows: dict[str, np.ndarray]) -> np.ndarray:
    """What the drafters add to steps with rows[method] ([n]: expected draft rows each)."""
    total = np.zeros(len(next(iter(rows.values()))) if rows else 1)
    for method, n_m in rows.items():
        if method in profile.method_itl_ms:
            total += np.where(n_m > 0, _drafter_cost(profile, batch_size, n_m / batch_size,
                                                     method), 0.0)
    return total


def _drafter_cost(profile: ItlProfile, batch_size: float, k: np.ndarray,
                  method: str) -> np.ndarray:
    """What `method`'s drafting adds to a step where it drafts k ([n]) per sequence on
    average.

    The table has it at whole K, where every sequence drafts: from K = 1 on, read it
    there; below, the line through K = 1 and 2 is extended. Interpolating toward
    K = 0 instead would charge a drafter's fixed cost in proportion to its rows, and a
    batch where few sequences draft would look nearly free of it.
    """
    def extra(kk: np.ndarray) -> np.ndarray:
        return np.maximum(profile.itls(batch_size, kk, method) - profile.itls(batch_size, kk),
                          0.0)

    # One read of the table for every k and for K = 1 and 2 (the line below K = 1).
    read = extra(np.concatenate((np.maximum(k, 1.0), [1.0, 2.0])))
    above, one, two = read[:-2], read[-2], read[-1]
    if profile.ks[-1] < 2:
        return above
    return np.where(k >= 1, above, np.clip(one - (1.0 - k) * (two - one), 0.0, one))


# The expectation is exact while members x transform size stays within this (16
# requests drafting up to 8 each); a larger batch is priced at its mean rows. Its
# rows are then a sum of many independent counts, whose spread is small beside
# their mean.
EXACT_BUDGET = 16 * 256


def _step_times(profile: ItlProfile, batch_size: float, methods: Sequence[str],
                available: Sequence[float], order: Sequence[int],
                spread: bool = True, catch_up: Sequence[float] | None = None) -> np.ndarray:
    """[len(order) + 1]: modelled ms of a step of `batch_size` sequences after each
    prefix of `order`, every member at K = 0 before it and each entry one more row
    asked of member order[p]. Member i gets all its k_i rows with probability
    available[i], else none: the forward's time is averaged over the distribution of
    the step's draft rows, and each drafter's cost taken from the profile's model of
    it (`drafter_waits`: the tokens, sequences and depth asked of it) or, from tables,
    at its expected rows (it is near straight in them).

    The distribution of a sum of independent counts is the convolution of theirs, a
    product of their transforms: member i's is (1 - q_i) + q_i w^k_i at the `size`-th
    roots of unity w, size > the most rows, so the cyclic convolution never wraps
    around, and E[forward] = sum_n P(n) forward(n) is the inner product of the
    transforms (Parseval). Along `order` one factor changes at a time, so the
    products after every prefix are one cumulative product of new / old factors
    ([positions, size]), not a walk in Python (which took 7 ms of the gateway's CPU
    a step at batch 16, taken from the verifier's forward on a 2-core machine).
    A factor may come near 0 ((1 - q) + q w^k at q = 1/2, w^k = -1) and the product
    stays exact through it: the old factor divided out is the very float the
    member's previous row multiplied in, and (x * r) / r rounds to x at any
    magnitude.

    spread=False: every prefix at its mean rows (no expectation), which is never above
    its time with the spread.

    catch_up[i]: the context rows member i's drafter takes in a step when it first drafts
    for it (Member.catch_up), added to its method's modelled wait with its first row.
    """
    q = np.asarray(available, dtype=np.float64)[list(order)]  # [P]
    most = len(order)
    k = np.zeros(len(methods), dtype=np.int64)
    new_k = np.empty(most, dtype=np.int64)  # [P]: the member's K after position p
    for p, i in enumerate(order):
        k[i] += 1
        new_k[p] = k[i]
    total = np.zeros(most + 1)  # [P + 1] expected draft rows of all methods
    tabled: dict[str, np.ndarray] = {}  # method -> [P + 1] its expected draft rows
    wait = np.zeros(most + 1)  # [P + 1] what the drafters the profile models add
    for method in dict.fromkeys(methods):
        mine = np.array([methods[i] == method for i in order], dtype=bool)  # [P]
        rows = np.concatenate(([0.0], np.cumsum(np.where(mine, q, 0.0))))
        total += rows
        # The drafter's asked tokens, sequences and depth after each prefix: it is
        # asked (and does its work) whether or not it has drafts.
        asked = np.concatenate(([0], np.cumsum(mine)))
        sequences = np.concatenate(([0], np.cumsum(mine & (new_k == 1))))
        depth = np.concatenate(([0], np.maximum.accumulate(np.where(mine, new_k, 0))))
        backlog = 0.0
        if catch_up is not None:
            first = mine & (new_k == 1)
            backlog = np.concatenate(([0.0], np.cumsum(np.where(
                first, np.asarray(catch_up, dtype=np.float64)[list(order)], 0.0))))
        modelled = profile.drafter_waits(method, sequences, asked, depth, backlog)
        if modelled is None:
            tabled[method] = rows
        else:
            wait += modelled
    t = profile.itls(batch_size, total / batch_size)  # [P + 1], at the mean rows
    size = most + 1  # > the most rows: the cyclic convolution never wraps around
    if spread and most and len(methods) * size <= EXACT_BUDGET:
        forward = profile.itls(batch_size, np.arange(size) / batch_size)  # [size]: at n rows
        spectrum = np.conj(np.fft.fft(forward)) / size  # [size]
        # Member i's factor at K = k is (1 - q_i) + q_i w^k, w^k = roots[k j mod size].
        roots = np.exp(-2j * np.pi * np.arange(size) / size)  # [size]
        j = np.arange(size)
        new = np.outer(new_k, j) % size  # [P, size]: the index of w^k in roots
        old = (new - j) % size  # of w^(k - 1)
        ratio = (((1.0 - q)[:, None] + q[:, None] * roots[new])
                 / ((1.0 - q)[:, None] + q[:, None] * roots[old]))
        products = np.concatenate((np.ones((1, size), dtype=complex),
                                   np.cumprod(ratio, axis=0)))  # [P + 1, size]
        # A sum of products, not `@`: OpenBLAS would run a matrix-vector product of this
        # size on every core and spin there after, taking them from the verifier's
        # forward (the gateway's CPU doubled in wall time, and plain steps of a batch of
        # 8 took 200 ms instead of 100 while it chose).
        expected = (products * spectrum).sum(axis=1).real  # [P + 1]
        # Never below the time at the mean rows: where the profile's slope falls past
        # a knot (the online fit's bends), spread would look like a saving, and such a
        # bend is the fit's, not the machine's.
        t = np.maximum(t, expected)
    return t + wait + (_drafters_cost(profile, batch_size, tabled) if tabled else 0.0)


def allocate(profile: ItlProfile, batch_size: int, members: Iterable[Member]) -> list[int]:
    """Each member's K (in `members`' order) maximizing the batch's tokens per ms."""
    return _best(profile, batch_size, list(members))[0]


def _best(profile: ItlProfile, batch_size: int,
          members: Sequence[Member]) -> tuple[list[int], float]:
    """allocate()'s Ks and their modelled goodput (the margin check compares it).

    The walk takes the positions in one order, so it finds the best set of rows among
    that order's prefixes. In order of reach that is the best set, unless members'
    drafters must first take in context (Member.catch_up), a cost of a member's first
    row alone: a member whose backlog is dear (one that ran plain long, with few steps
    left) may have the highest reach, and every prefix that drafts for the others then
    pays its catch-up too. A batch that ran plain a while is mostly such members, and
    would stay plain while a new member's drafting pays. So a second walk takes each
    member's first position at its reach less its catch-up, in tokens at the plain
    step's tokens per ms (its later positions never before it), and the better of the
    two walks is the answer (where it is walked, the second adds 0.5-0.6 ms of the
    gateway's CPU to a choice at batch 4-16, twice the first's, in a microbenchmark)."""
    batch = float(max(batch_size, len(members), 1))
    # Each member's reach at each of its positions, every position's reach scaled by
    # what its steps realize; reach never rises along a member's positions.
    reach: list[list[float]] = []
    for m in members:
        rates, r, mine = m.rates(), m.calibration(), []
        for j in range(min(m.max_num_speculative_tokens, profile.ks[-1])):
            r *= rate_at(rates, j)
            mine.append(r)
        reach.append(mine)
    # A drafter that has nothing to propose for a step (q: how often it has) feeds
    # no row and yields nothing: a position yields q * reach tokens, and its row is
    # there in a share q of the steps.
    available = [m.availability() for m in members]
    methods = [m.method for m in members]
    catch_up = [m.catch_up() for m in members]
    # (-key, member, position), sorted: every prefix takes each member's positions from
    # the first on (ties keep order).
    # Only as many rows as the profile prices from measured steps (max_draft_rows): the
    # positions of highest reach first.
    most = profile.max_draft_rows(batch)
    by_reach = sorted((-r, i, j) for i, mine in enumerate(reach) for j, r in enumerate(mine))
    if most < len(by_reach):
        by_reach = by_reach[:int(most)]
    best = _walk(profile, batch, [(i, -key) for key, i, _ in by_reach], available, methods,
                 catch_up)
    penalty = _catch_up_ms(profile, methods, catch_up)  # [members] ms of each one's catch-up
    if penalty is None or not penalty.any():
        return best
    per_ms = batch / float(profile.itls(batch, np.zeros(1))[0])  # tokens per ms, plain
    net = []
    for i, mine in enumerate(reach):
        key = np.inf
        for j, r in enumerate(mine):
            key = min(key, r - (per_ms * penalty[i] if j == 0 else 0.0))
            net.append((-key, i, j))
    net.sort()
    if most < len(net):
        net = net[:int(most)]
    if [i for _, i, _ in net] == [i for _, i, _ in by_reach]:
        return best
    # Walked at the positions' own reach: the key only orders them.
    other = _walk(profile, batch, [(i, reach[i][j]) for _, i, j in net], available,
                  methods, catch_up)
    return other if other[1] > best[1] else best


def _catch_up_ms(profile: ItlProfile, methods: Sequence[str],
                 catch_up: Sequence[float]) -> np.ndarray | None:
    """[members]: the ms each member's catch-up adds to its drafter's wait, where the
    profile models its drafters (None where none of them is)."""
    out, modelled = np.zeros(len(methods)), False
    for method in dict.fromkeys(methods):
        mine = np.array([m == method for m in methods])
        backlog = np.where(mine, np.asarray(catch_up, dtype=np.float64), 0.0)
        one = np.ones(len(methods))
        with_it = profile.drafter_waits(method, one, one, one, backlog)
        if with_it is None:
            continue
        modelled = True
        out += np.where(mine, with_it - profile.drafter_waits(method, one, one, one, 0.0), 0.0)
    return out if modelled else None


def _walk(profile: ItlProfile, batch: float, positions: Sequence[tuple[int, float]],
          available: Sequence[float], methods: Sequence[str],
          catch_up: Sequence[float]) -> tuple[list[int], float]:
    """The best prefix of `positions` ((member, reach) each, every member's in order)
    and its modelled goodput."""
    order = [i for i, _ in positions]
    gain = np.array([available[i] * r for i, r in positions])
    tokens = batch + np.concatenate(([0.0], np.cumsum(gain)))  # [P + 1]
    # The expectation over the rows' spread costs (prefixes x transform size): at batch
    # 16 and up to 8 drafts each, a millisecond of the gateway's CPU every step, taken
    # from the verifier's forward on a small machine. Only prefixes that may be best
    # need it. A prefix's time at its mean rows is never above its expected time, so
    # its goodput there bounds the expected one from above: the best at the mean rows,
    # n0, gives a goodput `found` with the spread, and no prefix whose bound is below
    # `found` can beat it. The walk's answer is the same, from the prefixes up to the
    # last one whose bound reaches `found` (at batch 16, a third of them or fewer).
    bound = tokens / _step_times(profile, batch, methods, available, order, spread=False,
                                 catch_up=catch_up)
    n0 = int(np.argmax(bound))
    goodput = tokens[:n0 + 1] / _step_times(profile, batch, methods, available, order[:n0],
                                            catch_up=catch_up)
    last = int(np.flatnonzero(bound >= goodput.max())[-1])
    if last > n0:
        goodput = tokens[:last + 1] / _step_times(profile, batch, methods, available,
                                                  order[:last], catch_up=catch_up)
    n = int(np.argmax(goodput))  # the first best prefix
    ks = [0] * len(methods)
    for i in order[:n]:
        ks[i] += 1
    return ks, float(goodput[n])


def batch_goodput(profile: ItlProfile, batch_size: int, members: Sequence[Member],
                  ks: Sequence[int]) -> float:
    """The batch's modelled tokens per ms with members[i] at ks[i]."""
    batch = float(max(batch_size, len(members), 1))
    available = [m.availability() for m in members]
    tokens = batch
    for m, q, k in zip(members, available, ks, strict=True):
        rates, reach = m.rates(), m.calibration()
        for j in range(k):
            reach *= rate_at(rates, j)
            tokens += q * reach
    order = [i for i, k in enumerate(ks) for _ in range(k)]
    time = _step_times(profile, batch, [m.method for m in members], available, order,
                       catch_up=[m.catch_up() for m in members])
    return tokens / float(time[-1])


# A new choice replaces the batch's current Ks only when its modelled goodput is this
# much higher. The model's rates move a little every step; without a margin the Ks of
# a batch churn between near-equal choices, each change a PolicyUpdate to the verifier
# and its drafters, and a batch whose rows jump from step to step runs slower than
# its mean rows say (CPU kernels change tiles past a row count).
MIN_GAIN = 0.02


# A batch of a size whose plain decoding is not measured yet (ItlProfile.measured_plain)
# runs plain first, for at most this many steps of the size in PROBE_WINDOW steps: a
# batch whose static-K neighbours always draft never makes a plain step to measure.
PROBE_STEPS = 8
PROBE_WINDOW = 512
# A batch chosen plain stays plain, unchosen, for up to this many steps while the
# profile and the batch stay (BatchK.next_k).
PLAIN_KEEP_STEPS = 4
# A batch chosen to draft keeps its Ks, unchosen, for this many steps while the batch
# stays (its members and size): its members' rates move a little a step (half-life 8).
DRAFT_KEEP_STEPS = 2


@dataclass(frozen=True, slots=True)
class _Snapshot:
    """A member's rates and availability read once for a step's choice (Member): the
    choice and the margin check read them several times."""

    method: str
    max_num_speculative_tokens: int
    _rates: tuple[float, ...]
    _availability: float
    _calibration: float
    _catch_up: float = 0.0

    def rates(self) -> tuple[float, ...]:
        return self._rates

    def availability(self) -> float:
        return self._availability

    def calibration(self) -> float:
        return self._calibration

    def catch_up(self) -> float:
        return self._catch_up


@dataclass(frozen=True, slots=True)
class _Kept:
    """A step's choice for the batch, kept unchosen for the steps after it while the
    batch stays (its size and members): PLAIN_KEEP_STEPS where it ran every member
    plain and the profile stays too, DRAFT_KEEP_STEPS where it drafted."""

    profile: ItlProfile
    batch_size: int
    members: tuple[int, ...]  # member ids
    plain: bool
    step: int

    def holds(self, profile: ItlProfile, batch_size: int, members: tuple[int, ...],
              step: int) -> bool:
        if (self.batch_size, self.members) != (batch_size, members):
            return False
        if self.plain:
            return self.profile is profile and 0 <= step - self.step < PLAIN_KEEP_STEPS
        return 0 <= step - self.step < DRAFT_KEEP_STEPS


class BatchK:
    """The dynamic-K requests running on one replica, and their K for its latest step.

    The first request to hear of a step computes every member's K; the others read
    theirs, so the choice costs one walk per step, not one per request. Members
    join when their stream opens on the replica and leave when it ends.
    """

    def __init__(self) -> None:
        self._members: dict[int, Member] = {}  # id -> member, in joining order
        self._step: int | None = None
        self._ks: dict[int, int] = {}  # id -> K chosen at self._step
        # (method, batch size, members of the method) -> (the step it was chosen at, the
        # K-by-outcome table chosen for them: outcome_table.py; None: plain), so one
        # member chooses for all, and for the steps after it (TABLE_REFRESH_STEPS).
        self.tables: dict[tuple[str, int, int],
                          tuple[int, tuple[int, int, int, int] | None]] = {}
        self._probes: dict[int, list[int]] = {}  # batch size -> steps run plain to measure it
        self._kept: _Kept | None = None  # the latest choice (None: a probe's)

    def __len__(self) -> int:
        return len(self._members)

    def count(self, method: str) -> int:
        """Members drafting with `method`."""
        return sum(1 for m in self._members.values() if m.method == method)

    def join(self, member: Member) -> None:
        self._members[id(member)] = member
        self._step = None  # the next step chooses with it

    def leave(self, member: Member) -> None:
        if self._members.pop(id(member), None) is not None:
            self._step = None

    def runs_plain(self, member: Member) -> bool:
        """Whether the batch's latest choice ran plain every member now on it but
        `member` (a stream that has just joined): the new stream is then best opened
        plain too, and its K chosen with the batch from its first response on."""
        kept = self._kept
        others = [i for i in self._members if i != id(member)]
        return kept is not None and kept.plain and bool(others) \
            and set(others) <= set(kept.members)

    def probe(self, profile: ItlProfile, batch_size: int, step: int) -> bool:
        """Whether this step of `batch_size` sequences runs plain to measure plain decoding
        there (the model's plain step is then read off other rows and batch sizes, and a
        batch that drafts on a wrong one never learns better); counts it if so."""
        if profile.measured_plain(batch_size):
            return False
        recent = [s for s in self._probes.get(batch_size, ()) if 0 <= step - s < PROBE_WINDOW]
        if len(recent) < PROBE_STEPS and step not in recent:
            recent.append(step)
        self._probes[batch_size] = recent
        return step in recent

    def chosen(self, member: Member, step: int) -> int | None:
        """`member`'s K where the batch has chosen for `step` with it, else None: the
        first member to hear of a step chooses for all, the others read theirs."""
        return self._ks.get(id(member)) if step == self._step else None

    def next_k(self, member: Member, profile: ItlProfile, batch_size: int,
               step: int) -> int:
        if step != self._step or id(member) not in self._ks:
            members = list(self._members.values())
            if self.probe(profile, batch_size, step):
                self._ks = dict.fromkeys(map(id, members), 0)
                self._step, self._kept = step, None
                return 0
            ids = tuple(self._members)
            if self._kept is not None and self._kept.holds(profile, batch_size, ids, step):
                # Kept: little the choice reads has moved. Plain members learn nothing new
                # (their evidence only ages toward the prior), and an online profile is
                # refitted every REFIT_STEPS; drafting ones' rates move a little a step,
                # and the Ks of 19 in 718 choices at C = 4 (eagle3) differed from the
                # step's before. A choice costs the gateway's CPU, which a small machine
                # takes from the forward: a fifth of the gateway's CPU at C = 4 (0.01
                # cores, py-spy), and a batch of 16 that dynamic K ran plain took 3-4 %
                # longer a step than one of plain requests.
                self._step = step
                return self._ks.get(id(member), 0)
            views = [_Snapshot(m.method, m.max_num_speculative_tokens, tuple(m.rates()),
                               m.availability(), m.calibration(), m.catch_up())
                     for m in members]
            ks, goodput = _best(profile, batch_size, views)
            if members and all(id(m) in self._ks for m in members):
                current = [self._ks[id(m)] for m in members]
                if ks != current and goodput < \
                        (1.0 + MIN_GAIN) * batch_goodput(profile, batch_size, views, current):
                    ks = current
            self._ks = dict(zip(map(id, members), ks, strict=True))
            self._step = step
            self._kept = _Kept(profile, batch_size, ids, not any(ks), step)
        return self._ks.get(id(member), 0)


class BatchKs:
    """One BatchK per replica address."""

    def __init__(self) -> None:
        self._by_replica: dict[str, BatchK] = {}

    def of(self, address: str) -> BatchK:
        return self._by_replica.setdefault(address, BatchK())
