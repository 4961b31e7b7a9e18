"""Routing across verifier replicas: least loaded first, a replica that dies
mid-request is replaced without losing or changing output, with no replica
left the client gets a clear error promptly, a replica whose health says
NOT_SERVING gets no requests, and a request the verifier failed on its own is
not replayed on another replica."""

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
    s = GatewayStack(loop, model, smollm2_dir, replicas=1, drafters={}, resume_wait_s=1.0)
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
        # Held for resume_wait_s in case it comes back, then a clear error.
        with pytest.raises(openai.APIError, match="no verifier replica came back within 1 s"):
            list(chunks)
        assert 1.0 <= time.time() - t0 < 5
        # A new request is held as long for one to come up, then refused with 503.
        r = httpx2.post(s.base_url + "/chat/completions",
                        json={"messages": [{"role": "user", "content": "x"}]}, timeout=10)
        assert r.status_code == 503
        assert "no verifier replica came back within 1 s" in r.json()["error"]["message"]
        s.replicas.clear()
    finally:
        s.close()


@pytest.mark.parametrize("spec", [{"method": "none"}, {"method": "ngram",
                                                       "num_speculative_tokens": 3}])
def test_the_only_replica_restarting_loses_nothing(loop, model, smollm2_dir, spec):
    """Streams in flight when the only verifier dies are held until it serves again at
    its address, then resume from their tokens so far to the same text: greedy ones,
    and a seeded sampled one (its noise is keyed by position). A request that arrives
    while it is down is held too, and served once it is back."""
    from tests.gateway.stack import Replica

    s = GatewayStack(loop, model, smollm2_dir, replicas=1, resume_wait_s=20.0)
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        contents = [f"Write a long letter number {i}." for i in range(3)]
        wants = [s.reference(s.chat_ids(c), 100)[0] for c in contents]
        seeded = {"temperature": 0.8, "seed": 7, "max_tokens": 100,
                  "messages": [{"role": "user", "content": "Write a long letter number 9."}]}
        wants.append(client.chat.completions.create(
            model=MODEL_NAME, extra_body={"speculative": spec}, **seeded
        ).choices[0].message.content)
        streams = [iter(client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": c}], temperature=0,
            max_tokens=100, stream=True, extra_body={"speculative": spec})) for c in contents]
        streams.append(iter(client.chat.completions.create(
            model=MODEL_NAME, stream=True, extra_body={"speculative": spec}, **seeded)))
        got = [[next(chunks) for _ in range(3)] for chunks in streams]
        old = s.replicas[0]
        port = int(old.address.rsplit(":", 1)[1])
        old.stop(loop, 0.0)  # abrupt, as if the process died
        late_content = "Write a long letter number 5."
        late_want = s.reference(s.chat_ids(late_content), 40)[0]
        late: list = []
        arrives = threading.Thread(target=lambda: late.append(client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": late_content}],
            temperature=0, max_tokens=40, extra_body={"speculative": spec})))
        arrives.start()

        def restart() -> None:
            time.sleep(1.0)  # down for a while, then back at the same address
            s.replicas[0] = Replica(loop, model, s.tokenizer.eos_token_ids,
                                    {n: d.port for n, d in s.drafter_services.items()},
                                    grammars=s.grammars, port=port)

        threading.Thread(target=restart).start()
        for chunks, pieces in zip(streams, got, strict=True):
            pieces += list(chunks)
        texts = ["".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
                 for pieces in got]
        assert texts == wants
        arrives.join(30)
        assert [r.choices[0].message.content for r in late] == [late_want]
        metrics = httpx2.get(s.base_url.removesuffix("/v1") + "/metrics").text
        assert "specdec_requests_resumed_total 4.0" in metrics
        assert "specdec_requests_held_total" in metrics
        assert "specdec_requests_held_total 0.0" not in metrics
    finally:
        s.close()


