"""bench/chaos.py: its table of overload responses and injected faults."""

from bench import chaos


def test_render_reports_statuses_faults_and_losses():
    result = {
        "device_name": "CPU", "timestamp": "2026-11-25T10:00:00+00:00",
        "overload": {"requests": 512, "max_tokens": 64, "wall_s": 80.0,
                     "statuses": {"200": 300, "429": 212}, "served": 300,
                     "served_within_90s": 0.95, "served_s_p50": 30.0, "served_s_p90": 70.0,
                     "server_errors": 0, "client_errors": 0},
        "chaos": {"seconds": 180.0, "concurrency": 8, "max_tokens": 64,
                  "faults": [{"service": "ngram"}, {"service": "verifier"}],
                  "faults_by_service": {"ngram": 1, "eagle3": 0, "verifier": 1},
                  "requests": 90, "lost": 1, "corrupted": 0,
                  "lost_statuses": ["503"]},
    }
    text = chaos.render(result)
    assert "| 200: 300, 429: 212 | 300 | 95 % | 30.0 / 70.0 | 0 | 0 |" in text
    assert "| 2 (ngram 1, eagle3 0, verifier 1) | 90 | 1 | 0 |" in text
    assert "Lost requests ended with: 503" in text


def test_a_soak_reports_rss_per_service_and_no_overload_phase():
    result = {
        "device_name": "CPU", "timestamp": "2026-12-06T10:00:00+00:00", "overload": None,
        "chaos": {"seconds": 1200.0, "concurrency": 8, "max_tokens": 64,
                  "faults": [{"service": "verifier"}], "faults_by_service": {"verifier": 1},
                  "requests": 900, "lost": 0, "corrupted": 0, "lost_statuses": [],
                  "rss": {"gateway": {"before_kb": 400 * 1024, "after_kb": 410 * 1024,
                                      "restarted": False},
                          "verifier": {"before_kb": 2000 * 1024, "after_kb": 1900 * 1024,
                                       "restarted": True}}},
    }
    text = chaos.render(result)
    assert "Overload" not in text
    assert "| gateway | 400 | 410 | +2.5% |" in text
    assert "| verifier | 2000 | 1900 | restarted (a fault killed it) |" in text
