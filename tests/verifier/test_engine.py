"""Engine exactness: with any drafts, greedy output equals plain greedy
decoding (float64 tiny model), plus admission, chunked prefill, cancel, and a
failed step undone."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.generate import greedy_generate
from specdec.models import LlamaForCausalLM
from specdec.sampling import SamplingParams
from tests.tiny import tiny_llama
from verifier.engine import (
    Engine,
    EngineConfig,
    FinishReason,
    Proposal,
    Proposer,
    Request,
    StepFailed,
)

VOCAB = 97
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(VOCAB, seed=0)


class ScriptedProposer(Proposer):
    """Drafts from the target's known greedy continuation, corrupted with
    probability `error_rate` per token (0 = oracle, 1 = random tokens)."""

    def __init__(self, references: dict[int, list[int]], error_rate: float, seed: int = 0,
                 with_probs: bool = False):
        self.with_probs = with_probs
        self.references = references  # seq_id -> prompt + greedy continuation
        self.error_rate = error_rate
        self.rng = random.Random(seed)
        self.live: set[int] = set()

    def start(self, seq_id, request):
        self.live.add(seq_id)

    def propose(self, wanted, tokens):
        out = {}
        for seq_id, k in wanted.items():
            ref, n = self.references[seq_id], len(tokens[seq_id])
            draft = []
            for i in range(k):
                right = ref[n + i] if n + i < len(ref) else 0
                wrong = self.rng.random() < self.error_rate
                draft.append(self.rng.randrange(VOCAB) if wrong else right)
            probs = None
            if self.with_probs:
                # A smooth q that puts most mass on the drafted token.
                probs = torch.full((k, VOCAB), 0.5 / (VOCAB - 1))
                probs[torch.arange(k), torch.tensor(draft)] = 0.5
            out[seq_id] = Proposal(draft, probs)
        return out

    def advance(self, seq_id, outcome):
        pass

    def free(self, seq_id):
        self.live.discard(seq_id)


def run(engine: Engine, requests: list[Request], stats: dict | None = None) -> dict[str, list[int]]:
    for r in requests:
        engine.add_request(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    stats = {} if stats is None else stats
    for _ in range(10_000):
        if not engine.has_work():
            break
        stats["steps"] = stats.get("steps", 0) + 1
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            stats["drafted"] = stats.get("drafted", 0) + o.num_drafted
            stats["accepted"] = stats.get("accepted", 0) + o.num_accepted
    assert not engine.has_work()
    return out


def make_requests(batch: int, k: int, max_tokens: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for i in range(batch):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        # Mixed K inside one batch: some sequences speculate less or not at all.
        ki = k if i % 3 == 0 else rng.randint(0, k)
        reqs.append(Request(f"r{i}", prompt, max_tokens, GREEDY, num_speculative_tokens=ki))
    return reqs


@pytest.mark.parametrize("error_rate", [0.0, 1.0, 0.3], ids=["oracle", "random", "mixed"])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_equals_plain_decoding(model, batch, k, error_rate):
    max_tokens = 24
    reqs = make_requests(batch, k, max_tokens, seed=batch * 100 + k)
    plain = greedy_generate(model, [r.prompt_token_ids for r in reqs], max_tokens)
    refs = {i: r.prompt_token_ids + p for i, (r, p) in enumerate(zip(reqs, plain, strict=True))}
    proposer = ScriptedProposer(refs, error_rate, seed=k)
    engine = Engine(model, EngineConfig(max_num_seqs=8, max_model_len=128, block_size=4,
                                        num_kv_blocks=512, max_num_batched_tokens=64), proposer)
    stats: dict = {}
    out = run(engine, reqs, stats)
    for r, want in zip(reqs, plain, strict=True):
        assert out[r.request_id] == want, r.request_id
    assert not proposer.live  # every sequence freed in the drafter
    assert engine.cache.num_free_blocks == 512
    assert stats["drafted"] > 0
    if error_rate == 0.0:
        # Oracle drafts are all accepted: after the prefill step, K + 1 tokens a step.
        assert stats["accepted"] == stats["drafted"]
        if batch == 1:
            assert stats["steps"] == 1 + -(-(max_tokens - 1) // (k + 1))
    if error_rate == 1.0:
        assert stats["accepted"] < stats["drafted"]


def test_step_outputs_carry_the_rows_the_step_fed(model):
    """num_tokens is the step's whole feed: prefill chunks, then 1 + drafts per
    verify block, the same on every output of the step (the gateway's step-time
    model regresses on it)."""
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11, 12]]
    plain = greedy_generate(model, prompts, 20)
    refs = {i: p + c for i, (p, c) in enumerate(zip(prompts, plain, strict=True))}
    engine = Engine(model, EngineConfig(max_model_len=128, block_size=4, num_kv_blocks=64),
                    ScriptedProposer(refs, 0.3, seed=1))
    engine.add_request(Request("a", prompts[0], 20, GREEDY, num_speculative_tokens=3))
    engine.add_request(Request("b", prompts[1], 20, GREEDY, num_speculative_tokens=0))
    first = engine.step()
    assert [o.num_tokens for o in first] == [5 + 7] * 2  # both prompts in one prefill step
    verify_steps = 0
    while engine.has_work():
        outs = engine.step()
        if len(outs) == 2:
            assert {o.num_tokens for o in outs} == {sum(1 + o.num_drafted for o in outs)}
            verify_steps += 1
    assert verify_steps >= 3


def test_drafts_with_probabilities_keep_greedy_exact(model):
    reqs = make_requests(4, 4, 16, seed=11)
    plain = greedy_generate(model, [r.prompt_token_ids for r in reqs], 16)
    refs = {i: r.prompt_token_ids + p for i, (r, p) in enumerate(zip(reqs, plain, strict=True))}
    proposer = ScriptedProposer(refs, 0.3, seed=3, with_probs=True)
    engine = Engine(model, EngineConfig(max_model_len=128, block_size=4, num_kv_blocks=256), proposer)
    stats: dict = {}
    out = run(engine, reqs, stats)
    assert [out[r.request_id] for r in reqs] == plain
    assert 0 < stats["accepted"] < stats["drafted"]


def test_no_drafter_and_small_cache_still_exact(model):
    """K=0 everywhere is plain decoding; a cache too small for the whole batch
    makes requests wait (and be preempted), never fail; prefill is chunked."""
    reqs = make_requests(8, 0, 20, seed=5)
    plain = greedy_generate(model, [r.prompt_token_ids for r in reqs], 20)
    engine = Engine(model, EngineConfig(max_num_seqs=8, max_model_len=64, block_size=4,
                                        num_kv_blocks=24, max_num_batched_tokens=8))
    out = run(engine, reqs)
    assert [out[r.request_id] for r in reqs] == plain
    assert engine.cache.num_free_blocks == 24


def test_waiting_requests_are_admitted_lowest_priority_value_first(model):
    """vLLM's priority: with room for one sequence, the waiting requests run lowest
    value first, arrival order among equals; the output stays plain decoding's."""
    prompts = {name: [3 + i, 9, 27] for i, name in enumerate(["first", "low", "urgent", "mid",
                                                             "urgent2"])}
    plain = dict(zip(prompts, greedy_generate(model, list(prompts.values()), 6), strict=True))
    engine = Engine(model, EngineConfig(max_num_seqs=1, max_model_len=64, block_size=4,
                                        num_kv_blocks=64))
    order: list[str] = []
    out: dict[str, list[int]] = {name: [] for name in prompts}
    engine.add_request(Request("first", prompts["first"], 6, GREEDY, priority=0))
    out["first"] += engine.step()[0].new_token_ids  # admitted before the others arrive
    for name, priority in (("low", 5), ("urgent", -3), ("mid", 1), ("urgent2", -3)):
        engine.add_request(Request(name, prompts[name], 6, GREEDY, priority=priority))
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                order.append(o.request_id)
    assert order == ["first", "urgent", "urgent2", "mid", "low"]
    assert out == plain


