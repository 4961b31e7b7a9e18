"""The self-distillation prompt set (drafter/train/prompts.py): large, deterministic,
its two splits disjoint, and free of the project's benchmark prompts."""

from __future__ import annotations

import pytest

from bench.eagle_acceptance import PROMPTS as CHAT
from bench.prompts import PROMPTS
from drafter.train.prompts import build_prompts


@pytest.fixture(scope="module")
def splits() -> dict[str, list[str]]:
    return {s: build_prompts(s) for s in ("train", "heldout")}


def test_splits_are_large_deterministic_and_disjoint(splits):
    assert len(splits["train"]) >= 2000 and len(splits["heldout"]) >= 200
    assert len(set(splits["train"])) == len(splits["train"])
    assert not set(splits["train"]) & set(splits["heldout"])
    assert build_prompts("heldout") == splits["heldout"]


def test_no_benchmark_prompt_is_used(splits):
    bench = [m["content"] for p in PROMPTS for m in p.messages] + CHAT
    for prompt in splits["train"] + splits["heldout"]:
        for text in bench:
            assert text not in prompt and prompt not in text


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match="split"):
        build_prompts("test")