def test_a_draining_verifier_finishes_what_it_runs(loop, model, smollm2_dir):
    """Stopped gracefully (SIGTERM), the only verifier stops taking requests but finishes
    those in flight within its grace: their streams end whole and unchanged, nothing is
    aborted or resumed."""
    s = GatewayStack(loop, model, smollm2_dir, replicas=1, drafters={}, resume_wait_s=0.5)
    stopper = None
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        contents = [f"Tell me about the number {i}." for i in range(2)]
        wants = [s.reference(s.chat_ids(c), 300)[0] for c in contents]
        streams = [iter(client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": c}], temperature=0,
            max_tokens=300, stream=True)) for c in contents]
        got = [[next(chunks)] for chunks in streams]
        replica = s.replicas[0]
        stopper = threading.Thread(target=replica.stop, args=(loop, 10.0))
        stopper.start()
        assert _wait(lambda: not replica.servicer._accepting, 5.0)  # draining now
        assert replica.servicer._active  # with requests still running
        for chunks, pieces in zip(streams, got, strict=True):
            pieces += list(chunks)
        texts = ["".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
                 for pieces in got]
        assert texts == wants
        assert all(pieces[-1].choices[0].finish_reason == "length" for pieces in got)
        metrics = httpx2.get(s.base_url.removesuffix("/v1") + "/metrics").text
        assert "specdec_requests_resumed_total 0.0" in metrics
    finally:
        if stopper is not None:
            stopper.join(timeout=30)
            s.replicas.clear()
        s.close()


def _wait(cond, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_not_serving_replica_gets_no_requests(loop, model, smollm2_dir):
    s = GatewayStack(loop, model, smollm2_dir, replicas=2, drafters={})
    try:
        down, up = s.replicas
        pool = s.gateway.replicas
        # Its engine failed, or it is shutting down: Load still answers, health does not.
        loop.run(down.service.grpc.set_serving(False))
        assert _wait(lambda: not pool.replicas[0].healthy)
        assert pool.replicas[0].error == "health: NOT_SERVING"
        assert down.load().num_running == 0  # Load answers all the same
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        for i in range(4):
            client.chat.completions.create(model=MODEL_NAME, max_tokens=4,
                                           messages=[{"role": "user", "content": f"hi {i}"}])
        assert down.servicer.engine.times.steps == 0 and up.servicer.engine.times.steps > 0
        health = httpx2.get(s.base_url.removesuffix("/v1") + "/health").json()
        assert [v["healthy"] for v in health["verifiers"]] == [False, True]
        loop.run(down.service.grpc.set_serving(True))
        assert _wait(lambda: pool.replicas[0].healthy)
    finally:
        s.close()


def test_a_request_the_verifier_failed_alone_is_not_replayed(loop, model, smollm2_dir):
    s = GatewayStack(loop, model, smollm2_dir, replicas=2, drafters={})
    try:
        raised: list[str] = []
        for replica in s.replicas:
            run = replica.servicer.engine.runner.run

            def poisoned(batch, drafts, proposer, run=run, address=replica.address):
                out = run(batch, drafts, proposer)
                # The poison request is the one with max_tokens 7.
                if any(item.seq.request.max_tokens == 7 for item in batch):
                    raised.append(address)
                    raise RuntimeError("poisoned")
                return out

            replica.servicer.engine.runner.run = poisoned
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model=MODEL_NAME, max_tokens=7,
                                           messages=[{"role": "user", "content": "poison"}])
        assert e.value.status_code == 500
        assert e.value.body["type"] == "internal_error"
        assert "RuntimeError: poisoned" in e.value.body["message"]
        assert len(raised) == 1  # on one replica, once: not replayed on the other
        # Not the replica's fault: both stay routable, and serve the next request.
        assert all(r.healthy for r in s.gateway.replicas.replicas)
        content = "Say something."
        want, _ = s.reference(s.chat_ids(content), 6)
        got = client.chat.completions.create(model=MODEL_NAME, max_tokens=6, temperature=0,
                                             messages=[{"role": "user", "content": content}])
        assert got.choices[0].message.content == want
    finally:
        s.close()


def test_load_counts_out_streams_ended_since_the_report():
    """A stream that ended since the report counting it was asked for is no longer
    load: one request following another at one in flight must not see a load of 2
    (routing and admission would count a request that is gone)."""
    from gateway.replicas import Replica
    from specdec.pb import verifier_pb2

    r = Replica("127.0.0.1:1")
    opened = r.stream_opened()  # stream A
    r.took_report(verifier_pb2.LoadReport(num_running=1), asked=time.monotonic())
    assert r.load == 1
    r.stream_ended(opened)
    assert r.load == 0 and r.inflight == 0
    b_opened = r.stream_opened()  # stream B, opened after A ended, before the next report
    assert r.load == 1
    # Another gateway's two sequences arrive; the report counts them and B.
    r.took_report(verifier_pb2.LoadReport(num_running=3), asked=time.monotonic())
    assert r.load == 3
    c_opened = r.stream_opened()  # stream C opens and ends before any report counts it
    r.stream_ended(c_opened)
    assert r.load == 3  # the report never counted C: nothing to take out
    r.stream_ended(b_opened)
    assert r.load == 2
