"""The gateway's export of its verifiers' cumulative counts (gateway/metrics.py)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from specdec.pb import common_pb2, verifier_pb2


def samples(metrics: GatewayMetrics) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples}


def test_each_drafters_bets_are_exported_per_verifier():
    metrics = GatewayMetrics()
    report = verifier_pb2.LoadReport()
    report.drafters.add(name="ngram", method=common_pb2.SPEC_METHOD_NGRAM, bet_lookups=40,
                        bet_hits=25)
    report.drafters.add(name="eagle3", method=common_pb2.SPEC_METHOD_EAGLE3)  # places none
    metrics.observe_verifier("v1:50051", report)
    report = verifier_pb2.LoadReport()
    report.drafters.add(name="ngram", method=common_pb2.SPEC_METHOD_NGRAM, bet_lookups=7,
                        bet_hits=1)
    metrics.observe_verifier("v2:50051", report)

    got = samples(metrics)

    def labels(verifier: str) -> tuple:
        return tuple(sorted({"verifier": verifier, "drafter": "ngram",
                             "method": "ngram"}.items()))

    assert got["specdec_verifier_draft_bet_lookups_total", labels("v1:50051")] == 40
    assert got["specdec_verifier_draft_bet_hits_total", labels("v1:50051")] == 25
    assert got["specdec_verifier_draft_bet_lookups_total", labels("v2:50051")] == 7
    assert got["specdec_verifier_draft_bet_hits_total", labels("v2:50051")] == 1
    assert not any(labels_ and dict(labels_).get("drafter") == "eagle3"
                   for _, labels_ in got)
