"""Re-rendezvous: how fast the survivors of a failed node form the next round.

How: a job of N nodes (``min_nodes = N-1``, ``max_nodes = N``) forms; one node lives in a
worker process of its own (started after the first worker, so with c10d it never hosts
the store). Then:

- kill (every backend): SIGKILL that process, so the kernel closes its connections. The
  survivors poll ``num_nodes_waiting()`` every 0.1 s as torchrun's agent does; "detect" is
  when the last survivor sees it positive, "form N-1" when the last survivor holds its
  info of the next round (they call ``next_rendezvous()`` as soon as they see it). torch's
  backends never report a dead node in ``num_nodes_waiting()`` (pytorch#111646), so there
  the survivors call ``next_rendezvous()`` right after the kill (as a collective timeout
  would make them, at the earliest) and detection is reported as "never".
- silent vanish (rdzv-server only): SIGSTOP instead, so nothing is closed and only the
  heartbeat TTL (0.5 s x 4 = 2 s) can tell; then a replacement node joins and the
  survivors, seeing it waiting, re-join: "form N (replacement)" runs from its join to the
  last node holding the round of N.

Times are from the signal (or the replacement's join). Ranks must be 0..N-2 (0..N-1) once
each. Every phase is bounded by the plan's timeout.
"""

from __future__ import annotations

import logging
import signal
import uuid
from dataclasses import dataclass, replace

from .backend import Backend, NodeSpec
from .nodes import GO, Group, NodeError, Phase, SimulatedJob, ranks_ok, split
from .process import Timeout, Unavailable
from .result import Plan, Row, load_average

log = logging.getLogger("bench")

REJOIN = "rejoin"  # torch's backends: the survivors re-join now
#: A survivor that sees the failure sooner than this saw something else: no backend detects
#: a death within 0.1 s (rdzv-server's fastest path is its disconnect grace, >= 0.25 s).
TOO_EARLY = 0.1
REPLACE = "replace"  # the replacement node joins now


@dataclass(frozen=True)
class Scenario:
    """One failure to inflict: its name in the report, and the signal."""

    name: str
    sig: signal.Signals


KILL = Scenario("kill", signal.SIGKILL)
SIGSTOP = Scenario("sigstop", signal.SIGSTOP)


def measure(backends: list[Backend], plan: Plan) -> tuple[list[Row], dict[str, object]]:
    rows: list[Row] = []
    raw: dict[str, object] = {}
    for backend in backends:
        scenarios = [KILL, SIGSTOP] if backend.reports_dead_nodes else [KILL]
        try:
            backend.start(plan.work_dir, plan.log_dir)
        except (Unavailable, Timeout) as exc:
            status = "unavailable" if isinstance(exc, Unavailable) else "error"
            for scenario in scenarios:
                rows += [
                    Row.failed("rerdzv", backend.label, f"form N-1 ({scenario.name})", n, "s", status, str(exc))
                    for n in plan.rerdzv_sizes
                ]
            continue
        try:
            for scenario in scenarios:
                gave_up = ""
                for n in plan.rerdzv_sizes:
                    if gave_up:
                        rows.append(Row.failed("rerdzv", backend.label, f"form N-1 ({scenario.name})", n, "s", "skipped", gave_up))
                        continue
                    new_rows, data = _one(backend, scenario, n, plan)
                    rows += new_rows
                    raw[f"{backend.label}/{scenario.name}/{n}"] = {**data, "load": load_average()}
                    for row in new_rows:
                        log.info("rerdzv %s %s N=%d: %s %s", backend.label, row.metric, n, row.status, row.value)
                    if any(r.status in ("timeout", "error") for r in new_rows):
                        gave_up = f"failed at N={n}"
        finally:
            backend.stop()
    return rows, raw


