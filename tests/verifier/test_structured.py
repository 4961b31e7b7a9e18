"""Structured outputs in the engine: the grammar's mask on every verified position,
drafts it forbids cut, exact against plain decoding under the same grammar."""

from __future__ import annotations

import json
import re

import pytest
import torch
import xgrammar as xgr

from specdec.pb import common_pb2
from specdec.sampling import SamplingParams
from specdec.structured import Grammars, allowed_tokens
from specdec.tokenizer import Tokenizer
from tests.tiny import next_token_logits, tiny_llama
from tests.verifier.test_engine import ScriptedProposer, run
from verifier.engine import Engine, EngineConfig, Request

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer.hf, len(tokenizer.hf), tokenizer.eos_token_ids)


@pytest.fixture(scope="module")
def model(tokenizer):
    # Random float64 weights over the real tokenizer's vocabulary: the grammar decides
    # much of the output, the model the rest, and outputs compare with ==.
    return tiny_llama(len(tokenizer.hf), seed=3, logit_scale=2.0)


def spec(**kind) -> common_pb2.StructuredOutput:
    if "choice" in kind:
        return common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=kind["choice"]))
    return common_pb2.StructuredOutput(**kind)


def reference(model, grammars, structured, prompt, max_tokens, eos):
    """Plain greedy decoding under the grammar, written independently of the engine: a
    full forward per token, xgrammar's own matcher and mask, argmax."""
    matcher = xgr.GrammarMatcher(grammars.compile(structured))
    bitmask = xgr.allocate_token_bitmask(1, model.config.vocab_size)
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        # A fresh cache and a full forward per token: nothing of the engine's reuse.
        with torch.no_grad():
            logits = next_token_logits(model, [ids])[0].clone()  # [V], masked below
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = allowed_tokens(bitmask, logits.shape[-1])[0]
        logits[~allowed] = float("-inf")
        t = int(logits.argmax())
        assert matcher.accept_token(t)
        out.append(t)
        ids.append(t)
        if t in eos:
            break
    return out


def request(grammars, structured, prompt, max_tokens, k=0, rid="r0", **sampling):
    return Request(rid, prompt, max_tokens, SamplingParams(temperature=0.0, **sampling),
                   num_speculative_tokens=k,
                   grammar=grammars.matcher(grammars.compile(structured)))


CASES = {
    "json_schema": spec(json_schema=json.dumps(SCHEMA)),
    "json_object": spec(json_object=True),
    "regex": spec(regex=r"[a-c]{3}-[0-9]{2,4}"),
    "choice": spec(choice=["positive", "negative", "neutral"]),
    "grammar": spec(grammar='root ::= "yes" | "no" | "(" root " and " root ")"'),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("k, error_rate", [(0, 0.0), (4, 0.0), (4, 0.5), (4, 1.0)])
def test_greedy_under_a_grammar_equals_plain_decoding(model, grammars, tokenizer, name, k,
                                                      error_rate):
    structured = CASES[name]
    prompts = [tokenizer.encode(text) for text in ("Describe a person.", "Go:")]
    eos = tokenizer.eos_token_ids
    refs = [reference(model, grammars, structured, p, 24, eos) for p in prompts]
    reqs = [request(grammars, structured, p, 24, k=k, rid=f"r{i}")
            for i, p in enumerate(prompts)]
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=256,
                                        max_num_speculative_tokens=8),
                    ScriptedProposer({i: r.prompt_token_ids + g
                                      for i, (r, g) in enumerate(zip(reqs, refs, strict=True))},
                                     error_rate, seed=5) if k else None, eos)
    stats: dict = {}
    got = run(engine, reqs, stats)
    for i, r in enumerate(reqs):
        assert got[r.request_id] == refs[i], (name, i)
    if name in ("regex", "choice"):
        pattern = {"regex": r"[a-c]{3}-[0-9]{2,4}", "choice": "positive|negative|neutral"}[name]
        for ref in refs:
            text = tokenizer.decode([t for t in ref if t not in eos])
            assert re.fullmatch(pattern, text), text
    if name == "json_schema":
        for ref in refs:
            if ref[-1] in eos:  # complete (not cut by max_tokens)
                obj = json.loads(tokenizer.decode(ref[:-1]))
                assert set(obj) >= {"name", "age"} and isinstance(obj["age"], int)
    if k and error_rate == 0.0:
        assert stats["accepted"] > 0  # the oracle's drafts were verified and kept


def test_drafts_the_grammar_forbids_never_reach_the_forward(model, grammars, tokenizer):
    structured = CASES["regex"]
    prompt = tokenizer.encode("Go:")
    ref = reference(model, grammars, structured, prompt, 16, tokenizer.eos_token_ids)
    # Random drafts: almost none fits [a-c]{3}-[0-9]{2,4}, so almost every block is cut
    # to nothing before the forward and the rows fed stay near one per step.
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=256,
                                        max_num_speculative_tokens=8),
                    ScriptedProposer({0: prompt + ref}, error_rate=1.0, seed=2),
                    tokenizer.eos_token_ids)
    engine.add_request(request(grammars, structured, prompt, 16, k=8))
    rows, out = [], []
    while engine.has_work():
        for o in engine.step():
            out += o.new_token_ids
            rows.append(o.num_tokens)
    assert out == ref
    assert sum(rows[1:]) <= 2 * len(rows[1:])  # without the cut: 9 rows a step


