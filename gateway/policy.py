"""Per-request speculation policy: which method, how many draft tokens (K), when to stop.

Pure functions and small dataclasses, no gRPC. At admission the gateway turns a
request's `speculative` field and the chosen verifier's load into a `Decision`
(`decide`); while the request runs, `DynamicK` picks each round's K.

Dynamic K (docs/design.md section 5): a step that drafts k tokens yields on average
AL(k) = 1 + sum_{i<=k} prod_{j<=i} a_j tokens, where a_j is the probability that draft
position j is accepted given that positions 1..j-1 were, and costs ITL(batch size, k)
ms, read from a profiled table. K is the k in 0..K_max with the highest goodput
AL(k) / ITL(batch size, k); K=0 is plain decoding. A drafter's own time is part of
every speculative step, so the profile may hold one table per method: an ngram
drafter costs next to nothing, a draft model tens of ms, and one shared table would
make the slow drafter's K too large.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

METHODS = ("none", "ngram", "draft_model", "eagle", "eagle3")
DRAFTER_METHODS = METHODS[1:]
DISABLED_REASONS = (None, "request", "queue_size", "drafter_unavailable")
PROFILE_VERSION = 1

# Prior for a method the profile has no acceptance rates for. 0.5 claims neither a
# good nor a useless drafter: speculation then starts only where draft positions are
# cheap (small batches), and the request's own rates take over after warm-up.
NEUTRAL_ACCEPTANCE = 0.5

_K_ERROR = 'speculative.num_speculative_tokens: must be a non-negative integer or "auto"'


def _is_int(x: object) -> bool:
    # JSON true/false arrive as bool, which is an int subclass but never a count.
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


def _check_count(where: str, value: object) -> None:
    if not (_is_int(value) and value >= 0):
        raise ValueError(f"{where} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True)
class SpeculativeRequest:
    """A request's `speculative` field: {"method": ..., "num_speculative_tokens": <int> | "auto"}.

    None means "the deployment's default". With `auto` K follows the load (DynamicK),
    and `num_speculative_tokens`, when given, is its upper bound.
    """

    method: str | None = None
    num_speculative_tokens: int | None = None
    auto: bool = False
    # A configured drafter by name (LoadReport.drafters), for deployments with several
    # drafters of one method; None = the method's default drafter.
    drafter: str | None = None

    def __post_init__(self) -> None:
        if self.drafter is not None and not (isinstance(self.drafter, str) and self.drafter):
            raise ValueError(f"speculative.drafter: must be a non-empty string, "
                             f"got {self.drafter!r}")
        if self.method is not None:
            if not isinstance(self.method, str):
                raise ValueError(f"speculative.method: must be a string, got {self.method!r}")
            if self.method not in METHODS:
                raise ValueError(f"speculative.method: unknown method {self.method!r} "
                                 f"(expected one of {', '.join(METHODS)})")
        k = self.num_speculative_tokens
        if k is not None and not (_is_int(k) and k >= 0):
            raise ValueError(f"{_K_ERROR}, got {k!r}")
        if not isinstance(self.auto, bool):
            raise ValueError(f"speculative.auto: must be a bool, got {self.auto!r}")

    @classmethod
    def from_json(cls, obj: object) -> SpeculativeRequest:
        """Parse the OpenAI-extension field; None (absent) gives the defaults."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise ValueError(f"speculative: must be an object or null, got {type(obj).__name__}")
        unknown = [key for key in obj if key not in ("method", "num_speculative_tokens",
                                                     "drafter")]
        if unknown:
            raise ValueError(f"speculative: unknown field(s) {', '.join(map(repr, unknown))} "
                             "(expected method, num_speculative_tokens, drafter)")
        k = obj.get("num_speculative_tokens")
        if isinstance(k, str) and k == "auto":
            return cls(method=obj.get("method"), auto=True, drafter=obj.get("drafter"))
        return cls(method=obj.get("method"), num_speculative_tokens=k,
                   drafter=obj.get("drafter"))


@dataclass(frozen=True)
class Deployment:
    """What this gateway's deployment offers; `methods_available` are the drafters now up."""

    default_method: str
    methods_available: frozenset[str]
    default_k: int
    k_max: int
    disable_queue_size: int | None  # None = never auto-disable

    def __post_init__(self) -> None:
        if self.default_method not in METHODS:
            raise ValueError(f"deployment: default_method {self.default_method!r} is unknown "
                             f"(expected one of {', '.join(METHODS)})")
        object.__setattr__(self, "methods_available", frozenset(self.methods_available))
        unknown = sorted(self.methods_available - set(METHODS))
        if unknown:
            raise ValueError(f"deployment: methods_available has unknown method(s) {unknown}")
        _check_count("deployment: default_k", self.default_k)
        _check_count("deployment: k_max", self.k_max)
        if self.default_k > self.k_max:
            raise ValueError(f"deployment: default_k ({self.default_k}) must not exceed "
                             f"k_max ({self.k_max})")
        if self.disable_queue_size is not None:
            _check_count("deployment: disable_queue_size", self.disable_queue_size)


