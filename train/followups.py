"""Second-turn prompts built from the target's own replies: follow-up questions
and work over a given text.

Two kinds of prompt that the single-question chat set (chat_prompts.py) lacks,
both common in real chat traffic and in the benchmark's chat/other prompts:

- a conversation that goes on: the user's question, the target's own reply
  to it as the assistant turn, then a follow-up ("make that shorter", "give
  me an example", "what if I am a beginner?"). The answer leans on the
  earlier turn, so a head learns to carry phrases over from the context,
  which heads trained on single questions barely do;
- a task over a passage of natural prose: summarise, list the main points,
  rewrite, correct the spelling. The passages are the target's replies
  themselves (the project has no other offline source of everyday prose);
  for the spelling task, with deterministic typos planted.

Rows come from a self-distillation file of the chat set (train/data.py
writes them), so the split follows that file: replies to held-out subjects
make held-out prompts. Every row gives one conversation of each kind, chosen
by a hash of its prompt index, so the set is deterministic.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable

FOLLOWUPS = [
    "Can you make that shorter?", "Can you give me an example?",
    "Could you explain that again more simply?", "Can you put that as a numbered list?",
    "What is the most important thing to remember from this?",
    "Is there anything I should be careful about?", "What if I am a complete beginner?",
    "Thanks! What should I do next?", "Can you explain the first point in more detail?",
    "Summarise your answer in one sentence.", "How long would that take?",
    "What would you do differently on a small budget?", "Can you explain that to a child?",
    "Why is that?", "Are there any common mistakes people make with this?",
    "Can you add one more tip?", "Which of these would you start with, and why?",
    "Could you write that as a short email to a friend?", "What are the pros and cons?",
    "That is helpful. Can you say more about the last part?",
]

PASSAGE_TASKS = [
    "Summarise this text in two sentences.\n\n{text}",
    "Give me a one-paragraph summary of the following.\n\n{text}",
    "What are the key points here? Use a bullet list.\n\n{text}",
    "Rewrite this text in a more formal tone:\n\n{text}",
    "Rewrite the following so that a ten-year-old can follow it:\n\n{text}",
    "Turn this into a short list of numbered steps:\n\n{text}",
    "Make this text shorter and friendlier:\n\n{text}",
    "Write a title for this text and explain your choice.\n\n{text}",
    "What questions could a reader ask after reading this?\n\n{text}",
]
SPELLING_TASKS = [
    "Fix the spelling mistakes in this text and return it:\n\n{text}",
    "Please correct the typos below without changing the wording otherwise.\n\n{text}",
]

_WORD = re.compile(r"[A-Za-z]{4,}")


def whole_sentences(text: str) -> str:
    """`text` up to its last sentence end, when that keeps at least half of it (a reply
    cut at the token limit otherwise ends mid-sentence)."""
    text = text.strip()
    end = max(text.rfind(c) for c in ".!?")
    return text[:end + 1] if end >= len(text) // 2 else text


def plant_typos(text: str, rng: random.Random, rate: float = 0.15) -> str:
    """`text` with about `rate` of its words of 4+ letters misspelt by swapping two
    inner letters (the first and last stay, so the word is still recognisable)."""
    def swap(m: re.Match) -> str:
        w = m.group(0)
        if rng.random() >= rate:
            return w
        i = rng.randrange(1, len(w) - 2)
        return w[:i] + w[i + 1] + w[i] + w[i + 2:]
    return _WORD.sub(swap, text)


def build_followups(rows: Iterable[dict], decode: Callable[[list[int]], str],
                    user_text: Callable[[list[int]], str], seed: int = 0) -> list[list[dict]]:
    """Two conversations per self-distillation row ({"i", "prompt", "reply"} token ids):
    a follow-up to the target's reply and a task over the reply as a passage.
    `decode` turns reply ids into text, `user_text` a prompt's ids into the user's
    question. Deterministic in the rows and `seed`; shuffled."""
    out: list[list[dict]] = []
    for row in rows:
        reply = whole_sentences(decode(row["reply"]))
        if len(reply) < 40:  # nothing to follow up or to work over
            continue
        rng = random.Random(f"followup-{seed}-{row['i']}")
        question = user_text(row["prompt"])
        out.append([{"role": "user", "content": question},
                    {"role": "assistant", "content": reply},
                    {"role": "user", "content": rng.choice(FOLLOWUPS)}])
        if rng.random() < 0.2:
            task = rng.choice(SPELLING_TASKS).format(text=plant_typos(reply, rng))
        else:
            task = rng.choice(PASSAGE_TASKS).format(text=reply)
        out.append([{"role": "user", "content": task}])
    random.Random(f"followups-{seed}").shuffle(out)
    return out
