"""`specdec-gateway` / `python -m gateway`: OpenAI-compatible REST and the gRPC
Gateway API in front of one or more verifier replicas."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from specdec import tls
from specdec.server import (
    INTERNAL_TOKEN_ENV,
    add_open_access_argument,
    host_port,
    open_access_refusal,
)
from specdec.speculation import METHODS

log = logging.getLogger("gateway")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec-gateway", description=__doc__)
    p.add_argument("--model", help="model directory, for the tokenizer and chat template "
                   "(default: the prepared default model)")
    p.add_argument("--served-model-name", help="model name clients send (default: the "
                   "directory's name)")
    p.add_argument("--verifier", action="append", default=[], metavar="HOST:PORT",
                   help="a verifier replica; repeat for several (default 127.0.0.1:50051)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="REST port")
    p.add_argument("--grpc-port", type=int, default=50050, help="gRPC port (-1 = no gRPC API)")
    p.add_argument("--speculative-method", default="none",
                   choices=list(METHODS),
                   help="method for requests that do not choose one")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="K for requests that do not choose one: their static K, or with "
                   "--dynamic-k the upper bound of their dynamic K")
    p.add_argument("--dynamic-k", action=argparse.BooleanOptionalAction, default=True,
                   help="requests that do not choose K get dynamic K (\"auto\"): the verifier "
                   "chooses each step's K within --num-speculative-tokens (default on)")
    p.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="log lines as text or as JSON objects (one per request on "
                   "gateway.requests: id, status, method, K, tokens, TTFT, end-to-end time)")
    p.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $SPECDEC_API_KEY)")
    p.add_argument("--max-queue-time-s", type=float, default=60.0,
                   help="refuse (429, Retry-After) a request expected to wait longer than "
                   "this for a verifier slot (0 = never)")
    p.add_argument("--max-num-requests", type=int, default=1024,
                   help="requests held at once, past which new ones get 429 (0 = no limit)")
    p.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="a request's time from admission to its last token, unless it asks "
                   "for less (REST `timeout`, gRPC deadline); 0 = none")
    p.add_argument("--resume-wait-s", type=float, default=120.0,
                   help="a request whose verifier replicas all failed waits this long for one "
                   "to serve again, then resumes from its tokens so far, and a new request "
                   "arriving while none serves waits as long (0 = fail at once)")
    add_open_access_argument(p, "an API key")
    p.add_argument("--max-prompt-tokens", type=int, default=0)
    p.add_argument("--max-tokens-limit", type=int, default=0,
                   help="largest max_tokens a request may ask for (0 = model length)")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--otlp-endpoint", default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
                   help="export OpenTelemetry spans over OTLP/gRPC to this endpoint")
    p.add_argument("--grace-s", type=float, default=10.0)
    tls.add_server_arguments(p, None, what="REST (HTTPS) and the gRPC API")
    return p


async def _serve(args: argparse.Namespace, public_tls: tls.TlsConfig | None,
                 internal_tls: tls.TlsConfig | None) -> int:
    from gateway.core import Gateway, GatewayConfig, Limits
    from gateway.replicas import ReplicaPool
    from gateway.service import serve
    from specdec.models.prepare import prepare_default_model
    from specdec.telemetry import setup_tracing
    from specdec.tokenizer import Tokenizer, model_fingerprint

    setup_tracing("specdec-gateway", args.otlp_endpoint)
    model_dir = Path(args.model) if args.model else prepare_default_model()
    tokenizer = Tokenizer.from_dir(model_dir)
    config = GatewayConfig(
        model_name=args.served_model_name or model_dir.name, model_root=str(model_dir),
        default_method=args.speculative_method,
        default_num_speculative_tokens=args.num_speculative_tokens,
        default_auto_k=args.dynamic_k,
        limits=Limits(
            max_prompt_tokens=args.max_prompt_tokens,
            max_tokens=args.max_tokens_limit,
            max_body_bytes=args.max_body_bytes,
        ),
        api_key=args.api_key or None,
        max_queue_time_s=args.max_queue_time_s,
        max_num_requests=args.max_num_requests,
        request_timeout_s=args.request_timeout_s,
        resume_wait_s=args.resume_wait_s,
    )
    replicas = ReplicaPool([host_port(v) for v in args.verifier or ["127.0.0.1:50051"]],
                           model_fingerprint(model_dir),
                           token=os.environ.get(INTERNAL_TOKEN_ENV) or None, tls=internal_tls)
    gateway = Gateway(config, tokenizer, replicas)
    grpc_address = None if args.grpc_port < 0 else f"{args.host}:{args.grpc_port}"
    service = await serve(gateway, args.host, args.port, grpc_address, public_tls)
    log.info("gateway serving %s: %s://%s:%d/v1 (gRPC %s%s), verifiers %s", config.model_name,
             "https" if public_tls else "http", args.host, service.http_port,
             service.grpc_port or "off", " TLS" if public_tls and service.grpc_port else "",
             ", ".join(r.address for r in replicas.replicas))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Registered after uvicorn started, so these replace the handlers it installed.
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop(args.grace_s)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        public_tls = tls.server_from_args(args)
        internal_tls = tls.TlsConfig.from_env()  # to the verifiers
    except ValueError as e:
        print(f"specdec-gateway: {e}", file=sys.stderr)
        return 2
    refusal = open_access_refusal("specdec-gateway", args, bool(args.api_key),
                                  "Set --api-key (or SPECDEC_API_KEY)")
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    from specdec.telemetry import setup_logging

    setup_logging(args.log_format)
    import uvloop

    return uvloop.run(_serve(args, public_tls, internal_tls))


if __name__ == "__main__":
    sys.exit(main())