def test_preemption_takes_the_highest_priority_value(model):
    """A cache too small for both: the sequence preempted is the one whose priority
    value is highest, though it was admitted first."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]]
    plain = greedy_generate(model, prompts, 20)
    engine = Engine(model, EngineConfig(max_num_seqs=2, max_model_len=32, block_size=4,
                                        num_kv_blocks=9, max_num_batched_tokens=64))
    preempted: list[str] = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda seq: (preempted.append(seq.request.request_id),
                                             preempt(seq))
    reqs = [Request("background", prompts[0], 20, GREEDY, priority=9),
            Request("interactive", prompts[1], 20, GREEDY, priority=0)]
    out = run(engine, reqs)
    assert preempted and set(preempted) == {"background"}
    assert [out["background"], out["interactive"]] == plain


def test_cancel_frees_kv_and_drafter(model):
    refs = {0: [1] * 200}
    proposer = ScriptedProposer(refs, 1.0)
    engine = Engine(model, EngineConfig(max_model_len=128, block_size=4, num_kv_blocks=64), proposer)
    engine.add_request(Request("a", [1, 2, 3], 50, GREEDY, num_speculative_tokens=3))
    engine.step()
    engine.step()
    assert engine.num_running == 1 and engine.cache.num_free_blocks < 64
    done = engine.cancel("a")
    assert done.finish_reason is FinishReason.CANCELLED
    assert engine.num_running == 0 and engine.cache.num_free_blocks == 64
    assert not proposer.live


def test_stop_token_and_max_tokens_cut_a_verify_block(model):
    plain = greedy_generate(model, [[5, 6, 7]], 12)[0]
    refs = {0: [5, 6, 7] + plain, 1: [5, 6, 7] + plain}
    stop = plain[4]
    first = plain.index(stop)
    engine = Engine(model, EngineConfig(max_model_len=64, block_size=4, num_kv_blocks=64),
                    ScriptedProposer(refs, 0.0))
    out = run(engine, [Request("stop", [5, 6, 7], 12, GREEDY, stop_token_ids={stop},
                               num_speculative_tokens=8),
                       Request("len", [5, 6, 7], 5, GREEDY, num_speculative_tokens=8)])
    assert out["stop"] == plain[: first + 1]
    assert out["len"] == plain[:5]


@pytest.mark.parametrize("field,kwargs", [
    ("prompt_token_ids", dict(prompt_token_ids=[VOCAB])),
    ("max_tokens", dict(max_tokens=1000)),
    ("num_speculative_tokens", dict(num_speculative_tokens=99)),
])
def test_bad_requests_name_the_field(model, field, kwargs):
    engine = Engine(model, EngineConfig(max_model_len=64, block_size=4, num_kv_blocks=64))
    base = dict(request_id="x", prompt_token_ids=[1, 2], max_tokens=4)
    with pytest.raises(ValueError, match=field):
        engine.add_request(Request(**{**base, **kwargs}))
    assert engine.num_waiting == 0


class HiddenRecorder(ScriptedProposer):
    """Asks for two layers' hidden states and records every outcome."""

    LAYERS = (2, 0)

    def __init__(self, references):
        super().__init__(references, error_rate=0.3, seed=4)
        self.rows: dict[int, dict[int, torch.Tensor]] = {}  # seq_id -> position -> [L, H]

    def hidden_layers(self, seq_id):
        return self.LAYERS

    def advance(self, seq_id, outcome):
        assert outcome.hidden_states is not None
        n = outcome.hidden_states.shape[0]
        if outcome.num_drafted:  # a verify step keeps the last token plus the accepted drafts
            assert n == outcome.num_accepted + 1
        for i in range(n):
            self.rows.setdefault(seq_id, {})[outcome.hidden_start + i] = outcome.hidden_states[i]


