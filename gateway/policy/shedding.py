"""Load shedding: refuse a request now (429) rather than serve it too late.

A verifier runs max_num_seqs requests at once and queues the rest. A request
admitted behind `load` others starts once floor(load / max_num_seqs) rounds of
the replica's slots have been served, so it waits about that many service
times, a service time being how long a request occupies a slot (its first token
to its last; measured by the gateway from its own requests, per replica). A
request whose expected wait exceeds the deployment's maximum queue time is
refused with Retry-After, so that the ones admitted keep a bounded latency, and
a client learns at once that it should come back rather than hang.
"""

from __future__ import annotations

import math

from gateway.policy.values import check_count, is_number

# Weight of the newest request in the service-time average: about the last 20
# requests of a replica count, so the estimate follows a change of load or of
# reply lengths within a round or two of its slots.
SERVICE_TIME_WEIGHT = 0.05


def expected_wait_s(load: int, max_num_seqs: int, service_time_s: float | None) -> float:
    """Seconds a request admitted now waits before its first step: 0 while a slot is
    free, else the rounds of slots ahead of it times the service time (0 while no
    request has been measured yet)."""
    check_count("expected_wait_s: load", load)
    if max_num_seqs < 1:
        raise ValueError(f"expected_wait_s: max_num_seqs must be >= 1, got {max_num_seqs}")
    if service_time_s is None:
        return 0.0
    if not (is_number(service_time_s) and service_time_s >= 0):
        raise ValueError(f"expected_wait_s: service_time_s must be >= 0, got {service_time_s!r}")
    return (load // max_num_seqs) * service_time_s


def retry_after_s(wait_s: float, max_queue_time_s: float) -> int:
    """Whole seconds after which the queue has drained below the limit, at least 1."""
    return max(1, math.ceil(wait_s - max_queue_time_s))


class ServiceTimes:
    """Per replica, an exponential average of how long a request holds a slot."""

    def __init__(self, weight: float = SERVICE_TIME_WEIGHT):
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.weight = weight
        self._mean: dict[str, float] = {}

    def observe(self, replica: str, seconds: float) -> None:
        if not (is_number(seconds) and seconds >= 0):
            raise ValueError(f"service time must be >= 0 seconds, got {seconds!r}")
        old = self._mean.get(replica)
        self._mean[replica] = seconds if old is None else old + self.weight * (seconds - old)

    def get(self, replica: str) -> float | None:
        """The average, None before the replica's first finished request."""
        return self._mean.get(replica)
