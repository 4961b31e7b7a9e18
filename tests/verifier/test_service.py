"""The Verifier gRPC service with real drafter services on loopback: output
equals plain greedy decoding whatever the drafters do (exact, correct,
random, slow, down, dying), bad input fails only its own stream, cancel
frees everything, and the CLI serves and shuts down cleanly."""

from __future__ import annotations

import copy
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter.method import Draft, DrafterInfo, DraftMethod
from drafter.service import serve as serve_drafter
from specdec.generate import greedy_generate
from specdec.models import LlamaForCausalLM
from specdec.pb import common_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.server import DRAFT_PART_BYTES, MAX_MESSAGE_BYTES, generate_message_bytes
from tests.loop_thread import LoopThread
from tests.ports import free_port
from tests.tiny import tiny_llama
from verifier.drafter_client import DrafterClient, TargetInfo
from verifier.drafting import DrafterPool
from verifier.engine import Engine, EngineConfig
from verifier.service import VerifierServicer, serve

VOCAB = 97
K_MAX = 8
MAX_LEN = 512
GREEDY = common_pb2.SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_target()


def tiny_target() -> LlamaForCausalLM:
    """A float64 random Llama: verify and decode agree exactly, so outputs compare with ==."""
    return tiny_llama(VOCAB, seed=1, max_len=MAX_LEN)


class ContextMethod(DraftMethod):
    """Test drafter: mirrors each sequence's context; subclasses draft from it."""

    name = "test"

    def __init__(self, delay_s: float = 0.0):
        self.ctx: dict = {}
        self.starts: list[tuple[object, int]] = []  # (key, len(output_ids)) per Start
        self.freed: list = []
        self.delay_s = delay_s

    def info(self) -> DrafterInfo:
        return DrafterInfo(method=common_pb2.SPEC_METHOD_NGRAM, vocab_size=VOCAB,
                           max_num_speculative_tokens=K_MAX)

    def start(self, key, prompt_ids, output_ids, sampling, max_num_speculative_tokens):
        self.ctx[key] = list(prompt_ids) + list(output_ids)
        self.starts.append((key, len(output_ids)))

    def advance(self, key, num_drafted, num_accepted, new_token_ids, num_rollback_tokens,
                hidden_states, hidden_start_position):
        ctx = self.ctx[key]
        del ctx[len(ctx) - num_rollback_tokens:]
        ctx.extend(new_token_ids)

    def propose(self, wanted):
        time.sleep(self.delay_s)
        return {key: Draft(self.draft(self.ctx[key], k)) for key, k in wanted.items() if key in self.ctx}

    def draft(self, ctx: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def free(self, key):
        if self.ctx.pop(key, None) is not None:
            self.freed.append(key)

    def has(self, key):
        return key in self.ctx


class OracleMethod(ContextMethod):
    """Drafts the target's own greedy continuation (every draft accepted)."""

    def __init__(self, model, **kw):
        super().__init__(**kw)
        self.model = model

    def draft(self, ctx, k):
        return greedy_generate(self.model, [ctx], k)[0]


class BettingOracle(OracleMethod):
    """The oracle, placing bets (DraftMethod.propose_after): every outcome it bets on is
    the one that comes. Sleeps delay_s before each proposal it drafts, and before each
    bet, so steps answered by neither wait; counts the proposals it drafted."""

    def __init__(self, model, **kw):
        super().__init__(model, **kw)
        self.drafted = 0  # propose calls that drafted for some sequence

    def propose(self, wanted):
        if not wanted:  # every sequence asked was answered by a bet the service kept
            return {}
        self.drafted += 1
        return super().propose(wanted)

    def propose_after(self, key, extra, k):
        time.sleep(self.delay_s)
        return self.draft(self.ctx[key] + list(extra), k)


class RandomMethod(ContextMethod):
    def __init__(self, seed: int = 0, **kw):
        super().__init__(**kw)
        self.rng = random.Random(seed)

    def draft(self, ctx, k):
        return [self.rng.randrange(VOCAB) for _ in range(k)]


class Stack:
    """A verifier and its drafters, in-process on loopback."""

    def __init__(self, loop: LoopThread, model: LlamaForCausalLM, drafters: dict[str, DraftMethod],
                 down: tuple[str, ...] = (), deadline_ms: float = 2000.0,
                 part_bytes: int = DRAFT_PART_BYTES):
        """part_bytes: the drafter streams' largest message, both ways."""
        self.loop = loop
        self.model = model
        self.methods = drafters
        self.drafter_services = {name: loop.run(serve_drafter(m, "127.0.0.1:0",
                                                              part_bytes=part_bytes))
                                 for name, m in drafters.items()}
        ports = {name: s.port for name, s in self.drafter_services.items()}
        ports.update({name: free_port() for name in down})
        cfg = model.config
        self.target = TargetInfo(VOCAB, "", cfg.hidden_size, cfg.num_layers)
        clients = [DrafterClient(name, f"127.0.0.1:{port}", self.target, backoff_s=(0.05, 0.2),
                                 part_bytes=part_bytes)
                   for name, port in ports.items()]
        self.pool = DrafterPool(clients, K_MAX, deadline_ms)
        engine = Engine(model, EngineConfig(max_num_seqs=16, max_model_len=MAX_LEN, block_size=16,
                                            num_kv_blocks=600, max_num_speculative_tokens=K_MAX),
                        self.pool)
        self.servicer = VerifierServicer(
            engine, self.pool, self.target, model_name="tiny", default_num_speculative_tokens=4
        )
        self.service = loop.run(serve(self.servicer, "127.0.0.1:0"))
        for name in drafters:
            assert self.pool.clients[name].wait_available(10), self.pool.clients[name].error
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.service.port}")
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.loop.run(self.service.stop(2.0))
        for s in self.drafter_services.values():
            self.loop.run(s.stop(0.5))

    def load(self) -> verifier_pb2.LoadReport:
        return self.stub.Load(verifier_pb2.LoadRequest(), timeout=5)


