"""Logits processors in the engine: vLLM's meanings, exact under speculation (row j
of a block counts drafts 1..j as output), against a plain loop written here."""

from __future__ import annotations

import pytest
import torch

from specdec.pb import common_pb2
from specdec.processors import LogitsProcessors, apply_block
from specdec.sampling import SamplingParams
from tests.tiny import next_token_logits, tiny_llama
from tests.verifier.test_engine import ScriptedProposer, run
from verifier.engine import Engine, EngineConfig, Request

VOCAB = 96
EOS = 95


@pytest.fixture(scope="module")
def model():
    return tiny_llama(VOCAB, seed=21, logit_scale=3.0)


def by_hand(logits: torch.Tensor, p: LogitsProcessors, prompt: list[int], out: list[int],
            stop_ids: set[int]) -> torch.Tensor:
    """One position, the textbook way: a loop over the vocabulary."""
    x = logits.clone().tolist()
    counts = {t: out.count(t) for t in set(out)}
    for v in range(len(x)):
        if p.allowed_token_ids and v not in p.allowed_token_ids:
            x[v] = float("-inf")
    for w in p.bad_words:
        if len(w) == 1 or tuple(out[len(out) - len(w) + 1:]) == w[:-1]:
            x[w[-1]] = float("-inf")
    if len(out) < p.min_tokens:
        for t in stop_ids:
            x[t] = float("-inf")
    for t, b in p.logit_bias:
        x[t] += b
    for v in range(len(x)):
        if p.repetition_penalty != 1.0 and (v in counts or v in prompt):
            x[v] = x[v] / p.repetition_penalty if x[v] > 0 else x[v] * p.repetition_penalty
        x[v] -= p.frequency_penalty * counts.get(v, 0)
        x[v] -= p.presence_penalty * (1 if v in counts else 0)
    return torch.tensor(x, dtype=logits.dtype)


PROCESSORS = {
    "penalties": LogitsProcessors(presence_penalty=0.7, frequency_penalty=0.4,
                                  repetition_penalty=1.3),
    "logit_bias": LogitsProcessors(logit_bias=((7, 5.0), (11, -100.0), (30, 2.5))),
    # A strong bias makes EOS the argmax: min_tokens alone holds it back.
    "min_tokens": LogitsProcessors(min_tokens=12, logit_bias=((EOS, 8.0),)),
    "bad_words": LogitsProcessors(bad_words=((40,), (12, 13), (20, 21, 22))),
    "allowed": LogitsProcessors(allowed_token_ids=tuple(range(0, VOCAB, 3))),
    "all": LogitsProcessors(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=0.8,
                            logit_bias=((EOS, 3.0), (9, 1.5)), min_tokens=6,
                            bad_words=((9, 9),)),
}


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_a_block_row_sees_the_drafts_before_it_as_output(name):
    p = PROCESSORS[name]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, VOCAB, generator=g, dtype=torch.float64) * 3
    prompt, out, drafts = [1, 2, 3, 12], [7, 12, 20, 21, 7], [9, 9, 22, 13]
    got = logits.clone()
    apply_block(got, p, prompt, out, drafts, {EOS})
    for j in range(5):
        want = by_hand(logits[j], p, prompt, out + drafts[:j], {EOS})
        assert torch.equal(got[j], want), (name, j)


def reference(model, p: LogitsProcessors, prompt: list[int], max_tokens: int,
              eos: frozenset[int] = frozenset({EOS})) -> list[int]:
    """Plain greedy decoding under the processors: a full forward per token."""
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = next_token_logits(model, [ids])[0]  # [V]
        t = int(by_hand(logits, p, prompt, out, set(eos)).argmax())
        out.append(t)
        ids.append(t)
        if t in eos:
            break
    return out