@dataclass(frozen=True)
class Decision:
    """How one request starts. With a disabled_reason it runs plainly (K=0 every step)."""

    method: str  # "none" or a drafter method
    k: int  # fixed K, or K's upper bound when auto_k
    auto_k: bool
    disabled_reason: str | None  # one of DISABLED_REASONS

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"decision: unknown method {self.method!r}")
        _check_count("decision: k", self.k)
        if self.disabled_reason not in DISABLED_REASONS:
            raise ValueError(f"decision: disabled_reason must be one of {DISABLED_REASONS}, "
                             f"got {self.disabled_reason!r}")
        if self.method == "none" and self.k:
            raise ValueError(f"decision: method 'none' needs k=0, got {self.k}")


def decide(req: SpeculativeRequest, dep: Deployment, num_running: int) -> Decision:
    """Admission policy for one request on a verifier with `num_running` running requests."""
    _check_count("num_running", num_running)
    method = req.method or dep.default_method
    requested_k = req.num_speculative_tokens
    # Checked first: a K no deployment setting allows is a mistake even when unused.
    if requested_k is not None and requested_k > dep.k_max:
        raise ValueError(f"speculative.num_speculative_tokens: {requested_k} exceeds this "
                         f"deployment's maximum of {dep.k_max}")
    if method == "none" or requested_k == 0:
        return Decision("none", 0, False, "request")
    if method not in dep.methods_available:
        # Better a plain answer than an error: the drafter may only be restarting.
        return Decision(method, 0, False, "drafter_unavailable")
    if requested_k is not None:
        k = requested_k
    else:
        k = dep.k_max if req.auto else dep.default_k
    # Under load the method and K are kept, so the verifier can be told to turn
    # speculation on later without asking the user again.
    overloaded = dep.disable_queue_size is not None and num_running > dep.disable_queue_size
    return Decision(method, k, req.auto, "queue_size" if overloaded else None)


