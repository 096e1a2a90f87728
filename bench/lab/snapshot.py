"""``python -m bench.lab.snapshot``: how long the server stops answering while it snapshots and recovers.

What it measures. A durable server (``--fsync never``, so the disk is not what is timed)
takes ``--keys`` keys (1M by default) in ``multi_set`` batches of 1,000, with
``--snapshot-every`` set so that the last batch is the record that triggers a snapshot.
A prober (one coroutine on one kept-alive connection) sends ``GET /healthz`` back to back,
1 ms apart, and keeps every round trip. The server answers ``/healthz`` on its event loop,
so the longest round trip is the longest stall of that loop, as every client sees it.

- ``snapshot``: the probes from just before the triggering batch until the snapshot file
  is on disk (plus 0.2 s). Before issue 8 the server built and encoded the snapshot on its
  loop (about 0.7 s per 1M keys); now a separate process rebuilds it from the log.
- ``recovery``: the server is SIGKILLed and started again on the same port with the
  prober already knocking; the probes from the first answer until 0.2 s after the ready
  line, and the time from the restart's process start to its ready line.

What it must not know: the server's internals (like the rest of ``bench``): it uses the
command line, ``/healthz`` and ``rdzv_client`` only. Runs in about 10 s on 2 cores. Prints
a table; ``--json PATH`` also writes the raw figures. To compare with the design before
issue 8, run this same file from a checkout of commit 7359904 (the server it starts is
the checkout's, as ``python -m rdzv_server`` imports from the working directory).

Figures (1M keys, 2 shared cores, three runs each, before -> after): longest stall while
snapshotting 254-724 ms -> 2.4-9.1 ms (the snapshot is on disk 1.3-2.0 s after the
trigger instead of 0.3-0.8 s: a builder process replays it); longest stall while
recovering 458-487 ms -> 118-124 ms (msgpack decoding the snapshot, which holds the GIL,
is what remains); restart to ready 0.93-0.97 s -> 0.97-1.05 s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..process import Service, free_port

#: Keys per multi_set batch, and batches in flight, while filling the server.
BATCH = 1000
BATCHES_IN_FLIGHT = 4
#: The prober's pause between probes: a stall shorter than this is invisible anyway.
PROBE_PAUSE_S = 0.001
#: What the server prints once it has recovered and accepts requests.
READY_LINE = "rdzv-server listening on http://"
JOB = "snapshot-bench"
#: The server's own account of its recovery time (from the start of recovery to ready).
RECOVERED = re.compile(r"Recovered \d+ jobs \(\d+ log records\) in ([0-9.]+) s")


@dataclass(frozen=True)
class Probes:
    """Round trips of ``GET /healthz`` over one window, in seconds."""

    window: str
    count: int
    max_s: float
    p99_s: float
    median_s: float
    seconds: float  # how long the window lasted

    @staticmethod
    def of(window: str, samples: list[float], seconds: float) -> Probes:
        if not samples:
            return Probes(window, 0, float("nan"), float("nan"), float("nan"), seconds)
        ordered = sorted(samples)
        p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
        return Probes(window, len(ordered), ordered[-1], p99, statistics.median(ordered), seconds)


class Prober:
    """``GET /healthz`` on one kept-alive connection, back to back; round trips in :attr:`samples`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.samples: list[float] = []
        self.answered = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def take(self) -> list[float]:
        samples, self.samples = self.samples, []
        return samples

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        while True:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
            except OSError:  # not listening yet (a restart)
                await asyncio.sleep(0.01)
                continue
            try:
                while True:
                    sent = time.perf_counter()
                    writer.write(request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = 0
                    for line in head.split(b"\r\n"):
                        name, _, value = line.partition(b":")
                        if name.strip().lower() == b"content-length":
                            length = int(value)
                    await reader.readexactly(length)
                    self.samples.append(time.perf_counter() - sent)
                    self.answered.set()
                    await asyncio.sleep(PROBE_PAUSE_S)
            except (OSError, asyncio.IncompleteReadError):
                writer.close()
                await asyncio.sleep(0.01)


def server_argv(port: int, data_dir: Path, snapshot_every: int) -> list[str]:
    return [
        sys.executable, "-m", "rdzv_server", "--host", "127.0.0.1", "--port", str(port),
        "--data-dir", str(data_dir), "--fsync", "never", "--snapshot-every", str(snapshot_every),
    ]  # fmt: skip


async def fill(endpoint: str, keys: int, *, last_batch: bool) -> None:
    """All batches but the last (``last_batch=False``), or just the last one."""
    from rdzv_client import AsyncClient, JobSettings

    firsts = list(range(0, keys, BATCH))
    firsts = firsts[-1:] if last_batch else firsts[:-1]
    async with AsyncClient(endpoint) as client:
        if not last_batch:
            await client.create_job(JOB, JobSettings(min_nodes=1, max_nodes=1))
        slots = asyncio.Semaphore(BATCHES_IN_FLIGHT)

        async def batch(first: int) -> None:
            async with slots:
                ks = [b"key/%08d" % k for k in range(first, min(first + BATCH, keys))]
                await client.multi_set(JOB, ks, [b"value-%08d" % k for k in range(first, first + len(ks))])

        await asyncio.gather(*(batch(first) for first in firsts))


async def snapshot_window(port: int, endpoint: str, data_dir: Path, keys: int, timeout: float) -> Probes:
    prober = Prober(port)
    prober.start()
    await prober.answered.wait()
    await asyncio.sleep(0.2)
    prober.take()  # the window opens with the triggering batch
    started = time.monotonic()
    await fill(endpoint, keys, last_batch=True)
    deadline = started + timeout
    while not list(data_dir.glob("snapshot-*.msgpack")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no snapshot within {timeout:g} s")
        await asyncio.sleep(0.01)
    written = time.monotonic() - started
    await asyncio.sleep(0.2)
    await prober.stop()
    return Probes.of(f"snapshot written {written:.2f} s after the trigger", prober.take(), time.monotonic() - started)


async def recovery_window(server: Service, port: int, timeout: float) -> tuple[Probes, float]:
    prober = Prober(port)
    prober.start()
    loop = asyncio.get_running_loop()
    # Service.start blocks until the ready line: run it beside the prober.
    await loop.run_in_executor(None, lambda: server.start(ready_line=READY_LINE, timeout=timeout))
    took = server.ready_at - server.started_at
    # A probe stalled by recovery is answered just before the ready line: let it arrive.
    await asyncio.sleep(0.2)
    samples = prober.take()
    await prober.stop()
    return Probes.of(f"restart to ready {took:.2f} s", samples, took), took


def run(keys: int, work_dir: Path | None, timeout: float) -> dict[str, object]:
    batches = -(-keys // BATCH)
    # +1: the job's creation is the first record, so the last batch is the triggering record.
    snapshot_every = batches + 1
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="rdzv-snapshot-bench-", dir=work_dir) as tmp:
        data_dir = Path(tmp) / "data"
        log_path = Path(tmp) / "server.log"
        server = Service("rdzv-server", server_argv(port, data_dir, snapshot_every), log_path)
        server.start(ready_line=READY_LINE, timeout=timeout)
        endpoint = f"127.0.0.1:{port}"
        try:
            t0 = time.monotonic()
            asyncio.run(fill(endpoint, keys, last_batch=False))
            fill_s = time.monotonic() - t0
            snap = asyncio.run(snapshot_window(port, endpoint, data_dir, keys, timeout))
            server.kill()
            restarted = Service("rdzv-server (restart)", server.argv, log_path)
            try:
                recovery, took = asyncio.run(recovery_window(restarted, port, timeout))
            finally:
                restarted.stop()
        finally:
            server.kill()
        log_text = log_path.read_text(encoding="utf-8", errors="replace")
    recovered = RECOVERED.findall(log_text)
    return {"keys": keys, "fill_s": fill_s, "snapshot": asdict(snap), "recovery": asdict(recovery),
            "restart_to_ready_s": took, "server_recovery_s": float(recovered[-1]) if recovered else None,
            "server_log_tail": log_text[-2000:]}  # fmt: skip


def table(result: dict[str, object]) -> str:
    keys = result["keys"]
    lines = [
        f"rdzv-server event-loop stall, {keys:,} keys (GET /healthz round trips, 1 ms apart)",
        f"{'window':<44} {'probes':>7} {'max ms':>9} {'p99 ms':>8} {'median ms':>10}",
    ]
    for name in ("snapshot", "recovery"):
        p = result[name]
        assert isinstance(p, dict)
        lines.append(
            f"{p['window']:<44} {p['count']:>7} {p['max_s'] * 1e3:>9.1f} {p['p99_s'] * 1e3:>8.1f} {p['median_s'] * 1e3:>10.2f}"
        )
    inside = result.get("server_recovery_s")
    if isinstance(inside, float):
        lines.append(f"(the server's own recovery time, from its log: {inside:.3f} s)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.lab.snapshot", description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=1_000_000, help="keys in the server (default %(default)s)")
    p.add_argument("--timeout", type=float, default=120.0, help="s for any one wait (default %(default)s)")
    p.add_argument("--work-dir", type=Path, default=None, help="where the data directory goes (default: $TMPDIR)")
    p.add_argument("--json", type=Path, default=None, help="also write the raw figures here")
    args = p.parse_args(argv)
    result = run(args.keys, args.work_dir, args.timeout)
    print(table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
