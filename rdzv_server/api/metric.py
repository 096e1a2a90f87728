"""The Prometheus metrics of one server: operations served (both protocols), what happened to
jobs (joins, rounds formed and how long they took, departures by cause, how long a death took
to notice) and state gauges.

What it owns: the registry ``GET /metrics`` renders. Operation metrics are recorded on
every request of either protocol, so recording is a few dict and list updates; the
metric families are built only when scraped. Connection metrics (how close each
transport limit is, what was shed or refused) are read from the
:class:`.connection.ConnectionTable` at scrape time.
"""

from __future__ import annotations

import bisect
import importlib.metadata
import itertools
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from rdzv_client.wire import signal_name

from ..core.event import JobEvent, Kind
from ..service import Service
from .connection import PROTOCOLS, ConnectionTable

# Latency buckets of rdzv_request_seconds, s: store ops take well under a millisecond,
# long-polls up to the 30 s default hold.
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0, 30.0)
try:
    _VERSION = importlib.metadata.version("rdzv-server")
except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
    _VERSION = "unknown"
# Formation of a round, s: milliseconds when max_nodes arrive together, last_call_timeout (30 s
# by default) after min_nodes, up to join_timeout (600 s).
FORMATION_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# From a node's death to the server marking it dead, s: the disconnect grace (0.5 s) for a
# crashed agent, the heartbeat TTL (10-15 s by default) for a host that vanished.
DETECTION_BUCKETS = (0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0)
# The served count of a one-way beat taken (see Metrics.beat_taken).
_BEAT_OK = ("beat", "ok")


class _Histogram:
    """One labelled histogram as plain numbers: counts per bucket (not cumulative) and sums."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.names = (*map(floatToGoString, buckets), "+Inf")
        self.counts: dict[str, list[int]] = {}
        self.sums: dict[str, float] = {}

    def observe(self, label: str, value: float) -> None:
        counts = self.counts.get(label)
        if counts is None:
            counts = self.counts[label] = [0] * len(self.names)
            self.sums[label] = 0.0
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sums[label] += value

    def family(self, name: str, documentation: str, label: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, documentation, labels=[label])
        for value, counts in self.counts.items():
            cumulative = list(itertools.accumulate(counts))
            family.add_metric([value], list(zip(self.names, cumulative)), sum_value=self.sums[value])
        return family


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
        self._latency = _Histogram(LATENCY_BUCKETS)  # by op
        self._auth_failures: dict[str, int] = {}  # by reason: missing, wrong, forbidden
        # What happened to jobs; every label set is bounded (event.Cause values, one "all").
        self._joins: dict[str, int] = {}  # by the place a node got: candidate, waiting, standby, rejoined
        self._rounds: dict[str, int] = {}  # by reason
        self._departures: dict[str, int] = {}  # by cause
        self._refusals: dict[str, int] = {}  # node_refused, by cause: health_check_failed, cordoned
        self._restarts: dict[str, int] = {}  # restart_counted, by cause: member_died, workers_failed
        self._closures: dict[str, int] = {}  # job_closed, by cause (restart_budget_exhausted among them)
        self._worker_failures: dict[str, int] = {}  # failed workers of workers_failed events, by failure_kind
        self._formation = _Histogram(FORMATION_BUCKETS)  # by reason
        self._detection = _Histogram(DETECTION_BUCKETS)  # by cause
        svc.on_events = self.events_applied
        svc.on_detected = self._detection.observe
        self.registry.register(_OperationCollector(self))
        self.registry.register(_StateCollector(svc))

    def track_connections(self, table: ConnectionTable) -> None:
        """Export the connection table's gauges and counters (once, when the server starts)."""
        self.registry.register(_ConnectionCollector(table))

    def auth_failed(self, reason: str) -> None:
        """Count a request refused for its credentials (``missing``, ``wrong`` or ``forbidden``)."""
        self._auth_failures[reason] = self._auth_failures.get(reason, 0) + 1

    def observe(self, op: str, code: str, seconds: float) -> None:
        """Count one served operation of a known ``op`` with result ``code``."""
        key = (op, code)
        self._served[key] = self._served.get(key, 0) + 1
        self._latency.observe(op, seconds)

    def beat_taken(self) -> None:
        """Count one one-way beat taken (``rdzv_requests_total{op="beat",code="ok"}``): counted,
        not timed, as it has no reply whose latency could be told."""
        self._served[_BEAT_OK] = self._served.get(_BEAT_OK, 0) + 1

    def events_applied(self, events: tuple[JobEvent, ...]) -> None:
        """Count what an applied, durable command did to its job (the service's ``on_events``)."""
        for event in events:
            cause = event.cause.value
            if event.kind is Kind.NODE_JOINED:
                self._joins[cause] = self._joins.get(cause, 0) + 1
            elif event.kind is Kind.ROUND_FORMED:
                self._rounds[cause] = self._rounds.get(cause, 0) + 1
                self._formation.observe(cause, float(event.detail.get("formation_s", 0.0)))
            elif event.kind is Kind.NODE_DEPARTED:
                self._departures[cause] = self._departures.get(cause, 0) + 1
            elif event.kind is Kind.NODE_REFUSED:
                self._refusals[cause] = self._refusals.get(cause, 0) + 1
            elif event.kind is Kind.RESTART_COUNTED:
                self._restarts[cause] = self._restarts.get(cause, 0) + 1
            elif event.kind is Kind.JOB_CLOSED:
                self._closures[cause] = self._closures.get(cause, 0) + 1
            elif event.kind is Kind.WORKERS_FAILED:
                for kind in failure_kinds(event.detail.get("failures", ())):
                    self._worker_failures[kind] = self._worker_failures.get(kind, 0) + 1


