"""``python -m bench.lab.etcd_faults``: what etcd's own faults cost the replicas (issue 14; ~2-4 minutes).

Fresh replicas (:data:`bench.ha.REPLICAS`) at the server's default lease (5 s) over a fresh
3-member etcd; one client adds continuously, and beside it a bare
:class:`rdzv_server.storage.etcd_client.EtcdClient` puts continuously (etcd's own gap, to
tell it from the replicas'). Each of ``plan.ha_repeats`` times: SIGKILL of an etcd
follower, then of etcd's leader (restarted on its data between kills): the write gap, the
longest interval between consecutive acks from the last ack before the kill until
:data:`bench.ha.STEADY_ACKS` acks after it. Then, :data:`QUORUM_REPEATS` times, a quorum loss
shaped like issue 14's reproduction: SIGSTOP the two etcd members that are not etcd's
leader, send :data:`IN_FLIGHT` adds straight to the leader replica (one endpoint, no
retries, an answer awaited up to :data:`IN_FLIGHT_WAIT_S`), SIGCONT both after
:data:`QUORUM_LOSS_S`: how many in-flight adds were answered (any answer, ``not_leader``
included) or hung, how far apart their answers came, the resume time (SIGCONT to the
first add acknowledged after it), and how far that lags etcd's own (SIGCONT to the bare
client's first put after it: etcd electing a leader again is etcd's time, not the
replicas'). The counter must be exact.

Its rows are ``ha`` rows, judged by issue 14's targets in :mod:`bench.target`; it takes
``python -m bench``'s own flags for them (``--quick``, ``--ha-repeats``,
``--ha-etcd-election-ms``, ``--timeout``, ``--out``) and prints the bench's table.

What it owns: the etcd faults, until then part of ``python -m bench --only ha``; they
answered issue 14 and are kept to answer it again. What it must not know: the other
measurements; the writer and the replicas are :mod:`bench.ha`'s.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import report, target
from ..backend.rdzv_replicas import EtcdCluster, ReplicatedBackend
from ..ha import ETCD_MEMBERS, MEASUREMENT, REPLICAS, STEADY_ACKS, add_until, samples, until_acked
from ..process import Timeout, Unavailable
from ..result import Plan, Row, load_average

log = logging.getLogger("bench")

#: The etcd faults run at the server's default lease: the targets are stated for it.
FAULTS_LEASE_TTL = 5
#: Quorum losses measured (each takes about half a minute).
QUORUM_REPEATS = 2
#: How long two of three etcd members stay SIGSTOPped: issue 14's reproduction.
QUORUM_LOSS_S = 8.0
#: Adds sent straight to the leader replica as the quorum goes, and how long each may wait
#: for an answer before it counts as hung (a leader serves again well within it).
IN_FLIGHT = 8
IN_FLIGHT_WAIT_S = 20.0

FAULT_METRICS = (
    ("follower", "etcd follower kill: gap"),
    ("leader", "etcd leader kill: gap"),
)
QUORUM_METRICS = (
    "quorum back: resume median",
    "quorum back: resume max",
    "quorum back: behind etcd max",
    "step-down: in-flight answered",
    "step-down: in-flight hung",
    "step-down: answer spread max",
)
ETCD_OWN = f"etcd x{ETCD_MEMBERS} (EtcdClient)"


@dataclasses.dataclass(frozen=True)
class MemberLoss:
    """One SIGKILL of an etcd member: the longest interval between acks around it (s), the
    same for the bare etcd client's puts, and which member it was."""

    role: str  # "leader" or "follower": etcd's role of the member killed
    member: int
    gap_s: float
    etcd_gap_s: float


@dataclasses.dataclass(frozen=True)
class QuorumLoss:
    """One quorum loss: when writes resumed after SIGCONT (s), when the bare etcd client's
    puts did, and each in-flight add's outcome ("ok", an error code, "hung" or "dropped")
    with its answer's time after the SIGSTOP (s)."""

    resume_s: float
    etcd_resume_s: float
    in_flight: list[tuple[str, float]]


def _etcd_faults_failed(plan: Plan, status: str, detail: str) -> list[Row]:
    label = f"rdzv-server (etcd x{REPLICAS})"
    rows = [
        Row.failed(MEASUREMENT, label, f"{metric} {stat}", plan.ha_repeats, "s", status, detail)
        for _, metric in FAULT_METRICS
        for stat in ("median", "max")
    ]
    return rows + [Row.failed(MEASUREMENT, label, metric, QUORUM_REPEATS, "s", status, detail) for metric in QUORUM_METRICS]


