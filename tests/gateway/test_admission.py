"""Admission control: 429 with Retry-After (RESOURCE_EXHAUSTED over gRPC) where a request
would wait past the maximum queue time or the gateway holds its limit of requests, the
admitted count freed by every way a request ends, and request timeouts."""

from __future__ import annotations

import asyncio

import httpx2
import openai
import pytest

from gateway.policy.shedding import ServiceTimes, expected_wait_s, retry_after_s
from specdec.client import Client, OverloadedError
from tests.gateway.stack import MODEL_NAME, GatewayStack

MESSAGES = [{"role": "user", "content": "Count to ten."}]


@pytest.fixture(scope="module")
def stack(loop, model, smollm2_dir):
    s = GatewayStack(loop, model, smollm2_dir, default_method="none", max_queue_time_s=30.0,
                     max_num_requests=100)
    yield s
    s.close()


@pytest.fixture
def address(stack, client):
    client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2)
    address = stack.gateway.replicas.replicas[0].address
    yield address
    stack.gateway.service_times = ServiceTimes()


def test_expected_wait_counts_rounds_of_slots():
    assert expected_wait_s(0, 16, 5.0) == expected_wait_s(15, 16, 5.0) == 0.0
    assert expected_wait_s(16, 16, 5.0) == 5.0 and expected_wait_s(40, 16, 5.0) == 10.0
    assert expected_wait_s(100, 16, None) == 0.0  # nothing measured yet: no shedding
    assert retry_after_s(75.0, 60.0) == 15 and retry_after_s(60.2, 60.0) == 1
    times = ServiceTimes(weight=0.5)
    times.observe("a", 10.0)
    times.observe("a", 20.0)
    assert times.get("a") == 15.0 and times.get("b") is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        expected_wait_s(1, 0, 1.0)


def test_a_long_queue_gets_429_with_retry_after(stack, client, address):
    gw = stack.gateway
    slots = gw.replicas.replicas[0].report.max_num_seqs
    gw.service_times = ServiceTimes()
    gw.service_times.observe(address, 100.0)  # each round of slots takes 100 s
    gw.admitted[address] += 3 * slots  # three rounds ahead: 300 s > 30 s
    try:
        r = httpx2.post(stack.base_url + "/chat/completions",
                        json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "270"
        error = r.json()["error"]
        assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
        assert "wait about 300 s" in error["message"]
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
        with Client(stack.grpc_address, max_retries=0) as sdk, \
                pytest.raises(OverloadedError, match="RESOURCE_EXHAUSTED"):
            sdk.chat(MESSAGES, max_tokens=4)
    finally:
        gw.admitted[address] -= 3 * slots
    # The queue drained: served again, and the refusals were counted.
    assert client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                          max_tokens=4).choices[0].message.content
    metrics = httpx2.get(stack.base_url.removesuffix("/v1") + "/metrics").text
    assert 'specdec_request_errors_total{code="Overloaded"} 3.0' in metrics


def test_the_gateway_limit_of_requests(stack, client, address):
    gw = stack.gateway
    gw.admitted[address] += 100
    try:
        with pytest.raises(openai.RateLimitError, match="limit"):
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4)
    finally:
        gw.admitted[address] -= 100


def test_every_end_of_a_request_frees_its_admission(stack, client, address):
    async def burst() -> None:
        async with openai.AsyncOpenAI(base_url=stack.base_url, api_key="x",
                                      max_retries=0) as c:
            async def streamed() -> None:
                stream = await c.chat.completions.create(
                    model=MODEL_NAME, messages=MESSAGES, max_tokens=16, stream=True)
                async for _ in stream:
                    pass

            async def abandoned() -> None:  # the client reads one chunk and goes away
                stream = await c.chat.completions.create(
                    model=MODEL_NAME, messages=MESSAGES, max_tokens=200, stream=True)
                async for _ in stream:
                    break
                await stream.close()

            await asyncio.gather(*(streamed() for _ in range(6)), abandoned(),
                                 c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                                           max_tokens=8, n=3))

    asyncio.run(burst())
    # n = 70 choices: refused as a whole after some were admitted (MAX_CHOICES is 64).
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, n=70)
    gw = stack.gateway
    for _ in range(50):
        if gw.admitted[address] == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert gw.admitted[address] == 0
    assert gw.service_times.get(address) is not None  # finished requests were measured


def test_a_request_past_its_timeout_gets_504_and_leaves_the_verifier(stack, client):
    r = httpx2.post(stack.base_url + "/chat/completions",
                    json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 400,
                          "ignore_eos": True, "timeout": 0.05})
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "timeout_error"
    assert "timed out after 0 s" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="timeout"):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                       extra_body={"timeout": -1})
    replica = stack.replicas[0]
    for _ in range(50):  # the deadline reached the verifier: its sequence is gone
        if replica.load().num_running == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert replica.load().num_running == 0


def test_a_full_verifier_queue_is_a_429_too(stack, client, address):
    """The verifier bounds its own queue (other gateways, direct gRPC clients): past it a
    new stream gets RESOURCE_EXHAUSTED, which the gateway answers with 429."""
    servicer = stack.replicas[0].servicer
    slots = servicer.engine.config.max_num_seqs
    fake = {f"held-{i}": None for i in range(slots + 2)}  # the batch full, 2 waiting
    servicer.max_num_waiting = 2
    servicer._active.update(fake)
    try:
        r = httpx2.post(stack.base_url + "/chat/completions",
                        json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 4})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert "queue is full (2 requests waiting" in r.json()["error"]["message"]
        # Streamed too: the gateway waits for the verifier to take the request before
        # its 200, so the refusal is a 429, not an error event inside a 200 stream.
        with pytest.raises(openai.RateLimitError, match="queue is full"):
            client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                           stream=True)
        s = httpx2.post(stack.base_url + "/completions",
                        json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 4, "n": 2,
                              "stream": True})
        assert s.status_code == 429
    finally:
        for rid in fake:
            servicer._active.pop(rid)
        servicer.max_num_waiting = 0
    assert client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                          max_tokens=4).choices[0].message.content


def test_before_any_request_finished_the_wait_counts_max_tokens_steps(stack, address):
    """A burst at start-up: no service time measured yet, so a request is taken to hold
    its slot for max_tokens steps of the verifier's recent step time."""
    gw = stack.gateway
    replica = gw.replicas.replicas[0]
    slots = replica.report.max_num_seqs

    async def pause_polls() -> None:  # the poll would replace the report set below
        gw.replicas._task.cancel()

    async def resume_polls() -> None:
        gw.replicas._task = asyncio.create_task(gw.replicas._poll())

    stack.loop.run(pause_polls())
    gw.admitted[address] += 3 * slots  # three rounds ahead
    try:
        replica.report.step_time_ema_ms = 100.0
        gw.service_times = ServiceTimes()  # nothing measured
        # 200 tokens: 20 s a round, three rounds 60 s > 30 s.
        long = httpx2.post(stack.base_url + "/chat/completions",
                           json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 200})
        # 2 tokens: 0.2 s a round.
        short = httpx2.post(stack.base_url + "/chat/completions",
                            json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2})
    finally:
        gw.admitted[address] -= 3 * slots
        stack.loop.run(resume_polls())
    assert long.status_code == 429 and "wait about 60 s" in long.json()["error"]["message"]
    assert short.status_code == 200