def failure_kind(exit_code: int) -> str:
    """A failed worker's metric label: a few exit code classes and the signal names, a bounded
    set (no job, no rank): exit 1 is Python's uncaught exception, 2-125 a program's own codes,
    126-255 a shell's (not executable, not found, 128+N: killed by signal N)."""
    if exit_code < 0:
        name = signal_name(exit_code)
        return name if name.startswith("SIG") else "signal_other"
    if exit_code <= 1:
        return f"exit_{exit_code}"
    return "exit_2_125" if exit_code <= 125 else "exit_126_255"


def failure_kinds(failures: Iterable[dict[str, Any]]) -> list[str]:
    """The labels of a workers_failed event's failures; a report with none is one ``no_detail``."""
    kinds = [failure_kind(int(f["exit_code"])) for f in failures]
    return kinds or ["no_detail"]


class _OperationCollector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Any:
        m = self.metrics
        served = CounterMetricFamily(
            "rdzv_requests", "Operations served, by operation and result code.", labels=["op", "code"]
        )
        for (op, code), n in m._served.items():
            served.add_metric([op, code], n)
        yield served
        yield m._latency.family(
            "rdzv_request_seconds", "Time to serve an operation (long-polls include their hold).", "op"
        )
        auth = CounterMetricFamily(
            "rdzv_auth_failures",
            "Requests refused for their credentials: no token, a wrong one, or one that does not allow it.",
            labels=["reason"],
        )
        for reason in ("missing", "wrong", "forbidden"):
            auth.add_metric([reason], m._auth_failures.get(reason, 0))
        yield auth
        for name, doc, label, counts in (
            ("rdzv_node_joins", "Nodes that joined a job, by the place they got in line.", "role", m._joins),
            ("rdzv_rounds_formed", "Rounds formed, by what completed them.", "reason", m._rounds),
            ("rdzv_node_departures", "Nodes that left a job, by cause (crashed, vanished, left, timed out).",
             "cause", m._departures),
            ("rdzv_node_refusals", "Nodes not admitted: a failed health check, a cordoned host.", "cause", m._refusals),
            ("rdzv_restarts", "Failures that spent a restart of a job's budget (max_restarts), by cause.", "cause",
             m._restarts),
            ("rdzv_jobs_closed", "Jobs closed, by cause (restart_budget_exhausted: the server stopped it).", "cause",
             m._closures),
            ("rdzv_worker_failures", "Failed workers the nodes reported (workers_failed), by how they ended: the "
             "signal, exit_1, exit_2_125, exit_126_255, or no_detail.", "kind", m._worker_failures),
        ):
            family = CounterMetricFamily(name, doc, labels=[label])
            for value, n in sorted(counts.items()):
                family.add_metric([value], n)
            yield family
        yield m._formation.family(
            "rdzv_round_formation_seconds", "From a round's opening to its formation, by what completed it.", "reason"
        )
        yield m._detection.family(
            "rdzv_death_detection_seconds",
            "From a node's last sign of life (its dropped watch, its last heartbeat) to the server marking it dead.",
            "cause",
        )
        info = GaugeMetricFamily("rdzv_build_info", "The server's version (always 1).", labels=["version"])
        info.add_metric([_VERSION], 1)
        yield info