@dataclass(frozen=True)
class ItlProfile:
    """Measured time of one verifier step by batch size and K, for one deployment.

    Written by the profiling command; `acceptance` holds per-method prior rates
    a_1, a_2, ... measured on a reference prompt set. `method_itl_ms` holds step
    times of drafter methods profiled on their own (same grid as itl_ms); a method
    without a table there uses the shared itl_ms.
    """

    batch_sizes: tuple[int, ...]  # strictly increasing, >= 1
    ks: tuple[int, ...]  # strictly increasing, starting at 0
    itl_ms: tuple[tuple[float, ...], ...]  # [len(batch_sizes)][len(ks)]
    acceptance: dict[str, tuple[float, ...]] = field(default_factory=dict, hash=False)
    method_itl_ms: dict[str, tuple[tuple[float, ...], ...]] = field(default_factory=dict,
                                                                     hash=False)

    def __post_init__(self) -> None:
        for name, least in (("batch_sizes", 1), ("ks", 0)):
            grid = tuple(getattr(self, name))
            object.__setattr__(self, name, grid)
            if not grid:
                raise ValueError(f"ITL profile: {name} must not be empty")
            if not all(_is_int(x) and x >= least for x in grid):
                raise ValueError(f"ITL profile: {name} must be integers >= {least}, got {grid}")
            if any(a >= b for a, b in zip(grid, grid[1:], strict=False)):
                raise ValueError(f"ITL profile: {name} must be strictly increasing, got {grid}")
        # Plain decoding is always a candidate; its cost must be measured, not guessed.
        if self.ks[0] != 0:
            raise ValueError(f"ITL profile: ks must include 0, got {self.ks}")
        object.__setattr__(self, "itl_ms", self._checked_table("itl_ms", self.itl_ms))
        method_tables = {}
        for method, rows in dict(self.method_itl_ms).items():
            if method not in DRAFTER_METHODS:
                raise ValueError(f"ITL profile: method_itl_ms has unknown method {method!r} "
                                 f"(expected one of {', '.join(DRAFTER_METHODS)})")
            method_tables[method] = self._checked_table(f"method_itl_ms[{method!r}]", rows)
        object.__setattr__(self, "method_itl_ms", method_tables)
        acceptance = {}
        for method, rates in dict(self.acceptance).items():
            if method not in DRAFTER_METHODS:
                raise ValueError(f"ITL profile: acceptance has unknown method {method!r} "
                                 f"(expected one of {', '.join(DRAFTER_METHODS)})")
            rates = tuple(rates)
            if not rates or not all(_is_number(r) and 0 <= r <= 1 for r in rates):
                raise ValueError(f"ITL profile: acceptance[{method!r}] must be a non-empty "
                                 f"list of rates in [0, 1], got {rates}")
            acceptance[method] = rates
        object.__setattr__(self, "acceptance", acceptance)

    def _checked_table(self, name: str, table: object) -> tuple[tuple[float, ...], ...]:
        """`table` as a tuple of rows, one per batch size and one positive ms per k."""
        rows = tuple(tuple(row) for row in table)
        if len(rows) != len(self.batch_sizes):
            raise ValueError(f"ITL profile: {name} must have {len(self.batch_sizes)} rows "
                             f"(one per batch size), got {len(rows)}")
        for i, row in enumerate(rows):
            if len(row) != len(self.ks):
                raise ValueError(f"ITL profile: {name}[{i}] must have {len(self.ks)} entries "
                                 f"(one per k), got {len(row)}")
            for j, ms in enumerate(row):
                if not (_is_number(ms) and ms > 0):
                    raise ValueError(f"ITL profile: {name}[{i}][{j}] must be a positive "
                                     f"number, got {ms!r}")
        return rows

    def itl(self, batch_size: float, k: float, method: str | None = None) -> float:
        """Bilinear interpolation of the method's table (else itl_ms), clamped to its edges.

        Clamped rather than extrapolated: the slope of the last cell carries the
        noise of two measurements, and extended far it can turn an ITL negative.
        """
        if not (math.isfinite(batch_size) and math.isfinite(k)):
            raise ValueError(f"itl: batch_size and k must be finite, got {batch_size}, {k}")
        table = self.method_itl_ms.get(method, self.itl_ms)  # None: the shared table
        i0, i1, tb = _bracket(self.batch_sizes, batch_size)
        j0, j1, tk = _bracket(self.ks, k)
        low = _lerp(table[i0][j0], table[i0][j1], tk)
        high = _lerp(table[i1][j0], table[i1][j1], tk)
        return _lerp(low, high, tb)

    def to_json(self) -> dict:
        obj = {
            "version": PROFILE_VERSION,
            "batch_sizes": list(self.batch_sizes),
            "ks": list(self.ks),
            "itl_ms": [list(row) for row in self.itl_ms],
            "acceptance": {m: list(r) for m, r in sorted(self.acceptance.items())},
        }
        # Only when present, so that a single-table profile is written as before.
        if self.method_itl_ms:
            obj["method_itl_ms"] = {m: [list(row) for row in rows]
                                    for m, rows in sorted(self.method_itl_ms.items())}
        return obj

    @classmethod
    def from_json(cls, obj: object) -> ItlProfile:
        if not isinstance(obj, dict):
            raise ValueError(f"ITL profile: must be a JSON object, got {type(obj).__name__}")
        # Unknown keys are refused so that a misspelt "acceptance" is not silently dropped.
        unknown = [key for key in obj if key not in _PROFILE_KEYS]
        if unknown:
            raise ValueError(f"ITL profile: unknown key(s) {', '.join(map(repr, unknown))}")
        for key in ("version", "batch_sizes", "ks", "itl_ms"):
            if key not in obj:
                raise ValueError(f"ITL profile: missing key {key!r}")
        version = obj["version"]
        if not _is_int(version) or version != PROFILE_VERSION:
            raise ValueError(f"ITL profile: key 'version' is {version!r}, this gateway reads "
                             f"version {PROFILE_VERSION}")
        for key in ("batch_sizes", "ks", "itl_ms"):
            if not isinstance(obj[key], list):
                raise ValueError(f"ITL profile: key {key!r} must be a list")
        if not all(isinstance(row, list) for row in obj["itl_ms"]):
            raise ValueError("ITL profile: key 'itl_ms' must be a list of lists")
        acceptance = obj.get("acceptance", {})
        if not (isinstance(acceptance, dict)
                and all(isinstance(r, list) for r in acceptance.values())):
            raise ValueError("ITL profile: key 'acceptance' must map method names to lists")
        method_itl_ms = obj.get("method_itl_ms", {})
        if not (isinstance(method_itl_ms, dict)
                and all(isinstance(rows, list) and all(isinstance(row, list) for row in rows)
                        for rows in method_itl_ms.values())):
            raise ValueError("ITL profile: key 'method_itl_ms' must map method names to "
                             "lists of lists")
        return cls(batch_sizes=tuple(obj["batch_sizes"]), ks=tuple(obj["ks"]),
                   itl_ms=tuple(tuple(row) for row in obj["itl_ms"]),
                   acceptance={m: tuple(r) for m, r in acceptance.items()},
                   method_itl_ms={m: tuple(tuple(row) for row in rows)
                                  for m, rows in method_itl_ms.items()})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ItlProfile:
        text = Path(path).read_text()
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: ITL profile is not valid JSON ({e})") from e
        try:
            return cls.from_json(obj)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e


