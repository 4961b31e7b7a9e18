"""The whole stack as `make run` starts it (compose.yaml's local services as real
processes on loopback, on free ports: tests/local_stack.py): chat completions with
each drafter, streaming and concurrent; a drafter killed mid-request; the gateway
killed and restarted; 64 concurrent streams that leave nothing allocated behind."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import grpc
import openai
import pytest

from specdec.client import Client
from specdec.pb import verifier_pb2, verifier_pb2_grpc
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.model]

COPY_PROMPT = ("Repeat this list exactly, one item per line: apples, pears, plums, cherries, "
               "peaches, grapes, lemons, limes, melons, figs.")


def _wait(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _chat(client: openai.OpenAI, content: str, method: str, max_tokens: int = 48, **kw):
    return client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": content}], temperature=0,
        max_tokens=max_tokens, extra_body={"speculative": {"method": method}, **kw})


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_chat_with_each_drafter_streaming_and_concurrent(local_stack):
    client = openai.OpenAI(base_url=local_stack.base_url, api_key="x", max_retries=0)
    plain = _chat(client, COPY_PROMPT, "none")
    assert plain.usage.completion_tokens > 10
    for method in ("ngram", "eagle3"):
        out = _chat(client, COPY_PROMPT, method)
        assert out.choices[0].message.content == plain.choices[0].message.content, method
        assert out.model_extra["spec_decode"]["num_drafts"] > 0
    # make run's suffix drafter serves too (its drafting is the controller's choice).
    assert _chat(client, COPY_PROMPT, "suffix").choices[0].message.content == \
        plain.choices[0].message.content
    ngram = _chat(client, COPY_PROMPT, "ngram").model_extra["spec_decode"]
    assert ngram["acceptance_length"] > 1.5  # the reply copies the prompt

    chunks = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": COPY_PROMPT}], temperature=0,
        max_tokens=48, stream=True, extra_body={"speculative": {"method": "ngram"}})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        plain.choices[0].message.content

    prompts = [f"Write one sentence about the number {i}." for i in range(6)]
    alone = [_chat(client, p, "none", 24).choices[0].message.content for p in prompts]

    async def together():
        aclient = openai.AsyncOpenAI(base_url=local_stack.base_url, api_key="x",
                                     max_retries=0)
        outs = await asyncio.gather(*(aclient.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": p}], temperature=0,
            max_tokens=24, extra_body={"speculative": {"method": m}})
            for p, m in zip(prompts, ["ngram", "eagle3", "none"] * 2, strict=True)))
        return [o.choices[0].message.content for o in outs]

    assert asyncio.run(together()) == alone


def test_structured_outputs_on_the_real_model_with_each_drafter(local_stack):
    """SmolLM2 under a JSON schema and a choice: valid, and the same with every drafter."""
    client = openai.OpenAI(base_url=local_stack.base_url, api_key="x", max_retries=0)
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20},
                                               "country": {"enum": ["France", "Spain"]}},
              "required": ["capital", "country"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    content = "What is the capital of France? Answer in JSON."
    texts = {}
    for method in ("none", "ngram", "eagle3"):
        r = _chat(client, content, method, max_tokens=64, response_format=fmt)
        texts[method] = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", texts[method]
        obj = json.loads(texts[method])
        assert set(obj) == {"capital", "country"} and obj["country"] in ("France", "Spain")
    assert texts["ngram"] == texts["eagle3"] == texts["none"], texts
    r = _chat(client, "Is the sky blue? Answer yes or no.", "ngram",
              guided_choice=["yes", "no"])
    assert r.choices[0].message.content in ("yes", "no")


def test_drafter_killed_mid_request(local_stack):
    client = openai.OpenAI(base_url=local_stack.base_url, api_key="x", max_retries=0)
    want = _chat(client, COPY_PROMPT, "none", 120, ignore_eos=True).choices[0].message.content
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": COPY_PROMPT}], temperature=0,
        max_tokens=120, stream=True,
        extra_body={"speculative": {"method": "ngram"}, "ignore_eos": True})
    chunks = iter(stream)
    got = [next(chunks) for _ in range(3)]
    old = local_stack.procs["ngram"]
    old.send_signal(signal.SIGKILL)
    got += list(chunks)
    assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == want
    # The supervisor restarts it; the verifier reconnects and speculation resumes.
    _wait(lambda: local_stack.procs["ngram"] is not old, 30, "ngram drafter not restarted")
    local_stack.wait_drafters(("ngram",))
    again = _chat(client, COPY_PROMPT, "ngram", 120, ignore_eos=True)
    assert again.choices[0].message.content == want
    assert again.model_extra["spec_decode"]["num_accepted_tokens"] > 0


def test_gateway_killed_and_restarted(local_stack):
    client = openai.OpenAI(base_url=local_stack.base_url, api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=1000, stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    next(chunks)
    assert local_stack.load().num_running == 1
    old = local_stack.procs["gateway"]
    old.send_signal(signal.SIGKILL)
    with pytest.raises(openai.APIError):
        list(chunks)
    # The verifier frees what the dead gateway abandoned.
    _wait(lambda: local_stack.load().num_running == 0, 10,
          "verifier kept the abandoned request")
    load = local_stack.load()
    assert load.num_free_kv_tokens == load.num_total_kv_tokens
    # The SDK retries UNAVAILABLE before its first message while the gateway restarts.
    with Client(local_stack.grpc_address, max_retries=8, retry_backoff_s=0.25) as sdk:
        out = sdk.chat([{"role": "user", "content": "hi"}], max_tokens=4)
    assert out.usage.completion_tokens == 4
    assert local_stack.procs["gateway"] is not old


def test_64_concurrent_streams_leave_nothing_behind(local_stack):
    client = openai.OpenAI(base_url=local_stack.base_url, api_key="x", max_retries=0)
    _chat(client, "warm up", "ngram", 16)
    verifier_pid = local_stack.procs["verifier"].pid
    rss_before = _rss_kb(verifier_pid)

    async def one(aclient, i):
        stream = await aclient.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": f"Count from {i} upward."}],
            temperature=0, max_tokens=16, stream=True, stream_options={"include_usage": True},
            extra_body={"speculative": {"method": ["ngram", "eagle3", "none"][i % 3]},
                        "ignore_eos": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def run():
        aclient = openai.AsyncOpenAI(base_url=local_stack.base_url, api_key="x",
                                     max_retries=0, timeout=300)
        return await asyncio.wait_for(asyncio.gather(*(one(aclient, i) for i in range(64))), 300)

    t0 = time.monotonic()
    assert asyncio.run(run()) == [16] * 64
    elapsed = time.monotonic() - t0
    _wait(lambda: local_stack.load().num_running == 0, 10, "requests still running")
    load = local_stack.load()
    assert load.num_waiting == 0 and load.num_free_kv_tokens == load.num_total_kv_tokens
    rss_after = _rss_kb(verifier_pid)
    # Memory returns to its level before the burst (allocator slack aside).
    assert rss_after < rss_before * 1.15 + 50_000, (rss_before, rss_after, elapsed)


def test_verifier_replica_killed_mid_request(local_stack, smollm2_dir, tmp_path):
    """A second verifier process and a gateway over both: SIGKILL the replica serving a
    request; the request resumes on the other from the tokens produced so far."""
    import subprocess
    import sys

    from specdec.server import check_health

    # Ports the kernel hands out: fixed ones in the ephemeral range can be held by a client.
    spare_port, http_port, grpc_port = free_port(), free_port(), free_port()
    spare = subprocess.Popen(
        [sys.executable, "-m", "verifier", "--model", str(smollm2_dir), "--port", str(spare_port),
         "--max-num-seqs", "4", "--max-model-len", "1024", "--threads", "1",
         "--drafter", f"ngram={local_stack.address(50061)}"],
        stdout=(tmp_path / "spare.log").open("w"), stderr=subprocess.STDOUT)
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--model", str(smollm2_dir), "--served-model-name",
         "smollm2", "--verifier", local_stack.verifier_address,
         "--verifier", f"127.0.0.1:{spare_port}",
         "--port", str(http_port), "--grpc-port", str(grpc_port)],
        stdout=(tmp_path / "gateway.log").open("w"), stderr=subprocess.STDOUT)
    try:
        _wait(lambda: check_health(f"127.0.0.1:{spare_port}")
              and check_health(f"127.0.0.1:{grpc_port}"), 120,
              "spare verifier or second gateway not healthy")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="x",
                               max_retries=0)
        want = _chat(client, COPY_PROMPT, "none", 100, ignore_eos=True).choices[0].message.content
        stream = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": COPY_PROMPT}], temperature=0,
            max_tokens=100, stream=True, stream_options={"include_usage": True},
            extra_body={"speculative": {"method": "ngram"}, "ignore_eos": True})
        chunks = iter(stream)
        got = [next(chunks) for _ in range(3)]
        with grpc.insecure_channel(f"127.0.0.1:{spare_port}") as ch:
            on_spare = verifier_pb2_grpc.VerifierStub(ch).Load(
                verifier_pb2.LoadRequest(), timeout=5).num_running == 1
        victim = spare if on_spare else local_stack.procs["verifier"]
        victim.send_signal(signal.SIGKILL)
        got += list(chunks)
        assert "".join(c.choices[0].delta.content or "" for c in got if c.choices) == want
        assert got[-1].usage.completion_tokens == 100
    finally:
        for p in (gateway, spare):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        # The stack's own verifier may have been the victim: wait for its restart.
        _wait(lambda: _load_ok(local_stack), 120, "stack verifier did not come back")


def _load_ok(stack) -> bool:
    try:
        stack.load()
        return True
    except grpc.RpcError:
        return False
