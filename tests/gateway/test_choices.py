"""Several choices per request: `n` for chat and completions (streamed or not), a list
of prompts in /v1/completions, and `echo`. Each choice is its own sequence with its own
seed stream and spec_decode; the prompt's prefill is shared through the prefix cache."""

from __future__ import annotations

import json

import httpx2
import pytest

from tests.gateway.stack import MODEL_NAME


def seeded(client, seed: int, n: int = 1, **kw):
    return client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story."}],
        temperature=1.0, max_tokens=16, seed=seed, n=n, **kw)


@pytest.mark.parametrize("spec", [{"method": "none"}, {"method": "draft_model"}],
                         ids=lambda s: s["method"])
def test_chat_n_choices_are_seeded_seed_plus_index(stack, client, spec):
    extra = {"speculative": spec}
    many = seeded(client, 40, n=3, extra_body=extra)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.message.content for c in many.choices]
    # Choice i is the single request seeded 40 + i (vLLM's seeds for n > 1).
    singles = [seeded(client, 40 + i, extra_body=extra) for i in range(3)]
    assert texts == [r.choices[0].message.content for r in singles]
    assert len(set(texts)) > 1  # different seeds, different samples
    assert many.usage.completion_tokens == sum(r.usage.completion_tokens for r in singles)
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens  # counted once
    per_choice = [c.model_extra["spec_decode"] for c in many.choices]
    assert many.model_extra["spec_decode"]["num_drafts"] == sum(s["num_drafts"]
                                                                for s in per_choice)


def test_chat_n_streamed(stack, client):
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me a story."}],
        temperature=1.0, max_tokens=16, seed=7, n=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"speculative": {"method": "ngram"}}))
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    singles = [seeded(client, 7 + i, extra_body={"speculative": {"method": "ngram"}})
               for i in (0, 1)]
    assert [texts[0], texts[1]] == [r.choices[0].message.content for r in singles]
    assert chunks[-1].usage.completion_tokens == sum(r.usage.completion_tokens
                                                     for r in singles)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_prompt_list_n_and_echo(stack, client, stream):
    prompts = ["The quick brown fox", "Once upon a time"]
    wants = [stack.reference(stack.tokenizer.encode(p), 12)[0] for p in prompts]
    kw = dict(model=MODEL_NAME, prompt=prompts, temperature=0, max_tokens=12, n=2, echo=True,
              extra_body={"speculative": {"method": "draft_model"}})
    if stream:
        texts: dict[int, str] = {}
        for c in client.completions.create(stream=True, **kw):
            for ch in c.choices:
                texts[ch.index] = texts.get(ch.index, "") + ch.text
        got = [texts[i] for i in range(4)]
    else:
        resp = client.completions.create(**kw)
        got = [c.text for c in sorted(resp.choices, key=lambda c: c.index)]
        assert resp.usage.prompt_tokens == sum(len(stack.tokenizer.encode(p)) for p in prompts)
    # Choice index = prompt index * n + i; greedy choices of one prompt are equal.
    assert got == [prompts[0] + wants[0]] * 2 + [prompts[1] + wants[1]] * 2


def test_choice_limits_and_best_of(stack):
    url = stack.base_url + "/completions"
    for body, needle in [({"prompt": "x", "n": 65}, "n"),
                         ({"prompt": ["x"] * 33, "n": 2}, "choices per request"),
                         ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
                         ({"prompt": "x", "echo": True, "logprobs": 1}, "echo")]:
        r = httpx2.post(url, content=json.dumps({"model": MODEL_NAME, "max_tokens": 2, **body}),
                        headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"], r.text
    ok = httpx2.post(url, content=json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": 2,
                                              "n": 2, "best_of": 2}),
                     headers={"content-type": "application/json"})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
