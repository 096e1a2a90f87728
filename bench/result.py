"""The records every measurement returns, and how a run is summed up.

What it owns: :class:`Row` (one figure: what, which backend, N, value and unit, or why
there is no value) and :class:`Plan` (what this run measures and how hard). Targets are
judged in :mod:`bench.target`; rendering is :mod:`bench.report`'s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

#: A row's status: ``ok`` has a value; the others say why it has none.
STATUSES = ("ok", "timeout", "unavailable", "error", "skipped", "never", "unsupported")


@dataclass
class Row:
    """One figure of the report."""

    measurement: str  # formation | store | rerdzv | server | ha | scale
    backend: str  # the backend's label
    metric: str  # e.g. "formation time", "set p50", "detect (kill)"
    n: int | None  # nodes, clients or jobs x nodes: what the figure scales with
    value: float | None
    unit: str
    status: str = "ok"
    detail: str = ""
    target: str = ""  # filled in by bench.target
    passed: bool | None = None  # None: no target for this row

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r}")

    @staticmethod
    def failed(measurement: str, backend: str, metric: str, n: int | None, unit: str, status: str, detail: str) -> Row:
        return Row(measurement, backend, metric, n, None, unit, status, detail)


@dataclass(frozen=True)
class Plan:
    """What a run measures: parsed from the command line by ``bench.__main__``."""

    quick: bool
    only: tuple[str, ...]
    backends: tuple[str, ...]
    formation_sizes: tuple[int, ...]
    rerdzv_sizes: tuple[int, ...]
    timeout: float  # per formation / per phase of a re-rendezvous, s
    out_dir: Any  # pathlib.Path
    store_ops: int  # latency samples per operation
    throughput_seconds: float
    throughput_clients: tuple[int, ...]
    server_jobs: int
    server_nodes: int
    server_sample_seconds: float
    recovery_keys: int
    ha_clients: tuple[int, ...]  # concurrent writers per throughput step (bench.ha)
    ha_sizes: tuple[int, ...]  # formation sizes per mode (bench.ha)
    ha_ttls: tuple[int, ...]  # replica lease TTLs, s, each with its own take-overs (bench.ha)
    ha_repeats: int  # leader kills per TTL
    ha_ops: int  # round-trip samples per operation
    ha_etcd_election_ms: int = 0  # etcd's --election-timeout (heartbeat a tenth of it); 0: etcd's default
    scale_sizes: tuple[int, ...] = ()  # agents in the one job of bench.scale
    scale_seconds: float = 30.0  # how long bench.scale samples the server's CPU under heartbeats
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def log_dir(self) -> Any:
        return self.out_dir / "logs"

    @property
    def work_dir(self) -> Any:
        return self.out_dir / "tmp"


def load_average() -> float:
    """The 1-minute load average: the bench shares the machine, so every result records it."""
    return os.getloadavg()[0]


def percentile(values: Sequence[float], p: float) -> float:
    """The nearest-rank ``p``-th percentile of ``values`` (not empty): a value that was measured."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]
