"""Goodput: a step that drafts k tokens yields on average AL(k) = 1 + sum_{i<=k}
prod_{j<=i} a_j tokens, where a_j is the probability that draft position j is accepted
given that positions 1..j-1 were, and costs ITL(batch size, k) ms, read from the
profile. The best K is the k in 0..K_max with the highest goodput AL(k) / ITL; K=0 is
plain decoding. A drafter's own time is part of every speculative step, so the profile
may hold one table per method: an ngram drafter costs next to nothing, a draft model
tens of ms, and one shared table would make the slow drafter's K too large."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.policy.itl_profile import ItlProfile
from gateway.policy.values import check_count


def rate_at(rates: Sequence[float], i: int) -> float:
    """Rate of position i+1; positions past the list reuse its last rate."""
    if i < len(rates):
        return rates[i]
    return rates[-1] if rates else 0.0


def acceptance_length(rates: Sequence[float], k: int) -> float:
    """Expected tokens per step with k drafts: 1 + sum_{i<=k} prod_{j<=i} rates[j-1]."""
    check_count("acceptance_length: k", k)
    expected, reach = 1.0, 1.0
    for i in range(k):
        reach *= rate_at(rates, i)  # probability that draft position i+1 is accepted
        expected += reach
    return expected


def goodput(profile: ItlProfile, batch_size: float, rates: Sequence[float], k: int,
            method: str | None = None) -> float:
    """Tokens per ms for one sequence speculating k tokens at this batch size.

    `method` picks the method's own ITL table where the profile has one.
    """
    return acceptance_length(rates, k) / profile.itl(batch_size, k, method)


def choose_k(
    profile: ItlProfile,
    batch_size: float,
    rates: Sequence[float],
    max_num_speculative_tokens: int,
    method: str | None = None,
) -> int:
    """argmax over k in 0..max_num_speculative_tokens of goodput (with `method`'s ITL);
    ties go to the smaller k.

    K above the profile's largest measured k is never chosen: its ITL would be
    clamped to that k's, which would make the extra draft positions look free.
    """
    check_count("choose_k: max_num_speculative_tokens", max_num_speculative_tokens)
    best_k, best = 0, goodput(profile, batch_size, rates, 0, method)
    for k in range(1, min(max_num_speculative_tokens, profile.ks[-1]) + 1):
        g = goodput(profile, batch_size, rates, k, method)
        if g > best:
            best_k, best = k, g
    return best_k
