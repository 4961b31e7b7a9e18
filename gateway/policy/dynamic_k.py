"""Dynamic K: each round's K for one running request, from the profile's ITL and the
request's acceptance (its own aged counts around the method's rates in the profile)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.policy.batch_k import BatchK
from gateway.policy.goodput import choose_k, rate_at
from gateway.policy.itl_profile import ItlProfile
from gateway.policy.values import check_count, is_number
from specdec.speculation import DRAFTER_METHODS

# Prior for a method the profile has no acceptance rates for. 0.5 claims neither a
# good nor a useless drafter: speculation then starts only where draft positions are
# cheap (small batches), and the requests' own counts soon outweigh it.
NEUTRAL_ACCEPTANCE = 0.5
# How many drafting steps the method's rates count for in a request's own estimate.
# A request's K follows its own rates, so the steps that draft deep are those whose
# rates read high: a weak prior makes them overstate what those steps then accept
# (the winner's curse), and a long memory makes it worse: on 1415 steps of `make run`
# (ngram, C = 1 and 4), 8 steps of prior with a half-life of 48 overstated the chance
# of reaching positions 1-4 by 0.06-0.09 (12-23 %). But acceptance comes in runs (a
# block of the prompt copied, then new text), so recent steps say most, and a short
# memory lets a small prior through. Replayed on every dynamic-K step of two
# `bench.serving` runs (ngram and eagle3, C = 1, 4 and 16; 11000 responses), 8 steps
# with a half-life of 8 predicted each drafted position's acceptance better than 32
# with 16 (log loss 0.554 / 0.549 / 0.573 against 0.564 / 0.559 / 0.597 for ngram,
# 0.577 / 0.595 / 0.594 against 0.591 / 0.613 / 0.612 for eagle3) and stayed
# calibrated where K is chosen: positions a request reaches with a chance of 1/4 or
# more were accepted 1.00-1.02 times as often as it said, of 1/2 or more 0.99-1.08
# (32 / 16: 1.00-1.04 and 1.01-1.10, but per request it moved too little: ngram's first
# positions it put at 0.51 were accepted 0.31 of the time, at 0.59 0.65). 4 / 4 and
# 2 / 4 overstate positions of 1/2 or more by up to 4 and 9 %.
PRIOR_STEPS = 8.0
# The drafters whose dynamic K is a table of K by the outcome of the request's latest
# drafting step (outcome_table.py), where the verifier takes one. An ngram drafter's
# acceptance comes in runs: with K = 4 fixed (bench.serving traces, C = 1 / 4 / 16),
# the steps after one whose every draft was accepted accepted 2.02 drafts, after some
# 1.42, after none 0.73, after one where it had nothing 0.39 (drafts in 62 % of them).
# The gateway hears of a step's outcome after the verifier has begun the next, and its
# answer lands a step later still, so the verifier applies the table itself. Other
# methods are not measured with it.
OUTCOME_TABLE_METHODS = frozenset({"ngram"})
# Half-life of a request's evidence, in its steps (see PRIOR_STEPS). Counts that never
# aged would keep a request at K = 0, which learns nothing more, for good.
HALF_LIFE_STEPS = 8.0
# A drafter may have nothing to propose (an ngram drafter without a match): the share
# of asked steps that drafted is held toward the method's share in the profile (1
# where it has none) with the weight of this many steps.
AVAILABILITY_PRIOR_STEPS = 4.0


class OnlineAcceptance:
    """Acceptance counts per draft position, and the rates they estimate.

    Position i counts as tried only when positions 1..i-1 were accepted: the
    verifier stops at the first rejection, so later drafts are never judged. The
    ratio accepted/tried is then the conditional rate a_i that acceptance_length
    multiplies; counting every drafted position as tried would estimate
    prod_{j<=i} a_j instead, and the product would apply it twice.

    With a half-life the counts age (`age()`, once per step of the request): a
    drafter's acceptance moves within one reply (an ngram drafter copying a block
    of the prompt, then writing new text), and old evidence must not pin K. In
    particular a request whose rates made K = 0 best drafts nothing more, so
    nothing new is learnt; as its evidence ages the rates return to the prior
    and it tries speculation again.
    """

    def __init__(self, half_life_steps: float | None = None) -> None:
        if half_life_steps is not None and not (is_number(half_life_steps)
                                                and half_life_steps > 0):
            raise ValueError(f"half_life_steps must be a number > 0, got {half_life_steps!r}")
        self._decay = 1.0 if half_life_steps is None else 0.5 ** (1.0 / half_life_steps)
        self._tried: list[float] = []  # [position - 1], aged counts
        self._accepted: list[float] = []  # [position - 1]
        self._steps = 0

    @property
    def steps(self) -> int:
        """Number of steps that drafted at least one token."""
        return self._steps

    def age(self) -> None:
        """One step has passed: every count so far weighs 2^(-1/half-life) less."""
        if self._decay != 1.0:
            self._tried = [t * self._decay for t in self._tried]
            self._accepted = [a * self._decay for a in self._accepted]

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
            self._tried.append(0.0)
            self._accepted.append(0.0)
        for i in range(judged):
            self._tried[i] += 1
        for i in range(num_accepted):
            self._accepted[i] += 1

    def rates(
        self, prior: Sequence[float], prior_steps: float, max_num_speculative_tokens: int
    ) -> tuple[float, ...]:
        """Rates for positions 1..max_num_speculative_tokens: each the posterior mean
        (accepted + prior_steps * prior) / (tried + prior_steps), so the prior counts
        as prior_steps tries of every position; a position never tried keeps the prior."""
        if not (is_number(prior_steps) and prior_steps >= 0):
            raise ValueError(f"prior_steps must be a number >= 0, got {prior_steps!r}")
        check_count("max_num_speculative_tokens", max_num_speculative_tokens)
        out = []
        for i in range(max_num_speculative_tokens):
            p = rate_at(prior, i)
            tried = self._tried[i] if i < len(self._tried) else 0.0
            accepted = self._accepted[i] if i < len(self._accepted) else 0.0
            out.append((accepted + prior_steps * p) / (tried + prior_steps)
                       if tried + prior_steps > 0 else p)
        return tuple(out)


class OnlineShare:
    """An aged count of tries and of the hits among them, and the share of hits it
    estimates around a prior: how often a drafter asked for drafts has some."""

    def __init__(self, half_life: float) -> None:
        self._decay = 0.5 ** (1.0 / half_life)
        self._tried = 0.0
        self._hits = 0.0

    def update(self, tried: bool, hit: bool) -> None:
        """One more occasion: earlier counts weigh 2^(-1/half-life) less, and it counts
        as a try (and a hit) where it was one."""
        self.add(float(tried), float(tried and hit))

    def add(self, tries: float, hits: float) -> None:
        """One more occasion worth `tries` tries with `hits` hits among them (expected
        and realized tokens, say), earlier counts aged as in update()."""
        self._tried = self._tried * self._decay + tries
        self._hits = self._hits * self._decay + hits

    def share(self, prior: float, prior_steps: float) -> float:
        """The posterior mean (hits + prior_steps * prior) / (tries + prior_steps)."""
        return (self._hits + prior_steps * prior) / (self._tried + prior_steps)


# The deployment's profile as it is now: a file's, fixed, or the online model's, which
# changes as steps are measured and is None until it has seen enough of them.
ProfileSource = Callable[[], ItlProfile | None]


class DynamicK:
    """Each round's K for one request: the profile's ITL and the request's acceptance.

    The profile is read afresh every round, so an online profile's newest fit
    applies to requests already running. The request's rates are the posterior of
    its own aged counts around the method's rates in the profile (worth
    `prior_steps` drafting steps): a few lucky or unlucky steps move K only a
    little, a drafter that keeps failing on this request takes it to K = 0, and
    evidence older than a few half-lives fades, so a request at K = 0 (by its rates
    or by load) tries speculation again once the prior says it pays.
    """

    def __init__(
        self,
        profile: ProfileSource,
        method: str,
        max_num_speculative_tokens: int,
        prior_steps: float = PRIOR_STEPS,
        half_life_steps: float = HALF_LIFE_STEPS,
        calibration: Callable[[], float] | None = None,
    ):
        """calibration: the method's accepted drafts over those its requests' rates
        expected, now (OnlineProfile.calibration); None: taken as 1."""
        if method not in DRAFTER_METHODS:
            raise ValueError(f"dynamic K: method must be one of {', '.join(DRAFTER_METHODS)}, "
                             f"got {method!r}")
        check_count("dynamic K: max_num_speculative_tokens", max_num_speculative_tokens)
        if not (is_number(prior_steps) and prior_steps >= 0):
            raise ValueError(f"dynamic K: prior_steps must be a number >= 0, got {prior_steps!r}")
        self.profile = profile
        self.method = method
        self.max_num_speculative_tokens = max_num_speculative_tokens
        self.prior_steps = prior_steps
        self.acceptance = OnlineAcceptance(half_life_steps)
        self.answers = OnlineShare(half_life_steps)  # steps that asked, and got drafts
        self._calibration = calibration
        self.batch: BatchK | None = None  # the replica's batch it chooses K with
        # Kept by the request's stream (Generation): the context rows its drafter has not
        # seen, of them those of its latest step, and the tokens it may still generate.
        self.backlog = 0
        self.fresh = 0
        self.remaining = 0

    def join(self, batch: BatchK) -> None:
        """From now on K is chosen with `batch`'s other members (its stream opened on
        that batch's replica), no longer in `self.batch`'s."""
        self.leave()
        batch.join(self)
        self.batch = batch

    def leave(self) -> None:
        if self.batch is not None:
            self.batch.leave(self)
            self.batch = None

    @property
    def prior(self) -> tuple[float, ...]:
        """The method's rates in the current profile, neutral where it has none."""
        return self._prior(self.profile())

    def _prior(self, profile: ItlProfile | None) -> tuple[float, ...]:
        if profile is None:
            return (NEUTRAL_ACCEPTANCE,)
        return profile.acceptance.get(self.method, (NEUTRAL_ACCEPTANCE,))

    def observe(self, num_drafted: int, num_accepted: int, asked: bool = True) -> None:
        """One step of the request, drafting or not: age the counts, add the step's.
        asked: the step asked for drafts (K > 0), so none drafted means the drafter
        had none."""
        self.acceptance.age()
        self.acceptance.update(num_drafted, num_accepted)
        self.answers.update(asked, num_drafted > 0)

    def availability(self) -> float:
        """The chance that a step asking for drafts gets some: the aged share of asked
        steps that did, around the method's share in the profile
        (AVAILABILITY_PRIOR_STEPS steps' worth; 1 where the profile has none)."""
        profile = self.profile()
        prior = 1.0 if profile is None else profile.availability.get(self.method, 1.0)
        return self.answers.share(prior, AVAILABILITY_PRIOR_STEPS)

    def calibration(self) -> float:
        """What the method's drafting steps accept for each draft their requests' rates
        expect them to (1: as expected). A request drafts deep when its rates read high,
        and its rates are a few steps' evidence: the steps chosen for depth are those
        that overstate, and accept less than they said (the winner's curse). At
        C = 4 eagle3's steps accepted 0.89 of the drafts expected when K was chosen,
        and dynamic K drafted where plain decoding was faster. The batch's choice
        scales every expected accepted draft of the method by this."""
        return 1.0 if self._calibration is None else self._calibration()

    def catch_up(self) -> float:
        """The context rows its drafter takes in a step it drafts for it, from now on:
        its latest step's tokens, and the rest of its backlog (an EAGLE head's whole
        prompt and reply so far, after plain steps) spread over the steps it may have
        left, drafting from now on, as the batch's choice would have it.

        Spread instead over its share of drafting steps so far (how much it had drafted
        told how much it would), a batch held plain priced its backlog ever dearer the
        longer it ran plain, and never drafted again: at C = 16 with eagle3 the tail of
        a cell, batch 6 and then 3, ran plain where drafting was modelled 1.2 and 1.5
        times as productive without the backlog, its 200 rows a member priced as 88-215
        rows a step. The head takes a backlog in over several proposals
        (drafter/eagle.py, CATCH_UP_BUDGET_ROWS), so a batch that drafts a few steps and
        turns plain again stalls no step far for it."""
        rest = self.backlog - self.fresh
        if rest <= 0:
            return float(max(self.backlog, 0))
        per_step = 1.0 + self.expected_accepted(self.max_num_speculative_tokens)
        return self.fresh + rest / max(1.0, self.remaining / per_step)

    def expected_accepted(self, k: int) -> float:
        """The accepted drafts this request's rates expect of a step asking k: the
        chance its drafter has drafts times the sum of each position's reach."""
        reach = total = 0.0
        if k > 0:
            reach = 1.0
            for rate in self.rates()[:k]:
                reach *= rate
                total += reach
        return self.availability() * total

    def rates(self, profile: ItlProfile | None = None) -> tuple[float, ...]:
        """The request's rates (profile: its current one, where already read)."""
        prior = self._prior(self.profile() if profile is None else profile)
        return self.acceptance.rates(prior, self.prior_steps, self.max_num_speculative_tokens)

    def next_k(self, batch_size: float, step: int | None = None) -> int | None:
        """The best K at this batch size; None while there is no profile yet (an
        online one still learning), in which case the caller keeps its K.

        With `step` (the verifier's step number) and a batch joined, K is chosen with
        the batch's other dynamic-K requests (batch_k.py); otherwise alone, as if every
        sequence of the batch drafted alike (a stream's first K, before any step).
        """
        if step is not None and self.batch is not None:
            k = self.batch.chosen(self, step)
            if k is not None:
                return k  # chosen for the batch, profile and all, by its first member
        profile = self.profile()
        if profile is None:
            return None
        if step is not None and self.batch is not None:
            return self.batch.next_k(self, profile, int(batch_size), step)
        if not profile.measured_plain(round(batch_size)):
            return 0  # plain first, to be measured there (BatchK.probe)
        # No deeper than the profile prices from measured steps (max_draft_rows).
        most = profile.max_draft_rows(batch_size) / max(batch_size, 1.0)
        return choose_k(profile, batch_size, self.rates(profile),
                        int(min(self.max_num_speculative_tokens, most)), self.method)
