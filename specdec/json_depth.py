"""JSON from clients, parsed with a bound on how deeply it nests, and refused where a
string in it is not text.

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


def unencodable_text(value: Any) -> str | None:
    """Where in a parsed JSON value a string (or key) cannot be UTF-8 (a lone surrogate,
    which JSON's \\ud800 escapes write in plain ASCII): a path such as
    `.messages[0].content`, or None. Counted without recursion."""
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "the value"
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((key, f"{path} (a key)"))
                stack.append((child, f"{path}.{key}"))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def parse_json(text: str | bytes, where: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """The parsed value; ValueError naming `where` for text that is not JSON, nests
    deeper than max_depth, or holds a string that is no Unicode text (a lone surrogate:
    every later step that encodes it, the tokenizer's, a response's, would raise)."""
    too_deep = f"{where}: nests deeper than {max_depth} levels of objects and arrays"
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    except RecursionError:  # deeper than the interpreter's recursion limit
        raise ValueError(too_deep) from None
    if json_depth(value) > max_depth:
        raise ValueError(too_deep)
    if (path := unencodable_text(value)) is not None:
        raise ValueError(f"{where}: {path.removeprefix('.')}: not Unicode text "
                         f"(a lone surrogate escape such as \\ud800)")
    return value
