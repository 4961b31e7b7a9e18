"""The gateway process: REST (uvicorn) and gRPC servers on one event loop,
sharing one `Gateway` (tokenizer, replicas, policies, metrics)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from dataclasses import dataclass
from typing import Any

import uvicorn

from gateway.core import Gateway
from gateway.grpc_api import GatewayServicer
from gateway.openai_api import create_app
from specdec.pb import gateway_pb2_grpc
from specdec.server import GrpcService, start_server
from specdec.tls import TlsConfig

log = logging.getLogger(__name__)


@dataclass
class GatewayService:
    gateway: Gateway
    http: uvicorn.Server
    http_task: asyncio.Task
    grpc: GrpcService | None
    http_port: int

    @property
    def grpc_port(self) -> int | None:
        return self.grpc.port if self.grpc is not None else None

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.grpc is not None:
            await self.grpc.stop(grace_s)
        self.http.should_exit = True
        try:
            await asyncio.wait_for(self.http_task, timeout=grace_s + 1.0)
        except TimeoutError:
            self.http.force_exit = True
            await asyncio.gather(self.http_task, return_exceptions=True)
        await self.gateway.replicas.close()


def uvicorn_ssl(tls: TlsConfig | None) -> dict[str, Any]:
    """uvicorn.Config's ssl_* arguments for `tls` (none: plain HTTP)."""
    if tls is None:
        return {}
    return {"ssl_certfile": tls.certfile, "ssl_keyfile": tls.keyfile,
            "ssl_ca_certs": tls.ca_certs,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_NONE}


async def serve(gateway: Gateway, http_host: str = "127.0.0.1", http_port: int = 8000,
                grpc_address: str | None = "127.0.0.1:50050",
                tls: TlsConfig | None = None) -> GatewayService:
    """Start polling the replicas, then both front ends (port 0 = any free port); with
    `tls`, REST is HTTPS and the gRPC API TLS, with the same certificate."""
    await gateway.replicas.start()
    # httptools: uvicorn's C parser and writer, as `vllm serve` runs; its pure-Python h11
    # took a tenth of the gateway's CPU per streamed token (1.05 -> 0.96 ms at C = 1).
    config = uvicorn.Config(create_app(gateway), host=http_host, port=http_port,
                            http="httptools", log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=5, **uvicorn_ssl(tls))
    http = uvicorn.Server(config)
    task = asyncio.create_task(http.serve())
    while not http.started:
        if task.done():
            task.result()  # raises the bind error
            raise OSError(f"HTTP server on {http_host}:{http_port} exited at start")
        await asyncio.sleep(0.01)
    port = http.servers[0].sockets[0].getsockname()[1]
    grpc_service = None
    if grpc_address is not None:
        servicer = GatewayServicer(gateway)
        grpc_service = await start_server(
            grpc_address,
            lambda server: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server),
            ["specdec.v1.Gateway"], servicer,
            # The public API takes messages no larger than REST takes bodies.
            max_receive_bytes=gateway.config.limits.max_body_bytes, tls=tls)
    return GatewayService(gateway, http, task, grpc_service, port)
