"""gRPC server bootstrap shared by the drafter, verifier and gateway services.

Every service answers the standard health service (overall "" and its own
service name), accepts large messages (hidden states and dense draft
probabilities are big), and stops gracefully: health flips to NOT_SERVING
first so routers stop sending, then the service drains its own work, then
the server stops with a grace period for streams still open.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import inspect
import ipaddress
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Iterable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specdec.tls import TlsConfig, open_channel

log = logging.getLogger(__name__)

# What a client takes from a server it chose (a gateway from its verifiers, the SDK from
# its gateway): a Generate reply with a long prompt's logprobs exceeds gRPC's 4 MiB
# default. Servers take less: each says what (start_server's max_receive_bytes).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# What a gRPC server takes unless told otherwise.
GRPC_DEFAULT_BYTES = 4 * 1024 * 1024
# A Generate request's text (grammars, stop strings, a tool list's schemas), which a
# gateway takes within its body limit (4 MiB by default).
GENERATE_TEXT_BYTES = 16 * 1024 * 1024
# The drafter streams' messages (docs/design.md section 3, "Message sizes"): each end
# packs a step's request or answer into messages of at most this many bytes. Only what
# cannot be split is larger, alone in its message: a Start, a tokens-only Advance, or
# one proposal with dense q ([K, vocab] float32).
DRAFT_PART_BYTES = 4 * 1024 * 1024
# The longest context a drafter that states none (ngram, suffix) takes Starts for.
UNBOUNDED_CONTEXT = 1 << 20


def generate_message_bytes(max_model_len: int, vocab_size: int) -> int:
    """The largest Generate request a verifier takes: a prompt of max_model_len ids
    and lists as long as the vocabulary (logit_bias, allowed ids), at most 16 bytes an
    entry on the wire, and GENERATE_TEXT_BYTES of text. A larger one is refused by
    gRPC (RESOURCE_EXHAUSTED) before it is read into memory."""
    return GENERATE_TEXT_BYTES + 16 * (max_model_len + vocab_size)


def draft_request_bytes(max_model_len: int, vocab_size: int) -> int:
    """The largest DraftRequest message a drafter takes: a part, or a Start for a context
    of max_model_len tokens (0: UNBOUNDED_CONTEXT). A Start carries the prompt and
    sampling of one Generate request and the tokens generated since, no more than
    that request's bound for its context."""
    return max(DRAFT_PART_BYTES,
               generate_message_bytes(max_model_len or UNBOUNDED_CONTEXT, vocab_size))


def draft_response_bytes(max_num_speculative_tokens: int, vocab_size: int) -> int:
    """The largest DraftResponse message a verifier takes: a part, or one proposal of
    max_num_speculative_tokens drafts with dense q (float32) beside a part's worth."""
    return DRAFT_PART_BYTES + 4 * max_num_speculative_tokens * vocab_size


# Find dead peers on long-lived streams (drafter streams idle between requests).
KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
GRPC_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *KEEPALIVE_OPTIONS,
]

# The trailing metadata of an INTERNAL status that a request failed for a reason of
# its own (the verifier found it by stepping it alone): another server would fail it
# too, so it is not retried elsewhere. An INTERNAL without it (the transport, a server
# going down) stays worth resuming on another replica.
REQUEST_FAILED = ("specdec-error", "request-failed")
# Initial metadata of a Generate stream the verifier has taken (checked and queued): a
# caller that awaits it learns of a refusal (a full queue, a bad request) before it
# commits to a response of its own.
ADMITTED = ("specdec-admitted", "1")


def is_request_failed(error: grpc.RpcError) -> bool:
    """Whether `error` is INTERNAL and carries REQUEST_FAILED."""
    code = getattr(error, "code", None)
    if code is None or code() != grpc.StatusCode.INTERNAL:
        return False
    return any(tuple(item) == REQUEST_FAILED for item in error.trailing_metadata() or ())


# Servers must accept the clients' keepalive pings.
SERVER_OPTIONS: list[tuple[str, int]] = KEEPALIVE_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
]


