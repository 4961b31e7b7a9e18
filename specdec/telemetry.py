"""OpenTelemetry set-up shared by the services, and trace context over gRPC metadata.

Without an endpoint nothing is installed: the API's no-op tracer makes spans
free, and no context travels. With one, spans go to an OTLP/gRPC collector in
batches. Context crosses services as W3C `traceparent` metadata: gateway ->
verifier per request, verifier -> drafter per Draft stream (one stream carries
many requests, so drafter spans hang off the stream, not off a request).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from opentelemetry import context, propagate, trace

log = logging.getLogger(__name__)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and a record's `fields`
    (a dict passed as `extra={"fields": ...}`, e.g. the gateway's request log) merged in."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": self.formatTime(record), "level": record.levelname,
               "logger": record.name, "message": record.getMessage()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(log_format: str = "text") -> None:
    """Log at INFO to stderr, as text lines or (log_format "json") JSON objects."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(
        "%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


def setup_tracing(service_name: str, otlp_endpoint: str | None) -> bool:
    """Install a tracer provider exporting to `otlp_endpoint`; False (and nothing
    installed) without one."""
    if not otlp_endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(
        OTLPSpanExporter(endpoint=otlp_endpoint, insecure=not otlp_endpoint.startswith("https"))))
    trace.set_tracer_provider(provider)
    log.info("exporting traces to %s", otlp_endpoint)
    return True


def outgoing_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as gRPC metadata (empty when nothing is traced)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def incoming_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> context.Context:
    """The caller's trace context from gRPC invocation metadata."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)
