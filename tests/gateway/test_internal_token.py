"""The internal APIs behind one shared token (SPECDEC_INTERNAL_TOKEN): the verifier and
drafters refuse calls without it (UNAUTHENTICATED) but keep health open, and a whole
deployment whose services present it serves as before."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.pb import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.server import token_metadata
from tests.gateway.stack import MODEL_NAME, GatewayStack

TOKEN = "internal-s3cret"


@pytest.fixture(scope="module")
def stack(loop, model, smollm2_dir):
    s = GatewayStack(loop, model, smollm2_dir, default_method="ngram", token=TOKEN)
    yield s
    s.close()


def test_a_deployment_with_a_token_serves(stack, client):
    # A static K: the drafter is asked every step (dynamic K may find drafting not
    # worth it for 8 tokens).
    reply = client.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0,
                                           messages=[{"role": "user", "content": "Hi"}],
                                           extra_body={"speculative": {"num_speculative_tokens": 2}})
    assert reply.choices[0].message.content
    assert reply.model_extra["spec_decode"]["method"] == "ngram"
    assert "disabled_reason" not in reply.model_extra["spec_decode"]
    # The verifier reached its drafters with the token too.
    with grpc.insecure_channel(stack.replicas[0].address) as ch:
        load = verifier_pb2_grpc.VerifierStub(ch).Load(verifier_pb2.LoadRequest(), timeout=5,
                                                       metadata=token_metadata(TOKEN))
    assert load.drafters and all(d.available for d in load.drafters)


@pytest.mark.parametrize("which", ["verifier", "drafter"])
def test_calls_without_the_token_are_refused_and_health_stays_open(stack, which):
    if which == "verifier":
        address = stack.replicas[0].address
        call = lambda ch, md: verifier_pb2_grpc.VerifierStub(ch).Load(  # noqa: E731
            verifier_pb2.LoadRequest(), timeout=5, metadata=md)
    else:
        address = f"127.0.0.1:{next(iter(stack.drafter_services.values())).port}"
        call = lambda ch, md: drafter_pb2_grpc.DrafterStub(ch).Info(  # noqa: E731
            drafter_pb2.InfoRequest(), timeout=5, metadata=md)
    with grpc.insecure_channel(address) as ch:
        for md in ((), token_metadata("wrong")):
            with pytest.raises(grpc.RpcError) as e:
                call(ch, md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "internal token" in e.value.details()
        assert call(ch, token_metadata(TOKEN)) is not None
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                      timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
