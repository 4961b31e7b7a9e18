"""Prometheus series of the gateway.

Our series are `specdec_*`. The same measurements are exported again under the names
and labels vLLM's serving metrics have (`vllm:*`, labelled model_name and engine;
VllmNames), so a dashboard built on `vllm serve` (vLLM's own Grafana dashboard
among them) reads a specdec deployment unchanged. Each gateway owns its registry:
tests run several in one process.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from specdec.pb import verifier_pb2
from specdec.speculation import method_name

# Latency buckets (seconds) wide enough for a CPU deployment and a GPU one.
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
            5.0, 10.0, 20.0, 40.0, 80.0)
# Token counts: 1, 2, 5 per decade, as vLLM's request_*_tokens histograms have them.
_TOKENS = tuple(m * 10 ** e for e in range(6) for m in (1, 2, 5))
_AL = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0)


class VerifierCounters(Collector):
    """Each verifier's cumulative counts as its last Load report gave them (the verifier
    counts, the gateway exports): vLLM's prefix_cache_queries / _hits, in tokens, with
    the hit rate since the verifier started; and per drafter, the bets on outcomes
    looked up and hit (DraftBet)."""

    def __init__(self) -> None:
        self.reports: dict[str, verifier_pb2.LoadReport] = {}  # address -> last report

    def collect(self) -> Iterator[Metric]:
        queries = CounterMetricFamily(
            "specdec_verifier_prefix_cache_queries",
            "Context tokens of admitted sequences looked up in the verifier's prefix cache",
            labels=["verifier"])
        hits = CounterMetricFamily(
            "specdec_verifier_prefix_cache_hits",
            "Of those, tokens whose KV was found cached", labels=["verifier"])
        rate = GaugeMetricFamily("specdec_verifier_prefix_cache_hit_rate",
                                 "Prefix cache hits / queries since the verifier started",
                                 labels=["verifier"])
        for address, report in self.reports.items():
            if report.prefix_caching_enabled:
                queries.add_metric([address], report.prefix_cache_queries)
                hits.add_metric([address], report.prefix_cache_hits)
                rate.add_metric([address], report.prefix_cache_hit_rate)
        yield from (queries, hits, rate)
        labels = ["verifier", "drafter", "method"]
        lookups = CounterMetricFamily(
            "specdec_verifier_draft_bet_lookups",
            "Sequences asked for drafts with an outcome a bet or table could name, on "
            "drafters that place them", labels=labels)
        bet_hits = CounterMetricFamily(
            "specdec_verifier_draft_bet_hits",
            "Of those, sequences whose drafts came from a bet, without waiting for the "
            "drafter", labels=labels)
        for address, report in self.reports.items():
            for d in report.drafters:
                if d.bet_lookups:
                    names = [address, d.name, method_name(d.method) or ""]
                    lookups.add_metric(names, d.bet_lookups)
                    bet_hits.add_metric(names, d.bet_hits)
        yield from (lookups, bet_hits)


class GatewayMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specdec_requests", "Finished requests",
                                ["method", "finish_reason"], registry=r)
        self.request_errors = Counter("specdec_request_errors", "Requests that failed",
                                      ["code"], registry=r)
        self.running = Gauge("specdec_requests_running",
                             "Requests this gateway is streaming from a verifier", registry=r)
        self.verifier_running = Gauge("specdec_verifier_requests_running",
                                      "Running requests reported by each verifier",
                                      ["verifier"], registry=r)
        self.verifier_waiting = Gauge("specdec_verifier_requests_waiting",
                                      "Waiting requests reported by each verifier",
                                      ["verifier"], registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("specdec_generation_tokens", "Generated tokens",
                                         registry=r)
        self.num_drafts = Counter("specdec_spec_decode_num_drafts",
                                  "Steps that verified at least one draft token",
                                  ["method"], registry=r)
        self.num_draft_tokens = Counter("specdec_spec_decode_num_draft_tokens",
                                        "Draft tokens verified", ["method"], registry=r)
        self.num_accepted_tokens = Counter("specdec_spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted", ["method"], registry=r)
        self.accepted_per_pos = Counter("specdec_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft (1-based)",
                                        ["method", "position"], registry=r)
        self.acceptance_length = Histogram("specdec_spec_decode_acceptance_length",
                                           "Per request: tokens emitted per drafting step",
                                           ["method"], buckets=_AL, registry=r)
        self.k_chosen = Histogram("specdec_spec_decode_k",
                                  "K each verifier step asked of a speculative request "
                                  "(0: it ran without drafts)", ["method"],
                                  buckets=tuple(range(9)), registry=r)
        self.disabled = Counter("specdec_spec_decode_disabled",
                                "Requests served without a draft, by why speculation was off",
                                ["reason"], registry=r)
        self.plain_steps = Counter("specdec_spec_decode_plain_steps",
                                   "Steps of speculative requests run without drafts, by why "
                                   "(queue_size, dynamic_k, drafter_unavailable, ...)",
                                   ["reason"], registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY, registry=r)
        self.itl = Histogram("specdec_inter_token_latency_seconds",
                             "Time between consecutive output tokens (a step emitting n tokens "
                             "counts n intervals of its time / n)", buckets=_LATENCY, registry=r)
        self.tpot = Histogram("specdec_time_per_output_token_seconds",
                              "Per request: (end-to-end - TTFT) / (output tokens - 1)",
                              buckets=_LATENCY, registry=r)
        self.e2e = Histogram("specdec_e2e_request_latency_seconds", "End-to-end request latency",
                             buckets=_LATENCY, registry=r)
        # A request's phases as the gateway sees them: queued from its arrival until the
        # verifier's step that gave its first token began (that step's time taken from
        # when its first response came), prefill that step, decode the rest.
        self.queue_time = Histogram("specdec_request_queue_time_seconds",
                                    "Per request: arrival to the start of the verifier step "
                                    "that gave its first token", buckets=_LATENCY, registry=r)
        self.prefill_time = Histogram("specdec_request_prefill_time_seconds",
                                      "Per request: the verifier step that gave its first token",
                                      buckets=_LATENCY, registry=r)
        self.decode_time = Histogram("specdec_request_decode_time_seconds",
                                     "Per request: first token to last", buckets=_LATENCY,
                                     registry=r)
        self.request_prompt_tokens = Histogram("specdec_request_prompt_tokens",
                                               "Per request: prompt tokens", buckets=_TOKENS,
                                               registry=r)
        self.request_generation_tokens = Histogram("specdec_request_generation_tokens",
                                                   "Per request: generated tokens",
                                                   buckets=_TOKENS, registry=r)
        self.resumed = Counter("specdec_requests_resumed",
                               "Requests moved to another verifier replica mid-generation",
                               registry=r)
        self.held = Counter("specdec_requests_held",
                            "Requests held while no verifier replica served: to resume, or "
                            "new ones, to start",
                            registry=r)
        self.verifier_counters = VerifierCounters()
        r.register(self.verifier_counters)
        r.register(VllmNames(self, model_name))

    def observe_verifier(self, address: str, report: verifier_pb2.LoadReport) -> None:
        """The series a verifier's Load report carries."""
        self.verifier_running.labels(address).set(report.num_running)
        self.verifier_waiting.labels(address).set(report.num_waiting)
        self.verifier_counters.reports[address] = report

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VllmNames(Collector):
    """The gateway's series again as `vllm serve` names and labels them: one engine
    ("0") of model_name, counters summed over our extra labels (method, verifier), the
    verifiers' gauges over all replicas. Collected from our own series at each scrape,
    so the two never disagree."""

    # vllm name -> our histogram attribute. vLLM's request_max_num_generation_tokens is
    # the longest sequence of a request's n; each of ours is one sequence.
    HISTOGRAMS = {
        "vllm:time_to_first_token_seconds": "ttft",
        "vllm:inter_token_latency_seconds": "itl",
        "vllm:request_time_per_output_token_seconds": "tpot",
        "vllm:e2e_request_latency_seconds": "e2e",
        "vllm:request_queue_time_seconds": "queue_time",
        "vllm:request_prefill_time_seconds": "prefill_time",
        "vllm:request_decode_time_seconds": "decode_time",
        "vllm:request_prompt_tokens": "request_prompt_tokens",
        "vllm:request_generation_tokens": "request_generation_tokens",
        "vllm:request_max_num_generation_tokens": "request_generation_tokens",
    }
    # vllm name (without _total) -> (our counter attribute, the label vLLM keeps).
    COUNTERS = {
        "vllm:prompt_tokens": ("prompt_tokens", None),
        "vllm:generation_tokens": ("generation_tokens", None),
        "vllm:request_success": ("requests", "finish_reason"),
        "vllm:spec_decode_num_drafts": ("num_drafts", None),
        "vllm:spec_decode_num_draft_tokens": ("num_draft_tokens", None),
        "vllm:spec_decode_num_accepted_tokens": ("num_accepted_tokens", None),
        "vllm:spec_decode_num_accepted_tokens_per_pos": ("accepted_per_pos", "position"),
    }
    # Our label names where vLLM's differ.
    LABEL_AS = {"finish_reason": "finished_reason"}

    def __init__(self, metrics: GatewayMetrics, model_name: str):
        self.metrics = metrics
        self.labels = {"model_name": model_name, "engine": "0"}

    def collect(self) -> Iterator[Metric]:
        names, values = list(self.labels), list(self.labels.values())
        for theirs, ours in self.HISTOGRAMS.items():
            (metric,) = getattr(self.metrics, ours).collect()
            buckets = [(s.labels["le"], s.value) for s in metric.samples
                       if s.name.endswith("_bucket")]
            total = next(s.value for s in metric.samples if s.name.endswith("_sum"))
            family = HistogramMetricFamily(theirs, metric.documentation, labels=names)
            family.add_metric(values, buckets, total)
            yield family
        for theirs, (ours, keep) in self.COUNTERS.items():
            (metric,) = getattr(self.metrics, ours).collect()
            sums: dict[str, float] = {}
            for s in metric.samples:
                if s.name.endswith("_total"):
                    key = s.labels[keep] if keep else ""
                    sums[key] = sums.get(key, 0.0) + s.value
            family = CounterMetricFamily(
                theirs, metric.documentation,
                labels=names + ([self.LABEL_AS.get(keep, keep)] if keep else []))
            for key, value in sums.items():
                family.add_metric(values + ([key] if keep else []), value)
            if not keep and not sums:
                family.add_metric(values, 0.0)
            yield family
        reports = list(self.metrics.verifier_counters.reports.values())
        gauges = {
            "vllm:num_requests_running": ("Requests running on the verifiers",
                                          sum(r.num_running for r in reports)),
            "vllm:num_requests_waiting": ("Requests waiting on the verifiers",
                                          sum(r.num_waiting for r in reports)),
            "vllm:kv_cache_usage_perc": (
                "Share of the verifiers' KV cache in use (1 = full)",
                1.0 - sum(r.num_free_kv_tokens for r in reports)
                / max(1, sum(r.num_total_kv_tokens for r in reports)) if reports else 0.0),
        }
        for name, (doc, value) in gauges.items():
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        for name, field in (("vllm:prefix_cache_queries", "prefix_cache_queries"),
                            ("vllm:prefix_cache_hits", "prefix_cache_hits")):
            family = CounterMetricFamily(name, f"Prefix cache {field[13:]}, in tokens",
                                         labels=names)
            family.add_metric(values, sum(getattr(r, field) for r in reports))
            yield family
