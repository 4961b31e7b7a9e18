"""JSON from clients, parsed with a bound on how deeply it nests.

Python's json module recurses once per level: a body of a few hundred kilobytes of
`[` raises RecursionError (a 500 where a 400 is due), and a JSON Schema nested a few
thousand levels deep that parses still reaches the grammar compiler, which recurses
in C++. Real requests nest a handful of levels (a JSON Schema for tool arguments a
dozen or two), so anything past MAX_JSON_DEPTH is refused, naming the field.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64


def json_depth(value: Any) -> int:
    """Levels of objects and arrays in a parsed JSON value (a scalar: 0, `{}`: 1),
    counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_json(text: str | bytes, where: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The parsed value; ValueError naming `where` for text that is not JSON or nests
    deeper than max_depth."""
    too_deep = f"{where}: nests deeper than {max_depth} levels of objects and arrays"
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    except RecursionError:  # deeper than the interpreter's recursion limit
        raise ValueError(too_deep) from None
    if json_depth(value) > max_depth:
        raise ValueError(too_deep)
    return value