@pytest.mark.parametrize("structured, field", [
    (spec(json_schema="{not json"), "structured_output.json_schema"),
    (spec(json_schema='{"type": "nope"}'), "structured_output.json_schema"),
    (spec(regex="("), "structured_output.regex"),
    (spec(choice=[]), "structured_output.choice"),
    (spec(grammar="root ::= "), "structured_output.grammar"),
    (spec(json_object=False), "structured_output.json_object"),
    (common_pb2.StructuredOutput(), "structured_output"),
])
def test_bad_grammars_name_their_field(grammars, structured, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        grammars.compile(structured)


class SilentProposer(ScriptedProposer):
    """A drafter that never proposes anything."""

    def __init__(self):
        super().__init__({}, 0.0)

    def propose(self, wanted, tokens):
        return {}


def test_text_the_grammar_forces_is_free_drafts(model, grammars, tokenizer):
    """With no drafter proposal at all, the grammar's forced text (a key's rest after
    its first token, quotes, colons) is drafted; the output stays exact."""
    schema = {"type": "object", "properties": {
        "a_rather_long_property_name": {"type": "integer"}},
        "required": ["a_rather_long_property_name"], "additionalProperties": False}
    structured = spec(json_schema=json.dumps(schema))
    prompt = tokenizer.encode("JSON:")
    eos = tokenizer.eos_token_ids
    ref = reference(model, grammars, structured, prompt, 48, eos)
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=256,
                                        max_num_speculative_tokens=8), SilentProposer(), eos)
    stats: dict = {}
    assert run(engine, [request(grammars, structured, prompt, 48, k=8)], stats)["r0"] == ref
    assert stats["drafted"] > 0


def test_forced_text_is_drafted_as_the_tokenizer_writes_it(grammars, tokenizer):
    schema = {"type": "object", "properties": {"a_rather_long_property_name": {"type": "integer"}},
              "required": ["a_rather_long_property_name"], "additionalProperties": False}
    g = grammars.matcher(grammars.compile(spec(json_schema=json.dumps(schema))))
    head = tokenizer.encode('{"a')
    g.accept(head)
    want = tokenizer.encode('_rather_long_property_name"')
    assert g.forced_tokens([], 64) == want
    assert g.forced_tokens([], 3) == want[:3]
    # After drafts of its own the forced text continues from there; nothing is kept.
    assert g.forced_tokens(want[:2], 64) == tokenizer.encode(
        tokenizer.decode(want[2:]))
    assert g.allowed_drafts(want) == len(want)


@pytest.mark.slow
def test_free_drafts_on_the_real_model_cut_the_steps(smollm2_dir, grammars, tokenizer):
    """SmolLM2 writes JSON keys as its tokenizer does, so it accepts the grammar's
    drafts: the same reply in far fewer steps, with no drafter."""
    from specdec.models import load_model

    real = load_model(smollm2_dir, dtype="float32", device="cpu")
    schema = {"type": "object", "properties": {
        "name_of_the_city": {"type": "string", "maxLength": 12},
        "population_in_millions": {"type": "integer"},
        "is_a_capital_city": {"type": "boolean"}},
        "required": ["name_of_the_city", "population_in_millions", "is_a_capital_city"],
        "additionalProperties": False}
    structured = spec(json_schema=json.dumps(schema))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe Paris as JSON."}])
    eos = tokenizer.eos_token_ids

    def go(k: int) -> tuple[list[int], int]:
        engine = Engine(real, EngineConfig(max_num_seqs=2, max_model_len=1024,
                                           max_num_speculative_tokens=8),
                        SilentProposer(), eos)
        stats: dict = {}
        out = run(engine, [request(grammars, structured, prompt, 80, k=k)], stats)["r0"]
        return out, stats["steps"]

    plain, plain_steps = go(0)
    free, free_steps = go(8)
    assert free == plain
    json.loads(tokenizer.decode([t for t in plain if t not in eos]))
    assert free_steps < 0.75 * plain_steps, (free_steps, plain_steps)


@pytest.mark.parametrize("k", [0, 4])
def test_constraints_that_allow_no_token_end_only_their_request(model, grammars, tokenizer, k):
    """A grammar and allowed_token_ids that leave no token between them: the request ends
    with NoTokenAllowed, the client's error naming its position, where it sampled a token
    its grammar refuses and failed as the engine's own error; its neighbour runs on."""
    from specdec.processors import LogitsProcessors
    from verifier.engine import NoTokenAllowed

    structured = CASES["regex"]  # [a-c]{3}-[0-9]{2,4}: no "x", no "9" first
    eos = tokenizer.eos_token_ids
    prompt = tokenizer.encode("Go:")
    ref = reference(model, grammars, structured, prompt, 12, eos)
    bad = Request("bad", prompt, 12, SamplingParams(temperature=0.0), num_speculative_tokens=k,
                  grammar=grammars.matcher(grammars.compile(structured)),
                  processors=LogitsProcessors(allowed_token_ids=tuple(
                      tokenizer.encode("x") + tokenizer.encode("9"))))
    good = request(grammars, structured, prompt, 12, k=k, rid="good")
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=256,
                                        max_num_speculative_tokens=8),
                    ScriptedProposer({0: prompt + ref, 1: prompt + ref}, 0.0) if k else None, eos)
    engine.add_request(bad)
    engine.add_request(good)
    got, errors = {"bad": [], "good": []}, {}
    while engine.has_work():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
            if o.error is not None:
                errors[o.request_id] = o.error
    assert isinstance(errors.get("bad"), NoTokenAllowed), errors
    assert "output position 0" in str(errors["bad"]) and got["bad"] == []
    assert got["good"] == ref and "good" not in errors
