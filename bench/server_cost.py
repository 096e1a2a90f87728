"""Server cost: rdzv-server's memory and CPU under many heartbeating nodes, and its recovery time.

Heartbeats: a memory-mode server holds ``plan.server_jobs`` jobs of ``plan.server_nodes``
nodes each (min = max, so every job forms). A few spawned load processes, each with one
:class:`rdzv_client.AsyncClient`, join every node of their jobs (all of a job's nodes at
once), then beat every node with ``watch(hold=0)`` once per :data:`BEAT_PERIOD` (the jobs
have a heartbeat TTL of :data:`HEARTBEAT_TTL`, three periods), paced evenly. Once every
job has formed, the bench samples the server's RSS and CPU (psutil, once a second) for
``plan.server_sample_seconds`` and counts the beats the server answered meanwhile: the
sustained rate next to the rate asked for. The load processes share the machine's cores
with the server; CPU% is the server process's alone (100% = one core).

Recovery: a durable server (``--fsync never``) takes ``plan.recovery_keys`` keys in
``multi_set`` batches of 1,000, is SIGKILLed and restarted; the time is from the restart's
process start to its ready line. Twice: with ``--snapshot-every`` far above the record
count (the whole log is replayed), and with a snapshot cut at the last batch (recovery
loads the snapshot; the default ``--snapshot-every`` of 100,000 *records* would never cut
one for 1,000 batch records, so the run says so and sets it to the batch count).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing.connection
import re
import tempfile
import time
from pathlib import Path

from .backend.rdzv_server import start_server
from .process import SPAWN, Service, Timeout, Unavailable, end_processes, gather, wait_until
from .result import Plan, Row, load_average

log = logging.getLogger("bench")

#: Jobs' heartbeat TTL and how often each node beats (a third of it, as the client does).
HEARTBEAT_TTL = 60.0
BEAT_PERIOD = 20.0
#: Load-generating processes (each one event loop, one client).
LOAD_PROCESSES = 4
#: Beats in flight per load process at most.
BEATS_IN_FLIGHT = 256
#: Keys per multi_set batch, and batches in flight, for the recovery data.
BATCH = 1000
BATCHES_IN_FLIGHT = 4
#: Joining every node takes well under this; past it the run reports a timeout.
JOIN_TIMEOUT = 300.0
RECOVERED = re.compile(r"Recovered (\d+) jobs \((\d+) log records\) in ([0-9.]+) s")


def measure(plan: Plan) -> tuple[list[Row], dict[str, object]]:
    rows: list[Row] = []
    raw: dict[str, object] = {}
    rows += _heartbeats(plan, raw)
    rows += _recovery(plan, raw, snapshot=False)
    rows += _recovery(plan, raw, snapshot=True)
    return rows, raw


# --------------------------------------------------------------------------- heartbeats


def _heartbeats(plan: Plan, raw: dict[str, object]) -> list[Row]:
    import psutil

    jobs, nodes = plan.server_jobs, plan.server_nodes
    scale = jobs * nodes
    label = f"{jobs}x{nodes}"
    try:
        server, endpoint = start_server("rdzv-server-cost", ["--memory"], plan.log_dir)
    except (Unavailable, Timeout) as exc:
        return [Row.failed("server", "rdzv-server", f"RSS ({label} heartbeating)", scale, "MB", "error", str(exc))]
    procs: list[multiprocessing.process.BaseProcess] = []
    pipes: list[multiprocessing.connection.Connection] = []
    try:
        proc_info = psutil.Process(server.pid)
        rss_idle = proc_info.memory_info().rss / 1e6
        loaders = min(LOAD_PROCESSES, jobs)
        for i in range(loaders):
            parent, child = SPAWN.Pipe()
            mine = [f"cost-{j}" for j in range(i, jobs, loaders)]
            proc = SPAWN.Process(target=_load_worker, args=(child, endpoint, mine, nodes), daemon=True)
            proc.start()
            procs.append(proc)
            pipes.append(parent)
        t0 = time.monotonic()
        try:
            gather(pipes, JOIN_TIMEOUT, f"{scale} nodes to join")
        except (Timeout, RuntimeError) as exc:
            status = "timeout" if isinstance(exc, Timeout) else "error"
            return [Row.failed("server", "rdzv-server", f"join ({label})", scale, "s", status, str(exc))]
        join_s = time.monotonic() - t0
        time.sleep(1.0)  # let the pacing settle
        proc_info.cpu_percent(None)
        before = sum(_gather_counts(pipes))
        t_start = time.monotonic()
        samples: list[tuple[float, float, float]] = []
        while time.monotonic() - t_start < plan.server_sample_seconds:
            time.sleep(1.0)
            samples.append((time.monotonic() - t_start, proc_info.cpu_percent(None), proc_info.memory_info().rss / 1e6))
        after = sum(_gather_counts(pipes))
        elapsed = time.monotonic() - t_start
        for pipe in pipes:
            pipe.send("stop")
        errors = sum(gather(pipes, 60.0, "load processes to stop"))
    finally:
        end_processes(procs, grace=10.0)
        server.stop()
    rate = (after - before) / elapsed
    asked = scale / BEAT_PERIOD
    cpu = sum(s[1] for s in samples) / len(samples)
    rss = max(s[2] for s in samples)
    raw["heartbeats"] = {
        "jobs": jobs, "nodes": nodes, "join_s": join_s, "rss_idle_mb": rss_idle, "samples": samples,
        "beats_per_s": rate, "asked_per_s": asked, "beat_errors": errors, "load": load_average(),
    }  # fmt: skip
    detail = f"{rate:.0f} beats/s of {asked:.0f} asked"
    return [
        Row("server", "rdzv-server", f"join ({label})", scale, join_s, "s", detail="every node joined, every job formed"),
        Row("server", "rdzv-server", f"RSS ({label} heartbeating)", scale, rss, "MB", detail=f"idle {rss_idle:.0f} MB"),
        Row("server", "rdzv-server", f"CPU ({label} heartbeating)", scale, cpu, "% core", detail=detail),
        Row("server", "rdzv-server", f"beats sustained ({label})", scale, rate, "beats/s",
            detail=f"{asked:.0f} asked, {errors} errors"),
    ]  # fmt: skip


def _gather_counts(pipes: list[multiprocessing.connection.Connection]) -> list[int]:
    for pipe in pipes:
        pipe.send("count")
    return gather(pipes, 30.0, "beat counts")


def _load_worker(pipe: multiprocessing.connection.Connection, endpoint: str, jobs: list[str], nodes: int) -> None:
    """A load process: join every node of ``jobs``, then beat each every BEAT_PERIOD until told to stop."""
    logging.basicConfig(level=logging.ERROR)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(_load(pipe, endpoint, jobs, nodes))
    except Exception as exc:  # noqa: BLE001 (sent to the parent)
        pipe.send(("error", repr(exc)))


async def _load(pipe: multiprocessing.connection.Connection, endpoint: str, jobs: list[str], nodes: int) -> None:
    from rdzv_client import AsyncClient, JobSettings

    loop = asyncio.get_running_loop()
    async with AsyncClient(endpoint, connection_limit=nodes + BEATS_IN_FLIGHT) as client:
        members: list[tuple[str, str, int]] = []
        for job in jobs:
            assignments = await asyncio.gather(
                *(
                    client.join(
                        job, node_id=f"node-{i}", addr="127.0.0.1", nproc_per_node=1,
                        settings=JobSettings(nodes, nodes, last_call_timeout=1.0, heartbeat_ttl=HEARTBEAT_TTL),
                        timeout=JOIN_TIMEOUT,
                    )
                    for i in range(nodes)
                )
            )  # fmt: skip
            members += [(job, f"node-{i}", a.round) for i, a in enumerate(assignments)]
        pipe.send(("ok", None))
        beats = errors = 0
        slots = asyncio.Semaphore(BEATS_IN_FLIGHT)

        async def beat(job: str, node: str, round_: int) -> None:
            nonlocal beats, errors
            try:
                await client.watch(job, node, round=round_, known=-1, hold=0.0)
                beats += 1
            except Exception:  # noqa: BLE001 (counted; the rate shows it)
                errors += 1
            finally:
                slots.release()

        interval = BEAT_PERIOD / len(members)
        tasks: set[asyncio.Task[None]] = set()
        start = loop.time()
        i = 0
        deadline = start + 3600.0  # bounded even if the bench never says stop
        while loop.time() < deadline:
            while pipe.poll():
                command = pipe.recv()
                if command == "count":
                    pipe.send(("ok", beats))
                elif command == "stop":
                    for task in tasks:
                        task.cancel()
                    pipe.send(("ok", errors))
                    return
            due = start + i * interval
            now = loop.time()
            if due > now:
                await asyncio.sleep(min(due - now, 0.01))
                continue
            # Behind schedule: send what is due (as fast as the slots allow), never skip.
            await slots.acquire()
            task = asyncio.create_task(beat(*members[i % len(members)]))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1


# --------------------------------------------------------------------------- recovery


def _recovery(plan: Plan, raw: dict[str, object], *, snapshot: bool) -> list[Row]:
    keys = plan.recovery_keys
    batches = -(-keys // BATCH)
    metric = f"recovery, {'snapshot' if snapshot else 'log replay'} ({keys:,} keys)"
    # +1: the job's creation is the first record; cut the snapshot right after the last batch.
    flags = ["--fsync", "never", "--snapshot-every", str(batches + 1 if snapshot else 10_000_000)]
    plan.work_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rdzv-recovery-", dir=plan.work_dir) as data_dir:
        argv = ["--data-dir", data_dir, *flags]
        name = f"rdzv-server-recovery-{'snapshot' if snapshot else 'log'}"
        try:
            server, endpoint = start_server(name, argv, plan.log_dir)
        except (Unavailable, Timeout) as exc:
            return [Row.failed("server", "rdzv-server", metric, keys, "s", "error", str(exc))]
        try:
            t0 = time.monotonic()
            asyncio.run(_write_keys(endpoint, keys))
            write_s = time.monotonic() - t0
            if snapshot:
                wait_until(lambda: any(Path(data_dir).glob("snapshot-*.msgpack")), 120.0, "the snapshot to be written")
        except (Timeout, Exception) as exc:  # noqa: BLE001
            server.kill()
            return [Row.failed("server", "rdzv-server", metric, keys, "s", "error", f"writing keys: {exc!r}")]
        server.kill()  # SIGKILL: no flush, no goodbye
        restarted = Service(name + "-restart", server.argv, plan.log_dir / f"{name}.log")
        try:
            restarted.start(ready_line="rdzv-server listening on http://", timeout=120.0)
        except (Unavailable, Timeout) as exc:
            return [Row.failed("server", "rdzv-server", metric, keys, "s", "timeout", str(exc))]
        took = restarted.ready_at - restarted.started_at
        try:
            check = _check_last_key(restarted.ready_text.removeprefix("rdzv-server listening on http://"), keys)
        finally:
            restarted.stop()
    inside = RECOVERED.findall(restarted.log_path.read_text(encoding="utf-8", errors="replace"))
    server_says = f"; server: {inside[-1][2]} s for {inside[-1][1]} records" if inside else ""
    raw[metric] = {"restart_to_ready_s": took, "write_s": write_s, "log": inside[-1] if inside else None}
    if check:
        return [Row.failed("server", "rdzv-server", metric, keys, "s", "error", check)]
    return [Row("server", "rdzv-server", metric, keys, took, "s", detail=f"written in {write_s:.1f} s{server_says}")]


async def _write_keys(endpoint: str, keys: int) -> None:
    from rdzv_client import AsyncClient, JobSettings

    async with AsyncClient(endpoint) as client:
        await client.create_job("recovery", JobSettings(min_nodes=1, max_nodes=1))
        slots = asyncio.Semaphore(BATCHES_IN_FLIGHT)

        async def batch(first: int) -> None:
            async with slots:
                ks = [b"key/%08d" % k for k in range(first, min(first + BATCH, keys))]
                await client.multi_set("recovery", ks, [b"value-%08d" % k for k in range(first, first + len(ks))])

        await asyncio.gather(*(batch(first) for first in range(0, keys, BATCH)))


def _check_last_key(endpoint: str, keys: int) -> str:
    """'' when the restarted server has the last key written; else what is wrong."""
    from rdzv_client import Client

    with Client(endpoint) as client:
        value = client.get("recovery", b"key/%08d" % (keys - 1), timeout=5.0)
    return "" if value == b"value-%08d" % (keys - 1) else f"the last key came back as {value!r}"