def _one(backend: Backend, scenario: Scenario, n: int, plan: Plan) -> tuple[list[Row], dict[str, object]]:
    silent = scenario is SIGSTOP
    spec: NodeSpec = backend.node_spec(
        f"rerdzv-{scenario.name}-{n}-{uuid.uuid4().hex[:8]}", n - 1, n, backend.failure_conf(silent=silent)
    )
    spec = replace(spec, env={**spec.env, **backend.failure_env()})
    detects = backend.reports_dead_nodes
    survivor_phases = [Phase.on(GO), Phase.poll() if detects else Phase.on(REJOIN)]
    if silent:
        survivor_phases.append(Phase.poll())  # the replacement's arrival
    victim = n - 1
    groups = split(range(n - 1), tuple(survivor_phases)) + [Group((victim,), (Phase.on(GO),))]
    if silent:
        groups.append(Group((n,), (Phase.on(REPLACE),)))
    rows: list[Row] = []
    data: dict[str, object] = {}
    label = backend.label

    def fail(metric: str, status: str, detail: str) -> tuple[list[Row], dict[str, object]]:
        rows.append(Row.failed("rerdzv", label, metric, n, "s", status, detail))
        return rows, data

    with SimulatedJob(spec, groups, plan.timeout, events=(REJOIN, REPLACE)) as job:
        try:
            job.start()
            job.fire(GO)
            job.wait_formed(0, n, plan.timeout)
        except (Timeout, NodeError) as exc:
            return fail(f"form N ({scenario.name})", "timeout" if isinstance(exc, Timeout) else "error", str(exc))
        t_fail = job.signal(victim, scenario.sig)
        if not detects:
            job.fire(REJOIN)
        try:
            survivors = job.wait_formed(1, n - 1, plan.timeout)
        except (Timeout, NodeError) as exc:
            status = "timeout" if isinstance(exc, Timeout) else "error"
            if detects and job.count("detected", 1) < n - 1:
                fail(f"detect ({scenario.name})", status, f"{job.count('detected', 1)}/{n - 1} survivors saw it: {exc}")
            return fail(f"form N-1 ({scenario.name})", status, str(exc))
        if detects:
            seen = sorted(r.t - t_fail for r in job.of("detected", 1))
            data["detect_s"] = seen
            early = sum(1 for t in seen if t < TOO_EARLY)
            if early:
                rows.append(
                    Row.failed("rerdzv", label, f"detect ({scenario.name})", n, "s", "error",
                               f"{early} survivors saw num_nodes_waiting() > 0 within {TOO_EARLY:g} s of the failure "
                               f"(first at {seen[0]:+.3f} s): live nodes were declared dead (heartbeats lost under load)")
                )  # fmt: skip
            else:
                rows.append(Row("rerdzv", label, f"detect ({scenario.name})", n, seen[-1], "s", detail=f"first {seen[0]:.3f} s"))
        else:
            rows.append(
                Row.failed("rerdzv", label, f"detect ({scenario.name})", n, "s", "never",
                           "num_nodes_waiting() ignores dead nodes (pytorch#111646)")
            )  # fmt: skip
        formed = sorted(r.t - t_fail for r in survivors)
        data["form_n_minus_1_s"] = formed
        problem = ranks_ok(survivors, n - 1)
        rows.append(
            Row("rerdzv", label, f"form N-1 ({scenario.name})", n, formed[-1], "s", detail=problem)
            if not problem
            else Row.failed("rerdzv", label, f"form N-1 ({scenario.name})", n, "s", "error", problem)
        )
        if silent:
            t_join = job.fire(REPLACE)
            try:
                job.wait(
                    lambda: job.count("formed", 2) >= n - 1 and len([r for r in job.of("formed", 0) if r.node == n]) == 1,
                    plan.timeout,
                    f"the round of {n} with the replacement",
                )
            except (Timeout, NodeError) as exc:
                return fail("form N (replacement)", "timeout" if isinstance(exc, Timeout) else "error", str(exc))
            final = job.of("formed", 2) + [r for r in job.of("formed", 0) if r.node == n]
            took = sorted(r.t - t_join for r in final)
            data["form_n_replacement_s"] = took
            problem = ranks_ok(final, n)
            rows.append(
                Row("rerdzv", label, "form N (replacement)", n, took[-1], "s")
                if not problem
                else Row.failed("rerdzv", label, "form N (replacement)", n, "s", "error", problem)
            )
    return rows, data