def _etcd_faults_rows(plan: Plan, raw: dict[str, Any]) -> list[Row]:
    """Fresh etcd and replicas at the default lease; every fault of the module docstring."""
    etcd = EtcdCluster(ETCD_MEMBERS, election_ms=plan.ha_etcd_election_ms)
    backend = ReplicatedBackend([], size=REPLICAS, lease_ttl=FAULTS_LEASE_TTL)
    try:
        try:
            etcd.start(plan.work_dir, plan.log_dir)
            backend.etcd_urls = list(etcd.client_urls)
            backend.start(plan.work_dir, plan.log_dir)
        except (Unavailable, Timeout) as exc:
            log.info("ha etcd faults: could not start: %s", exc)
            return _etcd_faults_failed(plan, "unavailable" if isinstance(exc, Unavailable) else "error", str(exc))
        try:
            losses, quorum, counter, acks = asyncio.run(_etcd_faults(etcd, backend, plan))
        except Exception as exc:  # noqa: BLE001 - the writer's or a restart's failure is a row, not a crash
            status = "timeout" if isinstance(exc, (Timeout, asyncio.TimeoutError)) else "error"
            log.info("ha etcd faults: %s %s", status, exc)
            return _etcd_faults_failed(plan, status, f"{type(exc).__name__}: {exc}")
    finally:
        backend.stop()
        etcd.stop()
    raw.update(
        {
            "member_losses": [dataclasses.asdict(loss) for loss in losses],
            "quorum_losses": [dataclasses.asdict(q) for q in quorum],
            "counter": counter,
            "acks": acks,
            "load": load_average(),
        }
    )
    if counter != acks:
        return _etcd_faults_failed(plan, "error", f"the counter is {counter} after {acks} acknowledged adds")
    label = backend.label
    rows: list[Row] = []
    for role, metric in FAULT_METRICS:
        gaps = [loss.gap_s for loss in losses if loss.role == role]
        own = [loss.etcd_gap_s for loss in losses if loss.role == role]
        if not gaps:
            continue
        rows.append(Row(MEASUREMENT, label, f"{metric} median", len(gaps), statistics.median(gaps), "s", detail=samples(gaps)))
        rows.append(Row(MEASUREMENT, label, f"{metric} max", len(gaps), max(gaps), "s", detail=samples(gaps)))
        rows.append(Row(MEASUREMENT, ETCD_OWN, f"{role} kill: put gap max", len(own), max(own), "s", detail=samples(own)))
    resumes = [q.resume_s for q in quorum]
    behind = [q.resume_s - q.etcd_resume_s for q in quorum]
    outcomes = [outcome for q in quorum for outcome, _ in q.in_flight]
    answered = [o for o in outcomes if o not in ("hung", "dropped")]
    spreads = [
        max(times) - min(times)
        for times in ([t for outcome, t in q.in_flight if outcome not in ("hung", "dropped")] for q in quorum)
        if times
    ]
    breakdown = ", ".join(f"{outcomes.count(o)} {o}" for o in sorted(set(outcomes)))
    rows += [
        Row(MEASUREMENT, label, QUORUM_METRICS[0], len(resumes), statistics.median(resumes), "s", detail=samples(resumes)),
        Row(MEASUREMENT, label, QUORUM_METRICS[1], len(resumes), max(resumes), "s", detail=samples(resumes)),
        Row(MEASUREMENT, label, QUORUM_METRICS[2], len(behind), max(behind), "s", detail=samples(behind)),
        Row(MEASUREMENT, label, QUORUM_METRICS[3], len(outcomes), len(answered), "adds", detail=breakdown),
        Row(MEASUREMENT, label, QUORUM_METRICS[4], len(outcomes), outcomes.count("hung"), "adds", detail=breakdown),
    ]
    if spreads:
        rows.append(Row(MEASUREMENT, label, QUORUM_METRICS[5], len(spreads), max(spreads), "s", detail=samples(spreads)))
    else:
        rows.append(Row.failed(MEASUREMENT, label, QUORUM_METRICS[5], len(quorum), "s", "never", "no in-flight add was answered"))
    log.info("ha etcd faults: %s; quorum %s", [dataclasses.astuple(loss) for loss in losses], quorum)
    return rows