class GrpcService:
    """A started grpc.aio server with its health servicer."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer,
                 port: int, service_names: list[str], servicer: object = None):
        self.server = server
        self.servicer = servicer  # the service's own servicer, for statistics and tests
        self.health = health_servicer
        self.port = port
        self.service_names = service_names
        self._stopped = asyncio.Event()

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 5.0,
                   drain: Callable[[], Awaitable[None]] | None = None) -> None:
        """NOT_SERVING, then `drain` (the service finishes or cancels its work), then stop."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        await self.set_serving(False)
        if drain is not None:
            try:
                await asyncio.wait_for(drain(), timeout=grace_s)
            except TimeoutError:
                log.warning("drain did not finish within %.1f s", grace_s)
        await self.server.stop(grace_s)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


# The environment variable of the shared token the internal APIs (Verifier, Drafter)
# require when it is set; the services' entry points read it, clients send it.
INTERNAL_TOKEN_ENV = "SPECDEC_INTERNAL_TOKEN"
_HEALTH_PREFIX = "/grpc.health.v1.Health/"


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class TokenAuth(grpc.aio.ServerInterceptor):
    """Every RPC but the health service's must carry `authorization: Bearer <token>`;
    the others get UNAUTHENTICATED. Health stays open for orchestrators' probes."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the internal token must not be empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(_HEALTH_PREFIX):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        # compare_digest: the time taken must not tell how much of the token matched.
        if hmac.compare_digest(str(got).encode(), self._expected):
            return handler

        async def deny(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "missing or wrong internal token (metadata authorization: "
                                f"Bearer <${INTERNAL_TOKEN_ENV}>)")

        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class ParseRequests(grpc.aio.ServerInterceptor):
    """A unary request the protobuf parser refuses (bytes that are no message of its
    type, a string field that is not UTF-8) ends with INVALID_ARGUMENT naming the
    message type. Left to grpc, the parser's exception ends the call with UNKNOWN, as a
    server's own failure would. The request is parsed in the handler instead, where
    the call can be aborted with the client's error. Streamed requests (our own
    services' internal streams) are left as they are."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if (handler is None or handler.request_streaming
                or handler.request_deserializer is None):
            return handler
        deserialize = handler.request_deserializer

        async def parse(raw: bytes, context):
            try:
                return deserialize(raw)
            except DecodeError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"request: not a valid message for {details.method}: {e}")

        if handler.response_streaming and inspect.isasyncgenfunction(handler.unary_stream):
            behaviour = handler.unary_stream

            async def unary_stream(raw: bytes, context):
                request = await parse(raw, context)
                async for response in behaviour(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                unary_stream, response_serializer=handler.response_serializer)
        if not handler.response_streaming and inspect.iscoroutinefunction(handler.unary_unary):
            behaviour = handler.unary_unary

            async def unary_unary(raw: bytes, context):
                return await behaviour(await parse(raw, context), context)

            return grpc.unary_unary_rpc_method_handler(
                unary_unary, response_serializer=handler.response_serializer)
        return handler


ALLOW_UNAUTHENTICATED_ENV = "SPECDEC_ALLOW_UNAUTHENTICATED"
# The address a container's port is published on, where the service sits behind such a
# port (compose sets it): beyond loopback, that is where the service is reached.
PUBLISHED_HOST_ENV = "SPECDEC_PUBLISHED_HOST"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve anywhere


def add_open_access_argument(p: argparse.ArgumentParser, what: str) -> None:
    """--allow-unauthenticated (default $SPECDEC_ALLOW_UNAUTHENTICATED) and --published-host
    (default $SPECDEC_PUBLISHED_HOST), which open_access_refusal reads."""
    p.add_argument("--allow-unauthenticated", action="store_true",
                   default=os.environ.get(ALLOW_UNAUTHENTICATED_ENV, "") not in ("", "0"),
                   help=f"serve without {what} on an address beyond loopback (refused "
                   f"otherwise; default: ${ALLOW_UNAUTHENTICATED_ENV})")
    p.add_argument("--published-host", default=os.environ.get(PUBLISHED_HOST_ENV) or None,
                   help="the address a container's port for this service is published on, "
                   "checked instead of --host: inside a container the service listens on "
                   f"0.0.0.0 whoever can reach it (default: ${PUBLISHED_HOST_ENV})")