def start_msg(prompt, max_tokens, *, k=0, drafter="", method=common_pb2.SPEC_METHOD_UNSPECIFIED,
              sampling=None, request_id="") -> verifier_pb2.GenerateRequest:
    s = common_pb2.SamplingParams()
    s.CopyFrom(sampling or GREEDY)
    s.max_tokens = max_tokens
    return verifier_pb2.GenerateRequest(start=verifier_pb2.GenerateRequest.Start(
        request_id=request_id, prompt_token_ids=prompt, sampling=s,
        speculation=common_pb2.SpeculationPolicy(method=method, drafter=drafter,
                                                 num_speculative_tokens=k)))


def generate(stub, msg, timeout=60) -> tuple[list[int], list[verifier_pb2.GenerateResponse]]:
    responses = list(stub.Generate(iter([msg]), timeout=timeout))
    return [t for r in responses for t in r.token_ids], responses


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 25))] for _ in range(n)]


def run_concurrently(fn, args_list):
    results: list = [None] * len(args_list)
    errors: list = []

    def work(i, args):
        try:
            results[i] = fn(*args)
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i, a)) for i, a in enumerate(args_list)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("drafter", ["none", "oracle", "random"])
@pytest.mark.parametrize("batch", [1, 8])
def test_output_equals_plain_greedy(loop, model, drafter, batch):
    stack = Stack(loop, model, {"oracle": OracleMethod(model), "random": RandomMethod()})
    try:
        ps = prompts(batch, seed=batch)
        expected = greedy_generate(model, ps, 40)
        method = common_pb2.SPEC_METHOD_NONE if drafter == "none" else common_pb2.SPEC_METHOD_UNSPECIFIED
        name = "" if drafter == "none" else drafter
        msgs = [start_msg(p, 40, k=1 + i % K_MAX, drafter=name, method=method) for i, p in enumerate(ps)]
        results = run_concurrently(lambda m: generate(stack.stub, m), [(m,) for m in msgs])
        for (tokens, responses), want in zip(results, expected, strict=True):
            assert tokens == want
            last = responses[-1]
            assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert last.usage.completion_tokens == 40
            spec = last.spec_decode
            if drafter == "none":
                assert spec.num_drafts == 0
                assert spec.disabled_reason == common_pb2.DISABLED_REASON_REQUEST
            else:
                assert spec.num_draft_tokens > 0
                assert spec.disabled_reason == common_pb2.DISABLED_REASON_NONE
            if drafter == "oracle":  # every draft is the target's own choice
                assert spec.num_accepted_tokens == spec.num_draft_tokens
                assert len(responses) < 40
            # A step feeds at least each of its sequences' last token and this one's drafts.
            for r in responses:
                st = r.step_stats
                assert st.num_tokens >= st.batch_size + st.num_drafted > 0
            if batch == 1:  # after the prefill, the whole step is this block
                assert all(r.step_stats.num_tokens == 1 + r.step_stats.num_drafted
                           for r in responses[1:])
        assert stack.load().num_running == 0
    finally:
        stack.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("drafter", ["oracle", "random"])