class KeptHiddenRecorder(HiddenRecorder):
    """A HiddenRecorder that takes the rows of steps without drafts as places in the
    engine's feature store, and reads them at the next propose, as the drafter client
    does when it next sends."""

    def __init__(self, references):
        super().__init__(references)
        self.read = None
        self.unread: list[tuple[int, int, int]] = []  # (seq_id, start, num)
        self.kept = 0

    def bind_feature_reader(self, read):
        self.read = read
        return True

    def propose(self, wanted, tokens):
        for seq_id, start, num in self.unread:
            rows = self.read(seq_id, start, num)  # [num, L * H]
            for i in range(num):
                self.rows.setdefault(seq_id, {})[start + i] = rows[i].view(len(self.LAYERS), -1)
        self.unread = []
        return super().propose(wanted, tokens)

    def advance(self, seq_id, outcome):
        if not outcome.hidden_kept:
            return super().advance(seq_id, outcome)
        assert outcome.hidden_states is None and not outcome.num_drafted
        self.kept += outcome.hidden_kept
        self.unread.append((seq_id, outcome.hidden_start, outcome.hidden_kept))


@pytest.mark.parametrize("recorder", [HiddenRecorder, KeptHiddenRecorder])
def test_hidden_states_of_kept_positions_reach_the_proposer(model, recorder):
    """Chunked prefill, plain decode and verify steps hand the drafter the target's
    hidden states of exactly the positions kept, equal to one full forward's: taken
    out of the step's, or read later from the feature store (steps without drafts,
    for a proposer that reads it)."""
    reqs = make_requests(3, 4, 20, seed=11)
    for i, r in enumerate(reqs):
        r.num_speculative_tokens = 4 if i else 0  # the first decodes plain
    refs = {i: r.prompt_token_ids + g for i, (r, g) in enumerate(
        zip(reqs, greedy_generate(model, [r.prompt_token_ids for r in reqs], 20), strict=True))}
    proposer = recorder(refs)
    engine = Engine(model, EngineConfig(max_num_batched_tokens=16, max_num_speculative_tokens=8),
                    proposer)
    out = run(engine, reqs)
    if recorder is KeptHiddenRecorder:
        assert proposer.kept > 20  # prompts and plain decode steps went through the store
        assert engine._read_features(0, 0, 1) is None  # freed: its rows are no longer its
    for seq_id, r in enumerate(reqs):
        tokens = r.prompt_token_ids + out[r.request_id]
        cache = model.make_kv_cache(64, 16)
        cache.add(0)
        full = model(torch.tensor(tokens[:-1]), cache.plan([(0, len(tokens) - 1)]), cache,
                     hidden_layers=HiddenRecorder.LAYERS).hidden_states  # [2, T-1, H]
        rows = proposer.rows[seq_id]
        # Every position but the last two (the finishing step sends no outcome) was reported.
        assert set(range(len(tokens) - 1 - 4)) <= set(rows)
        for pos, h in rows.items():
            torch.testing.assert_close(h, full[:, pos], atol=1e-9, rtol=0)


