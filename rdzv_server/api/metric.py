"""The Prometheus metrics of one server: operations served (both protocols) and state gauges.

What it owns: the registry ``GET /metrics`` renders. Operation metrics are recorded on
every request of either protocol, so recording is a dict lookup and two updates: the
labelled children are resolved once per (op, code), never per request.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

from ..service import Service


class Metrics:
    """Prometheus metrics of one app (its own registry, so several apps can share a process)."""

    def __init__(self, svc: Service) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rdzv_requests", "Operations served, by operation and result code.", ["op", "code"], registry=self.registry
        )
        self.latency = Histogram(
            "rdzv_request_seconds",
            "Time to serve an operation (long-polls include their hold).",
            ["op"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30),
            registry=self.registry,
        )
        self.registry.register(_StateCollector(svc))
        # Both label sets are bounded: ops are wire.REQUESTS, codes are wire.ErrorCode + "ok".
        self._counters: dict[tuple[str, str], Any] = {}
        self._histograms: dict[str, Any] = {}

    def observe(self, op: str, code: str, seconds: float) -> None:
        """Count one served operation of a known ``op`` with result ``code``."""
        counter = self._counters.get((op, code))
        if counter is None:
            counter = self._counters[(op, code)] = self.requests.labels(op, code)
        counter.inc()
        histogram = self._histograms.get(op)
        if histogram is None:
            histogram = self._histograms[op] = self.latency.labels(op)
        histogram.observe(seconds)


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
