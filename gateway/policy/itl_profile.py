"""The ITL profile: a deployment's measured step time by batch size and K (one table
shared by all methods, optionally one per drafter method), with prior acceptance rates
per method; its JSON file format (written by `specdec profile`, read by
`specdec-gateway --profile`) and bilinear interpolation over it."""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gateway.policy.values import is_int, is_number
from specdec.speculation import DRAFTER_METHODS

PROFILE_VERSION = 1


@dataclass(frozen=True)
class ItlProfile:
    """Measured time of one verifier step by batch size and K, for one deployment.

    Written by the profiling command; `acceptance` holds per-method prior rates
    a_1, a_2, ... measured on a reference prompt set, and `availability` the share of
    steps asking a method for drafts in which it had some (an ngram drafter without a
    match has none); a method not there is taken to always have drafts.
    `method_itl_ms` holds step times of drafter methods profiled on their own (same
    grid as itl_ms); a method without a table there uses the shared itl_ms.
    """

    batch_sizes: tuple[int, ...]  # strictly increasing, >= 1
    ks: tuple[int, ...]  # strictly increasing, starting at 0
    itl_ms: tuple[tuple[float, ...], ...]  # [len(batch_sizes)][len(ks)]
    acceptance: dict[str, tuple[float, ...]] = field(default_factory=dict, hash=False)
    method_itl_ms: dict[str, tuple[tuple[float, ...], ...]] = field(default_factory=dict,
                                                                     hash=False)
    availability: dict[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for name, least in (("batch_sizes", 1), ("ks", 0)):
            grid = tuple(getattr(self, name))
            object.__setattr__(self, name, grid)
            if not grid:
                raise ValueError(f"ITL profile: {name} must not be empty")
            if not all(is_int(x) and x >= least for x in grid):
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
            if not rates or not all(is_number(r) and 0 <= r <= 1 for r in rates):
                raise ValueError(f"ITL profile: acceptance[{method!r}] must be a non-empty "
                                 f"list of rates in [0, 1], got {rates}")
            acceptance[method] = rates
        object.__setattr__(self, "acceptance", acceptance)
        availability = dict(self.availability)
        for method, share in availability.items():
            if method not in DRAFTER_METHODS:
                raise ValueError(f"ITL profile: availability has unknown method {method!r} "
                                 f"(expected one of {', '.join(DRAFTER_METHODS)})")
            if not (is_number(share) and 0 <= share <= 1):
                raise ValueError(f"ITL profile: availability[{method!r}] must be a number in "
                                 f"[0, 1], got {share!r}")
        object.__setattr__(self, "availability", availability)

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
                if not (is_number(ms) and ms > 0):
                    raise ValueError(f"ITL profile: {name}[{i}][{j}] must be a positive "
                                     f"number, got {ms!r}")
        return rows

    def measured_plain(self, batch_size: int) -> bool:
        """Whether plain decoding at this batch size was measured rather than only
        modelled. A profiled table measured every cell of its grid; the online model's
        (FittedProfile) says per batch size."""
        return True

    def max_draft_rows(self, batch_size: float) -> float:
        """The most draft rows a step of `batch_size` sequences may feed by this profile:
        where its ITL is measured, not extrapolated. A profiled table measured its whole
        grid (and clamps past it); the online model's (FittedProfile) knows rows only up
        to a little past the most its recent steps fed."""
        return math.inf

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

    def itls(self, batch_size: float, ks: np.ndarray, method: str | None = None) -> np.ndarray:
        """itl at one batch size for many K at once ([n] -> [n] ms): dynamic K reads
        hundreds of points of one batch size every step."""
        ks = np.asarray(ks, dtype=np.float64)
        if not (math.isfinite(batch_size) and np.isfinite(ks).all()):
            raise ValueError(f"itls: batch_size and ks must be finite, got {batch_size}, {ks}")
        table = self.method_itl_ms.get(method, self.itl_ms)
        i0, i1, tb = _bracket(self.batch_sizes, batch_size)
        # np.interp holds the edge values outside the grid, as itl() clamps.
        low = np.interp(ks, self.ks, table[i0])
        high = np.interp(ks, self.ks, table[i1])
        return (1.0 - tb) * low + tb * high

    def drafter_waits(self, method: str, sequences: np.ndarray, tokens: np.ndarray,
                      depth: np.ndarray, backlog: np.ndarray | float = 0.0
                      ) -> np.ndarray | None:
        """ms `method` adds to steps asking it for tokens[i] drafts over sequences[i]
        sequences, at most depth[i] of one, taking in backlog[i] context rows (0 where
        sequences[i] is 0), where the profile has a model of it; None where it has only
        tables (whose columns are steps where every sequence drafts alike)."""
        return None

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
        if self.availability:
            obj["availability"] = dict(sorted(self.availability.items()))
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
        if not is_int(version) or version != PROFILE_VERSION:
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
        availability = obj.get("availability", {})
        if not isinstance(availability, dict):
            raise ValueError("ITL profile: key 'availability' must map method names to "
                             "numbers")
        return cls(batch_sizes=tuple(obj["batch_sizes"]), ks=tuple(obj["ks"]),
                   itl_ms=tuple(tuple(row) for row in obj["itl_ms"]),
                   acceptance={m: tuple(r) for m, r in acceptance.items()},
                   method_itl_ms={m: tuple(tuple(row) for row in rows)
                                  for m, rows in method_itl_ms.items()},
                   availability=availability)

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


_PROFILE_KEYS = ("version", "batch_sizes", "ks", "itl_ms", "acceptance", "method_itl_ms",
                 "availability")


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
