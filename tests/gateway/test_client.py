"""The gRPC Gateway API through the SDK (specdec.client): sync and asyncio,
streaming and not, typed errors, and retry before the first token."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specdec.client import (
    AsyncClient,
    AuthenticationError,
    Client,
    InvalidRequestError,
    NotFoundError,
    UnavailableError,
)
from tests.gateway.stack import GatewayStack
from tests.ports import free_port


@pytest.fixture(scope="module")
def stack(loop, model, smollm2_dir):
    s = GatewayStack(loop, model, smollm2_dir, default_method="ngram")
    yield s
    s.close()


def test_sync_generate_and_chat(stack):
    with Client(stack.grpc_address) as client:
        prompt = "A list of colours: red, green,"
        want, ids = stack.reference(stack.tokenizer.encode(prompt), 20)
        out = client.generate(prompt, max_tokens=20, temperature=0,
                              speculative={"method": "draft_model", "num_speculative_tokens": 3})
        assert out.text == want and out.token_ids == ids
        assert out.finish_reason == "length" and out.usage.completion_tokens == 20
        assert out.spec_decode.method == "draft_model" and out.spec_decode.acceptance_length > 2
        # Token-id prompts are used as they are.
        assert client.generate(stack.tokenizer.encode(prompt), max_tokens=20,
                               temperature=0).token_ids == ids

        messages = [{"role": "user", "content": "Name a planet."}]
        want, ids = stack.reference(stack.chat_ids("Name a planet."), 16)
        chunks = list(client.chat(messages, max_tokens=16, temperature=0, stream=True))
        assert "".join(c.text for c in chunks) == want
        assert [t for c in chunks for t in c.token_ids] == ids
        assert all(c.finish_reason is None for c in chunks[:-1])
        assert chunks[-1].usage.completion_tokens == len(ids)
        # The deployment default (ngram) applies when the request does not choose.
        assert chunks[-1].spec_decode.method == "ngram"


def test_async_client(stack):
    messages = [{"role": "user", "content": "Say something."}]
    want, _ = stack.reference(stack.chat_ids("Say something."), 12)

    async def run():
        async with AsyncClient(stack.grpc_address) as client:
            whole = await client.chat(messages, max_tokens=12, temperature=0,
                                      speculative={"method": "none"})
            stream = await client.chat(messages, max_tokens=12, temperature=0, stream=True)
            pieces = [c.text async for c in stream]
            with pytest.raises(InvalidRequestError, match="max_tokens"):
                await client.chat(messages, max_tokens=10_000)
            return whole, pieces

    whole, pieces = asyncio.run(run())
    assert whole.text == want == "".join(pieces)
    assert whole.spec_decode.disabled_reason == "request"


def test_typed_errors(stack, loop, smollm2_dir):
    with Client(stack.grpc_address, max_retries=0) as client:
        with pytest.raises(InvalidRequestError, match="num_speculative_tokens"):
            client.generate("x", max_tokens=4, speculative={"num_speculative_tokens": 50})
        with pytest.raises(InvalidRequestError, match="prompt"):
            client.generate([], max_tokens=4)
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            client.generate([10**7], max_tokens=4)
        with pytest.raises(NotFoundError, match="other-model"):
            client.generate("x", max_tokens=4, model="other-model")
        with pytest.raises(InvalidRequestError, match="role"):
            client.chat([{"role": "robot", "content": "x"}], max_tokens=4)
    s = GatewayStack(loop, stack.model, smollm2_dir, drafters={}, api_key="k")
    try:
        with pytest.raises(AuthenticationError):
            Client(s.grpc_address).generate("x", max_tokens=2)
        assert Client(s.grpc_address, api_key="k").generate("x", max_tokens=2).usage.completion_tokens == 2
    finally:
        s.close()


def test_retry_on_unavailable_before_first_token(stack, loop, smollm2_dir):
    port = free_port()
    with Client(f"127.0.0.1:{port}", max_retries=0) as client:
        with pytest.raises(UnavailableError):
            client.generate("x", max_tokens=2)
    started: list[GatewayStack] = []

    def start_later():
        time.sleep(0.5)
        started.append(GatewayStack(loop, stack.model, smollm2_dir, drafters={}, grpc_port=port))

    t = threading.Thread(target=start_later)
    t.start()
    try:
        # The gateway comes up while the client is backing off: the call succeeds.
        with Client(f"127.0.0.1:{port}", max_retries=6, retry_backoff_s=0.2) as client:
            out = client.generate("Hello", max_tokens=3, temperature=0)
        assert out.usage.completion_tokens == 3
    finally:
        t.join(30)
        for s in started:
            s.close()


def test_n_choices_are_seeded_seed_plus_index(stack):
    with Client(stack.grpc_address) as client:
        kw = {"max_tokens": 12, "temperature": 1.0, "speculative": {"method": "ngram"}}
        many = client.generate("Once upon a time", n=3, seed=40, **kw)
        assert [c.index for c in many] == [0, 1, 2]
        # Choice i is the single request seeded 40 + i, as over REST and in vLLM.
        singles = [client.generate("Once upon a time", seed=40 + i, **kw) for i in range(3)]
        assert [c.text for c in many] == [s.text for s in singles]
        assert [c.token_ids for c in many] == [s.token_ids for s in singles]
        assert len({c.text for c in many}) > 1
        assert all(c.finish_reason and c.usage.completion_tokens == len(c.token_ids)
                   for c in many)
        # Streamed, the chunks of each choice carry its index and reassemble to it.
        chunks = list(client.chat([{"role": "user", "content": "Hi"}], n=2, seed=5,
                                  stream=True, **kw))
        streamed = ["".join(c.text for c in chunks if c.index == i) for i in range(2)]
        whole = client.chat([{"role": "user", "content": "Hi"}], n=2, seed=5, **kw)
        assert streamed == [c.text for c in whole]
        assert sum(c.finish_reason is not None for c in chunks) == 2
        with pytest.raises(InvalidRequestError, match="n: at most 64"):
            client.generate("x", n=65, max_tokens=2)
        with pytest.raises(InvalidRequestError, match="n: a positive integer"):
            client.generate("x", n=0, max_tokens=2)


def test_logprobs_carry_token_text(stack):
    with Client(stack.grpc_address) as client:
        out = client.generate("A list of colours: red, green,", max_tokens=6, temperature=0,
                              logprobs=3)
    assert [lp.token_id for lp in out.logprobs] == out.token_ids
    for lp in out.logprobs:
        assert lp.token == stack.tokenizer.decode([lp.token_id], skip_special_tokens=False)
        assert len(lp.top_logprobs) == 3 and lp.rank == 1  # greedy: the most likely token
        assert lp.top_logprobs[0].token_id == lp.token_id
        assert lp.top_logprobs[0].logprob == pytest.approx(lp.logprob)
        assert all(t.token == stack.tokenizer.decode([t.token_id], skip_special_tokens=False)
                   for t in lp.top_logprobs)
    assert "".join(lp.token for lp in out.logprobs) == out.text