_PROFILE_KEYS = ("version", "batch_sizes", "ks", "itl_ms", "acceptance", "method_itl_ms")


def _bracket(grid: Sequence[int], x: float) -> tuple[int, int, float]:
    """Grid indices around x (clamped to the grid) and x's weight toward the upper one."""
    if x <= grid[0]:
        return 0, 0, 0.0
    if x >= grid[-1]:
        return len(grid) - 1, len(grid) - 1, 0.0
    hi = bisect.bisect_right(grid, x)  # grid[hi - 1] <= x < grid[hi]
    return hi - 1, hi, (x - grid[hi - 1]) / (grid[hi] - grid[hi - 1])


def _lerp(a: float, b: float, t: float) -> float:
    # This form is exact at t=0 and t=1, so grid points return the measured value.
    return (1.0 - t) * a + t * b


def _rate_at(rates: Sequence[float], i: int) -> float:
    """Rate of position i+1; positions past the list reuse its last rate."""
    if i < len(rates):
        return rates[i]
    return rates[-1] if rates else 0.0


def acceptance_length(rates: Sequence[float], k: int) -> float:
    """Expected tokens per step with k drafts: 1 + sum_{i<=k} prod_{j<=i} rates[j-1]."""
    _check_count("acceptance_length: k", k)
    expected, reach = 1.0, 1.0
    for i in range(k):
        reach *= _rate_at(rates, i)  # probability that draft position i+1 is accepted
        expected += reach
    return expected


def goodput(profile: ItlProfile, batch_size: float, rates: Sequence[float], k: int,
            method: str | None = None) -> float:
    """Tokens per ms for one sequence speculating k tokens at this batch size.

    `method` picks the method's own ITL table where the profile has one.
    """
    return acceptance_length(rates, k) / profile.itl(batch_size, k, method)


def choose_k(profile: ItlProfile, batch_size: float, rates: Sequence[float], k_max: int,
             method: str | None = None) -> int:
    """argmax over k in 0..k_max of goodput (with `method`'s ITL); ties go to the smaller k.

    K above the profile's largest measured k is never chosen: its ITL would be
    clamped to that k's, which would make the extra draft positions look free.
    """
    _check_count("choose_k: k_max", k_max)
    best_k, best = 0, goodput(profile, batch_size, rates, 0, method)
    for k in range(1, min(k_max, profile.ks[-1]) + 1):
        g = goodput(profile, batch_size, rates, k, method)
        if g > best:
            best_k, best = k, g
    return best_k


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
        _check_count("num_drafted", num_drafted)
        _check_count("num_accepted", num_accepted)
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

    def rates(self, prior: Sequence[float], warmup_steps: int, k_max: int) -> tuple[float, ...]:
        """Rates for positions 1..k_max: the prior until warm-up, then the observed ones."""
        _check_count("warmup_steps", warmup_steps)
        _check_count("k_max", k_max)
        prior_rates = tuple(_rate_at(prior, i) for i in range(k_max))
        if self._steps < warmup_steps:
            return prior_rates
        return tuple(
            self._accepted[i] / self._tried[i] if i < len(self._tried) and self._tried[i] else p
            for i, p in enumerate(prior_rates)
        )


class DynamicK:
    """Each round's K for one request: the profile's ITL and the request's acceptance.

    When the request's own rates make K=0 best at every batch size, nothing more is
    drafted and K stays 0: a drafter that fails on this request is not retried. K=0
    caused by load alone rises again when the batch shrinks.
    """

    def __init__(self, profile: ItlProfile, method: str, k_max: int, warmup_steps: int = 8):
        if method not in DRAFTER_METHODS:
            raise ValueError(f"dynamic K: method must be one of {', '.join(DRAFTER_METHODS)}, "
                             f"got {method!r}")
        _check_count("dynamic K: k_max", k_max)
        _check_count("dynamic K: warmup_steps", warmup_steps)
        self.profile = profile
        self.method = method
        self.k_max = k_max
        self.warmup_steps = warmup_steps
        self.prior: tuple[float, ...] = profile.acceptance.get(method, (NEUTRAL_ACCEPTANCE,))
        self.acceptance = OnlineAcceptance()

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.acceptance.update(num_drafted, num_accepted)

    def next_k(self, batch_size: float) -> int:
        rates = self.acceptance.rates(self.prior, self.warmup_steps, self.k_max)
        return choose_k(self.profile, batch_size, rates, self.k_max, self.method)