def test_logprobs_match_log_softmax_of_the_target(model):
    req = Request("lp", [5, 6, 7], 6, GREEDY, num_speculative_tokens=3, num_logprobs=4)
    refs = {0: [5, 6, 7] + greedy_generate(model, [[5, 6, 7]], 6)[0]}
    engine = Engine(model, EngineConfig(), ScriptedProposer(refs, error_rate=0.0))
    engine.add_request(req)
    lps = []
    while engine.has_work():
        for o in engine.step():
            assert len(o.logprobs) == len(o.new_token_ids)
            lps += o.logprobs
    ctx = [5, 6, 7]
    for lp in lps:
        cache = model.make_kv_cache(16, 16)
        cache.add(0)
        ref = torch.log_softmax(model(torch.tensor(ctx), cache.plan([(0, len(ctx))]), cache).logits[0].float(), -1)
        assert lp.token_id == ref.argmax().item() and lp.rank == 1
        assert lp.logprob == pytest.approx(ref[lp.token_id].item(), abs=1e-6)
        assert [t for t, _ in lp.top] == ref.topk(4).indices.tolist()
        ctx.append(lp.token_id)


@pytest.mark.parametrize("fail_at", [1, 3, 6])  # the prefill step, then verify steps
def test_a_failed_step_is_undone(model, fail_at):
    """A step that raises after its forward and its sampling (KV appended for every
    fed token, random numbers drawn) leaves nothing behind: the engine runs on and
    every output, seeded sampled ones included, equals a run where it never failed."""
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [3, 2, 3, 8]]
    plain = greedy_generate(model, prompts, 16)
    refs = {i: p + c for i, (p, c) in enumerate(zip(prompts, plain, strict=True))}

    def requests():
        return [Request(f"r{i}", p, 16, GREEDY if i % 2 else SamplingParams(temperature=1.0, seed=i),
                        num_speculative_tokens=3) for i, p in enumerate(prompts)]

    def engine():
        return Engine(model, EngineConfig(max_model_len=128, block_size=4, num_kv_blocks=64),
                      ScriptedProposer(refs, error_rate=0.0))

    clean = run(engine(), requests())
    e = engine()
    sample, calls = e._sample, []

    def failing_sample(*args):
        result = sample(*args)
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("boom")
        return result

    e._sample = failing_sample
    for r in requests():
        e.add_request(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests()}
    failures = 0
    while e.has_work():
        try:
            outputs = e.step()
        except StepFailed as failed:
            failures += 1
            assert failed.request_ids == [seq.request.request_id for seq in e.scheduler.running]
            assert str(failed.__cause__) == "boom"
            # The KV the step appended is gone: each sequence holds its computed tokens.
            for seq in e.scheduler.running:
                assert e.cache.length(seq.seq_id) == seq.num_computed
            continue
        for o in outputs:
            out[o.request_id] += o.new_token_ids
    assert failures == 1
    assert out == clean
    assert out["r1"] == plain[1] and out["r3"] == plain[3]
    assert e.cache.num_free_blocks == 64


