"""Client JSON: nesting bounded, strings that are no text refused, each naming where."""

from __future__ import annotations

import re

import pytest

from specdec.json_depth import json_depth, parse_json, unencodable_text


def test_depth_is_counted_without_recursion():
    assert json_depth(1) == 0 and json_depth({}) == 1 and json_depth([[{"a": [1]}]]) == 4
    deep: list = []
    for _ in range(4999):
        deep = [deep]
    assert json_depth(deep) == 5000


@pytest.mark.parametrize(("text", "message"), [
    ("{not json", "x: not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "x: nests deeper than 64"),
    ('{"a": "\\ud800"}', "x: a: not Unicode text"),
    ('{"m": [{"c": "ok"}, {"c": "\\udfff tail"}]}', "x: m[1].c: not Unicode text"),
    ('{"\\ud83d": 1}', "x:  (a key): not Unicode text"),
])
def test_refusals_name_where(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_json(text, "x")


def test_surrogate_pairs_are_text():
    # An escaped pair is one character outside the BMP: text, kept as it is.
    assert parse_json('{"a": "\\ud83e\\udd80 crab"}', "x") == {"a": "\U0001f980 crab"}
    assert unencodable_text({"a": ["é", {"b": "漢字"}]}) is None
