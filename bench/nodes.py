"""Simulated nodes: spawned worker processes, each running many handlers in threads.

What it owns: :class:`SimulatedJob`, which spreads the nodes of one job over worker
processes (at most :data:`NODES_PER_PROCESS` each, a handler and a thread per node), gives
them a common start, and collects what each node saw with ``time.monotonic()`` stamps
(CLOCK_MONOTONIC is one clock for every process on the machine, so the parent can subtract
its own stamps from the workers').

A node goes through a list of :class:`Phase`\\ s. Each phase waits for its trigger, then
calls ``next_rendezvous()`` and reports ``formed`` with the rank and world size it got:

- ``Phase.on(EVENT)``: the parent fires ``EVENT`` (the common start; "collective timed out");
- ``Phase.poll()``: the node polls ``num_nodes_waiting()`` every 0.1 s, as torchrun's agent
  monitor loop does, reports ``detected`` once it is positive, then re-joins.

Events are shared-memory flags, not ``multiprocessing.Event``: the bench SIGKILLs and
SIGSTOPs workers, and setting an ``Event`` that a killed process was waiting on blocks the
setter forever. Each worker's main thread relays the flags (polled every millisecond)
to ``threading.Event`` objects its node threads wait on.

Order of start: every worker imports torch first; the first worker then makes its handlers
and only after it reported ``ready`` do the others make theirs. With c10d the first node to
bind the endpoint hosts the TCPStore, so the host is always in the first worker (the
bench never kills that one). Every wait is bounded; a worker that outlives its task is
SIGKILLed by :meth:`SimulatedJob.close`.
"""

from __future__ import annotations

import ctypes
import logging
import math
import multiprocessing.connection
import multiprocessing.process
import os
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from typing_extensions import Self

from .backend import NodeSpec
from .process import SPAWN, Timeout, end_processes

#: torchrun spreads nodes over hosts; the bench spreads them over processes this big.
NODES_PER_PROCESS = 256
#: torchrun's default ``--monitor-interval``: how often the agent asks num_nodes_waiting().
POLL_INTERVAL = 0.1
#: Importing torch in a dozen processes at once on two cores takes a while.
DEFAULT_READY_TIMEOUT = 180.0

#: The event every job's first phase waits for.
GO = "go"
#: Set by :meth:`SimulatedJob.close`: workers exit.
STOP = "stop"
#: Set when the first worker is ready: the others make their handlers.
CREATE_REST = "create-rest"
#: Niceness of the worker processes but the first (see _worker).
NODE_NICENESS = 10
#: How often a worker looks at the flags: the resolution of every common start.
FLAG_POLL = 0.001


class Flag:
    """A one-shot cross-process event that killing a waiter cannot wedge (a shared double)."""

    def __init__(self) -> None:
        self._value = SPAWN.RawValue(ctypes.c_double, 0.0)

    def set(self) -> None:
        self._value.value = 1.0

    def is_set(self) -> bool:
        return bool(self._value.value)

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.is_set():
            if time.monotonic() >= deadline:
                return False
            time.sleep(FLAG_POLL)
        return True


@dataclass(frozen=True)
class Phase:
    """What makes a node call ``next_rendezvous()``: an ``event`` fired by the parent, or polling."""

    event: str | None  # None: poll num_nodes_waiting()

    @staticmethod
    def on(event: str) -> Phase:
        return Phase(event)

    @staticmethod
    def poll() -> Phase:
        return Phase(None)


@dataclass(frozen=True)
class Report:
    """One thing one node saw: ``ready`` (its handler exists), ``detected``, ``formed`` or ``error``."""

    kind: str
    node: int
    phase: int
    t: float  # time.monotonic() when it happened
    rank: int = -1
    world_size: int = -1
    detail: str = ""


class Channel:
    """A worker's own report pipe to the parent, shared by its node threads.

    Not a ``multiprocessing.Queue``: all writers of a Queue share one cross-process lock,
    and a worker SIGKILLed in the instant its feeder thread holds it would silence every
    other worker for good. A pipe per worker leaves nothing shared to wedge.
    """

    def __init__(self, conn: multiprocessing.connection.Connection) -> None:
        self._conn = conn
        self._lock = threading.Lock()

    def put(self, report: Report) -> None:
        with self._lock:
            self._conn.send(report)


@dataclass(frozen=True)
class Group:
    """Nodes that share one worker process and go through the same phases."""

    nodes: tuple[int, ...]
    phases: tuple[Phase, ...]


