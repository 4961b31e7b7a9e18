"""RemoteProposer (verifier/vllm/proposer.py) without vLLM: a stand-in model runner
builds it, as vLLM's does in its constructor, and fake drafter services answer its Draft
streams on loopback. Each request's method and K come from its extra_args, a request
with speculation off gets no drafts, drafts follow the rows of input_batch.req_ids, and
a slow, gone or broken drafter costs that step's drafts, never an exception."""

from __future__ import annotations

import sys
import time
from concurrent import futures
from types import ModuleType, SimpleNamespace

import grpc
import numpy as np
import pytest

from specdec.pb import common_pb2, drafter_pb2, drafter_pb2_grpc
from tests.verifier.test_speculation import MadeUpCost
from verifier.vllm.policy import RequestPolicy
from verifier.vllm.proposer import ProposerConfig, RemoteProposer

VOCAB = 1000
MAX_MODEL_LEN = 256
MAX_NUM_REQS = 8
MAX_K = 4  # the speculative config's num_speculative_tokens
DEFAULT_K = 3  # ProposerConfig.num_speculative_tokens: K of requests that name none


class GPUModelRunner:
    """Stands in for vllm.v1.worker.gpu_model_runner.GPUModelRunner."""


class Runner(GPUModelRunner):
    """What the proposer reads of vLLM's model runner: `requests[id].sampling_params`
    and `input_batch.req_ids`; it builds the proposer in its constructor, as vLLM's does."""

    def __init__(self, vllm_config):
        self.requests: dict[str, SimpleNamespace] = {}
        self.input_batch = SimpleNamespace(req_ids=[])
        self.drafter = RemoteProposer(vllm_config)


