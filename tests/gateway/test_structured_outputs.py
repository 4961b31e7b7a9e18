"""Structured outputs through the REST and gRPC APIs: every form a vLLM user sends,
exact under speculation (the same text as plain decoding under the grammar)."""

from __future__ import annotations

import json
import re

import pytest

from specdec.client import Client, InvalidRequestError
from specdec.pb import common_pb2
from tests.gateway.stack import MODEL_NAME
from tests.verifier.test_structured import reference

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "rank": {"type": "integer"}},
          "required": ["city", "rank"], "additionalProperties": False}

# (REST extra body, the StructuredOutput it means, a check of the text)
FORMS = {
    "response_format json_schema": (
        {"response_format": {"type": "json_schema",
                             "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}}},
        common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)), "json"),
    "response_format json_object": (
        {"response_format": {"type": "json_object"}},
        common_pb2.StructuredOutput(json_object=True), "json"),
    "structured_outputs regex": (
        {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,5}"}},
        common_pb2.StructuredOutput(regex=r"[0-9]{3}-[a-z]{2,5}"), r"[0-9]{3}-[a-z]{2,5}"),
    "guided_choice": (
        {"guided_choice": ["red", "green", "blue"]},
        common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=["red", "green", "blue"])),
        "red|green|blue"),
    "structured_outputs grammar": (
        {"structured_outputs": {"grammar": 'root ::= "a" | "b" root'}},
        common_pb2.StructuredOutput(grammar='root ::= "a" | "b" root'), "b*a"),
}


def want(stack, structured, content, max_tokens=32):
    ids = reference(stack.model, stack.grammars, structured, stack.chat_ids(content),
                    max_tokens, stack.tokenizer.eos_token_ids)
    eos = stack.tokenizer.eos_token_ids
    return stack.tokenizer.decode([t for t in ids if t not in eos]), ids


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("spec", [{"method": "none"},
                                  {"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "draft_model", "num_speculative_tokens": 4}],
                         ids=lambda s: s["method"])
def test_every_form_is_exact_under_speculation(stack, client, form, spec):
    body, structured, check = FORMS[form]
    content = "Name a place."
    text, ids = want(stack, structured, content)
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=32, extra_body={**body, "speculative": spec})
    got = resp.choices[0].message.content
    assert got == text
    if ids[-1] in stack.tokenizer.eos_token_ids:  # complete: the text is in the language
        assert resp.choices[0].finish_reason == "stop"
        if check == "json":
            obj = json.loads(got)
            assert isinstance(obj, dict)
            if "json_schema" in form:
                assert set(obj) == {"city", "rank"} and isinstance(obj["rank"], int)
        else:
            assert re.fullmatch(check, got), got


def test_streamed_and_completions(stack, client):
    body, structured, _ = FORMS["guided_choice"]
    content = "Pick a colour."
    text, _ = want(stack, structured, content)
    chunks = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=32, stream=True,
        extra_body={**body, "speculative": {"method": "draft_model"}})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    prompt = "Colour:"
    ids = reference(stack.model, stack.grammars, structured, stack.tokenizer.encode(prompt), 16,
                    stack.tokenizer.eos_token_ids)
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                     temperature=0, extra_body=body)
    eos = stack.tokenizer.eos_token_ids
    assert resp.choices[0].text == stack.tokenizer.decode([t for t in ids if t not in eos])
    assert resp.choices[0].text in ("red", "green", "blue")


def test_grpc_api_takes_the_same_grammar(stack):
    body, structured, _ = FORMS["structured_outputs regex"]
    content = "Code?"
    text, _ = want(stack, structured, content)
    messages = [{"role": "user", "content": content}]
    with Client(stack.grpc_address) as c:
        got = c.chat(messages, temperature=0, max_tokens=32,
                     structured_output=body["structured_outputs"],
                     speculative={"method": "draft_model"})
        assert got.text == text
        # A bad grammar is INVALID_ARGUMENT naming the field, as REST's 400.
        with pytest.raises(InvalidRequestError, match="structured_output.regex"):
            c.chat(messages, max_tokens=8, structured_output={"regex": "("})
        with pytest.raises(InvalidRequestError, match="exactly one"):
            c.chat(messages, max_tokens=8, structured_output={"regex": "a", "grammar": "b"})
