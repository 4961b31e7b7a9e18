"""Fuzzing the gateway (bench/fuzz.py's cases, a bounded and derandomized set): no
REST or gRPC input gives a 5xx, a refusal without its error, a hang or a dropped
connection, and the stack answers a greedy request the same afterwards."""

from __future__ import annotations

import grpc
import httpx2
import pytest

from bench import fuzz
from gateway.core import Limits
from tests.gateway.stack import MODEL_NAME, GatewayStack

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def fuzz_stack(loop, model, smollm2_dir):
    # The deployment's drafters, ngram by default; replies short, so that the cases that
    # run cost little.
    s = GatewayStack(loop, model, smollm2_dir, default_method="ngram",
                     limits=Limits(max_tokens=8))
    yield s
    s.close()


def _run(stack: GatewayStack, api: str, num_cases: int) -> fuzz.Tally:
    content = "Name three colours."
    want, _ = stack.reference(stack.chat_ids(content), 8)
    tally = fuzz.Tally()
    root = stack.base_url.removesuffix("/v1")
    with httpx2.Client() as client:
        if api == "rest":
            fuzz.fuzz(fuzz.rest_cases(MODEL_NAME),
                      lambda c: fuzz.check_rest(client, root, c, TIMEOUT_S),
                      num_cases, tally, api, derandomize=True)
        else:
            with grpc.insecure_channel(stack.grpc_address) as channel:
                fuzz.fuzz(fuzz.grpc_cases(MODEL_NAME),
                          lambda c: fuzz.check_grpc(channel, c, TIMEOUT_S),
                          num_cases, tally, api, derandomize=True)
        r = client.post(stack.base_url + "/chat/completions", timeout=TIMEOUT_S, json={
            "model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
    return tally


def test_no_rest_input_fails_the_server(fuzz_stack):
    tally = _run(fuzz_stack, "rest", 250)
    assert not tally.failures, "\n".join(f"{f['status']} {f['why'][:200]}\n  {f['case']}"
                                         for f in tally.failures)
    # The cases reach both outcomes: some run, most are refused.
    assert tally.cases["rest ok"] > 10 and tally.cases["rest refused"] > 50, tally.cases


def test_no_grpc_input_fails_the_server(fuzz_stack):
    tally = _run(fuzz_stack, "grpc", 150)
    assert not tally.failures, "\n".join(f"{f['status']} {f['why'][:200]}\n  {f['case']}"
                                         for f in tally.failures)
    assert tally.cases["grpc ok"] > 10 and tally.cases["grpc refused"] > 20, tally.cases


def test_a_server_failure_is_a_failure():
    """The verdicts can fail: a 500 with the OpenAI body, a 400 without it, a stream cut
    before its end."""
    def verdict(status: int, body: bytes, content_type: str = "application/json"):
        transport = httpx2.MockTransport(
            lambda request: httpx2.Response(status, content=body,
                                            headers={"content-type": content_type}))
        with httpx2.Client(transport=transport) as client:
            return fuzz.check_rest(client, "http://x", fuzz.RestCase("/v1/completions", b"{}"),
                                   1.0)

    assert verdict(500, b'{"error": {"message": "boom"}}').kind == "fail"
    assert verdict(400, b"Bad Request", "text/plain").kind == "fail"
    assert verdict(200, b'data: {"choices": []}\n\n', "text/event-stream").kind == "fail"
    assert verdict(400, b'{"error": {"message": "max_tokens: too big"}}').kind == "refused"
    assert verdict(200, b'data: {"choices": []}\n\ndata: [DONE]\n\n', "text/event-stream").kind == "ok"


def test_bytes_no_parser_accepts_get_invalid_argument(fuzz_stack):
    """Left to grpc, a request its parser refuses ends with UNKNOWN (the server's
    error): specdec.server.ParseRequests makes it the client's, naming the method."""
    with grpc.insecure_channel(fuzz_stack.grpc_address) as channel:
        for payload in (b"\x0a\x04\xff\xfe\xfd\xfc", b"\xff" * 7):
            call = channel.unary_stream("/specdec.v1.Gateway/Chat")
            with pytest.raises(grpc.RpcError) as e:
                list(call(payload, timeout=TIMEOUT_S))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "/specdec.v1.Gateway/Chat" in e.value.details()
