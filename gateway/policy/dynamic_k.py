"""Dynamic K: each round's K for one running request, from the profile's ITL and the
request's acceptance (the profile's prior rates until warm-up, then its own)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.policy.goodput import choose_k, rate_at
from gateway.policy.itl_profile import ItlProfile
from gateway.policy.values import check_count
from specdec.speculation import DRAFTER_METHODS

# Prior for a method the profile has no acceptance rates for. 0.5 claims neither a
# good nor a useless drafter: speculation then starts only where draft positions are
# cheap (small batches), and the request's own rates take over after warm-up.
NEUTRAL_ACCEPTANCE = 0.5


class OnlineAcceptance:
    """One request's acceptance counts per draft position.

    Position i counts as tried only when positions 1..i-1 were accepted: the
    verifier stops at the first rejection, so later drafts are never judged. The
    ratio accepted/tried is then the conditional rate a_i that acceptance_length
    multiplies; counting every drafted position as tried would estimate
    prod_{j<=i} a_j instead, and the product would apply it twice.
    """

    def __init__(self) -> None:
        self._tried: list[int] = []  # [position - 1]
        self._accepted: list[int] = []  # [position - 1]
        self._steps = 0

    @property
    def steps(self) -> int:
        """Number of steps that drafted at least one token."""
        return self._steps

    def update(self, num_drafted: int, num_accepted: int) -> None:
        check_count("num_drafted", num_drafted)
        check_count("num_accepted", num_accepted)
        if num_accepted > num_drafted:
            raise ValueError(f"num_accepted ({num_accepted}) exceeds num_drafted ({num_drafted})")
        if num_drafted == 0:
            return
        self._steps += 1
        judged = min(num_accepted + 1, num_drafted)
        while len(self._tried) < judged:
            self._tried.append(0)
            self._accepted.append(0)
        for i in range(judged):
            self._tried[i] += 1
        for i in range(num_accepted):
            self._accepted[i] += 1

    def rates(
        self, prior: Sequence[float], warmup_steps: int, max_num_speculative_tokens: int
    ) -> tuple[float, ...]:
        """Rates for positions 1..max_num_speculative_tokens: the prior until warm-up,
        then the observed ones."""
        check_count("warmup_steps", warmup_steps)
        check_count("max_num_speculative_tokens", max_num_speculative_tokens)
        prior_rates = tuple(rate_at(prior, i) for i in range(max_num_speculative_tokens))
        if self._steps < warmup_steps:
            return prior_rates
        return tuple(
            self._accepted[i] / self._tried[i] if i < len(self._tried) and self._tried[i] else p
            for i, p in enumerate(prior_rates)
        )


# The deployment's profile as it is now: a file's, fixed, or the online model's, which
# changes as steps are measured and is None until it has seen enough of them.
ProfileSource = Callable[[], ItlProfile | None]


class DynamicK:
    """Each round's K for one request: the profile's ITL and the request's acceptance.

    The profile is read afresh every round, so an online profile's newest fit
    applies to requests already running. When the request's own rates make K=0
    best at every batch size, nothing more is drafted and K stays 0: a drafter
    that fails on this request is not retried. K=0 caused by load alone rises
    again when the batch shrinks.
    """

    def __init__(
        self,
        profile: ProfileSource,
        method: str,
        max_num_speculative_tokens: int,
        warmup_steps: int = 8,
    ):
        if method not in DRAFTER_METHODS:
            raise ValueError(f"dynamic K: method must be one of {', '.join(DRAFTER_METHODS)}, "
                             f"got {method!r}")
        check_count("dynamic K: max_num_speculative_tokens", max_num_speculative_tokens)
        check_count("dynamic K: warmup_steps", warmup_steps)
        self.profile = profile
        self.method = method
        self.max_num_speculative_tokens = max_num_speculative_tokens
        self.warmup_steps = warmup_steps
        self.acceptance = OnlineAcceptance()

    @property
    def prior(self) -> tuple[float, ...]:
        """The method's rates in the current profile, neutral where it has none."""
        profile = self.profile()
        if profile is None:
            return (NEUTRAL_ACCEPTANCE,)
        return profile.acceptance.get(self.method, (NEUTRAL_ACCEPTANCE,))

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.update(num_drafted, num_accepted)

    def next_k(self, batch_size: float) -> int | None:
        """The best K at this batch size; None while there is no profile yet (an
        online one still learning), in which case the caller keeps its K."""
        profile = self.profile()
        if profile is None:
            return None
        prior = profile.acceptance.get(self.method, (NEUTRAL_ACCEPTANCE,))
        rates = self.acceptance.rates(prior, self.warmup_steps, self.max_num_speculative_tokens)
        return choose_k(profile, batch_size, rates, self.max_num_speculative_tokens, self.method)