@pytest.mark.parametrize("name", sorted(PROCESSORS))
@pytest.mark.parametrize("k, error_rate", [(0, 0.0), (4, 0.0), (4, 0.5), (8, 1.0)])
def test_greedy_with_processors_equals_plain_decoding(model, name, k, error_rate):
    p = PROCESSORS[name]
    prompts = [[1, 2, 3, 12, 20], [40, 41, 9, 8, 7, 6]]
    refs = [reference(model, p, pr, 20) for pr in prompts]
    reqs = [Request(f"r{i}", pr, 20, SamplingParams(temperature=0.0), num_speculative_tokens=k,
                    processors=p) for i, pr in enumerate(prompts)]
    proposer = ScriptedProposer({i: pr + ref for i, (pr, ref) in enumerate(
        zip(prompts, refs, strict=True))}, error_rate, seed=9) if k else None
    engine = Engine(model, EngineConfig(max_num_seqs=4, max_model_len=256,
                                        max_num_speculative_tokens=8), proposer,
                    frozenset({EOS}))
    stats: dict = {}
    got = run(engine, reqs, stats)
    for i, r in enumerate(reqs):
        assert got[r.request_id] == refs[i], (name, i)
    if k and error_rate == 0.0:
        assert stats["accepted"] > 0


@pytest.mark.parametrize("name", ["logit_bias", "bad_words"])
def test_graphed_steps_with_processors_take_the_processed_argmax(model, name):
    """The argmax a CUDA graph takes is of the raw logits: a greedy request under
    processors takes its own of the processed rows (the graph's argmax made worthless
    here, the runner replayed on CPU)."""
    from tests.verifier.test_cuda_graphs import _engine_with_runner, corrupt_graph_outputs

    p = PROCESSORS[name]
    prompts = [[1, 2, 3, 12, 20], [40, 41, 9, 8, 7, 6]]
    refs = [reference(model, p, pr, 20) for pr in prompts]
    reqs = [Request(f"r{i}", pr, 20, SamplingParams(temperature=0.0), num_speculative_tokens=4,
                    processors=p) for i, pr in enumerate(prompts)]
    proposer = ScriptedProposer({i: pr + ref for i, (pr, ref) in enumerate(
        zip(prompts, refs, strict=True))}, 0.5, seed=9)
    engine = _engine_with_runner(model, proposer, max_num_seqs=4, max_model_len=64,
                                 max_num_speculative_tokens=4)
    corrupt_graph_outputs(engine.runner.graphs, argmax=True)
    got = run(engine, reqs, {})
    assert [got[r.request_id] for r in reqs] == refs
    assert engine.runner.graphs.num_runs > 3


def test_processors_change_the_output(model):
    """The cases above are not vacuous: each processor changes plain greedy output."""
    prompt = [1, 2, 3, 12, 20]
    plain = reference(model, LogitsProcessors(), prompt, 20)
    for name, p in PROCESSORS.items():
        assert reference(model, p, prompt, 20) != plain, name


@pytest.mark.parametrize("fields, name", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
    ({"logit_bias": {3: 101.0}}, "logit_bias"),
    ({"allowed_token_ids": [VOCAB + 4]}, "allowed_token_ids"),
])
def test_out_of_range_values_name_their_field(fields, name):
    s = common_pb2.SamplingParams(**fields)
    with pytest.raises(ValueError, match=rf"^sampling\.{name}: "):
        LogitsProcessors.from_proto(s, VOCAB)
    with pytest.raises(ValueError, match=rf"^{name}: "):
        LogitsProcessors.from_proto(s, VOCAB, field="")


def test_bad_words_are_checked():
    s = common_pb2.SamplingParams()
    s.bad_words.add(ids=[])
    with pytest.raises(ValueError, match="bad_words"):
        LogitsProcessors.from_proto(s, VOCAB)
    ok = common_pb2.SamplingParams(min_tokens=3)
    ok.bad_words.add(ids=[4, 5])
    p = LogitsProcessors.from_proto(ok, VOCAB)
    assert p.bad_words == ((4, 5),) and p.min_tokens == 3 and p.active
    assert not LogitsProcessors.from_proto(common_pb2.SamplingParams(), VOCAB).active