class _StateCollector:
    def __init__(self, svc: Service) -> None:
        self.svc = svc

    def collect(self) -> Any:
        jobs = self.svc.jobs()
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
        cordons = GaugeMetricFamily(
            "rdzv_cordons", "Hosts cordoned now, by whom: operator (rdzvctl) or flapping (automatic quarantine).",
            labels=["by"],
        )
        for by, n in self.svc.cordon_counts().items():
            cordons.add_metric([by], n)
        yield cordons
        # The restart budgets of the jobs that set one, summed (no job id in the metrics: each
        # job's own count is in its document, `rdzvctl show` and its page).
        budgeted = [e.job for e in jobs if e.job.settings.max_restarts is not None]
        yield GaugeMetricFamily("rdzv_restarts_used", "Restarts spent by the jobs with a restart budget (max_restarts), summed.",
                                value=sum(j.restarts for j in budgeted))
        yield GaugeMetricFamily("rdzv_restarts_budget", "The restart budgets (max_restarts) of those jobs, summed.",
                                value=sum(j.settings.max_restarts or 0 for j in budgeted))
        yield GaugeMetricFamily(
            "rdzv_jobs_budget_spent", "Running jobs whose restart budget is spent: their next failure stops them.",
            value=sum(1 for j in budgeted if j.state.value != "closed" and j.restarts >= (j.settings.max_restarts or 0)),
        )
        yield from self._limits()
        yield GaugeMetricFamily("rdzv_waiters", "Parked long-polls.", value=len(self.svc.waiters))
        yield GaugeMetricFamily("rdzv_ready", "1 once recovery finished.", value=1 if self.svc.ready else 0)
        roles = GaugeMetricFamily(
            "rdzv_replica_role", "1 for this server's role: single (no --etcd), leader, follower or candidate.",
            labels=["role"],
        )
        for name in ("single", "leader", "follower", "candidate"):
            roles.add_metric([name], 1 if self.svc.role == name else 0)
        yield roles


    def _limits(self) -> Any:
        """Each state limit beside its use: the fullest job for the per-job quotas."""
        config = self.svc.config
        stores = [e.kv for e in self.svc.jobs()]
        sessions, session_bytes = self.svc.session_usage()
        rows = (
            ("rdzv_jobs_held", "Jobs held (every state).", len(stores), "max_jobs"),
            ("rdzv_job_keys_max", "Keys of the job that holds the most.", max((kv.keys for kv in stores), default=0),
             "max_keys_per_job"),
            ("rdzv_job_bytes_max", "Bytes of keys and values of the job that holds the most.",
             max((kv.bytes for kv in stores), default=0), "max_job_bytes"),
            ("rdzv_sessions", "Clients whose writes are remembered for exactly-once retries.", sessions,
             "max_sessions"),
            ("rdzv_session_bytes", "Bytes of write results kept for retries.", session_bytes,
             "max_session_bytes"),
        )
        for name, text, value, flag in rows:
            yield GaugeMetricFamily(name, text, value=value)
            yield GaugeMetricFamily(
                f"{name}_limit", f"The limit of {name} (--{flag.replace('_', '-')}).", value=getattr(config, flag)
            )


class _ConnectionCollector:
    def __init__(self, table: ConnectionTable) -> None:
        self.table = table

    def collect(self) -> Any:
        t = self.table
        conns = GaugeMetricFamily(
            "rdzv_connections", "Open connections, by protocol (undecided: not spoken yet).", labels=["protocol"]
        )
        counts = {"undecided": len(t.undecided), **t.by_protocol}
        for protocol in PROTOCOLS:
            conns.add_metric([protocol], counts[protocol])
        yield conns
        yield GaugeMetricFamily(
            "rdzv_connections_limit",
            "Open connections allowed (--max-connections, clamped to the open-files limit).",
            value=t.max_connections,
        )
        yield GaugeMetricFamily(
            "rdzv_buffered_bytes", "Bytes of partly received requests held over all connections.", value=t.buffered
        )
        yield GaugeMetricFamily(
            "rdzv_buffered_bytes_limit",
            "Bytes of partly received requests allowed (--max-buffered-bytes).",
            value=t.max_buffered_bytes,
        )
        yield GaugeMetricFamily(
            "rdzv_pre_auth_buffered_bytes",
            "Of rdzv_buffered_bytes, those held by connections that have not shown a token yet.",
            value=t.pre_auth_buffered,
        )
        yield GaugeMetricFamily(
            "rdzv_pre_auth_buffered_bytes_limit",
            "Bytes connections that have not shown a token may hold together (--max-pre-auth-bytes).",
            value=t.max_pre_auth_bytes,
        )
        shed = CounterMetricFamily(
            "rdzv_connections_shed", "Connections the server closed, by reason.", labels=["reason"]
        )
        for reason, n in t.shed_total.items():
            shed.add_metric([reason], n)
        yield shed
        rejected = CounterMetricFamily(
            "rdzv_requests_rejected",
            "Requests and connections refused before reaching an operation, by error code.",
            labels=["code"],
        )
        for code, n in sorted(t.rejected_total.items()):
            rejected.add_metric([code], n)
        yield rejected