def split(nodes: Sequence[int], phases: tuple[Phase, ...], per_process: int = NODES_PER_PROCESS) -> list[Group]:
    """``nodes`` in ceil(len/per_process) groups of (nearly) equal size."""
    count = max(1, math.ceil(len(nodes) / per_process))
    size = math.ceil(len(nodes) / count)
    return [Group(tuple(nodes[i : i + size]), phases) for i in range(0, len(nodes), size)]


# --------------------------------------------------------------------------- worker side


def _worker(
    spec: NodeSpec,
    group: Group,
    first: bool,
    flags: dict[str, Flag],
    conn: multiprocessing.connection.Connection,
    phase_timeout: float,
) -> None:
    """A worker process: make the group's handlers, run each node's phases in a thread."""
    reports = Channel(conn)
    logging.basicConfig(level=logging.ERROR)
    os.environ.update(spec.env)
    if not first:
        # Thousands of node threads on two cores would otherwise starve the service under
        # test, which in real use has a host of its own. The first worker keeps the default
        # priority: with c10d it hosts the job's TCPStore, so c10d's store gets the same
        # footing as rdzv-server and etcd.
        os.nice(NODE_NICENESS)
    # Import torch's registry before anything of ours: it loads the rdzv-server entry point.
    import torch.distributed.elastic.rendezvous.registry  # noqa: F401

    if not first and not flags[CREATE_REST].wait(DEFAULT_READY_TIMEOUT):
        os._exit(3)
    handlers = []
    for node in group.nodes:
        try:
            handlers.append(spec.handler())
        except Exception as exc:  # noqa: BLE001 (reported to the parent, which decides)
            reports.put(Report("error", node, -1, time.monotonic(), detail=f"handler: {exc!r}"))
            os._exit(2)
    for node in group.nodes:
        reports.put(Report("ready", node, -1, time.monotonic()))
    events = {name: threading.Event() for name in flags}
    threads = [
        threading.Thread(target=_node, args=(node, h, group.phases, events, reports, phase_timeout), daemon=True)
        for node, h in zip(group.nodes, handlers)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + phase_timeout * (len(group.phases) + 1)
    pending = dict(flags)
    while not events[STOP].is_set() and time.monotonic() < deadline:
        for name, flag in list(pending.items()):
            if flag.is_set():
                events[name].set()
                del pending[name]
        time.sleep(FLAG_POLL)
    os._exit(0)  # handler threads (heartbeats, watches) die with the process, as an agent's would


def _node(
    node: int,
    handler: Any,
    phases: tuple[Phase, ...],
    events: dict[str, threading.Event],
    reports: Channel,
    phase_timeout: float,
) -> None:
    for index, phase in enumerate(phases):
        if phase.event is not None:
            if not events[phase.event].wait(phase_timeout):
                return  # the parent moved on (it reports the timeout)
        elif not _poll_waiting(node, index, handler, events[STOP], reports, phase_timeout):
            return
        try:
            info = handler.next_rendezvous()
        except Exception as exc:  # noqa: BLE001
            reports.put(Report("error", node, index, time.monotonic(), detail=f"next_rendezvous: {exc!r}"))
            return
        reports.put(Report("formed", node, index, time.monotonic(), info.rank, info.world_size))


def _poll_waiting(
    node: int,
    index: int,
    handler: Any,
    stop: threading.Event,
    reports: Channel,
    timeout: float,
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        try:
            waiting = handler.num_nodes_waiting()
        except Exception as exc:  # noqa: BLE001
            reports.put(Report("error", node, index, time.monotonic(), detail=f"num_nodes_waiting: {exc!r}"))
            return False
        if waiting > 0:
            reports.put(Report("detected", node, index, time.monotonic()))
            return True
        time.sleep(POLL_INTERVAL)
    return False


# --------------------------------------------------------------------------- parent side


class SimulatedJob:
    """The nodes of one job in worker processes. Use as a context manager (it always cleans up).

    ``groups[0]`` starts first (see the module docstring); ``events`` names every event a
    phase waits for besides :data:`GO`.
    """

    def __init__(self, spec: NodeSpec, groups: list[Group], phase_timeout: float, events: Sequence[str] = ()) -> None:
        self.spec = spec
        self.groups = groups
        self.phase_timeout = phase_timeout
        self.events = {name: Flag() for name in (GO, STOP, CREATE_REST, *events)}
        self.reports: list[Report] = []
        self.errors: list[Report] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[multiprocessing.process.BaseProcess] = []
        self._by_node = {node: i for i, g in enumerate(groups) for node in g.nodes}
        self._signalled: set[int] = set()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, ready_timeout: float = DEFAULT_READY_TIMEOUT) -> None:
        """Spawn the workers and wait until every node has its handler; :class:`Timeout` if not."""
        for i, group in enumerate(self.groups):
            parent, child = SPAWN.Pipe(duplex=False)
            self._conns.append(parent)
            proc = SPAWN.Process(
                target=_worker,
                args=(self.spec, group, i == 0, self.events, child, self.phase_timeout),
                name=f"bench-nodes-{i}",
                daemon=True,
            )
            proc.start()
            child.close()  # the worker holds the only writing end: its exit reads as EOF here
            self._procs.append(proc)
        first = len(self.groups[0].nodes)
        self.wait(lambda: self.count("ready") >= first, ready_timeout, "the first worker's handlers")
        self.events[CREATE_REST].set()
        total = sum(len(g.nodes) for g in self.groups)
        self.wait(lambda: self.count("ready") >= total, ready_timeout, f"handlers of all {total} nodes")

    def fire(self, event: str) -> float:
        """Set ``event``; return the monotonic time just before."""
        t = time.monotonic()
        self.events[event].set()
        return t

    def signal(self, node: int, sig: signal.Signals) -> float:
        """Send ``sig`` to the process of ``node`` (and of its group); return the monotonic time just before.

        That process may die from it without the wait failing.
        """
        index = self._by_node[node]
        pid = self._procs[index].pid
        assert pid is not None
        self._signalled.add(index)
        t = time.monotonic()
        os.kill(pid, sig)
        return t

    def count(self, kind: str, phase: int | None = None) -> int:
        return sum(1 for r in self.reports if r.kind == kind and (phase is None or r.phase == phase))

    def of(self, kind: str, phase: int) -> list[Report]:
        return [r for r in self.reports if r.kind == kind and r.phase == phase]

    def wait(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Collect reports until ``condition()`` holds; :class:`Timeout` after ``timeout`` s.

        An error report from a node ends the wait early with :class:`NodeError`.
        """
        deadline = time.monotonic() + timeout
        while not condition():
            if self.errors:
                raise NodeError(f"{len(self.errors)} node(s) failed while waiting for {what}: {self.errors[0].detail}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Timeout(f"{what}: not within {timeout:g} s")
            ready = multiprocessing.connection.wait(self._conns, timeout=min(remaining, 0.5))
            for conn in ready:
                try:
                    report = conn.recv()  # type: ignore[union-attr]
                except Exception:  # noqa: BLE001 (EOF, or a message cut off by a kill: that worker is gone)
                    self._conns.remove(conn)  # type: ignore[arg-type]
                    continue
                (self.errors if report.kind == "error" else self.reports).append(report)
            if not ready:
                died = [p for i, p in enumerate(self._procs) if p.exitcode not in (None, 0) and i not in self._signalled]
                if died:
                    codes = sorted({p.exitcode for p in died}, key=str)
                    raise NodeError(f"a worker died (exit codes {codes}) while waiting for {what}")

    def wait_formed(self, phase: int, nodes: int, timeout: float) -> list[Report]:
        """Wait until ``nodes`` nodes report ``formed`` in ``phase``; return those reports."""
        self.wait(lambda: self.count("formed", phase) >= nodes, timeout, f"{nodes} nodes to form (phase {phase})")
        return self.of("formed", phase)

    def close(self) -> None:
        for index in self._signalled:  # a stopped process cannot exit by itself
            pid = self._procs[index].pid
            if pid is not None and self._procs[index].exitcode is None:
                os.kill(pid, signal.SIGKILL)
        self.events[STOP].set()
        end_processes(self._procs, grace=5.0)
        for conn in self._conns:
            conn.close()


class NodeError(Exception):
    """A simulated node's handler raised, or a worker process died."""


def ranks_ok(formed: list[Report], world_size: int) -> str:
    """'' when the reports hold ranks 0..world_size-1 once each, all with that world size; else why not."""
    ranks = sorted(r.rank for r in formed)
    if ranks != list(range(world_size)):
        dup = [r for r, n in _counts(ranks).items() if n > 1]
        return f"ranks are not 0..{world_size - 1} once each (got {len(ranks)} ranks, duplicates {dup[:5]})"
    sizes = {r.world_size for r in formed}
    if sizes != {world_size}:
        return f"world sizes {sorted(sizes)} != {world_size}"
    return ""


def _counts(values: list[int]) -> dict[int, int]:
    out: dict[int, int] = defaultdict(int)
    for v in values:
        out[v] += 1
    return out
