"""Second-turn self-distillation prompts (train/followups.py): follow-ups to
the target's own replies and tasks over them as passages, built from a data file's
rows through train.data.conversations_of."""

from __future__ import annotations

import json
import random

import pytest

from bench.eagle_acceptance import PROMPTS as CHAT
from bench.prompts import PROMPTS
from specdec.tokenizer import Tokenizer
from train.data import PROMPT_SETS, conversations_of
from train.followups import FOLLOWUPS, build_followups, plant_typos, whole_sentences

REPLY = ("Water a pothos when the top inch of soil is dry. It prefers bright, indirect "
         "light. Yellow leaves usually mean too much water, and brown tips")


def test_whole_sentences_drops_a_cut_off_tail():
    assert whole_sentences(REPLY).endswith("indirect light.")
    # Cutting would lose more than half: the text stays whole.
    assert whole_sentences("Yes. " + "and then " * 20) == ("Yes. " + "and then " * 20).strip()


def test_typos_swap_inner_letters_only():
    text = "Remember to water the plant every morning before breakfast"
    assert plant_typos(text, random.Random(0), rate=0.0) == text
    typo = plant_typos(text, random.Random(0), rate=1.0)
    assert typo == plant_typos(text, random.Random(0), rate=1.0)
    words, typo_words = text.split(), typo.split()
    assert len(typo_words) == len(words)
    changed = [(w, t) for w, t in zip(words, typo_words, strict=True) if w != t]
    assert changed, typo
    for w, t in changed:
        assert len(w) >= 4 and sorted(w) == sorted(t) and (w[0], w[-1]) == (t[0], t[-1])


def _rows(n: int) -> list[dict]:
    return [{"i": i, "prompt": [i], "reply": [i, i]} for i in range(n)]


def test_every_row_gives_a_followup_and_a_passage_task():
    decode = lambda ids: f"{REPLY} (reply {ids[0]})."  # noqa: E731
    convs = build_followups(_rows(40), decode, lambda ids: f"question {ids[0]}?")
    assert convs == build_followups(_rows(40), decode, lambda ids: f"question {ids[0]}?")
    assert len(convs) == 80
    turns = [c for c in convs if len(c) == 3]
    tasks = [c for c in convs if len(c) == 1]
    assert len(turns) == len(tasks) == 40
    for c in turns:
        n = int(c[0]["content"].split()[1].rstrip("?"))
        assert [m["role"] for m in c] == ["user", "assistant", "user"]
        assert c[1]["content"] == f"{REPLY} (reply {n})." and c[2]["content"] in FOLLOWUPS
    # Passage tasks carry the reply as written, or (the spelling task) with typos.
    exact = [c for c in tasks if REPLY in c[0]["content"]]
    assert 0 < len(exact) < len(tasks)


def test_short_replies_are_skipped():
    assert build_followups(_rows(5), lambda ids: "Yes.", lambda ids: "q") == []


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def test_conversations_of_a_chat_file(smollm2, tmp_path):
    questions = PROMPT_SETS["chat"]("heldout")[:6]
    path = tmp_path / "chat.jsonl"
    with path.open("w") as f:
        for i, q in enumerate(questions):
            reply = smollm2.encode(f"Here is my answer to number {i}. {REPLY}.",
                                   add_special_tokens=False)
            prompt = smollm2.apply_chat_template([{"role": "user", "content": q}])
            f.write(json.dumps({"i": i, "prompt": prompt, "reply": reply}) + "\n")
    convs = conversations_of(smollm2, "chat", "train", path)
    assert len(convs) == 12
    assert {c[0]["content"] for c in convs if len(c) == 3} == set(questions)
    bench = [m["content"] for p in PROMPTS for m in p.messages] + CHAT
    assert not {m["content"] for c in convs for m in c} & set(bench)
    # A file from another prompt set is refused with the reason.
    with pytest.raises(ValueError, match="not in the 'mixed' prompt set"):
        conversations_of(smollm2, "mixed", "train", path)


def test_single_turn_conversations_are_the_prompt_set(smollm2):
    convs = conversations_of(smollm2, "chat", "heldout")
    assert [c[0]["content"] for c in convs] == PROMPT_SETS["chat"]("heldout")
    assert all(len(c) == 1 and c[0]["role"] == "user" for c in convs)
