"""Every output-changing feature under every real drafter: a grammar (JSON schema, regex)
and logits processors, with the ngram, EAGLE-3 and draft-model drafters in process at
K = 1 and 4, alone and in a batch of 8 that mixes them with plain requests. Greedy
output must equal decoding with the same feature and no speculation (K = 0).

The tiny float64 target's 97 tokens spell printable ASCII (token i is chr(32 + i), the
last two are a newline and EOS), so a JSON schema compiles over its vocabulary and the
grammar's forced text tokenizes one character a token."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from drafter.draft_model import DraftModelMethod
from drafter.eagle import Eagle3Method
from drafter.ngram import NgramMethod
from specdec.processors import LogitsProcessors
from specdec.sampling import SamplingParams
from specdec.structured import GrammarState
from tests.drafter.test_eagle import VOCAB, head_tensors, make_target, save_head
from train.inprocess import InProcessProposer
from verifier.engine import Engine, EngineConfig, Request

EOS = VOCAB - 1
TEXT = [chr(32 + i) for i in range(VOCAB - 2)] + ["\n", "</s>"]
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"},
                                           "tag": {"type": "string", "maxLength": 6}},
          "required": ["id", "tag"], "additionalProperties": False}
TOKENS = 28


def encode(text: str) -> list[int]:
    return [TEXT.index(c) for c in text]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    make_target(root / "target")
    make_target(root / "draft", num_layers=2, seed=5)
    save_head(root / "head", "eagle3", head_tensors("eagle3", seed=3))
    return root


@pytest.fixture(scope="module")
def target(dirs):
    from specdec.models import load_model

    return load_model(dirs / "target", dtype=torch.float64)


@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo(TEXT, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info)
    return {"json_schema": compiler.compile_json_schema(json.dumps(SCHEMA), strict_mode=True),
            "regex": compiler.compile_regex(r"(ab|[c-f]{2})[0-9]{3}-[a-z]+")}


DRAFTERS = {
    "ngram": lambda d: NgramMethod(min_n=1, max_n=3),
    "eagle3": lambda d: Eagle3Method(d / "head", d / "target", dtype="float64", lookup_min_n=2),
    "draft_model": lambda d: DraftModelMethod(d / "draft", dtype="float64", pipeline=False,
                                              cuda_graphs=False),
}
FEATURES = ("json_schema", "regex", "processors")
PROCESSORS = LogitsProcessors(presence_penalty=0.5, frequency_penalty=0.3,
                              repetition_penalty=1.3, logit_bias=((EOS, 2.0), (40, 1.5)),
                              min_tokens=6)


def requests(feature: str, compiled, batch: int, k: int) -> list[Request]:
    """`batch` greedy requests: the first and every other one with the feature, the rest
    plain; all ask for K = k (the plain ones speculate too)."""
    out = []
    for i in range(batch):
        prompt = encode(f"Q{i}: give me a record of item {i} please. ")
        kw: dict = {}
        if i % 2 == 0:
            if feature == "processors":
                kw["processors"] = PROCESSORS
            else:
                kw["grammar"] = GrammarState(xgr, compiled[feature], VOCAB, encode)
        out.append(Request(f"r{i}", prompt, TOKENS, SamplingParams(temperature=0.0),
                           num_speculative_tokens=k, drafter="d" if k else None, **kw))
    return out


def decode(target, reqs: list[Request], proposer) -> tuple[dict[str, list[int]], int, int]:
    engine = Engine(target, EngineConfig(max_num_seqs=8, max_model_len=256,
                                         max_num_speculative_tokens=4), proposer, {EOS})
    for r in reqs:
        engine.add_request(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    drafted = accepted = 0
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            drafted += o.num_drafted
            accepted += o.num_accepted
    return out, drafted, accepted


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
@pytest.mark.parametrize("feature", FEATURES)
def test_greedy_equals_plain_decoding_with_the_feature(target, dirs, compiled, feature,
                                                       drafter, k, batch):
    plain, _, _ = decode(target, requests(feature, compiled, batch, 0), None)
    proposer = InProcessProposer(DRAFTERS[drafter](dirs), max_num_speculative_tokens=4)
    got, drafted, _ = decode(target, requests(feature, compiled, batch, k), proposer)
    assert got == plain
    if drafter != "ngram" or feature != "processors":
        # The drafter (or the grammar's forced text) did draft. Lookup has nothing to
        # find under penalties: the random target's replies never repeat a token.
        assert drafted > 0
    if feature != "processors":
        # The feature's replies follow the grammar to its end.
        matcher = xgr.GrammarMatcher(compiled[feature])
        reply = got["r0"]
        assert all(matcher.accept_token(t) for t in reply)
        if feature == "json_schema" and reply[-1] == EOS:
            obj = json.loads("".join(TEXT[t] for t in reply[:-1]))
            assert set(obj) == {"id", "tag"}
