"""Routing across verifier replicas: least loaded first, a replica that dies
mid-request is replaced without losing or changing output, and with no
replica left the client gets a clear error promptly."""

from __future__ import annotations

import threading
import time

import httpx2
import openai
import pytest

from tests.gateway.stack import MODEL_NAME, GatewayStack


def _running(s: GatewayStack) -> list[int]:
    return [r.load().num_running for r in s.replicas]


def test_least_loaded_replica(loop, model, smollm2_dir):
    s = GatewayStack(loop, model, smollm2_dir, replicas=2, drafters={})
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        streams = []
        for i in range(4):
            stream = client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": f"story {i}"}],
                max_tokens=60, stream=True, extra_body={"ignore_eos": True})
            next(iter(stream))
            streams.append(stream)
        deadline = time.time() + 5
        while time.time() < deadline and sum(_running(s)) < 4:
            time.sleep(0.02)
        assert _running(s) == [2, 2]
        for stream in streams:
            list(stream)
    finally:
        s.close()


@pytest.mark.parametrize("spec", [{"method": "none"}, {"method": "draft_model",
                                                       "num_speculative_tokens": 3}])
def test_replica_dies_mid_request(loop, model, smollm2_dir, spec):
    s = GatewayStack(loop, model, smollm2_dir, replicas=2)
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        content = "Write a long letter."
        want, ids = s.reference(s.chat_ids(content), 120)
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": content}], temperature=0,
            max_tokens=120, stream=True, stream_options={"include_usage": True},
            extra_body={"speculative": spec})
        chunks = iter(stream)
        got = [next(chunks) for _ in range(4)]
        victim = next(r for r in s.replicas if r.load().num_running == 1)
        # Abrupt: no grace, as if the process died.
        threading.Thread(target=victim.stop, args=(loop, 0.0)).start()
        got += list(chunks)
        text = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
        assert text == want
        assert got[-1].usage.completion_tokens == len(ids)
        metrics = httpx2.get(s.base_url.removesuffix("/v1") + "/metrics").text
        assert "specdec_requests_resumed_total 1.0" in metrics
        survivor = next(r for r in s.replicas if r is not victim)
        assert survivor.load().num_running == 0
    finally:
        for r in s.replicas:
            try:
                r.load()
            except Exception:  # noqa: BLE001 - the stopped one
                s.replicas.remove(r)
        s.close()


def test_single_replica_dies_gives_prompt_error(loop, model, smollm2_dir):
    s = GatewayStack(loop, model, smollm2_dir, replicas=1, drafters={})
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "go"}], max_tokens=400,
            stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        next(chunks)
        t0 = time.time()
        s.replicas[0].stop(loop, 0.0)
        with pytest.raises(openai.APIError, match="no other verifier replica"):
            list(chunks)
        assert time.time() - t0 < 5
        # New requests fail fast with 503 while no replica is up.
        r = httpx2.post(s.base_url + "/chat/completions",
                        json={"messages": [{"role": "user", "content": "x"}]}, timeout=10)
        assert r.status_code == 503 and "no verifier available" in r.json()["error"]["message"]
        s.replicas.clear()
    finally:
        s.close()
