"""The Prometheus metrics of one server: operations served (both protocols) and state gauges.

What it owns: the registry ``GET /metrics`` renders. Operation metrics are recorded on
every request of either protocol, so recording is a few dict and list updates; the
metric families are built only when scraped.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from ..service import Service

# Latency buckets of rdzv_request_seconds, s: store ops take well under a millisecond,
# long-polls up to the 30 s default hold.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0)
_BUCKET_NAMES = (*map(floatToGoString, LATENCY_BUCKETS), "+Inf")


class Metrics:
    """Prometheus metrics of one app (its own registry, so several apps can share a process).

    ``rdzv_requests_total{op, code}`` and the ``rdzv_request_seconds{op}`` histogram are
    kept as plain numbers by :meth:`observe` and turned into metric families only when
    scraped: prometheus_client's own Counter and Histogram take a lock per update, which
    cost a few microseconds a request, and everything here runs on one event loop.
    """

    def __init__(self, svc: Service) -> None:
        self.registry = CollectorRegistry()
        # Both label sets are bounded: ops are wire.REQUESTS, codes are wire.ErrorCode + "ok".
        self._served: dict[tuple[str, str], int] = {}
        self._latency: dict[str, list[int]] = {}  # per op: count per bucket (not cumulative)
        self._seconds: dict[str, float] = {}
        self.registry.register(_OperationCollector(self))
        self.registry.register(_StateCollector(svc))

    def observe(self, op: str, code: str, seconds: float) -> None:
        """Count one served operation of a known ``op`` with result ``code``."""
        key = (op, code)
        self._served[key] = self._served.get(key, 0) + 1
        buckets = self._latency.get(op)
        if buckets is None:
            buckets = self._latency[op] = [0] * len(_BUCKET_NAMES)
            self._seconds[op] = 0.0
        buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self._seconds[op] += seconds


class _OperationCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Any:
        m = self.metrics
        served = CounterMetricFamily("rdzv_requests", "Operations served, by operation and result code.", labels=["op", "code"])
        for (op, code), n in m._served.items():
            served.add_metric([op, code], n)
        yield served
        latency = HistogramMetricFamily(
            "rdzv_request_seconds", "Time to serve an operation (long-polls include their hold).", labels=["op"]
        )
        for op, counts in m._latency.items():
            cumulative = list(itertools.accumulate(counts))
            latency.add_metric([op], list(zip(_BUCKET_NAMES, cumulative)), sum_value=m._seconds[op])
        yield latency


class _StateCollector:
    def __init__(self, svc: Service) -> None:
        self.svc = svc

    def collect(self) -> Any:
        jobs = self.svc.machine.jobs.values()
        by_state: dict[str, int] = {"open": 0, "complete": 0, "closed": 0}
        nodes = GaugeMetricFamily("rdzv_nodes", "Nodes known to the server, by role or liveness.", labels=["status"])
        counts: dict[str, int] = {}
        for e in jobs:
            by_state[e.job.state.value] += 1
            for (role, liveness), n in e.job.counts.items():
                status = liveness.value if role.value == "member" else role.value
                counts[status] = counts.get(status, 0) + n
        g = GaugeMetricFamily("rdzv_jobs", "Jobs by state.", labels=["state"])
        for state, n in by_state.items():
            g.add_metric([state], n)
        yield g
        for status, n in counts.items():
            nodes.add_metric([status], n)
        yield nodes
        yield GaugeMetricFamily("rdzv_keys", "Keys stored over all jobs.", value=sum(e.kv.total_keys() for e in jobs))
        yield GaugeMetricFamily("rdzv_waiters", "Parked long-polls.", value=len(self.svc.waiters))
        yield GaugeMetricFamily("rdzv_ready", "1 once recovery finished.", value=1 if self.svc.ready else 0)
