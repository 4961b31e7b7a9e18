"""The self-distillation prompt sets (train/prompts.py, the mixed set, and
train/chat_prompts.py, everyday chat): large, deterministic, their two splits
disjoint, and free of the project's benchmark prompts."""

from __future__ import annotations

import pytest

from bench.eagle_acceptance import PROMPTS as CHAT
from bench.prompts import PROMPTS
from train.data import PROMPT_SETS

# Smallest sizes of each set's splits (train, heldout).
SIZES = {"mixed": (2000, 200), "chat": (1200, 120)}


@pytest.fixture(scope="module", params=sorted(PROMPT_SETS))
def splits(request) -> dict[str, list[str]]:
    build = PROMPT_SETS[request.param]
    return {"set": request.param, "build": build,
            **{s: build(s) for s in ("train", "heldout")}}


def test_splits_are_large_deterministic_and_disjoint(splits):
    n_train, n_heldout = SIZES[splits["set"]]
    assert len(splits["train"]) >= n_train and len(splits["heldout"]) >= n_heldout
    assert len(set(splits["train"])) == len(splits["train"])
    assert not set(splits["train"]) & set(splits["heldout"])
    assert splits["build"]("heldout") == splits["heldout"]


def test_no_benchmark_prompt_is_used(splits):
    bench = [m["content"] for p in PROMPTS for m in p.messages] + CHAT
    for prompt in splits["train"] + splits["heldout"]:
        for text in bench:
            assert text not in prompt and prompt not in text


def test_the_sets_do_not_share_prompts():
    train = {name: set(build("train")) for name, build in PROMPT_SETS.items()}
    assert not train["mixed"] & train["chat"]


def test_unknown_split_is_refused(splits):
    with pytest.raises(ValueError, match="split"):
        splits["build"]("test")
