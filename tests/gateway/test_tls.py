"""TLS end to end: the gateway serves REST over HTTPS and its gRPC API over TLS with one
certificate, to clients that trust its CA (and, with --ssl-cert-reqs 2, present a
certificate of their own); the internal links gateway -> verifier -> drafters run over
mutual TLS, which refuses a client without a certificate."""

from __future__ import annotations

import asyncio
import ssl

import grpc
import httpx2
import openai
import pytest

from gateway.core import Gateway, GatewayConfig
from gateway.replicas import ReplicaPool
from gateway.service import serve as serve_gateway
from specdec.client import AsyncClient, Client, UnavailableError
from specdec.pb import verifier_pb2, verifier_pb2_grpc
from specdec.tls import TlsConfig, open_channel
from tests.gateway.stack import MODEL_NAME, GatewayStack

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def stack(loop, model, smollm2_dir, pki):
    s = GatewayStack(loop, model, smollm2_dir, default_method="ngram", tls=pki.server(),
                     internal_tls=pki.server(require_client_cert=True))
    yield s
    s.close()


@pytest.fixture(scope="module")
def mtls_gateway(stack, pki):
    """A second gateway on the same verifiers that requires client certificates."""
    pool = ReplicaPool([r.address for r in stack.replicas], poll_interval_s=0.1,
                       tls=pki.server(require_client_cert=True))
    gateway = Gateway(GatewayConfig(model_name=MODEL_NAME), stack.tokenizer, pool)
    service = stack.loop.run(serve_gateway(gateway, "127.0.0.1", 0, "127.0.0.1:0",
                                           pki.server(require_client_cert=True)))
    yield service
    stack.loop.run(service.stop(1.0))


def _context(pki, client_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if client_cert:
        ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    return ctx


def test_rest_over_https_through_the_mutual_tls_chain(stack, pki):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0,
                           http_client=httpx2.Client(verify=_context(pki)))
    # A static K: the drafter is asked every step (dynamic K may find drafting not
    # worth it for 8 tokens).
    reply = client.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0,
                                           messages=HI,
                                           extra_body={"speculative": {"num_speculative_tokens": 2}})
    assert reply.choices[0].message.content
    # The verifier reached its drafters over mutual TLS: it speculated with ngram.
    assert reply.model_extra["spec_decode"]["method"] == "ngram"
    assert "disabled_reason" not in reply.model_extra["spec_decode"]


def test_rest_refuses_plain_http_and_clients_without_the_ca(stack, pki):
    url = stack.base_url + "/models"
    assert httpx2.get(url, verify=_context(pki)).status_code == 200
    with pytest.raises(httpx2.TransportError):
        httpx2.get(url.replace("https://", "http://"))
    with pytest.raises(httpx2.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx2.get(url)  # the system's roots


def test_sdk_over_tls(stack, pki):
    with Client(stack.grpc_address, ca_certs=str(pki.ca)) as client:
        assert client.chat(HI, max_tokens=8, temperature=0).text
    for kw in ({}, {"tls": True}):  # plaintext; the system's roots
        with Client(stack.grpc_address, max_retries=0, timeout_s=5, **kw) as client:
            with pytest.raises(UnavailableError):
                client.chat(HI, max_tokens=8)

    async def chat() -> str:
        client = AsyncClient(stack.grpc_address, ca_certs=str(pki.ca))
        try:
            return (await client.chat(HI, max_tokens=8, temperature=0)).text
        finally:
            await client.close()

    assert asyncio.run(chat())


def test_a_gateway_requiring_client_certificates(mtls_gateway, pki):
    url = f"https://127.0.0.1:{mtls_gateway.http_port}/v1/models"
    assert httpx2.get(url, verify=_context(pki, client_cert=True)).status_code == 200
    with pytest.raises(httpx2.TransportError):
        httpx2.get(url, verify=_context(pki))
    address = f"127.0.0.1:{mtls_gateway.grpc_port}"
    with Client(address, ca_certs=str(pki.ca), certfile=str(pki.client_cert),
                keyfile=str(pki.client_key)) as client:
        assert client.chat(HI, max_tokens=8, temperature=0).text
    with Client(address, ca_certs=str(pki.ca), max_retries=0, timeout_s=5) as client:
        with pytest.raises(UnavailableError):
            client.chat(HI, max_tokens=8)


@pytest.mark.parametrize("tls, refused", [
    (None, True),  # plaintext
    (lambda pki: TlsConfig(ca_certs=str(pki.ca)), True),  # no client certificate
    (lambda pki: pki.client(), False),
])
def test_the_verifier_requires_a_client_certificate(stack, pki, tls, refused):
    with open_channel(stack.replicas[0].address, tls and tls(pki)) as ch:
        call = lambda: verifier_pb2_grpc.VerifierStub(ch).Load(  # noqa: E731
            verifier_pb2.LoadRequest(), timeout=5)
        if refused:
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        else:
            load = call()
            assert load.drafters and all(d.available for d in load.drafters)