def test_step_only_runs_the_requests_named(model):
    engine = Engine(model, EngineConfig(max_model_len=128, block_size=4, num_kv_blocks=64))
    for i in range(3):
        engine.add_request(Request(f"r{i}", [7, 8, 9 + i], 8, GREEDY))
    assert engine.step(only={"r0"}) == []  # admits nobody: nothing runs yet
    assert {o.request_id for o in engine.step()} == {"r0", "r1", "r2"}
    assert {o.request_id for o in engine.step(only={"r2", "r0"})} == {"r0", "r2"}


def test_seeded_text_does_not_depend_on_k_drafts_batch_or_resume(model):
    """A seeded sampled request's tokens come from noise keyed by (seed, position):
    the same text at K = 0, under drafts of any quality (one-hot or with q), in a
    batch with other requests, and resumed from its prompt plus a prefix of its
    output, as the gateway resumes a request whose replica died."""
    prompt, n = [3, 1, 4, 1, 5, 9, 2, 6], 40
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def engine(refs=None, error_rate=0.0, with_probs=False):
        proposer = ScriptedProposer(refs, error_rate, seed=5, with_probs=with_probs) if refs else None
        return Engine(model, EngineConfig(max_model_len=128, block_size=4, num_kv_blocks=256),
                      proposer)

    plain = run(engine(), [Request("s", prompt, n, params)])["s"]
    others = [Request("g", [7, 7, 7], n, GREEDY, num_speculative_tokens=2),
              Request("u", [8, 6, 4], n, SamplingParams(temperature=1.0), num_speculative_tokens=3)]
    for k, error_rate, with_probs in [(4, 0.0, False), (4, 0.5, False), (2, 1.0, False),
                                      (3, 0.3, True)]:
        refs = {0: prompt + plain, 1: [7, 7, 7] + [0] * n, 2: [8, 6, 4] + [0] * n}
        stats: dict = {}
        out = run(engine(refs, error_rate, with_probs),
                  [Request("s", prompt, n, params, num_speculative_tokens=k), *others], stats)
        assert out["s"] == plain, (k, error_rate, with_probs)
        assert stats["drafted"] > 0
        if error_rate < 1:
            assert stats["accepted"] > 0
    # Resumed after 17 tokens: the prompt grows by them, the position keys stay put.
    resumed = run(engine(), [Request("s", prompt + plain[:17], n - 17, params)])["s"]
    assert plain[:17] + resumed == plain
    # Another seed samples another text.
    other = run(engine(), [Request("s", prompt, n, SamplingParams(temperature=0.9, top_p=0.95,
                                                                 seed=1235))])["s"]
    assert other != plain


class OutcomeScript(ScriptedProposer):
    """Drafts that, step after step, are all right, absent, right only at the first
    position, and all wrong; records the K each step asked for."""

    PLAN = ("all", "nothing", "some", "none")

    def __init__(self, references):
        super().__init__(references, 0.0)
        self.asked: list[int] = []

    def propose(self, wanted, tokens):
        out = super().propose(wanted, tokens)
        for seq_id, k in wanted.items():
            self.asked.append(k)
            kind = self.PLAN[(len(self.asked) - 1) % len(self.PLAN)]
            right = out[seq_id].token_ids
            if kind == "nothing":
                del out[seq_id]
            elif kind == "none" or (kind == "some" and k > 1):
                keep = 1 if kind == "some" else 0
                # Not the target's token: one more than it, in the vocabulary.
                out[seq_id] = Proposal(right[:keep] + [(t + 1) % VOCAB for t in right[keep:]])
        return out


