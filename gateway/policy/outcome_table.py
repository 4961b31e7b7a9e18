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
read from the same step-time profile dynamic K uses. The tables tried are one family,
level m: 2m after all accepted, m after some, m / 2 after a miss (at least 1), level 0
being plain decoding; 4 / 2 / 1 / 1 is level 2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from gateway.policy.batch_k import step_time
from gateway.policy.goodput import rate_at
from gateway.policy.itl_profile import ItlProfile
from specdec.speculation import DraftOutcome

Table = tuple[int, int, int, int]  # K after each DraftOutcome, in its order


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
    n = len(DraftOutcome)
    moves = np.zeros((n, n))  # [from, to]
    tokens, rows = np.ones(n), np.zeros(n)
    for s in DraftOutcome:
        k, q = table[s], availability[s]
        reach = np.cumprod([rate_at(rates[s], j) for j in range(k)]) if k else np.zeros(0)
        first, last = (reach[0], reach[-1]) if k else (0.0, 0.0)
        moves[s, DraftOutcome.NO_DRAFTS] += 1.0 - q
        moves[s, DraftOutcome.NONE_ACCEPTED] += q * (1.0 - first)
        moves[s, DraftOutcome.ALL_ACCEPTED] += q * last
        moves[s, DraftOutcome.SOME_ACCEPTED] += q * (first - last)
        tokens[s] += q * float(reach.sum())
        rows[s] = q * k
    # The stationary distribution: pi (moves - I) = 0 with sum(pi) = 1, by least squares
    # (the chain may have outcomes it never reaches).
    system = np.vstack([(moves - np.eye(n)).T, np.ones((1, n))])  # [n + 1, n]
    pi = np.linalg.lstsq(system, np.concatenate([np.zeros(n), [1.0]]), rcond=None)[0]
    pi = np.clip(pi, 0.0, None)
    pi /= pi.sum()
    return float(pi @ tokens), float(pi @ rows)


def choose_table(profile: ItlProfile, batch_size: int, members: int, method: str,
                 bound: int, rates_after: Callable[[int], Sequence[float]],
                 availability_after: Callable[[int], float]) -> Table | None:
    """The table of the best level for `members` requests of `method` in a batch of
    `batch_size` (the others plain), each drafting at most `bound`; None where plain
    decoding yields more. rates_after(s) / availability_after(s): the method's after
    outcome s."""
    batch = float(max(batch_size, members, 1))
    bound = min(bound, profile.ks[-1])
    rates = [rates_after(s) for s in DraftOutcome]
    available = [availability_after(s) for s in DraftOutcome]
    best, best_goodput = None, batch / step_time(profile, batch, {})
    for level in range(1, bound + 1):
        table = table_of_level(level, bound)
        tokens, rows = table_yield(table, rates, available)
        goodput = (batch + members * (tokens - 1.0)) / step_time(profile, batch,
                                                                 {method: members * rows})
        if goodput > best_goodput:
            best, best_goodput = table, goodput
    return best
