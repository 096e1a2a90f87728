"""Store operations through ``RendezvousInfo.store``, with a raw TCPStore as the reference.

How: each backend forms a 1-node job in the bench's own process (through torch's registry,
as torchrun would) and uses the store in the ``RendezvousInfo`` it got:

- latency: ``set``, ``get``, ``add``, ``compare_set`` and ``multi_get`` (8 keys), each
  ``plan.store_ops`` times in a row from one client after a short warm-up; p50 and p99.
  An operation the backend's store lacks is reported as unsupported.
- server CPU per operation: the CPU time the store's server process (every thread of it)
  spent over those timed calls, divided by their number (Linux' per-thread schedstat, in
  ns: clock-tick CPU times are too coarse for a few thousand calls).
- throughput: 1, 8 and 64 concurrent clients, each with its own store object onto the
  same job's key space, alternating ``set`` and ``get`` (``throughput``) and then doing
  ``add`` on a key of its own (``add throughput``), for ``plan.throughput_seconds``
  from a common start; clients are spread over up to 8 spawned processes (so the
  clients' GIL is not what is measured) with threads beyond that. rdzv-server clients in
  one process share one client connection pool, as handlers in one process do.

The worker processes are spawned once and reused for every backend and client count.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from .backend import Backend, StoreSpec
from .backend.tcpstore import LABEL as TCPSTORE
from .backend.tcpstore import TCPStoreService
from .process import SPAWN, Timeout, Unavailable, end_processes, gather, server_cpu_ns
from .result import Plan, Row, load_average, percentile

if TYPE_CHECKING:
    from torch.distributed import Store

log = logging.getLogger("bench")

OPS = ("set", "get", "add", "compare_set", "multi_get")
#: Spawned client processes at most; more clients become threads in them.
MAX_PROCESSES = 8
#: Warm-up calls per operation before timing (connections, code paths).
WARMUP = 20
VALUE = b"v" * 64
MULTI_KEYS = [f"lat/{i}" for i in range(8)]
#: How long one throughput step may take beyond its duration (opening stores, start-up).
STEP_SLACK = 60.0
#: What the clients of a throughput step do: its row's metric -> the mix's name.
MIXES = {"throughput": "set/get", "add throughput": "add"}


def measure(backends: list[Backend], plan: Plan) -> tuple[list[Row], dict[str, object]]:
    rows: list[Row] = []
    raw: dict[str, object] = {}
    pool = ClientPool(min(MAX_PROCESSES, max(plan.throughput_clients)))
    try:
        pool.start()
        reference = TCPStoreService()
        try:
            reference.start(plan.log_dir)
            spec = reference.store_spec()
            rows += _measure_store(TCPSTORE, spec.open(), spec, pool, plan, raw, reference.pid)
        except (Unavailable, Timeout) as exc:
            rows.append(Row.failed("store", TCPSTORE, "set p50", 1, "µs", "error", str(exc)))
        finally:
            reference.stop()
        for backend in backends:
            rows += _backend(backend, pool, plan, raw)
    finally:
        pool.close()
    return rows, raw


def _backend(backend: Backend, pool: ClientPool, plan: Plan, raw: dict[str, object]) -> list[Row]:
    try:
        backend.start(plan.work_dir, plan.log_dir)
    except (Unavailable, Timeout) as exc:
        status = "unavailable" if isinstance(exc, Unavailable) else "error"
        return [Row.failed("store", backend.label, f"{op} p50", 1, "µs", status, str(exc)) for op in OPS]
    handler = None
    try:
        spec = backend.node_spec(f"store-{uuid.uuid4().hex[:8]}", 1, 1, backend.base_conf())
        handler = spec.handler()
        info = handler.next_rendezvous()
        store_spec = backend.store_spec(spec, info)
        return _measure_store(backend.label, info.store, store_spec, pool, plan, raw, backend.service_pid())
    except Exception as exc:  # a backend's failure is a row, not the end of the run
        log.exception("store measurement of %s failed", backend.label)
        return [Row.failed("store", backend.label, "set p50", 1, "µs", "error", repr(exc))]
    finally:
        if handler is not None:
            _quietly(handler.shutdown)
        backend.stop()


def _measure_store(
    label: str,
    store: Store,
    spec: StoreSpec,
    pool: ClientPool,
    plan: Plan,
    raw: dict[str, object],
    server_pid: int | None = None,
) -> list[Row]:
    rows: list[Row] = []
    cpu: dict[str, float] = {}
    samples = latency(store, plan.store_ops, server_pid, cpu)
    for op, values in samples.items():
        if isinstance(values, str):
            rows.append(Row.failed("store", label, f"{op} p50", 1, "µs", "unsupported", values))
            continue
        rows.append(Row("store", label, f"{op} p50", 1, percentile(values, 50), "µs"))
        rows.append(Row("store", label, f"{op} p99", 1, percentile(values, 99), "µs"))
        if op in cpu:
            rows.append(Row("store", label, f"{op} server CPU", 1, cpu[op], "µs"))
    raw[f"{label}/latency_us"] = {op: v if isinstance(v, str) else _summary(v) for op, v in samples.items()}
    raw[f"{label}/server_cpu_us_per_op"] = cpu
    for metric, mix in MIXES.items():
        for clients in plan.throughput_clients:
            try:
                ops_per_s = pool.throughput(spec, clients, plan.throughput_seconds, mix)
            except (Timeout, RuntimeError) as exc:
                status = "timeout" if isinstance(exc, Timeout) else "error"
                rows.append(Row.failed("store", label, metric, clients, "ops/s", status, str(exc)))
                continue
            rows.append(Row("store", label, metric, clients, ops_per_s, "ops/s"))
            raw[f"{label}/{metric}/{clients}"] = {"ops_per_s": ops_per_s, "load": load_average()}
            log.info("store %s %s with %d clients: %.0f ops/s", label, metric, clients, ops_per_s)
    return rows


def latency(
    store: Store, count: int, server_pid: int | None = None, cpu: dict[str, float] | None = None
) -> dict[str, list[float] | str]:
    """Per operation: ``count`` latencies in µs, or why the store cannot do it; ``cpu`` gets
    the server's CPU µs per call of each operation (where ``server_pid``'s can be read)."""
    for key in MULTI_KEYS:
        store.set(key, VALUE)
    store.set("lat/cas", "0")
    cas = ["0", "1"]
    calls: dict[str, Callable[[int], object]] = {
        "set": lambda i: store.set(MULTI_KEYS[i % 8], b"%08d" % i + VALUE),  # a new value: a real write
        "get": lambda i: store.get(MULTI_KEYS[i % 8]),
        "add": lambda i: store.add("lat/counter", 1),
        "compare_set": lambda i: store.compare_set("lat/cas", cas[i % 2], cas[(i + 1) % 2]),
        "multi_get": lambda i: store.multi_get(MULTI_KEYS),
    }
    out: dict[str, list[float] | str] = {}
    for op, call in calls.items():
        try:
            for i in range(WARMUP):
                call(i)
        except Exception as exc:  # noqa: BLE001 (e.g. EtcdStore has no compare_set)
            out[op] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
            continue
        values = []
        cpu_before = server_cpu_ns(server_pid)
        for i in range(WARMUP, WARMUP + count):
            t = time.perf_counter_ns()
            call(i)
            values.append((time.perf_counter_ns() - t) / 1000.0)
        cpu_after = server_cpu_ns(server_pid)
        if cpu is not None and cpu_before is not None and cpu_after is not None:
            cpu[op] = (cpu_after - cpu_before) / 1000.0 / count
        out[op] = values
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99), "mean": statistics.fmean(values)}


def _quietly(call: Callable[[], object]) -> None:
    try:
        call()
    except Exception:  # cleanup after a measurement: nothing depends on it
        log.debug("cleanup failed", exc_info=True)


# --------------------------------------------------------------------------- client pool


class ClientPool:
    """Spawned processes that open store clients and hammer them on command (over pipes)."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pipes: list[multiprocessing.connection.Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []

    def start(self, timeout: float = 180.0) -> None:
        for i in range(self.processes):
            parent, child = SPAWN.Pipe()
            proc = SPAWN.Process(target=_client_worker, args=(child,), name=f"bench-store-{i}", daemon=True)
            proc.start()
            self._pipes.append(parent)
            self._procs.append(proc)
        gather(self._pipes, timeout, "store client processes to start")

    def throughput(self, spec: StoreSpec, clients: int, seconds: float, mix: str = "set/get") -> float:
        """Total ops/s of ``clients`` concurrent clients doing ``mix`` (:data:`MIXES`) over
        ``seconds``; raises Timeout or RuntimeError."""
        used = self._pipes[: min(clients, self.processes)]
        per = [clients // len(used) + (1 if i < clients % len(used) else 0) for i in range(len(used))]
        for pipe, threads in zip(used, per):
            pipe.send(("open", spec, threads))
        gather(used, STEP_SLACK, f"{clients} store clients to connect")
        start_at = time.monotonic() + 0.2
        for pipe in used:
            pipe.send(("run", start_at, seconds, mix))
        counts = gather(used, seconds + STEP_SLACK, f"{clients} store clients to finish")
        return sum(int(c) for c in counts) / seconds

    def close(self) -> None:
        for pipe in self._pipes:
            _quietly(lambda p=pipe: p.send(("exit", None)))  # type: ignore[misc]
        end_processes(self._procs, grace=5.0)


def _client_worker(pipe: multiprocessing.connection.Connection) -> None:
    """A pool process: ``open`` N stores, then ``run`` a mix (:data:`MIXES`) from a common start."""
    logging.basicConfig(level=logging.ERROR)
    import torch.distributed.elastic.rendezvous.registry  # noqa: F401  (before rdzv_client.torchrun)

    pipe.send(("ok", None))
    stores: list[Store] = []
    while True:
        if not pipe.poll(600.0):
            return  # the bench is gone
        command, *args = pipe.recv()
        try:
            if command == "exit":
                return
            if command == "open":
                spec, threads = args
                stores = [spec.open() for _ in range(threads)]
                for i, store in enumerate(stores):
                    store.set(f"tput/{i}", VALUE)
                pipe.send(("ok", None))
            elif command == "run":
                start_at, seconds, mix = args
                pipe.send(("ok", _run_mix(stores, start_at, seconds, mix)))
        except Exception as exc:  # noqa: BLE001 (sent to the parent)
            pipe.send(("error", f"{command}: {exc!r}"))


def _run_mix(stores: list[Store], start_at: float, seconds: float, mix: str) -> int:
    counts = [0] * len(stores)
    errors: list[BaseException] = []

    def client(i: int, store: Store) -> None:
        key = f"tput/{i}"
        time.sleep(max(0.0, start_at - time.monotonic()))
        end = start_at + seconds
        counter = f"{key}/count"
        call: Callable[[int], object]
        if mix == "add":
            call = lambda n: store.add(counter, 1)  # noqa: E731
        else:
            call = lambda n: store.set(key, b"%08d" % n + VALUE) if n % 2 == 0 else store.get(key)  # noqa: E731
        n = 0
        try:
            while time.monotonic() < end:
                call(n)
                n += 1
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        counts[i] = n

    threads = [threading.Thread(target=client, args=(i, s), daemon=True) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + STEP_SLACK)
    if errors:
        raise errors[0]
    return sum(counts)