def test_output_equals_plain_greedy_on_cuda(loop, model, drafter):
    """The service with its engine on a GPU: graphs captured on the engine's
    worker thread, a K per request (ragged steps), the Triton sampler's path."""
    stack = Stack(loop, copy.deepcopy(model).to("cuda"),
                  {"oracle": OracleMethod(model), "random": RandomMethod()})
    try:
        ps = prompts(8, seed=3)
        msgs = [start_msg(p, 40, k=1 + i % K_MAX, drafter=drafter) for i, p in enumerate(ps)]
        results = run_concurrently(lambda m: generate(stack.stub, m), [(m,) for m in msgs])
        assert [tokens for tokens, _ in results] == greedy_generate(model, ps, 40)
        graphs = stack.servicer.engine.runner.graphs
        assert graphs is not None and graphs.num_runs > 10
        assert stack.load().num_running == 0
    finally:
        stack.close()


def test_load_reports_the_drafters_own_share_of_the_draft_wait(loop, model):
    """engine_times.drafter_ms: what the drafter says it spent answering, within the
    engine's draft wait (the rest of which is the round trip)."""
    stack = Stack(loop, model, {"oracle": OracleMethod(model, delay_s=0.02)})
    try:
        p = prompts(1, seed=4)[0]
        before = stack.load().engine_times
        tokens, responses = generate(stack.stub, start_msg(p, 16, k=2, drafter="oracle"))
        assert tokens == greedy_generate(model, [p], 16)[0]
        times = stack.load().engine_times
        drafting = sum(1 for r in responses if r.step_stats.num_speculative_tokens)
        drafter_ms = times.drafter_ms - before.drafter_ms
        assert drafting >= 3
        # Each drafting step the drafter slept 20 ms before answering, and the
        # engine waited for all of it and for the round trip around it.
        assert drafter_ms >= 20 * drafting
        assert drafter_ms < times.draft_wait_ms - before.draft_wait_ms
    finally:
        stack.close()


def test_slow_drafter_hits_the_deadline_without_changing_output(loop, model):
    slow = OracleMethod(model, delay_s=0.15)
    stack = Stack(loop, model, {"slow": slow}, deadline_ms=20)
    try:
        p = prompts(1, seed=5)[0]
        tokens, responses = generate(stack.stub, start_msg(p, 30, k=4, drafter="slow"))
        assert tokens == greedy_generate(model, [p], 30)[0]
        reasons = {r.step_stats.disabled_reason for r in responses}
        assert common_pb2.DISABLED_REASON_DEADLINE in reasons
        # The verifier never waited for the drafter much past the deadline.
        assert max(r.step_stats.draft_wait_ms for r in responses) < 150
    finally:
        stack.close()


class SilentMethod(ContextMethod):
    """Answers every step in time, with nothing to propose."""

    def propose(self, wanted):
        return {}


