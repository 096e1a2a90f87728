"""High availability: rdzv-server replicated over etcd against the single server, and what etcd costs.

Three modes: ``rdzv-server`` (``--memory``), ``rdzv-server (durable)`` (``--data-dir``, fsync
``always``: one server with its log on local disk) and ``rdzv-server (etcd x3)`` (three
replicas with ``--etcd`` over a three-member etcd 3.4 on loopback; the client is given every
replica, ``127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3``, and follows a follower's ``not_leader``).

- write throughput: ``plan.ha_clients`` concurrent clients (asyncio tasks in the bench's own
  process, one :class:`rdzv_client.AsyncClient` each) doing ``add`` on one key of one job
  for ``plan.throughput_seconds`` from a common start; writes/s and p50/p99 latency. The
  counter must end at the number of acknowledged adds. Replicated: also adds per etcd txn
  (acks over etcd's revision growth during the step), which shows the group commit.
- formation: :func:`bench.formation.form_round` (torch's registry, simulated nodes) for each
  N of ``plan.ha_sizes`` on each mode, the replicated one through the endpoint list.
- take-over: with the lease TTL of each of ``plan.ha_ttls`` (a fresh set of replicas per
  TTL), one client adds continuously; the leader replica is SIGKILLed ``plan.ha_repeats``
  times (restarted on its port as a follower in between). Reported: time from the kill to
  the first write acknowledged after it, and to the first ``/readyz?role=leader`` 200 of a
  survivor (polled every :data:`LEADER_POLL_S`); median and max. The counter must be exact.
  An ack within :data:`IN_FLIGHT_S` of the kill is the dead leader's last answer still in
  the socket: no survivor can lead before the dead one's lease runs out (it cannot revoke
  it), and the shortest lease is 2 s, so nothing in that window is the new leader's.
- round trip: what one write costs the log in each mode, sequentially from one caller
  (no grouping): a bare etcd ``put`` and a fenced txn shaped like a replica's record write
  (compare the leader key's create revision; put the record and ``log-head``) through the
  server's own :class:`rdzv_server.storage.etcd_client.EtcdClient`, against
  :class:`rdzv_server.storage.file_log.FileLog` ``append`` with fsync ``always`` in a
  folder on the same disk as the etcd members' data. The three calls take turns, so a
  burst of background load hits all three alike. This is the one place where the bench
  uses the server's internals: the gap it explains is inside the server.

The replicated mode's throughput and formation run on the replicas of the first TTL of
``plan.ha_ttls`` (2 s by default), before their take-overs. Everything is on 127.0.0.1;
every wait is bounded (``plan.timeout``); etcd and every replica are stopped in ``finally``
(a Ctrl-C or SIGTERM unwinds through it).

What etcd's own faults (a member killed, the quorum lost) cost the replicas is the lab's,
``python -m bench.lab.etcd_faults`` (issue 14): it shares this module's writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from .backend.rdzv_replicas import EtcdCluster, ReplicatedBackend
from .backend.rdzv_server import RdzvServerBackend
from .formation import form_round
from .process import Timeout, Unavailable
from .result import Plan, Row, load_average, percentile

if TYPE_CHECKING:
    from rdzv_client import AsyncClient
    from rdzv_server.storage.etcd_client import EtcdClient

log = logging.getLogger("bench")

MEASUREMENT = "ha"
#: etcd members and replicas: the smallest cluster that survives losing one.
ETCD_MEMBERS = 3
REPLICAS = 3
RTT_ETCD = f"etcd x{ETCD_MEMBERS} (EtcdClient)"
RTT_FILE = "local log (FileLog)"
#: The round trips timed, each with what it is.
ROUND_TRIPS = {
    (RTT_ETCD, "put"): "one key, 128 B",
    (RTT_ETCD, "txn"): "compare the leader key; put record + head",
    (RTT_FILE, "append+fsync"): "one 128 B record, fsync always",
}
#: Round-trip calls before timing (connections, code paths).
WARMUP = 20
#: A small log record, as one add's is.
RECORD = b"r" * 128
#: How often the survivors' /readyz?role=leader is asked: the resolution of "new leader".
LEADER_POLL_S = 0.02
#: See the module docstring: an ack this soon after the kill is the dead leader's.
IN_FLIGHT_S = 0.1
#: Acks the take-over writer must make (writes flowing again) before the next kill.
STEADY_ACKS = 10
#: A throughput step may take this long beyond its duration (connections, a slow tail).
STEP_SLACK_S = 30.0


def measure(plan: Plan) -> tuple[list[Row], dict[str, Any]]:
    """Rows for every part (throughput, formation, take-over, round trip) and the raw samples."""
    parts: dict[str, list[Row]] = {"throughput": [], "formation": [], "take-over": [], "round trip": []}
    raw: dict[str, Any] = {"throughput": {}, "formation": {}, "take-over": {}, "round trip": {}}
    with contextlib.ExitStack() as cleanup:
        etcd = EtcdCluster(ETCD_MEMBERS, election_ms=plan.ha_etcd_election_ms)
        etcd_problem: tuple[str, str] | None = None  # (status, why) when etcd did not start
        started = time.monotonic()
        try:
            etcd.start(plan.work_dir, plan.log_dir)
            cleanup.callback(etcd.stop)
            log.info("ha: etcd x%d started in %.1f s", ETCD_MEMBERS, time.monotonic() - started)
        except (Unavailable, Timeout) as exc:
            etcd_problem = ("unavailable" if isinstance(exc, Unavailable) else "error", str(exc))
            log.info("ha: etcd did not start: %s", exc)

        parts["round trip"] += _round_trip(etcd.client_urls, etcd_problem, plan, raw["round trip"])
        for single in (RdzvServerBackend(durable=False), RdzvServerBackend(durable=True)):
            _serve(single, plan, parts, raw, takeover_ttl=None)
        for k, ttl in enumerate(plan.ha_ttls):
            replicated = ReplicatedBackend(etcd.client_urls, size=REPLICAS, lease_ttl=ttl)
            if etcd_problem is not None:
                _failed(replicated.label, plan, parts, *etcd_problem, load=k == 0, takeover_ttl=ttl)
                continue
            _serve(replicated, plan, parts, raw, takeover_ttl=ttl, load=k == 0)
    rows = [row for part in parts.values() for row in part]
    return rows, raw


# --------------------------------------------------------------------------- one mode


def _serve(
    backend: RdzvServerBackend,
    plan: Plan,
    parts: dict[str, list[Row]],
    raw: dict[str, Any],
    *,
    takeover_ttl: int | None,
    load: bool = True,
) -> None:
    """Start ``backend``; measure throughput and formation (``load``) and take-overs
    (``takeover_ttl``, replicated only); stop it whatever happens."""
    started = time.monotonic()
    try:
        backend.start(plan.work_dir, plan.log_dir)
    except (Unavailable, Timeout) as exc:
        status = "unavailable" if isinstance(exc, Unavailable) else "error"
        _failed(backend.label, plan, parts, status, str(exc), load=load, takeover_ttl=takeover_ttl)
        return
    log.info("ha: %s started in %.1f s", backend.label, time.monotonic() - started)
    try:
        if load:
            parts["throughput"] += _throughput_rows(backend, plan, raw["throughput"])
            parts["formation"] += _formation_rows(backend, plan, raw["formation"])
        if takeover_ttl is not None:
            assert isinstance(backend, ReplicatedBackend)
            parts["take-over"] += _takeover_rows(backend, takeover_ttl, plan, raw["take-over"])
    finally:
        stopping = time.monotonic()
        backend.stop()
        log.info("ha: %s stopped in %.1f s", backend.label, time.monotonic() - stopping)


def _failed(
    label: str, plan: Plan, parts: dict[str, list[Row]], status: str, detail: str, *, load: bool, takeover_ttl: int | None
) -> None:
    """The rows of a mode that could not start, each saying why."""
    if load:
        parts["throughput"] += [Row.failed(MEASUREMENT, label, "add writes/s", n, "ops/s", status, detail) for n in plan.ha_clients]
        parts["formation"] += [Row.failed(MEASUREMENT, label, "formation time", n, "s", status, detail) for n in plan.ha_sizes]
    if takeover_ttl is not None:
        parts["take-over"] += _takeover_failed(label, takeover_ttl, plan, status, detail)


# --------------------------------------------------------------------------- throughput


def _throughput_rows(backend: RdzvServerBackend, plan: Plan, raw: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for clients in plan.ha_clients:
        try:
            etcd_urls = backend.etcd_urls if isinstance(backend, ReplicatedBackend) else None
            acks, seconds, latencies, counter, txns = asyncio.run(_throughput(backend.endpoint, clients, plan, etcd_urls))
        except Exception as exc:  # noqa: BLE001 - the client's errors (RdzvError...): a row, not a crash
            status = "timeout" if isinstance(exc, (Timeout, asyncio.TimeoutError)) else "error"
            rows.append(Row.failed(MEASUREMENT, backend.label, "add writes/s", clients, "ops/s", status, f"{type(exc).__name__}: {exc}"))
            log.info("ha throughput %s clients=%d: %s %s", backend.label, clients, status, exc)
            continue
        raw[f"{backend.label}/{clients}"] = {"acks": acks, "seconds": seconds, "counter": counter, "etcd_txns": txns, "load": load_average()}
        if counter != acks:
            detail = f"the counter is {counter} after {acks} acknowledged adds"
            rows.append(Row.failed(MEASUREMENT, backend.label, "add writes/s", clients, "ops/s", "error", detail))
            continue
        ms = [v * 1000 for v in latencies]
        rows.append(Row(MEASUREMENT, backend.label, "add writes/s", clients, acks / seconds, "ops/s", detail=f"{acks} adds in {seconds:.2f} s"))
        rows.append(Row(MEASUREMENT, backend.label, "add p50", clients, percentile(ms, 50), "ms"))
        rows.append(Row(MEASUREMENT, backend.label, "add p99", clients, percentile(ms, 99), "ms"))
        if txns:  # group commit: the adds that arrive during one txn share the next
            rows.append(Row(MEASUREMENT, backend.label, "adds per etcd txn", clients, acks / txns, "adds", detail=f"{txns} txns"))
        log.info("ha throughput %s clients=%d: %.0f adds/s", backend.label, clients, acks / seconds)
    return rows


async def _throughput(
    endpoint: str, clients: int, plan: Plan, etcd_urls: list[str] | None
) -> tuple[int, float, list[float], int, int | None]:
    """Acknowledged adds, the seconds they took from the common start, every add's latency
    (s), the counter read afterwards, and (with ``etcd_urls``) how many etcd revisions (one
    per txn: the leader writes nothing else while no node is joined) the adds took."""
    from rdzv_client import AsyncClient, JobSettings
    from rdzv_server.storage.etcd_client import EtcdClient

    job = f"ha-throughput-{clients}-{uuid.uuid4().hex[:8]}"
    budget = plan.timeout  # a client gives up retrying after this long
    pool = [AsyncClient(endpoint, retry_budget=budget, request_timeout=budget) for _ in range(clients)]
    etcd = EtcdClient(etcd_urls) if etcd_urls else None
    try:
        await asyncio.wait_for(pool[0].create_job(job, JobSettings(min_nodes=1, max_nodes=1)), budget)
        # Every client opens its connection (and, with replicas, finds the leader) before the start.
        await asyncio.wait_for(asyncio.gather(*(c.add(job, "warm-up", 1) for c in pool)), budget + STEP_SLACK_S)
        revision = await asyncio.wait_for(_etcd_revision(etcd), budget)
        started = time.monotonic()
        end = started + plan.throughput_seconds

        async def writer(client: AsyncClient) -> list[float]:
            latencies: list[float] = []
            while (sent := time.monotonic()) < end:
                await client.add(job, "counter", 1)
                latencies.append(time.monotonic() - sent)
            return latencies

        per_client = await asyncio.wait_for(
            asyncio.gather(*(writer(c) for c in pool)), plan.throughput_seconds + budget + STEP_SLACK_S
        )
        seconds = time.monotonic() - started
        txns = await asyncio.wait_for(_etcd_revision(etcd), budget) - revision
        counter = await asyncio.wait_for(pool[0].add(job, "counter", 0), budget)
    finally:
        await asyncio.gather(*(c.aclose() for c in pool), return_exceptions=True)
        if etcd is not None:
            await etcd.close()
    latencies = [v for values in per_client for v in values]
    return len(latencies), seconds, latencies, counter, txns if etcd is not None else None


async def _etcd_revision(etcd: EtcdClient | None) -> int:
    """etcd's current revision (0 without etcd): it grows by one per committed txn."""
    return 0 if etcd is None else (await etcd.range(b"/rdzv-bench-revision")).revision