def internal_callers_authenticated(server_tls: TlsConfig | None) -> bool:
    """Whether an internal service's callers must prove who they are: the shared token
    is set, or its TLS requires their certificates."""
    return bool(os.environ.get(INTERNAL_TOKEN_ENV)) or bool(
        server_tls is not None and server_tls.require_client_cert)


def internal_open_access_refusal(program: str, args: argparse.Namespace,
                                 server_tls: TlsConfig | None, callers: str) -> str | None:
    """open_access_refusal for an internal service (verifier, drafter), whose callers
    (`callers`, who present the token) authenticate by the shared token or mutual TLS."""
    return open_access_refusal(program, args, internal_callers_authenticated(server_tls),
                               f"Set {INTERNAL_TOKEN_ENV} (the {callers} present it) or "
                               f"mutual TLS")


def open_access_refusal(program: str, args: argparse.Namespace, authenticated: bool,
                        how: str) -> str | None:
    """Why `program` must not start: it would serve beyond loopback (its --host, or the
    address its container port is published on) with nothing to authenticate its
    callers, and was not told it may (--allow-unauthenticated). None: it may start."""
    host = args.published_host or args.host
    if authenticated or args.allow_unauthenticated or is_loopback(host):
        return None
    return (f"{program}: refusing to serve on {host} without authentication: anyone who "
            f"reaches it could use it. {how}, listen on 127.0.0.1, or pass "
            f"--allow-unauthenticated ({ALLOW_UNAUTHENTICATED_ENV}=1) where the network is "
            f"yours.")


async def start_server(address: str, register: Callable[[grpc.aio.Server], None],
                       service_names: Iterable[str], servicer: object = None, *,
                       max_receive_bytes: int | None = None,
                       token: str | None = None, tls: TlsConfig | None = None) -> GrpcService:
    """Bind `address` ("host:port", port 0 = any free port), register the service's
    servicers and health, start, and report SERVING. max_receive_bytes: the largest
    message a client may send (None: GRPC_DEFAULT_BYTES); token: required of every call
    but health's (TokenAuth); tls: serve over TLS (health too: a plaintext probe cannot
    reach a TLS port)."""
    options = list(SERVER_OPTIONS)
    if max_receive_bytes is not None:
        options.append(("grpc.max_receive_message_length", max_receive_bytes))
    server = grpc.aio.server(options=options,
                             interceptors=[*([TokenAuth(token)] if token else []),
                                           ParseRequests()])
    register(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = (server.add_secure_port(address, tls.server_credentials()) if tls is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    service = GrpcService(server, health_servicer, port, list(service_names), servicer)
    await service.set_serving(True)
    return service


async def serve_until_signal(service: GrpcService, grace_s: float = 5.0,
                             drain: Callable[[], Awaitable[None]] | None = None) -> None:
    """Run until SIGINT or SIGTERM, then stop gracefully."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.create_task(service.wait_for_termination())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    await service.stop(grace_s, drain)
    waiter.cancel()
    stopper.cancel()


def host_port(address: str) -> str:
    """Accept "PORT", ":PORT" or "HOST:PORT"; default host is loopback."""
    if address.isdigit():
        return f"127.0.0.1:{address}"
    if address.startswith(":"):
        return f"127.0.0.1{address}"
    return address


def check_health(address: str, service: str = "", timeout_s: float = 2.0,
                 tls: TlsConfig | None = None) -> bool:
    """True when the gRPC health service at `address` reports `service` SERVING; over
    TLS with `tls` (a server requiring client certificates wants `tls`'s certificate)."""
    with open_channel(host_port(address), tls) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING
