"""Wiring: config -> storage -> core -> api; the clock, waiters, timers, shutdown.

What it owns: the one :class:`StateMachine`, the durable log, the server clock, parked
long-polls (:class:`Waiters`), the deadline timer, and the fast-path death detection for
nodes whose watch connection drops.

Rules:
- Every write goes through :meth:`Service.write`: apply (synchronous, nothing awaited),
  append its record to the log, await durability, then wake the waiters it satisfies and
  reschedule the job's timer. A reply is sent only after its record is durable.
- Reads answer only after every record applied so far is durable (:meth:`_sync`), so no
  client ever observes a write that a crash could still take back.
- The server clock is monotonic and continues across restarts from the last logged
  time, so deadlines neither fire nor stretch because the server was down; heartbeat
  times are reset on recovery (each node gets one full TTL of grace).
- The timer only detects; what it decides is applied as ordinary logged commands.

What it must not know: HTTP, the wire format (the API translates).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import random
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import asdict
from typing import Any, TypeVar

from .config import ServerConfig
from .core import command as c
from .core.error import NotReady, RdzvError, ShuttingDown
from .core.machine import Outcome, StateMachine, key_topic, round_topic, watch_topic
from .core.rendezvous import Job
from .storage import FileLog, FsyncPolicy, Log, MemoryLog

log = logging.getLogger("rdzv_server")

T = TypeVar("T")

# Node long-polls are held between this fraction and all of their hold (see _node_hold).
HOLD_JITTER = 0.75


class Waiters:
    """Parked long-polls, keyed by topic; a write wakes exactly the topics it touched."""

    def __init__(self) -> None:
        self._by_topic: dict[Hashable, set[asyncio.Future[None]]] = {}
        self._closed: BaseException | None = None

    def __len__(self) -> int:
        return sum(len(s) for s in self._by_topic.values())

    def wake(self, topics: Iterable[Hashable]) -> None:
        for topic in topics:
            for fut in self._by_topic.pop(topic, ()):
                if not fut.done():
                    fut.set_result(None)

    def fail_all(self, exc: BaseException) -> None:
        self._closed = exc
        for futs in self._by_topic.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(exc)
        self._by_topic.clear()

    async def wait_for(
        self, check: Callable[[], T | None], topics: Callable[[], Iterable[Hashable]], hold: float
    ) -> T | None:
        """Return ``check()`` once it is not None, re-checking on every wake; None after ``hold`` s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + hold
        while True:
            value = check()
            if value is not None:
                return value
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            if self._closed is not None:
                raise self._closed
            fut: asyncio.Future[None] = loop.create_future()
            registered = list(topics())
            for topic in registered:
                self._by_topic.setdefault(topic, set()).add(fut)
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                for topic in registered:
                    futs = self._by_topic.get(topic)
                    if futs is not None:
                        futs.discard(fut)
                        if not futs:
                            del self._by_topic[topic]


class Service:
    """The running server minus HTTP. Create, ``await start()``, serve, ``await stop()``."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.machine = StateMachine(max_value_bytes=config.max_value_bytes, job_ttl=config.job_ttl)
        self.waiters = Waiters()
        self.ready = False
        self.recovered_records = 0
        self.recovery_seconds = 0.0
        self._log: Log = MemoryLog()
        self._last_append: asyncio.Future[None] | None = None
        self._clock_base = 0.0
        self._mono_base = time.monotonic()
        self._heap: list[tuple[float, str]] = []
        self._scheduled: dict[str, float] = {}
        self._timer_wake = asyncio.Event()
        self._timer_task: asyncio.Task[None] | None = None
        self._snapshotting = False
        self._stopping = False
        self._lost: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._open_polls: dict[tuple[str, str], int] = {}
        self._rng = random.Random()
        #: Called once when the server must stop (the log failed); server.py exits non-zero.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.fatal_error: BaseException | None = None

    # -- clock ---------------------------------------------------------------------------

    def now(self) -> float:
        return self._clock_base + (time.monotonic() - self._mono_base)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Recover from the data directory (if any), then start the timer and report ready."""
        started = time.monotonic()
        data_dir = self.config.resolved_data_dir()
        if data_dir is not None:
            file_log, recovered = await asyncio.to_thread(FileLog.open, data_dir, FsyncPolicy(self.config.fsync))
            self._log = file_log
            if recovered.snapshot is not None:
                self.machine.restore(recovered.snapshot)
            for record in recovered.records:
                self._replay(record)
            self.recovered_records = len(recovered.records)
            if recovered.truncated_bytes:
                log.warning(
                    "Recovery dropped a torn tail of %d bytes from the log in %s (a crash mid-write); "
                    "every acknowledged write is before it.",
                    recovered.truncated_bytes,
                    data_dir,
                )
        self._clock_base = self.machine.clock
        self._mono_base = time.monotonic()
        now = self.now()
        self.machine.reset_heartbeats(now)
        for rdzv_id in list(self.machine.jobs):
            self._schedule(rdzv_id)
        self._timer_task = asyncio.create_task(self._run_timer(), name="rdzv-timer")
        self.recovery_seconds = time.monotonic() - started
        self.ready = True
        log.info(
            "Recovered %d jobs (%d log records) in %.3f s from %s.",
            len(self.machine.jobs),
            self.recovered_records,
            self.recovery_seconds,
            data_dir or "memory",
        )

    def _replay(self, record: dict[str, Any]) -> None:
        rid = record.get("rid")
        try:
            self.machine.apply(c.from_record(record["cmd"]), record["now"], (rid[0], rid[1]) if rid else None)
        except RdzvError as exc:  # a logged command applied once already; it cannot fail now
            raise RuntimeError(f"log replay diverged at {record!r}: {exc}") from exc

    def begin_stop(self) -> None:
        """Refuse new work and answer parked long-polls (clients retry after the restart)."""
        self._stopping = True
        self.ready = False
        self.waiters.fail_all(ShuttingDown("the server is shutting down; retry shortly"))
        for handle in self._lost.values():
            handle.cancel()

    async def close(self) -> None:
        """After in-flight requests drained: stop the timer, flush and close the log."""
        self.begin_stop()
        if self._timer_task is not None:
            self._timer_task.cancel()
            try:
                await self._timer_task
            except asyncio.CancelledError:
                pass
        await self._log.close()

    def _fatal(self, exc: BaseException) -> None:
        if self.fatal_error is not None:
            return
        self.fatal_error = exc
        log.critical("The log failed (%s): stopping, so that no write it did not record is ever served.", exc)
        self.begin_stop()
        if self.on_fatal is not None:
            self.on_fatal(exc)

    # -- writes -------------------------------------------------------------------------

    def _check_ready(self) -> None:
        if self._stopping:
            raise ShuttingDown("the server is shutting down; retry shortly")
        if not self.ready:
            raise NotReady("the server is still recovering its log; retry shortly")

    async def write(self, command: c.Command, rid: tuple[str, int] | None = None) -> dict[str, Any]:
        """Apply, log, await durability, wake. Raises RdzvError having changed nothing."""
        self._check_ready()
        now = self.now()
        outcome: Outcome = self.machine.apply(command, now, rid)
        if outcome.replayed:
            await self._sync()
            return outcome.result
        record = {"cmd": command.to_record(), "now": now, "rid": list(rid) if rid else None}
        try:
            fut = self._log.append(record)
            self._last_append = fut
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Memory now holds a change the log does not: serving on would break durability.
            self._fatal(exc)
            raise
        self.waiters.wake(outcome.wakes)
        self._schedule(command.rdzv_id)
        self._maybe_snapshot()
        return outcome.result

    async def _sync(self) -> None:
        fut = self._last_append
        if fut is not None and not fut.done():
            await asyncio.shield(fut)

    def _maybe_snapshot(self) -> None:
        if self._snapshotting or self._log.records_since_snapshot < self.config.snapshot_every:
            return
        self._snapshotting = True
        state = self.machine.to_snapshot()
        task = asyncio.ensure_future(self._log.snapshot(state))

        def done(t: asyncio.Future[None]) -> None:
            self._snapshotting = False
            if not t.cancelled() and t.exception() is not None:
                log.error("Writing a snapshot failed: %s; the log keeps growing until one succeeds.", t.exception())

        task.add_done_callback(done)

    # -- reads ---------------------------------------------------------------------------

    async def read(self, fn: Callable[[], T]) -> T:
        self._check_ready()
        value = fn()
        await self._sync()
        return value

    async def long_poll(
        self, check: Callable[[], T | None], topics: Callable[[], Iterable[Hashable]], hold: float
    ) -> T | None:
        self._check_ready()
        value = await self.waiters.wait_for(check, topics, min(hold, self.config.max_hold))
        await self._sync()
        return value

    # -- operations the API calls ----------------------------------------------------------

    async def get(self, rdzv_id: str, scope: int | None, key: bytes, hold: float) -> bytes | None:
        self.machine.kv(rdzv_id)  # JobNotFound before parking
        return await self.long_poll(
            lambda: self.machine.kv(rdzv_id).get(scope, key), lambda: (key_topic(rdzv_id, scope, key),), hold
        )

    async def multi_get(self, rdzv_id: str, scope: int | None, keys: tuple[bytes, ...], hold: float) -> list[bytes] | None:
        self.machine.kv(rdzv_id)  # JobNotFound before parking

        def first_missing() -> tuple[Hashable, ...]:
            kv = self.machine.kv(rdzv_id)
            missing = next((k for k in keys if kv.get(scope, k) is None), keys[0] if keys else b"")
            return (key_topic(rdzv_id, scope, missing),)

        return await self.long_poll(lambda: self.machine.kv(rdzv_id).multi_get(scope, keys), first_missing, hold)

    async def join(self, command: c.Join, rid: tuple[str, int] | None, hold: float) -> dict[str, Any]:
        result = await self.write(command, rid)
        return await self.await_round(command.rdzv_id, command.node_id, result["round"], hold)

    async def await_round(self, rdzv_id: str, node_id: str, round_: int, hold: float) -> dict[str, Any]:
        """Hold until the node has a place in a formed round >= ``round_``; a heartbeat too."""
        job = self._beat(rdzv_id, node_id)
        # A node still in line has no workers to lose: if this poll drops, its client polls
        # again (or joins again); the TTL and join_timeout are the backstops. Declaring it
        # dead here only made thousands of nodes connecting at once churn.
        with self._node_poll(rdzv_id, node_id, fast_death=False):
            assignment = await self.long_poll(
                lambda: self.machine.assignment(rdzv_id, node_id, round_),
                lambda: (round_topic(rdzv_id),),
                self._node_hold(hold, job),
            )
        self._beat(rdzv_id, node_id)
        return {"round": round_, "assignment": None if assignment is None else asdict(assignment)}

    def _node_hold(self, hold: float, job: Job) -> float:
        """How long to hold a node's long-poll: well inside the TTL (an open poll is not itself
        a heartbeat), and jittered so that thousands of polls parked together do not all
        come back, and re-poll, in the same instant."""
        return min(hold, job.settings.heartbeat_ttl / 3) * self._rng.uniform(HOLD_JITTER, 1.0)

    def _beat(self, rdzv_id: str, node_id: str) -> Job:
        """A request from a node is a heartbeat; it also cancels a pending connection-lost check."""
        self._check_ready()
        job = self.machine.heartbeat(rdzv_id, node_id, self.now())
        self._cancel_lost(rdzv_id, node_id)
        return job

    async def watch(self, rdzv_id: str, node_id: str, round_: int, known: int, hold: float) -> dict[str, Any]:
        """Heartbeat, then hold until num_nodes_waiting != known (see wire.WatchRequest)."""
        job = self._beat(rdzv_id, node_id)
        hold = self._node_hold(hold, job)

        def changed() -> dict[str, Any] | None:
            if rdzv_id not in self.machine.jobs:
                return {"round": round_, "state": "closed", "num_nodes_waiting": 0, "closed": True}
            view = self.machine.watch_view(rdzv_id, round_)
            return view if view["num_nodes_waiting"] != known or view["closed"] else None

        with self._node_poll(rdzv_id, node_id):
            view = await self.long_poll(changed, lambda: (watch_topic(rdzv_id),), hold)
        if rdzv_id in self.machine.jobs:
            self._beat(rdzv_id, node_id)
        return view if view is not None else self.machine.watch_view(rdzv_id, round_)

    # -- fast death detection -------------------------------------------------------------

    @contextlib.contextmanager
    def _node_poll(self, rdzv_id: str, node_id: str, *, fast_death: bool = True) -> Iterator[None]:
        """Track a node's open long-poll; with ``fast_death``, its connection dropping means
        the node died unless it polls again within the grace."""
        key = (rdzv_id, node_id)
        started = self.now()
        self._open_polls[key] = self._open_polls.get(key, 0) + 1
        try:
            yield
        except asyncio.CancelledError:
            self._close_poll(key)
            if fast_death:
                self.connection_lost(rdzv_id, node_id, started)
            raise
        except BaseException:
            self._close_poll(key)
            raise
        self._close_poll(key)

    def _close_poll(self, key: tuple[str, str]) -> None:
        left = self._open_polls.get(key, 1) - 1
        if left:
            self._open_polls[key] = left
        else:
            self._open_polls.pop(key, None)

    def connection_lost(self, rdzv_id: str, node_id: str, since: float) -> None:
        """A node's long-poll (sent at ``since``) dropped: dead unless it calls again within the grace."""
        if self._stopping:
            return
        lost_at = since
        loop = asyncio.get_running_loop()
        self._cancel_lost(rdzv_id, node_id)
        self._lost[(rdzv_id, node_id)] = loop.call_later(
            self.config.disconnect_grace, lambda: asyncio.ensure_future(self._confirm_lost(rdzv_id, node_id, lost_at))
        )

    def _cancel_lost(self, rdzv_id: str, node_id: str) -> None:
        handle = self._lost.pop((rdzv_id, node_id), None)
        if handle is not None:
            handle.cancel()

    async def _confirm_lost(self, rdzv_id: str, node_id: str, lost_at: float) -> None:
        self._lost.pop((rdzv_id, node_id), None)
        entry = self.machine.jobs.get(rdzv_id)
        if entry is None or self._stopping:
            return
        beat = entry.job.heartbeats.get(node_id)
        if beat is None or beat > lost_at or self._open_polls.get((rdzv_id, node_id)):
            return  # already gone, or it came back (a newer request, or another poll still open)
        log.info("Node %s of job %s dropped its connection and did not return: marking it dead.", node_id, rdzv_id)
        await self._apply_timer_command(c.Expire(rdzv_id, (node_id,), "dead"))

    # -- timer ------------------------------------------------------------------------------

    def _schedule(self, rdzv_id: str) -> None:
        deadline = self.machine.deadline(rdzv_id)
        if deadline is None:
            return
        current = self._scheduled.get(rdzv_id)
        if current is not None and current <= deadline:
            return  # an earlier wake-up is pending; it reschedules when it fires
        self._scheduled[rdzv_id] = deadline
        heapq.heappush(self._heap, (deadline, rdzv_id))
        if self._heap[0] == (deadline, rdzv_id):
            self._timer_wake.set()

    async def _run_timer(self) -> None:
        while True:
            self._timer_wake.clear()
            if self._heap:
                delay = max(0.0, self._heap[0][0] - self.now())
                try:
                    await asyncio.wait_for(self._timer_wake.wait(), delay)
                    continue
                except asyncio.TimeoutError:
                    pass
            else:
                await self._timer_wake.wait()
                continue
            now = self.now()
            while self._heap and self._heap[0][0] <= now:
                deadline, rdzv_id = heapq.heappop(self._heap)
                if self._scheduled.get(rdzv_id) != deadline:
                    continue  # superseded by an earlier one that already ran
                del self._scheduled[rdzv_id]
                for command in self.machine.due(rdzv_id, now):
                    await self._apply_timer_command(command)
                self._schedule(rdzv_id)

    async def _apply_timer_command(self, command: c.Command) -> None:
        try:
            result = await self.write(command)
        except RdzvError as exc:
            log.warning("Timer command %s for job %s failed: %s", command.op, command.rdzv_id, exc)
            return
        except Exception:
            log.exception("Timer command %s for job %s crashed", command.op, command.rdzv_id)
            return
        if isinstance(command, c.Expire):
            log.info(
                "Job %s: nodes %s departed (%s).", command.rdzv_id, ", ".join(command.node_ids), command.why
            )
        elif isinstance(command, c.LastCall) and result.get("formed"):
            log.info("Job %s: round %d formed at its last call.", command.rdzv_id, command.round)
        elif isinstance(command, c.Collect):
            log.info("Job %s collected after its TTL.", command.rdzv_id)
