"""Dynamic K as a table: K by the outcome of a request's latest drafting step (all drafts
accepted, some, none, no drafts; specdec.speculation.DraftOutcome), which the verifier
applies itself (PolicyUpdate.k_by_outcome), chosen for the load.

A drafter's acceptance comes in runs, so a step's outcome predicts the next: with K = 4
fixed, ngram accepted 2.02 drafts a step after a step whose drafts were all accepted,
1.42 after some, 0.73 after none, 0.39 after one where it had nothing. A table drafts
deep where a run goes on and little elsewhere; the table 4 / 2 / 1 / 1 beat every
static K, and dynamic K choosing one K a step, at C = 1, 4 and 16 (docs/design.md).

Which table pays depends on the load, as K does: a table's worth is what it yields
over the outcomes it leads to. Under table t a request moves between outcomes as a
Markov chain: from outcome s it drafts t[s] with probability q_s (its drafter has
drafts), and then the next outcome is all accepted with probability q_s * reach_s(t[s]),
none with q_s * (1 - a_s1), some with the rest of q_s, and no drafts with 1 - q_s, the
rates a_s and q_s being the method's in the steps after outcome s (the online model
learns them from every request). Its stationary distribution gives the table's tokens
and draft rows per step, and the batch's goodput, (B + extra tokens) / T(B, rows), is
read from the same step-time profile dynamic K uses, T averaged over the rows a step
may draft: a table drafts deep after a run and little after a miss, and step time jumps
past some rows (_spread_forward). The tables tried are one family,
level m: 2m after all accepted, m after some, m / 2 after a miss (at least 1), level 0
being plain decoding; 4 / 2 / 1 / 1 is level 2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from gateway.policy.batch_k import EXACT_BUDGET, step_time, step_times
from gateway.policy.goodput import rate_at
from gateway.policy.itl_profile import ItlProfile
from specdec.speculation import DraftOutcome

Table = tuple[int, int, int, int]  # K after each DraftOutcome, in its order

# A batch's table is chosen again after this many steps (or as soon as its size or
# its members of the method change). What it is chosen from moves slowly (the rates
# after each outcome have a half-life of thousands of steps), while choosing takes
# about 0.2 ms of the gateway's CPU, on a 2-core machine taken from the verifier's
# forward of the step under way: at one request, 1 % of a 17 ms step, every step.
TABLE_REFRESH_STEPS = 8


def table_of_level(level: int, bound: int) -> Table:
    """Level m's table: 2m after all accepted (at most `bound`), m after some, m / 2
    after none and after no drafts (at least 1); m and bound > 0."""
    if level <= 0 or bound <= 0:
        raise ValueError(f"table_of_level: level and bound must be > 0, got {level}, {bound}")
    m = min(level, bound)
    low = max(1, (m + 1) // 2)
    return (min(2 * m, bound), m, low, low)


def table_yield(table: Table, rates: Sequence[Sequence[float]],
                availability: Sequence[float]) -> tuple[float, float]:
    """(tokens, draft rows) per step of a request under `table` in the long run: rates[s]
    and availability[s] are the method's after outcome s (DraftOutcome order)."""
    tokens, rows = tables_yield([table], rates, availability)
    return float(tokens[0]), float(rows[0])


