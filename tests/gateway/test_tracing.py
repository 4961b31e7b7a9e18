"""OpenTelemetry context crosses the services in gRPC metadata: the verifier's
request span is a child of the gateway's, and the drafter's stream span a
child of the verifier's stream span."""

from __future__ import annotations

import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specdec.telemetry import setup_tracing
from tests.gateway.stack import MODEL_NAME, GatewayStack


@pytest.fixture(scope="module")
def exporter():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.fail("another test installed a tracer provider first")
    return exporter


def test_spans_link_gateway_verifier_drafter(exporter, loop, model, smollm2_dir):
    s = GatewayStack(loop, model, smollm2_dir)
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
            extra_body={"speculative": {"method": "draft_model"}})
    finally:
        s.close()
    spans = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    gw = spans["gateway.generate"][0]
    ver = next(v for v in spans["verifier.generate"] if v.parent is not None)
    assert ver.parent.span_id == gw.context.span_id
    assert ver.context.trace_id == gw.context.trace_id
    assert ver.attributes["specdec.completion_tokens"] == 6
    # One stream per drafter and replica; each drafter-side span hangs off its stream.
    streams = {sp.context.span_id for sp in spans["verifier.draft_stream"]}
    drafter_spans = spans["drafter.draft_stream"]
    assert len(drafter_spans) >= 2
    assert all(sp.parent is not None and sp.parent.span_id in streams for sp in drafter_spans)


def test_no_endpoint_installs_nothing():
    assert setup_tracing("x", None) is False