@pytest.fixture
def tp_rank(monkeypatch) -> list[int]:
    """vLLM's modules the proposer imports, as stubs; the list holds this process's
    tensor-parallel rank."""
    rank = [0]
    parallel_state = ModuleType("vllm.distributed.parallel_state")
    parallel_state.get_tensor_model_parallel_rank = lambda: rank[0]
    gpu_model_runner = ModuleType("vllm.v1.worker.gpu_model_runner")
    gpu_model_runner.GPUModelRunner = GPUModelRunner
    for name in ("vllm", "vllm.distributed", "vllm.v1", "vllm.v1.worker"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    monkeypatch.setitem(sys.modules, parallel_state.__name__, parallel_state)
    monkeypatch.setitem(sys.modules, gpu_model_runner.__name__, gpu_model_runner)
    return rank


class FakeDrafter(drafter_pb2_grpc.DrafterServicer):
    """Drafts last + offset + 1, ..., last + offset + K after each sequence's context
    (so a draft tells which context and which drafter it came from), answering each
    request after `delay_s`; `broken` ends its streams with an error."""

    def __init__(self, method: int, offset: int):
        self.method, self.offset = method, offset
        self.delay_s = 0.0
        self.broken = False
        self.contexts: dict[int, list[int]] = {}
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        drafter_pb2_grpc.add_DrafterServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Info(self, request, context):
        return drafter_pb2.InfoResponse(
            method=self.method, max_num_speculative_tokens=8,
            tokenizer=common_pb2.TokenizerFingerprint(vocab_size=VOCAB))

    def Draft(self, request_iterator, context):
        for req in request_iterator:
            if self.broken:
                context.abort(grpc.StatusCode.INTERNAL, "drafter bug")
            proposals = []
            for e in req.entries:
                kind = e.WhichOneof("kind")
                if kind == "free":
                    self.contexts.pop(e.seq_id, None)
                    continue
                if kind == "start":
                    self.contexts[e.seq_id] = [*e.start.prompt_token_ids,
                                               *e.start.output_token_ids]
                    k = e.start.num_speculative_tokens
                else:
                    self.contexts[e.seq_id] += e.advance.new_token_ids
                    k = e.advance.num_speculative_tokens
                last = self.contexts[e.seq_id][-1]
                if k:
                    proposals.append(drafter_pb2.DraftProposal(
                        seq_id=e.seq_id, round=e.round,
                        token_ids=[(last + self.offset + j) % VOCAB for j in range(1, k + 1)]))
            time.sleep(self.delay_s)
            yield drafter_pb2.DraftResponse(step=req.step, proposals=proposals)


def drafts_after(last: int, k: int, offset: int = 0) -> list[int]:
    return [(last + offset + j) % VOCAB for j in range(1, k + 1)]


@pytest.fixture
def drafters():
    ds = {"ngram": FakeDrafter(common_pb2.SPEC_METHOD_NGRAM, 0),
          "suffix": FakeDrafter(common_pb2.SPEC_METHOD_SUFFIX, 500)}
    yield ds
    for d in ds.values():
        d.server.stop(0)


class Engine:
    """vLLM's side of the steps: each request's tokens in the runner's rows, and the
    proposer called after every step as vLLM's runner calls it."""

    def __init__(self, drafters: dict[str, str], *, deadline_ms: float = 2000.0, **config):
        config = ProposerConfig(drafters=drafters, draft_deadline_ms=deadline_ms,
                                num_speculative_tokens=DEFAULT_K, **config)
        self.runner = Runner(SimpleNamespace(
            additional_config=config.to_additional_config(),
            speculative_config=SimpleNamespace(num_speculative_tokens=MAX_K),
            model_config=SimpleNamespace(
                max_model_len=MAX_MODEL_LEN, model="/nonexistent",
                hf_text_config=SimpleNamespace(vocab_size=VOCAB, hidden_size=16,
                                               num_hidden_layers=2))))
        self.proposer: RemoteProposer = self.runner.drafter
        self.proposer.load_model(None)  # vLLM's call once the target is loaded: connect
        for client in self.proposer.pool.clients.values():
            if client.address.endswith(":1"):
                continue  # nothing listens there
            assert client.wait_available(10), client.error
        self.tokens: dict[str, list[int]] = {}

    def add(self, req_id: str, prompt: list[int], **extra_args) -> None:
        self.runner.requests[req_id] = SimpleNamespace(
            sampling_params=SimpleNamespace(extra_args=extra_args))
        self.tokens[req_id] = list(prompt)

    def step(self, sampled: dict[str, list[int]]) -> list[list[int]]:
        """One step whose batch rows are `sampled`'s keys in order (each request's new
        tokens; [] for a partial prefill chunk); the proposer's drafts per row."""
        self.runner.input_batch.req_ids = list(sampled)
        num_tokens = np.zeros(MAX_NUM_REQS, dtype=np.int64)  # [max_num_reqs]
        token_ids = np.zeros((MAX_NUM_REQS, MAX_MODEL_LEN), dtype=np.int64)  # [max_num_reqs, max_model_len]
        for row, (req_id, new) in enumerate(sampled.items()):
            self.tokens[req_id] += new
            num_tokens[row] = len(self.tokens[req_id])
            token_ids[row, :num_tokens[row]] = self.tokens[req_id]
        return self.proposer.propose([list(t) for t in sampled.values()], num_tokens, token_ids)

    def finish(self, req_id: str) -> None:
        del self.runner.requests[req_id]

    def close(self) -> None:
        self.proposer.close()


@pytest.fixture
def engine(tp_rank, drafters):
    e = Engine({name: d.address for name, d in drafters.items()})
    yield e
    e.close()


def test_method_and_k_come_from_each_requests_extra_args(engine):
    engine.add("a", [1, 2], specdec_num_speculative_tokens=2)  # the first drafter's method
    engine.add("b", [3, 4])  # defaults: the first drafter, DEFAULT_K
    engine.add("c", [5, 6], specdec_method="suffix")
    engine.add("d", [7, 8], specdec_drafter="suffix", specdec_num_speculative_tokens=9)
    engine.add("off", [9, 10], specdec_method="none")
    engine.add("k0", [11, 12], specdec_num_speculative_tokens=0)
    engine.add("bad", [13, 14], specdec_method="nope")  # unknown: no drafts, no error
    new = {"a": [100], "b": [200], "c": [300], "d": [400], "off": [500], "k0": [600],
           "bad": [700]}
    assert engine.step(new) == [drafts_after(100, 2), drafts_after(200, DEFAULT_K),
                                drafts_after(300, DEFAULT_K, 500),
                                drafts_after(400, MAX_K, 500),  # K capped at the config's
                                [], [], []]
    # The next step: two drafts of "a" accepted plus its sampled token.
    new = {"a": [101, 102, 150], "b": [201], "c": [301], "d": [401], "off": [501],
           "k0": [601], "bad": [701]}
    assert engine.step(new) == [drafts_after(150, 2), drafts_after(201, DEFAULT_K),
                                drafts_after(301, DEFAULT_K, 500),
                                drafts_after(401, MAX_K, 500), [], [], []]


def test_drafts_follow_the_rows_of_input_batch(engine):
    # K per request, so that a draft tells whose policy it was made under too.
    engine.add("a", [1, 2], specdec_num_speculative_tokens=1)
    engine.add("b", [3, 4], specdec_num_speculative_tokens=2)
    engine.add("long", list(range(20, 40)), specdec_num_speculative_tokens=3)
    # "long"'s prompt is a partial prefill chunk: nothing sampled, nothing drafted.
    assert engine.step({"a": [10], "long": [], "b": [20]}) == [
        drafts_after(10, 1), [], drafts_after(20, 2)]
    # vLLM reorders its rows (condensing the batch after a request left, say).
    assert engine.step({"long": [77], "b": [21], "a": [11]}) == [
        drafts_after(77, 3), drafts_after(21, 2), drafts_after(11, 1)]
    engine.finish("a")
    assert engine.step({"b": [22], "long": [78]}) == [drafts_after(22, 2), drafts_after(78, 3)]


def test_policy_updates_set_k_by_the_requests_key(engine):
    engine.add("vllm-id-0", [1, 2],
               **RequestPolicy(num_speculative_tokens=2, request_id="r1").to_extra_args())
    assert engine.step({"vllm-id-0": [10]}) == [drafts_after(10, 2)]
    engine.proposer.set_num_speculative_tokens({"r1": 1})
    assert engine.step({"vllm-id-0": [11]}) == [drafts_after(11, 1)]
    engine.proposer.set_num_speculative_tokens({"r1": 0})  # speculation off mid-request
    assert engine.step({"vllm-id-0": [12]}) == [[]]


def test_a_slow_drafter_costs_the_step_its_drafts(tp_rank, drafters):
    engine = Engine({"ngram": drafters["ngram"].address}, deadline_ms=100)
    try:
        engine.add("a", [1, 2])
        drafters["ngram"].delay_s = 1.0
        t0 = time.monotonic()
        assert engine.step({"a": [10]}) == [[]]
        assert time.monotonic() - t0 < 0.9  # the deadline, not the drafter, ended the step
        drafters["ngram"].delay_s = 0.0
        # Steps go on without drafts until the late answer is in, then draft again.
        for last in range(11, 100):
            drafts = engine.step({"a": [last]})
            if drafts != [[]]:
                break
            time.sleep(0.05)
        assert drafts == [drafts_after(last, DEFAULT_K)]
    finally:
        engine.close()


def test_a_drafter_that_breaks_or_goes_away_costs_drafts_only(tp_rank, drafters):
    engine = Engine({"ngram": drafters["ngram"].address, "suffix": drafters["suffix"].address,
                     "draft_model": "127.0.0.1:1"})
    try:
        engine.add("a", [1, 2])
        engine.add("b", [3, 4], specdec_method="suffix")
        engine.add("c", [5, 6], specdec_method="draft_model")  # never reachable
        assert engine.step({"a": [10], "b": [20], "c": [30]}) == [
            drafts_after(10, DEFAULT_K), drafts_after(20, DEFAULT_K, 500), []]
        drafters["ngram"].broken = True
        drafters["suffix"].server.stop(0).wait()  # stop() only begins it
        assert engine.step({"a": [11], "b": [21], "c": [31]}) == [[], [], []]
        assert engine.step({"a": [12], "b": [22], "c": [32]}) == [[], [], []]
    finally:
        engine.close()


def test_a_failure_inside_the_proposer_costs_the_step_its_drafts(engine, monkeypatch):
    engine.add("a", [1, 2])
    assert engine.step({"a": [10]}) == [drafts_after(10, DEFAULT_K)]

    def broken(wanted, tokens):
        raise RuntimeError("bug")

    monkeypatch.setattr(engine.proposer.pool, "propose", broken)
    assert engine.step({"a": [11]}) == [[]]
    monkeypatch.undo()
    assert engine.step({"a": [12]}) == [drafts_after(12, DEFAULT_K)]


def test_only_the_first_tensor_parallel_rank_drafts(tp_rank, drafters):
    tp_rank[0] = 1
    engine = Engine({"ngram": drafters["ngram"].address})
    try:
        assert engine.proposer.pool.clients == {}  # no streams on this rank
        engine.add("a", [1, 2])
        assert engine.step({"a": [10]}) == [[]]
        assert engine.proposer.drafters() == []
    finally:
        engine.close()


def test_it_must_be_built_by_vllms_model_runner(tp_rank):
    config = ProposerConfig(drafters={})
    with pytest.raises(RuntimeError, match="must be built by vLLM's model runner"):
        RemoteProposer(SimpleNamespace(additional_config=config.to_additional_config()))


def test_drafter_states_for_the_load_report(engine, drafters):
    states = {d["name"]: d for d in engine.proposer.drafters()}
    ngram = states["ngram"]
    assert ngram == {"name": "ngram", "method": common_pb2.SPEC_METHOD_NGRAM,
                     "available": True, "max_num_speculative_tokens": MAX_K,
                     "bet_lookups": ngram["bet_lookups"], "bet_hits": ngram["bet_hits"]}
    assert 0 <= ngram["bet_hits"] <= ngram["bet_lookups"]
    assert states["suffix"]["method"] == common_pb2.SPEC_METHOD_SUFFIX


def test_the_controller_chooses_k_of_requests_that_name_none(tp_rank, drafters):
    """speculation_controller: a request naming no K is dynamic. Its drafts never land
    (each step accepts none), so it ends up asking its drafter for nothing, while the
    request with a fixed K keeps its drafts every step; one whose drafts land keeps
    drafting."""
    engine = Engine({name: d.address for name, d in drafters.items()},
                    speculation_controller=True)
    try:
        engine.proposer.controller.cost = MadeUpCost(engine.proposer.controller.config.cost_weight)
        engine.add("auto", [1, 2])
        engine.add("fixed", [3, 4], specdec_num_speculative_tokens=2)
        # Of another method: acceptance is learnt per method too.
        engine.add("lands", [5, 6], specdec_method="suffix", specdec_auto_k=True)
        engine.add("bad", [7, 8], specdec_auto_k="yes")  # not a bool: no drafts, no error
        new = {"auto": [100], "fixed": [200], "lands": [300], "bad": [400]}
        history = []
        for _ in range(40):
            drafts = engine.step(new)
            history.append(drafts)
            # "auto" and "fixed" reject every draft; "lands" accepts all of its drafts.
            new = {"auto": [new["auto"][-1] + 50], "fixed": [new["fixed"][-1] + 50],
                   "lands": [*drafts[2], drafts[2][-1] + 50 if drafts[2] else
                             new["lands"][-1] + 50], "bad": [new["bad"][-1] + 50]}
        assert all(not h[0] for h in history[-10:]) and any(h[0] for h in history)
        assert all(len(h[1]) == 2 for h in history)
        assert sum(len(h[2]) for h in history[-10:]) >= 10
        assert all(not h[3] for h in history)
        assert engine.proposer.controller.cost.ms  # it priced the steps it saw
    finally:
        engine.close()


def test_no_drafts_while_the_runner_holds_more_than_the_queue_size(tp_rank, drafters):
    engine = Engine({"ngram": drafters["ngram"].address}, disable_queue_size=1)
    try:
        engine.add("a", [1, 2])
        engine.add("b", [3, 4], specdec_num_speculative_tokens=2)
        assert engine.step({"a": [10], "b": [20]}) == [[], []]
        assert engine.step({"a": [11], "b": [21]}) == [[], []]
        engine.finish("b")
        assert engine.step({"a": [12]}) == [drafts_after(12, DEFAULT_K)]
    finally:
        engine.close()


class BettingDrafter(FakeDrafter):
    """FakeDrafter placing one bet on each proposal: every draft accepted and the next
    token in its run, followed by BET (told apart from any answer's drafts)."""

    BET = [7, 7, 7]

    def Draft(self, request_iterator, context):
        for answer in super().Draft(request_iterator, context):
            answer.bets_follow = bool(answer.proposals)
            yield answer
            if answer.bets_follow:
                yield drafter_pb2.DraftResponse(step=answer.step, followup=True, bets=[
                    drafter_pb2.DraftBet(seq_id=p.seq_id, round=p.round + 1,
                                         new_token_ids=[*p.token_ids, (p.token_ids[-1] + 1) % VOCAB],
                                         token_ids=self.BET)
                    for p in answer.proposals])


def test_vllms_steps_take_the_drafters_bets(tp_rank):
    """RemoteProposer shares the engine's drafter clients, bets included: the step after
    the outcome bet on gets the bet's drafts; another outcome gets the drafter's answer."""
    drafter = BettingDrafter(common_pb2.SPEC_METHOD_NGRAM, 0)
    engine = Engine({"ngram": drafter.address})
    try:
        engine.add("a", [1, 2], specdec_num_speculative_tokens=2)
        assert engine.step({"a": [10]}) == [drafts_after(10, 2)]  # 11 12
        assert engine.step({"a": [11, 12, 13]}) == [BettingDrafter.BET[:2]]
        # The bet's drafts 7 7: the first rejected, 50 instead. No bet named it.
        assert engine.step({"a": [50]}) == [drafts_after(50, 2)]
        (client,) = engine.proposer.pool.clients.values()
        assert (client.bet_lookups, client.bet_hits) == (2, 1)
    finally:
        engine.close()
        drafter.server.stop(0)


def test_log_steps_writes_a_line_a_step_that_the_benchmark_reads(tp_rank, drafters, capfd):
    from bench.serving import _PROPOSE

    engine = Engine({"ngram": drafters["ngram"].address}, log_steps=True)
    try:
        engine.add("a", [1, 2], specdec_num_speculative_tokens=2)
        engine.add("b", [3, 4], specdec_num_speculative_tokens=3)
        engine.step({"a": [10], "b": [20]})
        engine.step({"a": [11], "b": [21]})
    finally:
        engine.close()
    lines = [m.groups() for m in _PROPOSE.finditer(capfd.readouterr().err)]
    assert [(rows, drafts) for rows, drafts, _, _ in lines] == [("2", "5"), ("2", "5")]
    # The wait on the drafters is part of the propose call's time.
    assert all(0 < float(wait) <= float(took) for _, _, took, wait in lines)