# --------------------------------------------------------------------------- formation


def _formation_rows(backend: RdzvServerBackend, plan: Plan, raw: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    gave_up = ""
    for n in plan.ha_sizes:
        if gave_up:
            rows.append(Row.failed(MEASUREMENT, backend.label, "formation time", n, "s", "skipped", gave_up))
            continue
        row, finish = form_round(backend, n, plan)
        rows.append(dataclasses.replace(row, measurement=MEASUREMENT))
        raw[f"{backend.label}/{n}"] = {"finish_s": finish, "load": load_average()}
        log.info("ha formation %s N=%d: %s %s", backend.label, n, row.status, row.value if row.value is not None else row.detail)
        if row.status != "ok":
            gave_up = f"{row.status} at N={n}"
    return rows


# --------------------------------------------------------------------------- take-over


@dataclasses.dataclass(frozen=True)
class TakeOver:
    """One kill of the leader: seconds from the kill to the first ack and to a new leader."""

    killed: int  # the replica's index
    ack_s: float
    leader_s: float
    new_leader: int


def _takeover_metrics(ttl: int) -> tuple[str, str, str, str]:
    return (
        f"TTL {ttl} s: kill->ack median",
        f"TTL {ttl} s: kill->ack max",
        f"TTL {ttl} s: kill->leader median",
        f"TTL {ttl} s: kill->leader max",
    )


def _takeover_failed(label: str, ttl: int, plan: Plan, status: str, detail: str) -> list[Row]:
    return [Row.failed(MEASUREMENT, label, metric, plan.ha_repeats, "s", status, detail) for metric in _takeover_metrics(ttl)]


def _takeover_rows(backend: ReplicatedBackend, ttl: int, plan: Plan, raw: dict[str, Any]) -> list[Row]:
    try:
        done, failures, counter, acks = asyncio.run(_takeovers(backend, plan))
    except Exception as exc:  # noqa: BLE001 - the writer's or a restart's failure is a row, not a crash
        status = "timeout" if isinstance(exc, (Timeout, asyncio.TimeoutError)) else "error"
        log.info("ha take-over TTL %d: %s %s", ttl, status, exc)
        return _takeover_failed(backend.label, ttl, plan, status, f"{type(exc).__name__}: {exc}")
    raw[f"ttl-{ttl}"] = {
        "kills": [dataclasses.asdict(t) for t in done],
        "failures": failures,
        "counter": counter,
        "acks": acks,
        "load": load_average(),
    }
    ack_med, ack_max, leader_med, leader_max = _takeover_metrics(ttl)
    if counter != acks:
        detail = f"the counter is {counter} after {acks} acknowledged adds across the take-overs"
        return _takeover_failed(backend.label, ttl, plan, "error", detail)
    if not done:
        return _takeover_failed(backend.label, ttl, plan, "timeout", "; ".join(failures))
    ack = [t.ack_s for t in done]
    leader = [t.leader_s for t in done]
    n = len(done)
    rows = [
        Row(MEASUREMENT, backend.label, ack_med, n, statistics.median(ack), "s", detail=samples(ack)),
        Row(MEASUREMENT, backend.label, ack_max, n, max(ack), "s", detail=samples(ack)),
        Row(MEASUREMENT, backend.label, leader_med, n, statistics.median(leader), "s", detail=samples(leader)),
        Row(MEASUREMENT, backend.label, leader_max, n, max(leader), "s", detail=samples(leader)),
    ]
    if failures:  # a kill that was not taken over in time: its max is unknown
        for i in (1, 3):
            rows[i] = Row.failed(MEASUREMENT, backend.label, rows[i].metric, n, "s", "timeout", "; ".join(failures))
    log.info("ha take-over TTL %d: ack %s, leader %s, failures %s", ttl, samples(ack), samples(leader), failures)
    return rows


def samples(values: list[float]) -> str:
    return "samples " + ", ".join(f"{v:.2f}" for v in values) + " s"


async def _takeovers(backend: ReplicatedBackend, plan: Plan) -> tuple[list[TakeOver], list[str], int, int]:
    """Kill the leader ``plan.ha_repeats`` times under one continuous writer; return each
    take-over, the ones that ran out of time, the counter and the acknowledged adds."""
    from rdzv_client import AsyncClient, JobSettings

    budget = plan.timeout
    job = f"ha-takeover-{backend.lease_ttl}-{uuid.uuid4().hex[:8]}"
    done: list[TakeOver] = []
    failures: list[str] = []
    acks: list[float] = []  # time.monotonic() of each acknowledged add
    errors: list[BaseException] = []
    stop = asyncio.Event()
    async with AsyncClient(backend.endpoint, retry_budget=budget) as client:
        await asyncio.wait_for(client.create_job(job, JobSettings(min_nodes=1, max_nodes=1)), budget)

        writer = asyncio.create_task(add_until(client, job, stop, acks, errors))
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as http:
                for _ in range(plan.ha_repeats):
                    await until_acked(acks, len(acks) + STEADY_ACKS, errors, budget)
                    leader = await asyncio.to_thread(backend.wait_for_leader, budget)
                    first = len(acks)
                    killed_at = backend.kill(leader)
                    try:
                        done.append(await _watch(backend, http, leader, killed_at, acks, first, errors, budget))
                    except Timeout as exc:
                        failures.append(str(exc))
                    await asyncio.to_thread(backend.restart, leader)
        finally:
            stop.set()
            try:
                await asyncio.wait_for(writer, budget)
            except asyncio.TimeoutError:
                pass  # wait_for cancelled it; the counter check below tells
        if errors:
            raise RuntimeError(f"the writer failed: {errors[0]!r}") from errors[0]
        counter = await asyncio.wait_for(client.add(job, "counter", 0), budget)
    return done, failures, counter, len(acks)


async def add_until(
    client: AsyncClient, job: str, stop: asyncio.Event, acks: list[float], errors: list[BaseException]
) -> None:
    """Add 1 to the job's counter until ``stop``: each acknowledgement's time.monotonic() goes
    to ``acks``, the error that ends it to ``errors`` (the callers' waits report it)."""
    try:
        while not stop.is_set():
            await client.add(job, "counter", 1)
            acks.append(time.monotonic())
    except Exception as exc:  # noqa: BLE001 - reported by the callers' waits
        errors.append(exc)


async def until_acked(acks: list[float], count: int, errors: list[BaseException], timeout: float) -> None:
    """Wait until the writer has ``count`` acks (writes flow); raise :class:`Timeout` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while len(acks) < count:
        if errors:
            raise RuntimeError(f"the writer failed: {errors[0]!r}") from errors[0]
        if time.monotonic() >= deadline:
            raise Timeout(f"the writer's {count}th ack: not within {timeout:g} s")
        await asyncio.sleep(0.01)


async def _watch(
    backend: ReplicatedBackend,
    http: aiohttp.ClientSession,
    killed: int,
    killed_at: float,
    acks: list[float],
    first: int,
    errors: list[BaseException],
    timeout: float,
) -> TakeOver:
    """Poll the survivors' ``/readyz?role=leader`` and the writer's acks until both show
    the take-over; raise :class:`Timeout` after ``timeout`` s."""
    survivors = [i for i in range(len(backend.urls)) if i != killed]
    leader_at: float | None = None
    new_leader = -1
    ack_at: float | None = None
    deadline = killed_at + timeout
    while leader_at is None or ack_at is None:
        if errors:
            raise RuntimeError(f"the writer failed during the take-over: {errors[0]!r}") from errors[0]
        if time.monotonic() >= deadline:
            raise Timeout(f"take-over after killing r{killed}: not within {timeout:g} s (leader {leader_at is not None}, ack {ack_at is not None})")
        if leader_at is None:
            answers = await asyncio.gather(*(_leads(http, backend.urls[i]) for i in survivors))
            if any(answers):
                leader_at = time.monotonic()
                new_leader = survivors[answers.index(True)]
        if ack_at is None:
            ack_at = next((t for t in acks[first:] if t > killed_at + IN_FLIGHT_S), None)
        await asyncio.sleep(LEADER_POLL_S)
    return TakeOver(killed, ack_at - killed_at, leader_at - killed_at, new_leader)


async def _leads(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url + "/readyz", params={"role": "leader"}) as answer:
            return answer.status == 200
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError):  # not answering: not leading
        return False


# --------------------------------------------------------------------------- round trip


def _round_trip(urls: list[str], problem: tuple[str, str] | None, plan: Plan, raw: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    try:
        with _folder(plan.work_dir) as folder:
            samples = asyncio.run(_round_trips(None if problem else urls, folder, plan.ha_ops, plan.timeout))
    except Exception as exc:  # noqa: BLE001 - etcd's or the log's errors (EtcdError, OSError): a row
        detail = f"{type(exc).__name__}: {exc}"
        return [Row.failed(MEASUREMENT, label, f"{op} p50", plan.ha_ops, "ms", "error", detail) for label, op in ROUND_TRIPS]
    raw.update({f"{label}/{op} ms": values for (label, op), values in samples.items()})
    for (label, op), values in samples.items():
        rows.append(Row(MEASUREMENT, label, f"{op} p50", len(values), percentile(values, 50), "ms", detail=ROUND_TRIPS[label, op]))
        rows.append(Row(MEASUREMENT, label, f"{op} p99", len(values), percentile(values, 99), "ms", detail=ROUND_TRIPS[label, op]))
    if problem is not None:
        rows += [Row.failed(MEASUREMENT, label, f"{op} p50", plan.ha_ops, "ms", *problem) for label, op in ROUND_TRIPS if label == RTT_ETCD]
    return rows


@contextlib.contextmanager
def _folder(work_dir: Path) -> Iterator[Path]:
    work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="filelog-bench-", dir=work_dir) as name:
        yield Path(name)


async def _round_trips(urls: list[str] | None, folder: Path, ops: int, timeout: float) -> dict[tuple[str, str], list[float]]:
    """Milliseconds of ``ops`` sequential calls of each of :data:`ROUND_TRIPS` (etcd's only
    with ``urls``), interleaved so that each sees the same background load."""
    from rdzv_server.storage.etcd_client import Compare, EtcdClient, Put, prefix_end
    from rdzv_server.storage.file_log import FileLog
    from rdzv_server.storage.log import FsyncPolicy

    prefix = f"/rdzv-bench-rtt-{uuid.uuid4().hex[:8]}".encode()
    fence = prefix + b"/leader"
    out: dict[tuple[str, str], list[float]] = {key: [] for key in ROUND_TRIPS if urls or key[0] != RTT_ETCD}
    client = EtcdClient(urls) if urls else None
    file_log, _ = FileLog.open(folder, FsyncPolicy.ALWAYS)
    try:
        created = await asyncio.wait_for(client.put(fence, b"r0"), timeout) if client else 0

        async def put(i: int) -> None:
            assert client is not None
            await client.put(prefix + b"/put", RECORD)

        async def txn(i: int) -> None:  # a replica's record write: fenced, record and log-head
            assert client is not None
            ops = [Put(prefix + b"/log/%020d" % i, RECORD), Put(prefix + b"/log-head", b"%d" % i)]
            result = await client.txn([Compare(fence, "CREATE", created)], ops)
            if not result.succeeded:
                raise RuntimeError(f"the fenced txn's compare failed at {i}: someone else wrote {fence!r}")

        async def append(i: int) -> None:
            await file_log.append({"op": "add", "i": i, "value": RECORD})

        calls = {(RTT_ETCD, "put"): put, (RTT_ETCD, "txn"): txn, (RTT_FILE, "append+fsync"): append}
        for i in range(WARMUP + ops):
            for key, values in out.items():
                sent = time.perf_counter()
                await asyncio.wait_for(calls[key](i), timeout)
                if i >= WARMUP:
                    values.append((time.perf_counter() - sent) * 1000)
        if client is not None:
            await asyncio.wait_for(client.delete_range(prefix, prefix_end(prefix)), timeout)
    finally:
        await file_log.close()
        if client is not None:
            await client.close()
    return out
