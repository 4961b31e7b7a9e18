"""Logits processors through the REST API and the SDK: vLLM's fields, exact under
speculation (the text of plain greedy decoding under the same processors)."""

from __future__ import annotations

import pytest

from specdec.client import Client
from specdec.processors import LogitsProcessors
from tests.gateway.stack import MODEL_NAME
from tests.verifier.test_processors import reference


def text_of(stack, ids):
    eos = stack.tokenizer.eos_token_ids
    return stack.tokenizer.decode([t for t in ids if t not in eos])


@pytest.mark.parametrize("spec", [{"method": "none"},
                                  {"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "draft_model", "num_speculative_tokens": 4}],
                         ids=lambda s: s["method"])
def test_rest_fields_equal_plain_decoding_under_them(stack, client, spec):
    content = "Write a haiku about the sea."
    prompt = stack.chat_ids(content)
    eos = stack.tokenizer.eos_token_ids
    plain = reference(stack.model, LogitsProcessors(), prompt, 24, eos)
    first = plain[0]
    body = {"presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
            "logit_bias": {str(first): -100}, "min_tokens": 10}
    p = LogitsProcessors(presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.2,
                         logit_bias=((first, -100.0),), min_tokens=10)
    want = reference(stack.model, p, prompt, 24, eos)
    assert want != plain and want[0] != first
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=24, presence_penalty=0.8, frequency_penalty=0.5,
        logit_bias={str(first): -100},
        extra_body={k: v for k, v in body.items()
                    if k not in ("presence_penalty", "frequency_penalty", "logit_bias")}
        | {"speculative": spec})
    assert resp.choices[0].message.content == text_of(stack, want)
    assert resp.usage.completion_tokens == len(want) >= 10


def test_bad_words_and_allowed_token_ids(stack, client):
    content = "List three prime numbers."
    prompt = stack.chat_ids(content)
    eos = stack.tokenizer.eos_token_ids
    plain = reference(stack.model, LogitsProcessors(), prompt, 16, eos)
    word = stack.tokenizer.decode(plain[:1])
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=16, extra_body={"bad_words": [word], "speculative": {"method": "ngram"}})
    tok = stack.tokenizer
    banned = tuple({tuple(tok.encode(t)) for t in (word, " " + word.lstrip()) if tok.encode(t)})
    want = reference(stack.model, LogitsProcessors(bad_words=tuple(sorted(banned))), prompt, 16,
                     eos)
    assert resp.choices[0].message.content == text_of(stack, want) != text_of(stack, plain)
    allowed = sorted(set(plain[2:10]) | set(eos))
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=16, extra_body={"allowed_token_ids": allowed,
                                   "speculative": {"method": "draft_model"}})
    want = reference(stack.model, LogitsProcessors(allowed_token_ids=tuple(allowed)), prompt, 16,
                     eos)
    assert resp.choices[0].message.content == text_of(stack, want)
    assert set(want) <= set(allowed)


def test_sdk_takes_the_same_fields(stack):
    content = "Explain what a compiler does in one sentence."
    prompt = stack.chat_ids(content)
    eos = stack.tokenizer.eos_token_ids
    p = LogitsProcessors(presence_penalty=1.0, repetition_penalty=1.5, min_tokens=5)
    want = reference(stack.model, p, prompt, 20, eos)
    with Client(stack.grpc_address) as c:
        got = c.chat([{"role": "user", "content": content}], temperature=0, max_tokens=20,
                     presence_penalty=1.0, repetition_penalty=1.5, min_tokens=5,
                     speculative={"method": "draft_model"})
    assert got.text == text_of(stack, want)
