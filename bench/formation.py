"""Formation: how long N nodes take to form one round, for each backend.

How: a fresh job (``min_nodes = max_nodes = N``, so the round completes the moment the
last node joins, never at a last call) with its N nodes spread over worker processes,
256 handler threads at most per process (:mod:`bench.nodes`). Every handler is made and
waiting before the common start; the time is from that start until the last node holds
its ``RendezvousInfo`` (which includes the MASTER_ADDR/PORT exchange every torchrun agent
does in ``next_rendezvous``). The ranks must be 0..N-1 once each. A size that does not
form within the plan's timeout is reported as a timeout, and the larger sizes of that
backend are skipped.
"""

from __future__ import annotations

import logging
import uuid

from .backend import Backend
from .nodes import GO, NodeError, Phase, SimulatedJob, ranks_ok, split
from .process import Timeout, Unavailable
from .result import Plan, Row, load_average

log = logging.getLogger("bench")

METRIC = "formation time"


def measure(backends: list[Backend], plan: Plan) -> tuple[list[Row], dict[str, object]]:
    """Rows of formation time per backend and N, and the raw per-node finish times."""
    rows: list[Row] = []
    raw: dict[str, object] = {}
    for backend in backends:
        try:
            backend.start(plan.work_dir, plan.log_dir)
        except (Unavailable, Timeout) as exc:
            status = "unavailable" if isinstance(exc, Unavailable) else "error"
            rows += [Row.failed("formation", backend.label, METRIC, n, "s", status, str(exc)) for n in plan.formation_sizes]
            continue
        try:
            gave_up = ""
            for n in plan.formation_sizes:
                if gave_up:
                    rows.append(Row.failed("formation", backend.label, METRIC, n, "s", "skipped", gave_up))
                    continue
                row, finish = form_round(backend, n, plan)
                rows.append(row)
                raw[f"{backend.label}/{n}"] = {"finish_s": finish, "load": load_average()}
                log.info("formation %s N=%d: %s %s", backend.label, n, row.status, _shown(row))
                if row.status != "ok":
                    gave_up = f"{row.status} at N={n}"
        finally:
            backend.stop()
    return rows, raw


def _cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system) the service has used so far, or None without a service."""
    import psutil

    if pid is None:
        return None
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def form_round(backend: Backend, n: int, plan: Plan) -> tuple[Row, list[float]]:
    """One fresh job of N nodes on a started backend: its formation row and each node's finish time (s)."""
    spec = backend.node_spec(f"formation-{n}-{uuid.uuid4().hex[:8]}", n, n, backend.base_conf())
    with SimulatedJob(spec, split(range(n), (Phase.on(GO),)), plan.timeout) as job:
        try:
            job.start()
            cpu_before = _cpu_seconds(backend.service_pid())
            t0 = job.fire(GO)
            formed = job.wait_formed(0, n, plan.timeout)
            cpu_after = _cpu_seconds(backend.service_pid())
        except Timeout as exc:
            done = job.count("formed", 0)
            return Row.failed("formation", backend.label, METRIC, n, "s", "timeout", f"{exc} ({done}/{n} formed)"), []
        except NodeError as exc:
            return Row.failed("formation", backend.label, METRIC, n, "s", "error", str(exc)), []
    finish = sorted(r.t - t0 for r in formed)
    problem = ranks_ok(formed, n)
    if problem:
        return Row.failed("formation", backend.label, METRIC, n, "s", "error", problem), finish
    detail = f"median node {finish[len(finish) // 2]:.3f} s"
    if cpu_before is not None and cpu_after is not None:
        detail += f"; service CPU {cpu_after - cpu_before:.2f} s"
    return Row("formation", backend.label, METRIC, n, finish[-1], "s", detail=detail), finish


def _shown(row: Row) -> str:
    return f"{row.value:.3f} s" if row.value is not None else row.detail