async def _etcd_faults(
    etcd: EtcdCluster, backend: ReplicatedBackend, plan: Plan
) -> tuple[list[MemberLoss], list[QuorumLoss], int, int]:
    """Every fault under one continuous writer (and one bare etcd put loop); return the member
    losses, the quorum losses, the counter and the acknowledged adds."""
    from rdzv_client import AsyncClient, JobSettings
    from rdzv_server.storage.etcd_client import EtcdClient

    budget = plan.timeout
    job = f"ha-etcd-faults-{uuid.uuid4().hex[:8]}"
    acks: list[float] = []
    puts: list[float] = []
    errors: list[BaseException] = []
    stop = asyncio.Event()
    losses: list[MemberLoss] = []
    quorum: list[QuorumLoss] = []
    etcd_client = EtcdClient(etcd.client_urls)
    async with AsyncClient(backend.endpoint, retry_budget=budget) as client:
        await asyncio.wait_for(client.create_job(job, JobSettings(min_nodes=1, max_nodes=1)), budget)

        async def put() -> None:
            key = f"/rdzv-bench-put-{uuid.uuid4().hex[:8]}".encode()
            while not stop.is_set():
                try:
                    await etcd_client.put(key, b"x")
                    puts.append(time.monotonic())
                except Exception:  # noqa: BLE001 - etcd without quorum: the gap shows it
                    await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(add_until(client, job, stop, acks, errors)), asyncio.create_task(put())]
        try:
            for role in ("follower", "leader"):
                for _ in range(plan.ha_repeats):
                    await until_acked(acks, len(acks) + STEADY_ACKS, errors, budget)
                    leader = await asyncio.to_thread(etcd.leader)
                    member = leader if role == "leader" else (leader + 1) % ETCD_MEMBERS
                    first_ack, first_put = len(acks), len(puts)
                    killed_at = await asyncio.to_thread(etcd.kill, member)
                    await _until_after(acks, killed_at, STEADY_ACKS, errors, budget)
                    await _until_after(puts, killed_at, STEADY_ACKS, errors, budget)
                    losses.append(
                        MemberLoss(role, member, _gap(acks, first_ack, killed_at), _gap(puts, first_put, killed_at))
                    )
                    log.info("ha etcd faults: %s m%d killed: gap %.3f s (etcd's own %.3f s)", role, member,
                             losses[-1].gap_s, losses[-1].etcd_gap_s)  # fmt: skip
                    await asyncio.to_thread(etcd.restart, member)
            for _ in range(QUORUM_REPEATS):
                await until_acked(acks, len(acks) + STEADY_ACKS, errors, budget)
                quorum.append(await _quorum_loss(etcd, backend, job, acks, puts, errors, budget))
                log.info("ha etcd faults: quorum loss: %s", quorum[-1])
        finally:
            stop.set()
            for task in tasks:
                try:
                    await asyncio.wait_for(task, budget)
                except asyncio.TimeoutError:
                    pass  # wait_for cancelled it; the counter check tells
            await etcd_client.close()
        if errors:
            raise RuntimeError(f"the writer failed: {errors[0]!r}") from errors[0]
        counter = await asyncio.wait_for(client.add(job, "counter", 0), budget)
    return losses, quorum, counter, len(acks)


async def _quorum_loss(
    etcd: EtcdCluster,
    backend: ReplicatedBackend,
    job: str,
    acks: list[float],
    puts: list[float],
    errors: list[BaseException],
    budget: float,
) -> QuorumLoss:
    """SIGSTOP both etcd followers, send the in-flight adds to the leader replica, SIGCONT."""
    from rdzv_client import AsyncClient
    from rdzv_client.error import RdzvConnectionError, RdzvError

    leader = await asyncio.to_thread(etcd.leader)
    followers = [i for i in range(ETCD_MEMBERS) if i != leader]
    replica = await asyncio.to_thread(backend.wait_for_leader, budget)
    endpoint = f"127.0.0.1:{backend.ports[replica]}"
    stopped_at = time.monotonic()
    for i in followers:
        etcd.pause(i)

    async def in_flight(one: AsyncClient) -> tuple[str, float]:
        sent = time.monotonic()
        try:
            await one.add(job, "in-flight", 1)
            outcome = "ok"
        except RdzvError as exc:
            if exc.code is not None:  # an answer: not_leader, say
                outcome = exc.code.value
            elif isinstance(exc, RdzvConnectionError):  # no answer: waited out, or the connection dropped
                outcome = "hung" if time.monotonic() - sent >= IN_FLIGHT_WAIT_S * 0.9 else "dropped"
            else:
                outcome = type(exc).__name__
        return outcome, time.monotonic() - stopped_at

    clients = [AsyncClient(endpoint, retry_budget=0, request_timeout=IN_FLIGHT_WAIT_S) for _ in range(IN_FLIGHT)]
    try:
        pending = [asyncio.create_task(in_flight(one)) for one in clients]
        await asyncio.sleep(QUORUM_LOSS_S)
        resumed_at = time.monotonic()
        for i in followers:
            etcd.resume(i)
        first = await _until_after(acks, resumed_at, 1, errors, budget)
        etcd_first = await _until_after(puts, resumed_at, 1, errors, budget)
        outcomes = await asyncio.gather(*pending)
    finally:
        for i in followers:
            etcd.resume(i)  # a no-op for one already resumed
        await asyncio.gather(*(one.aclose() for one in clients), return_exceptions=True)
    return QuorumLoss(first - resumed_at, etcd_first - resumed_at, list(outcomes))


