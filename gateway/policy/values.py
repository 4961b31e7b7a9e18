"""Checks of the numbers that policy inputs carry (JSON decodes true as an int)."""

from __future__ import annotations

import math


def is_int(x: object) -> bool:
    # JSON true/false arrive as bool, which is an int subclass but never a count.
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: object) -> bool:
    return (is_int(x) or isinstance(x, float)) and math.isfinite(x)


def check_count(where: str, value: object) -> None:
    if not (is_int(value) and value >= 0):
        raise ValueError(f"{where} must be a non-negative integer, got {value!r}")