def test_a_drafter_with_nothing_to_propose_is_not_late(loop, model):
    stack = Stack(loop, model, {"silent": SilentMethod()}, deadline_ms=2000)
    try:
        p = prompts(1, seed=7)[0]
        tokens, responses = generate(stack.stub, start_msg(p, 12, k=4, drafter="silent"))
        assert tokens == greedy_generate(model, [p], 12)[0]
        assert all(r.step_stats.num_drafted == 0 for r in responses)
        assert {r.step_stats.disabled_reason for r in responses} == {
            common_pb2.DISABLED_REASON_NONE}
    finally:
        stack.close()


def test_unreachable_drafter_runs_plain(loop, model):
    stack = Stack(loop, model, {}, down=("ngram",))
    try:
        p = prompts(1, seed=6)[0]
        tokens, responses = generate(stack.stub, start_msg(p, 20, k=3, drafter="ngram"))
        assert tokens == greedy_generate(model, [p], 20)[0]
        assert responses[-1].spec_decode.num_drafts == 0
        assert responses[-1].spec_decode.disabled_reason == common_pb2.DISABLED_REASON_DRAFTER_UNAVAILABLE
        (report,) = stack.load().drafters
        assert report.name == "ngram" and not report.available
    finally:
        stack.close()


@pytest.mark.parametrize("betting", [False, True])
def test_drafter_dies_mid_request_and_is_restarted(loop, model, betting):
    # Drafts with a delay pace the verifier at about one step per 10 ms while the
    # drafter is up, so the request outlives its restart. The betting drafter's bets are
    # all on the outcome that comes.
    method = (BettingOracle(model, delay_s=0.01) if betting
              else RandomMethod(seed=3, delay_s=0.01))
    stack = Stack(loop, model, {"rnd": method})
    try:
        p = prompts(1, seed=7)[0]
        port = stack.drafter_services["rnd"].port
        stream = stack.stub.Generate(iter([start_msg(p, 400, k=2, drafter="rnd")]), timeout=120)
        tokens, after_restart = [], []
        restarted = False
        for r in stream:
            tokens += r.token_ids
            if not restarted and len(tokens) >= 30:
                loop.run(stack.drafter_services["rnd"].stop(0))  # abrupt: streams cancelled
                stack.drafter_services["rnd"] = loop.run(serve_drafter(method, f"127.0.0.1:{port}"))
                restarted = True
            elif restarted:
                after_restart.append(r)
        assert tokens == greedy_generate(model, [p], 400)[0]
        # The client re-started the live sequence on the new stream with the
        # tokens generated so far, and drafting resumed.
        assert any(n_out > 0 for _, n_out in method.starts)
        assert any(r.step_stats.num_drafted > 0 for r in after_restart[len(after_restart) // 2:])
    finally:
        stack.close()


BAD = {
    "token id >= vocab": (dict(prompt=[1, VOCAB]), "prompt_token_ids"),
    "empty prompt": (dict(prompt=[]), "prompt_token_ids"),
    "too long": (dict(max_tokens=MAX_LEN), "max_tokens"),
    "K over K_max": (dict(k=K_MAX + 1), "num_speculative_tokens"),
    "negative temperature": (dict(sampling=common_pb2.SamplingParams(temperature=-1.0)), "temperature"),
    "top_p zero": (dict(sampling=common_pb2.SamplingParams(temperature=1.0, top_p=0.0)), "top_p"),
    "top_p over 1": (dict(sampling=common_pb2.SamplingParams(temperature=1.0, top_p=1.5)), "top_p"),
    "unknown drafter": (dict(drafter="nope"), "drafter"),
}


def test_bets_answer_steps_without_waiting_for_the_drafter(loop, model):
    """A drafter that bets on every outcome right: after its first proposal every step
    takes its drafts from a bet, so the drafter never drafts again (its answers to those
    steps are the bets' drafts, kept by the service). Greedy output is plain greedy's; a
    seeded sampled request's is the same as without speculation."""
    method = BettingOracle(model)
    stack = Stack(loop, model, {"oracle": method})
    try:
        p = prompts(1, seed=11)[0]
        tokens, responses = generate(stack.stub, start_msg(p, 40, k=3, drafter="oracle"))
        assert tokens == greedy_generate(model, [p], 40)[0]
        drafting = sum(1 for r in responses if r.step_stats.num_drafted)
        (drafter,) = stack.load().drafters
        assert drafting >= 8 and method.drafted == 1
        assert drafter.bet_hits == drafter.bet_lookups == drafting - 1

        sampled = common_pb2.SamplingParams(temperature=1.0, top_p=0.9, seed=5)
        plain, _ = generate(stack.stub, start_msg(p, 40, sampling=sampled,
                                                   method=common_pb2.SPEC_METHOD_NONE))
        tokens, responses = generate(stack.stub, start_msg(p, 40, k=3, drafter="oracle",
                                                            sampling=sampled))
        assert tokens == plain
        (after,) = stack.load().drafters
        # Bets were looked up for it (one-hot drafts serve any sampling); the random
        # model's flat distributions seldom take all three greedy drafts, which is the
        # only outcome bet on.
        assert after.bet_lookups > drafter.bet_lookups
    finally:
        stack.close()


def test_bad_input_is_invalid_argument_and_others_go_on(loop, model):
    stack = Stack(loop, model, {"oracle": OracleMethod(model, delay_s=0.005)})
    try:
        p = prompts(1, seed=8)[0]
        long_run = stack.stub.Generate(iter([start_msg(p, 200, k=3, drafter="oracle")]), timeout=60)
        first = next(long_run)
        for name, (kw, field) in BAD.items():
            args = dict(prompt=[1, 2, 3], max_tokens=5)
            args.update(kw)
            with pytest.raises(grpc.RpcError) as err:
                generate(stack.stub, start_msg(args.pop("prompt"), args.pop("max_tokens"), **args))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
            assert field in err.value.details(), (name, err.value.details())
        tokens = list(first.token_ids) + [t for r in long_run for t in r.token_ids]
        assert tokens == greedy_generate(model, [p], 200)[0]
    finally:
        stack.close()


def test_cancel_frees_the_sequence_and_tells_the_drafter(loop, model):
    method = OracleMethod(model, delay_s=0.01)
    stack = Stack(loop, model, {"oracle": method})
    try:
        p = prompts(1, seed=9)[0]
        requests: queue.SimpleQueue = queue.SimpleQueue()
        requests.put(start_msg(p, 400, k=1, drafter="oracle"))
        stream = stack.stub.Generate(iter(requests.get, None), timeout=60)
        responses = [next(stream) for _ in range(3)]
        assert stack.load().num_running == 1
        requests.put(verifier_pb2.GenerateRequest(cancel=verifier_pb2.GenerateRequest.Cancel()))
        responses += list(stream)
        requests.put(None)
        assert responses[-1].finish_reason == common_pb2.FINISH_REASON_CANCELLED
        assert sum(len(r.token_ids) for r in responses) < 400
        report = stack.load()
        assert report.num_running == 0 and report.num_free_kv_tokens == report.num_total_kv_tokens
        _wait_for(lambda: len(method.freed) == 1 and not method.ctx)

        # A client that just goes away is cancelled the same way.
        stream = stack.stub.Generate(iter([start_msg(p, 400, k=1, drafter="oracle")]), timeout=60)
        next(stream)
        stream.cancel()
        _wait_for(lambda: stack.load().num_running == 0 and len(method.freed) == 2)
    finally:
        stack.close()


class StatesMethod(OracleMethod):
    """Drafts as OracleMethod, and needs the target's hidden states of layer 1 as an EAGLE
    head does: the drafter service refuses an Advance bringing tokens without them."""

    def info(self) -> DrafterInfo:
        return DrafterInfo(method=common_pb2.SPEC_METHOD_EAGLE3, vocab_size=VOCAB,
                           max_num_speculative_tokens=K_MAX, needs_hidden_states=True,
                           hidden_state_layers=[1], hidden_size=self.model.config.hidden_size)


def test_a_sequence_freed_after_k0_steps_leaves_a_hidden_state_drafters_stream_up(loop, model):
    # A request whose speculation is turned off is freed with its K = 0 outcomes held,
    # unsent. The drafter must not be sent their tokens without their states: that ended
    # the stream, and every live sequence (here the long request) started over on a new
    # one, its context lost.
    method = StatesMethod(model)
    stack = Stack(loop, model, {"states": method})
    try:
        short, long_ = prompts(2, seed=21)

        def off_after_one(p, max_tokens):
            requests: queue.SimpleQueue = queue.SimpleQueue()
            requests.put(start_msg(p, max_tokens, k=2, drafter="states"))
            responses = []
            for r in stack.stub.Generate(iter(requests.get, None), timeout=60):
                if not responses:
                    requests.put(verifier_pb2.GenerateRequest(
                        policy_update=verifier_pb2.GenerateRequest.PolicyUpdate(enabled=False)))
                responses.append(r)
            requests.put(None)
            return [t for r in responses for t in r.token_ids], responses

        def drafting(p, max_tokens):
            return generate(stack.stub, start_msg(p, max_tokens, k=2, drafter="states"))

        (got_short, rs), (got_long, rl) = run_concurrently(
            lambda f, p, n: f(p, n), [(off_after_one, short, 12), (drafting, long_, 150)])
        assert got_short == greedy_generate(model, [short], 12)[0]
        assert got_long == greedy_generate(model, [long_], 150)[0]
        # The short one ended after K = 0 steps while the long one was still running.
        assert sum(r.step_stats.num_speculative_tokens == 0 for r in rs) >= 5
        assert rs[-1].step_stats.step < rl[-1].step_stats.step
        assert [n for _, n in method.starts] == [0, 0]  # each started once, never again
        assert all(r.step_stats.num_drafted for r in rl[1:-1])
    finally:
        stack.close()


def test_logprobs_are_the_raw_target_log_softmax(loop, model):
    stack = Stack(loop, model, {"oracle": OracleMethod(model)})
    try:
        p = prompts(1, seed=10)[0]
        s = common_pb2.SamplingParams(temperature=0.0, logprobs=3)
        tokens, responses = generate(stack.stub, start_msg(p, 6, k=2, drafter="oracle", sampling=s))
        lps = [lp for r in responses for lp in r.logprobs]
        assert [lp.token_id for lp in lps] == tokens
        ctx = list(p)
        for tok, lp in zip(tokens, lps, strict=True):
            meta_cache = model.make_kv_cache(64, 16)
            meta_cache.add(0)
            meta = meta_cache.plan([(0, len(ctx))])
            logits = model(torch.tensor(ctx), meta, meta_cache).logits[0]
            ref = torch.log_softmax(logits.float(), -1)
            assert lp.logprob == pytest.approx(ref[tok].item(), abs=1e-5)
            assert lp.rank == 1  # greedy picks the top token
            assert [t.token_id for t in lp.top_logprobs] == ref.topk(3).indices.tolist()
            ctx.append(tok)
    finally:
        stack.close()


def _wait_for(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    assert cond()


@pytest.mark.model
def test_cli_serves_health_and_generate_then_stops_on_sigterm(smollm2_dir):
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "verifier", "--model", str(smollm2_dir), "--port", str(port),
         "--max-num-seqs", "4", "--max-model-len", "256", "--threads", "1",
         "--drafter", f"ngram=127.0.0.1:{free_port()}"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 120
        while True:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service="specdec.v1.Verifier"),
                                      timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.RpcError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.2)
        stub = verifier_pb2_grpc.VerifierStub(channel)
        from specdec.models import load_model
        from specdec.tokenizer import Tokenizer
        tok = Tokenizer.from_dir(smollm2_dir)
        prompt = tok.apply_chat_template([{"role": "user", "content": "Name a colour."}])
        tokens, responses = generate(stub, start_msg(prompt, 12, method=common_pb2.SPEC_METHOD_NONE))
        ref = greedy_generate(load_model(smollm2_dir), [prompt], 12, tok.eos_token_ids)[0]
        assert tokens == ref
        report = stub.Load(verifier_pb2.LoadRequest(), timeout=5)
        assert report.tokenizer.vocab_size == tok.vocab_size and report.tokenizer.hash
        assert [d.name for d in report.drafters] == ["ngram"]
        # Its engine's accounting: the prefill step and one step per further token.
        times = report.engine_times
        assert (times.steps, times.tokens) == (len(tokens), len(tokens))
        # Rows: the prompt's (one chunk at this length), then one per plain step.
        assert times.rows == len(prompt) + len(tokens) - 1
        assert times.forward_ms > 0 and times.deliver_ms > 0
        channel.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_speculation_off_and_on_mid_request_keeps_the_drafter_in_sync(loop, model):
    """K=0 steps still advance the drafter: after speculation is switched back on,
    a stateful drafter (the target as its own draft model, KV cache and all)
    proposes for the right context, so every draft is accepted again."""
    from drafter.draft_model import DraftModelMethod

    method = DraftModelMethod(model=model, pipeline=False)
    stack = Stack(loop, model, {"self": method})
    try:
        p = prompts(1, seed=12)[0]
        requests: queue.SimpleQueue = queue.SimpleQueue()
        requests.put(start_msg(p, 300, k=3, drafter="self"))
        stream = stack.stub.Generate(iter(requests.get, None), timeout=60)
        update = verifier_pb2.GenerateRequest.PolicyUpdate
        phases: dict[str, list] = {"on": [], "off": [], "again": []}
        phase, tokens = "on", []
        for r in stream:
            tokens += r.token_ids
            phases[phase].append(r)
            if phase == "on" and len(tokens) >= 20:
                requests.put(verifier_pb2.GenerateRequest(policy_update=update(enabled=False)))
                phase = "off"
            elif phase == "off" and sum(len(x.token_ids) for x in phases["off"]) >= 40:
                requests.put(verifier_pb2.GenerateRequest(policy_update=update(enabled=True)))
                phase = "again"
        requests.put(None)
        assert tokens == greedy_generate(model, [p], 300)[0]
        plain = [r for r in phases["off"] + phases["again"] if r.step_stats.num_speculative_tokens == 0
                 and r.step_stats.disabled_reason == common_pb2.DISABLED_REASON_REQUEST]
        assert len(plain) >= 20  # speculation really was off for a stretch
        drafted = [r for r in phases["again"] if r.step_stats.num_drafted]
        assert len(drafted) >= 10
        assert all(r.step_stats.num_accepted == r.step_stats.num_drafted for r in drafted)
        assert phases["again"][-1].spec_decode.disabled_reason == common_pb2.DISABLED_REASON_NONE
    finally:
        stack.close()




def test_a_generate_request_past_the_message_limit_is_refused_before_it_is_read(loop, model):
    """The verifier takes Generate messages of what a request can need (a prompt of
    max_model_len ids, vocabulary-long lists, 16 MiB of text), not what its clients
    take from it: a larger one ends its own call with RESOURCE_EXHAUSTED, and the next
    request is served."""
    stack = Stack(loop, model, {})
    try:
        limit = generate_message_bytes(MAX_LEN, VOCAB)
        assert limit < MAX_MESSAGE_BYTES
        with pytest.raises(grpc.RpcError) as err:
            generate(stack.stub, start_msg([1, 2, 3], 5, request_id="x" * (limit + 1)))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        p = prompts(1, seed=3)[0]
        tokens, _ = generate(stack.stub, start_msg(p, 8, method=common_pb2.SPEC_METHOD_NONE))
        assert tokens == greedy_generate(model, [p], 8)[0]
    finally:
        stack.close()