async def _until_after(times: list[float], at: float, count: int, errors: list[BaseException], timeout: float) -> float:
    """Wait until ``times`` holds ``count`` entries later than ``at``; return the first of them."""
    deadline = time.monotonic() + timeout
    while True:
        later = [t for t in times[-(count + 2000):] if t > at]
        if len(later) >= count:
            return later[0]
        if errors:
            raise RuntimeError(f"the writer failed: {errors[0]!r}") from errors[0]
        if time.monotonic() >= deadline:
            raise Timeout(f"{count} acks after the fault: not within {timeout:g} s")
        await asyncio.sleep(0.01)


def _gap(times: list[float], first: int, at: float) -> float:
    """The longest interval between consecutive ``times`` from the last one at or before
    ``at`` (an index from ``first - 1`` on) to the end."""
    start = max(0, first - 1)
    while start + 1 < len(times) and times[start + 1] <= at:
        start += 1
    window = times[start:]
    return max((b - a for a, b in zip(window, window[1:])), default=0.0)


def measure(plan: Plan) -> tuple[list[Row], dict[str, Any]]:
    """Every fault of the module docstring, on its own etcd and replicas: rows and raw samples."""
    raw: dict[str, Any] = {}
    return _etcd_faults_rows(plan, raw), raw


def main(argv: Sequence[str] | None = None) -> int:
    from ..__main__ import build_parser, make_plan

    p = argparse.ArgumentParser(prog="python -m bench.lab.etcd_faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 kills of each etcd member role instead of 5")
    p.add_argument("--ha-repeats", type=int, default=None, help="kills of each etcd member role (default 5; quick 3)")
    p.add_argument("--ha-etcd-election-ms", type=int, default=0, help="etcd's --election-timeout in ms (default: etcd's own, 1000)")
    p.add_argument("--timeout", type=float, default=None, help="s for any one wait (default 120; quick 30)")
    p.add_argument("--out", type=Path, default=Path("bench/out/etcd-faults"), help="output directory (default %(default)s)")
    args = p.parse_args(argv)
    # The bench's own parser checks the values and fills the plan's defaults, as ``--only ha`` would.
    bench_argv = ["--only", "ha", "--out", str(args.out)] + (["--quick"] if args.quick else [])
    for flag, value in (("--ha-repeats", args.ha_repeats), ("--ha-etcd-election-ms", args.ha_etcd_election_ms or None),
                        ("--timeout", args.timeout)):  # fmt: skip
        if value is not None:
            bench_argv += [flag, str(value)]
    plan = make_plan(build_parser().parse_args(bench_argv))
    plan.out_dir.mkdir(parents=True, exist_ok=True)
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        handlers=[logging.FileHandler(plan.out_dir / "bench.log", mode="w")])  # fmt: skip
    logging.getLogger("rdzv_client").setLevel(logging.ERROR)
    started = time.monotonic()
    load_before = load_average()
    rows, raw = measure(plan)
    target.judge(rows)
    meta = {"seconds": time.monotonic() - started, "load_before": load_before, "load_after": load_average()}
    report.write_json(plan.out_dir / "results.json", rows, {"etcd faults": raw}, meta)
    print(report.table(rows))
    print(f"took {meta['seconds']:.0f} s (load average {load_before:.1f} -> {meta['load_after']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