def tables_yield(tables: Sequence[Table], rates: Sequence[Sequence[float]],
                 availability: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """table_yield of L tables at once: ([L] tokens, [L] draft rows) per step."""
    tokens, spread = tables_spread(tables, rates, availability)
    return tokens, _mean_rows(spread)


def tables_spread(tables: Sequence[Table], rates: Sequence[Sequence[float]],
                  availability: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """L tables in the long run: ([L] tokens per step, [L, most K + 1] the chance
    that a step drafts each number of rows). The gateway scores every level while the
    verifier runs a step on the same cores, so this is one batched solve."""
    n, count = len(DraftOutcome), len(tables)
    most = max((k for t in tables for k in t), default=0)
    # reach[s][j]: the chance that position j + 1 is accepted after outcome s; [most]
    reach = [np.cumprod([rate_at(rates[s], j) for j in range(most)]) for s in DraftOutcome]
    sums = [np.cumsum(r) for r in reach]
    moves = np.zeros((count, n, n))  # [table, from, to]
    tokens = np.ones((count, n))
    for i, table in enumerate(tables):
        for s in DraftOutcome:
            k, q = table[s], availability[s]
            first, last = (reach[s][0], reach[s][k - 1]) if k else (0.0, 0.0)
            moves[i, s, DraftOutcome.NO_DRAFTS] += 1.0 - q
            moves[i, s, DraftOutcome.NONE_ACCEPTED] += q * (1.0 - first)
            moves[i, s, DraftOutcome.ALL_ACCEPTED] += q * last
            moves[i, s, DraftOutcome.SOME_ACCEPTED] += q * (first - last)
            tokens[i, s] += q * (sums[s][k - 1] if k else 0.0)
    pi = _stationary(moves)  # [L, n]
    spread = np.zeros((count, most + 1))
    for i, table in enumerate(tables):
        for s in DraftOutcome:
            q = availability[s]
            spread[i, table[s]] += pi[i, s] * q
            spread[i, 0] += pi[i, s] * (1.0 - q)
    return (pi * tokens).sum(axis=1), spread


def _mean_rows(spread: np.ndarray) -> np.ndarray:
    """[L]: the mean of each distribution of draft rows spread[l] ([L, most + 1]). A sum
    of products, not `@`, which may hand even small products to OpenBLAS's threads and
    spin on the verifier's cores (batch_k._step_times)."""
    return (spread * np.arange(spread.shape[1])).sum(axis=1)


def _spread_forward(profile: ItlProfile, batch: float, members: int,
                    spread: np.ndarray) -> np.ndarray:
    """[L]: what the spread of a step's draft rows adds to its forward, over its time at
    the mean rows, for `members` requests each drafting by spread[l] ([L, most + 1]).

    A table drafts few rows after a miss and many after a run: the step's rows are
    random, and step time is not straight in rows (at one sequence on 2 EPYC cores a
    forward of 9 rows took 24-25 ms against 16-18 at 5). Priced at the mean rows, a deep table looks as cheap as a
    flat one of the same mean. The members' rows are independent, so the step's draft
    rows are distributed as the members-fold convolution of one's (a power of its
    transform; `size` past the most rows, so the cyclic convolution never wraps). As
    in BatchK (batch_k.py), never below the time at the mean: a bend down in a fitted
    profile is the fit's, not the machine's."""
    most = spread.shape[1] - 1
    size = members * most + 1
    mean = members * _mean_rows(spread)  # [L]
    at_mean = profile.itls(batch, mean / batch)
    if size * len(spread) > EXACT_BUDGET:
        return np.zeros(len(spread))  # so many rows of independent members: near the mean
    total = np.clip(np.fft.irfft(np.fft.rfft(spread, size) ** members, size), 0.0, None)
    forward = profile.itls(batch, np.arange(size) / batch)  # [size]: at n draft rows
    # A sum of products, not `@` (_mean_rows).
    expected = (total * forward).sum(axis=1) / total.sum(axis=1)
    return np.maximum(expected - at_mean, 0.0)


def _stationary(moves: np.ndarray) -> np.ndarray:
    """The stationary distributions [L, n] of L chains moves [L, n, n]: pi (moves - I) = 0
    with sum(pi) = 1, one of the n balance equations replaced by the sum. A chain with
    more than one closed class (outcomes it never leaves) has no unique one: the batch
    is then solved chain by chain by least squares, which picks one for such a chain
    and finds the only one of every other."""
    count, n = moves.shape[:2]
    system = np.swapaxes(moves - np.eye(n), 1, 2).copy()  # [L, n, n]: rows are equations
    system[:, -1, :] = 1.0
    rhs = np.zeros(n)
    rhs[-1] = 1.0
    try:
        pi = np.linalg.solve(system, np.broadcast_to(rhs, (count, n))[..., None])[..., 0]
    except np.linalg.LinAlgError:
        pi = np.stack([np.linalg.lstsq(
            np.vstack([(m - np.eye(n)).T, np.ones((1, n))]),
            np.concatenate([np.zeros(n), [1.0]]), rcond=None)[0] for m in moves])
    pi = np.clip(pi, 0.0, None)
    return pi / pi.sum(axis=1, keepdims=True)


def choose_table(profile: ItlProfile, batch_size: int, members: int, method: str,
                 bound: int, rates_after: Callable[[int], Sequence[float]],
                 availability_after: Callable[[int], float]) -> Table | None:
    """The table of the best level for `members` requests of `method` in a batch of
    `batch_size` (the others plain), each drafting at most `bound`; None where plain
    decoding yields more. rates_after(s) / availability_after(s): the method's after
    outcome s."""
    batch = float(max(batch_size, members, 1))
    bound = min(bound, profile.ks[-1])
    if bound <= 0:
        return None
    members = max(members, 1)
    tables = [table_of_level(level, bound) for level in range(1, bound + 1)]
    tokens, spread = tables_spread(tables, [rates_after(s) for s in DraftOutcome],
                                   [availability_after(s) for s in DraftOutcome])
    rows = _mean_rows(spread)  # [L] per member
    times = (step_times(profile, batch, {method: members * rows})
             + _spread_forward(profile, batch, members, spread))
    goodput = (batch + members * (tokens - 1.0)) / times
    # Only tables whose draft rows the profile prices from measured steps, on average
    # (ItlProfile.max_draft_rows).
    goodput = np.where(members * rows <= profile.max_draft_rows(batch), goodput, -np.inf)
    plain = batch / step_time(profile, batch, {})
    best = int(np.argmax(goodput))
    return tables[best] if goodput[best] > plain else None
