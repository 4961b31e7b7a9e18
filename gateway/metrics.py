"""Prometheus series of the gateway.

Names follow the conventions serving engines use (vLLM's `vllm:spec_decode_*`
family, here under `specdec_`), so existing dashboards translate directly.
Each gateway owns its registry: tests run several in one process.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from specdec.pb import verifier_pb2
from specdec.speculation import method_name

# Latency buckets (seconds) wide enough for a CPU deployment and a GPU one.
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
            5.0, 10.0, 20.0, 40.0, 80.0)
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
            "Sequences asked for drafts right after a step that drafted for them, on "
            "drafters that place bets on outcomes", labels=labels)
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
    def __init__(self) -> None:
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
        self.resumed = Counter("specdec_requests_resumed",
                               "Requests moved to another verifier replica mid-generation",
                               registry=r)
        self.held = Counter("specdec_requests_held",
                            "Requests held while no verifier replica served: to resume, or "
                            "new ones, to start",
                            registry=r)
        self.verifier_counters = VerifierCounters()
        r.register(self.verifier_counters)

    def observe_verifier(self, address: str, report: verifier_pb2.LoadReport) -> None:
        """The series a verifier's Load report carries."""
        self.verifier_running.labels(address).set(report.num_running)
        self.verifier_waiting.labels(address).set(report.num_waiting)
        self.verifier_counters.reports[address] = report

    def render(self) -> bytes:
        return generate_latest(self.registry)
