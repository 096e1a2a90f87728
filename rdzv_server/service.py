"""Wiring: config -> storage -> core -> api; the clock, waiters, timers, shutdown.

What it owns: the one :class:`StateMachine`, the durable log, the server clock, parked
long-polls (their table is :mod:`.waiter`'s), the deadline timer (its schedule is
:mod:`.deadline`'s), and the fast-path death detection for nodes whose watch connection
drops.

Rules:
- Every write goes through :meth:`Service.submit` (:meth:`Service.write` awaits it): apply
  (synchronous, nothing awaited), append its record to the log; once the record is durable,
  wake the waiters it satisfies and reschedule the job's timer. A reply is sent only after
  its record is durable.
- Each operation has a synchronous half (:meth:`submit`, :meth:`read_now`, :meth:`poll_now`)
  that answers with its value and the append it still waits on (None: send it now), so the
  stream serves what does not park without a task; the coroutines are built on them.
- Reads answer only after every record applied so far is durable (:meth:`_sync`), so no
  client ever observes a write that a crash could still take back.
- The server clock is monotonic and continues across restarts from the last logged
  time, so deadlines neither fire nor stretch because the server was down; heartbeat
  times are reset on recovery (each node gets one full TTL of grace). Elapsed time is
  read only from the :class:`~.clock.Clock` given (tests pass a fake one).
- The timer only detects; what it decides is applied as ordinary logged commands.
- Whether it runs alone, follows or leads is its :class:`~.role.Role`'s business, asked
  through that one interface (:class:`~.role.Single` for the one server; with ``--etcd`` the
  ``join`` given to it, :mod:`.replication`'s, which drives it): a follower's machine changes
  only by replaying committed records, every operation answers ``not_leader``; :meth:`lead`
  makes it the leader over the replicated log (heartbeats reset, deadlines scheduled) and
  :meth:`stop_leading` ends that, dropping nothing that was acknowledged (only committed
  records were).

What it must not know: HTTP, the wire format (the API translates), etcd (the replication's).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import random
import time
from collections.abc import Callable, Coroutine, Hashable, Iterable, Iterator
from dataclasses import asdict
from typing import Any, TypeVar

from .clock import SYSTEM_CLOCK, Clock
from .config import ServerConfig
from .core import command as c
from .core.error import (
    LogQueueFull,
    RdzvError,
    RecordTooLarge,
    HostCordoned,
    SettingsConflict,
    ShuttingDown,
)
from .core.cordon import Cordon
from .core.event import Cause, EventPage, JobEvent
from .core.machine import Entry, Outcome, StateMachine, events_topic, key_topic, node_topic, round_topic, watch_topic
from .core.rendezvous import Departure, Job, JobSummary, JobView, departure_cause
from .core.store import KeyValueStore
from .deadline import Deadlines
from .role import Role, Single
from .storage import (
    FileLog,
    FsyncPolicy,
    Log,
    LogClosedError,
    LogFailedError,
    LogQueueFullError,
    MemoryLog,
    RecordTooLargeError,
    Recovered,
    ReplicatedLog,
    StorageError,
)
from .waiter import Waiters

log = logging.getLogger("rdzv_server")

T = TypeVar("T")

#: What the synchronous half of an operation gives: its value, and the append whose
#: durability it still waits on (None: it may be sent at once). See :meth:`Service.submit`.
Answer = tuple[T, "asyncio.Future[None] | None"]

# Node long-polls are held between this fraction and all of their hold (see _node_hold).
HOLD_JITTER = 0.75
# A leader that logged nothing for this long logs a Tick (while it holds any job), so that a
# take-over resumes the clock at most this far behind where the old leader's stood.
TICK_EVERY_S = 1.0
# A timer command the service refused (the log's queue full, say) is tried again this much
# later, not at once: the deadline it serves is already due, and retrying in the same pass
# would spin the event loop.
TIMER_RETRY_S = 0.5


class Service:
    """The running server minus HTTP. Create, ``await start()``, serve, ``await stop()``."""

    def __init__(
        self, config: ServerConfig, join: Callable[[Service], Role] | None = None, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        """``join`` makes this service's replica role (``--etcd``: :func:`.replication.join`);
        ``clock`` is where the server clock reads elapsed time (tests pass a fake one and call
        :meth:`check_deadlines` after moving it). Raises ValueError for ``--etcd`` without a join."""
        if config.etcd and join is None:
            raise ValueError("with --etcd the service needs a replica role: Service(config, replication.join)")
        self.config = config
        self._join = join
        self._clock = clock
        # Fresh machines for the live state, recovery and snapshot builds, all made alike; a
        # partial of the class pickles, so a snapshot builder process can use it. No limits
        # until recovery is done: a logged command applies again whatever today's limits.
        self._new_machine = functools.partial(
            StateMachine,
            max_value_bytes=config.max_value_bytes,
            job_ttl=config.job_ttl,
            session_ttl=config.session_ttl,
        )
        self.machine = self._new_machine()
        self.waiters = Waiters()
        self.ready = False  # serving operations (the leader, or the one server)
        self.recovered = False  # a state machine is installed (a replica may follow)
        self._role: Role = Single(self.log_index)
        self.started_at = time.time()
        self.bound_port: int | None = None  # the port listened on (server.py sets it before start)
        self.recovered_records = 0
        self.recovery_seconds = 0.0
        self._log: Log = MemoryLog()
        self._replicated: ReplicatedLog | None = None  # the log while this replica leads
        self._last_append: asyncio.Future[None] | None = None
        self._clock_base = 0.0
        self._mono_base = clock.monotonic()
        self._deadlines = Deadlines()
        self._timer_task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None  # a leader's (see TICK_EVERY_S)
        self._snapshotting = False
        self._stopping = False
        self._lost: dict[tuple[str, str], asyncio.TimerHandle] = {}
        self._open_polls: dict[tuple[str, str], int] = {}
        self._rng = random.Random()
        self._background: set[asyncio.Future[Any]] = set()
        #: Told what each applied command added to its job's timeline, once it is durable (metrics).
        self.on_events: Callable[[tuple[JobEvent, ...]], None] = lambda events: None
        #: Told how long a node's death took to notice, by cause, when the server marks it dead.
        self.on_detected: Callable[[str, float], None] = lambda cause, seconds: None
        #: Called once when the server must stop (the log failed); server.py exits non-zero.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.fatal_error: BaseException | None = None

    # -- clock ---------------------------------------------------------------------------

    def now(self) -> float:
        """The server clock: seconds, monotonic, resumed across restarts from the last logged time."""
        return self._clock_base + (self._clock.monotonic() - self._mono_base)

    def check_deadlines(self) -> None:
        """Have the timer look at the deadlines now (after a fake clock was moved; the real
        clock needs no call: the timer sleeps until the earliest deadline)."""
        self._deadlines.changed.set()

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def role(self) -> str:
        """``single`` (no --etcd), else this replica's ``leader``, ``follower`` or ``candidate``."""
        return self._role.role.value

    async def start(self) -> None:
        """Recover from the data directory (if any), then start the timer and report ready.

        With ``--etcd``: join the cluster as a replica and return once it follows (or leads).

        Recovery runs off the event loop (the loop keeps answering /healthz, and every
        operation answers not_ready): a thread reads the log and rebuilds a fresh machine
        from it, which is then swapped in. Raises ``SystemExit`` with a one-line message when
        the data directory cannot be used (another server holds it, damage recovery must
        not repair on its own, an I/O error): the process must not serve, and the message
        says what to do.
        """
        started = self._clock.monotonic()
        if self._join is not None:
            self._role = self._join(self)
            await self._role.start()
            self.recovery_seconds = self._clock.monotonic() - started
            return
        data_dir = self.config.resolved_data_dir()
        if data_dir is not None:
            # Recovery allocates millions of containers. The cyclic collector would rescan them
            # over and over, and inside msgpack's unpackb, which holds the GIL, so the loop too
            # would stall (a 1M-key snapshot decodes in 0.5 s instead of 0.15 s). The switch is
            # process-wide, so it is flipped here, on the loop's own thread, by the one owner of
            # the process's start, and only for the recovery (never by the recovery thread).
            collecting = gc.isenabled()
            gc.disable()
            try:
                try:
                    file_log, recovered = await asyncio.to_thread(
                        FileLog.open,
                        data_dir,
                        FsyncPolicy(self.config.fsync),
                        truncate_corrupt=self.config.truncate_corrupt_log,
                        max_queued_records=self.config.max_log_queue,
                        max_queued_bytes=self.config.max_log_queue_bytes,
                    )
                except (StorageError, OSError) as exc:
                    raise SystemExit(f"rdzv-server: error: cannot recover {data_dir}: {exc}") from exc
                self._log = file_log
                self.machine = await asyncio.to_thread(self.rebuild, recovered)
            finally:
                if collecting:
                    gc.enable()
            self.recovered_records = len(recovered.records)
            if recovered.truncated_bytes:
                log.warning(
                    "Recovery dropped a torn tail of %d bytes from the log in %s (a crash mid-write); "
                    "every acknowledged write is before it.",
                    recovered.truncated_bytes,
                    data_dir,
                )
        self.recovery_seconds = self._clock.monotonic() - started
        await self._serve(c.Restarted(""))
        log.info(
            "Recovered %d jobs (%d log records) in %.3f s from %s.",
            len(self.machine.jobs),
            self.recovered_records,
            self.recovery_seconds,
            data_dir or "memory",
        )

    async def _serve(self, restarted: c.Restarted) -> None:
        """Take up serving over the installed machine and log: the clock continues from the last
        logged time, each node gets one full TTL of grace, every deadline is scheduled."""
        self._clock_base = self.machine.clock
        self._mono_base = self._clock.monotonic()
        self.machine.reset_heartbeats(self.now())
        self._deadlines.clear()
        for rdzv_id in list(self.machine.jobs):
            self._schedule(rdzv_id)
        self.waiters.reopen()
        self._timer_task = asyncio.create_task(self._run_timer(), name="rdzv-timer")
        self.machine.set_limits(self.config.limits())  # after replay: see StateMachine.apply
        self.recovered = True
        self.ready = True
        if self.machine.jobs:  # every job's timeline says the server was away
            await self.write(restarted)

    # -- replicas (driven by replication.py) ---------------------------------------------------

    def follow(self, machine: StateMachine) -> None:
        """Install ``machine`` (rebuilt from etcd) as a follower's; the replication keeps it hot."""
        self.machine = machine
        self.recovered = True

    async def lead(self, replicated: ReplicatedLog, detail: str) -> None:
        """Serve as the leader over ``replicated``, the log the follower's machine has caught up to."""
        self._log = self._replicated = replicated
        self._last_append = None
        self._snapshotting = False
        self._ticker = asyncio.create_task(self._run_ticker(), name="rdzv-tick")
        await self._serve(c.Restarted("", "leader_changed", detail))

    async def stop_leading(self) -> None:
        """Stop serving at once (a lost lease, a failed append, shutdown): see :meth:`_stop_serving`;
        then wait for the timer and the ticker to end."""
        self._stop_serving("it stepped down")
        for task in (self._timer_task, self._ticker):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._timer_task = self._ticker = None

    def _stop_serving(self, reason: str) -> None:
        """A leader stops in one step, nothing awaited (so no request is served in between):
        refuse operations, answer every parked long-poll and every pending append (hence
        every write and read waiting on one) with ``not_leader``, time nothing, drop the log.
        What is in memory may hold commands the log never took, so the replication rebuilds
        the machine from etcd before anything is served again. Idempotent."""
        self.ready = False
        self.waiters.fail_all(self._role.unavailable())
        for handle in self._lost.values():
            handle.cancel()
        self._lost.clear()
        for task in (self._timer_task, self._ticker):
            if task is not None:
                task.cancel()
        replicated, self._replicated = self._replicated, None
        if replicated is not None:
            replicated.abandon(reason)  # fails its pending appends now: their callers answer not_leader
        self._log = MemoryLog()
        self._last_append = None

    def log_index(self) -> int:
        """The index of the last record appended to the replicated log (0 without one: the one
        server's log does not count records)."""
        return self._replicated.last_index if self._replicated is not None else 0

    def rebuild(self, recovered: Recovered) -> StateMachine:
        """Runs in a thread: a fresh machine rebuilt from ``recovered``, touched by nothing else
        until it is swapped in. Raises RuntimeError if a record does not replay."""
        machine = self._new_machine()
        if recovered.snapshot is not None:
            machine.restore(recovered.snapshot)
        for record in recovered.records:
            machine.replay(record)
        return machine

    def begin_stop(self) -> None:
        """Refuse new work and answer parked long-polls (clients retry after the restart)."""
        self._stopping = True
        self.ready = False
        self.waiters.fail_all(ShuttingDown("the server is shutting down; retry shortly"))
        for handle in self._lost.values():
            handle.cancel()
        if self._ticker is not None:
            self._ticker.cancel()

    async def close(self) -> None:
        """After in-flight requests drained: stop the timer, flush and close the log."""
        self.begin_stop()
        await self._role.close()  # a replica resigns: another takes over at once
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
        if not (self.ready and self._role.lease_valid()):
            # Recovering (the one server: not_ready), or following (a replica: not_leader). A
            # leader whose lease estimate ran out (paused past it, or etcd electing a new
            # leader) answers nothing, but does not step down: etcd's answer to its keepalive
            # decides, and a lease etcd kept makes it serve again at once (election.py).
            raise self._role.unavailable()

    async def write(self, command: c.Command, rid: tuple[Any, ...] | None = None) -> dict[str, Any]:
        """Apply, log, await durability, wake (:meth:`submit`, then its durability). Raises
        RdzvError having changed nothing, or as :meth:`settled` once applied."""
        result, pending = self.submit(command, rid)
        if pending is not None:
            await self._committed(pending)
        return result

    def submit(self, command: c.Command, rid: tuple[Any, ...] | None = None) -> Answer[dict[str, Any]]:
        """The synchronous half of :meth:`write`: apply and append now, nothing awaited.

        Returns the result and None when it may be sent at once (its record is durable
        already: the memory log, a replayed request whose effects are), else the append it
        waits on: send the result once that future is done and :meth:`settled` does not
        raise. Raises RdzvError having changed nothing; ``role.commit_failed()`` when the
        append has already failed.

        The effects of an applied command (waking waiters, scheduling its job's deadlines, a
        snapshot) follow from its record becoming durable, in :meth:`_durable`, whatever
        becomes of the request that carried it: a client that disconnects mid-fsync
        cancels only its own wait, as in etcd's apply loop.
        """
        self._check_ready()
        now = self.now()
        # The record depends only on the command, the time and the rid, so the log can refuse
        # it before it is applied: a refused write changes nothing and costs no leadership.
        record = {"cmd": command.to_record(), "now": now, "rid": list(rid) if rid else None}
        self._admit(command, record)
        outcome: Outcome = self.machine.apply(command, now, rid)
        if outcome.replayed:  # its effects came with the first application
            return outcome.result, self._pending(self._last_append)
        log_ = self._log
        try:
            fut = log_.append(record)
        except Exception as exc:
            self._log_failed(exc)
            raise
        self._last_append = fut
        if not fut.done():
            fut.add_done_callback(functools.partial(self._durable, log_, command, outcome))
            return outcome.result, fut
        self._durable(log_, command, outcome, fut)
        return outcome.result, self._pending(fut)

    def _admit(self, command: c.Command, record: dict[str, Any]) -> None:
        """Refuse, before anything is applied, a record the log cannot take or should not queue now."""
        try:
            self._log.check(record)
        except RecordTooLargeError as exc:
            raise RecordTooLarge(
                f"job {command.rdzv_id}: this {command.op} would log a record of {exc.size} bytes, but the log takes "
                f"at most {exc.limit} (with --etcd, etcd's request limit): nothing was applied; store less per "
                "request (smaller values, or several multi_set calls)"
            ) from exc
        except LogQueueFullError as exc:
            raise LogQueueFull(f"{exc} Nothing was applied: retry shortly.") from exc

    async def _committed(self, fut: asyncio.Future[None]) -> None:
        """Wait for ``fut`` (an append), then raise as :meth:`settled` does. Cancelling the
        wait does not cancel the append."""
        await asyncio.wait((fut,))
        self.settled(fut)

    def settled(self, fut: asyncio.Future[None]) -> None:
        """Raise what the done append ``fut`` means for the requests that waited on it: a
        replica's failed append answers ``not_leader`` (the client retries at the leader
        with the same request id, and the write applies once: committed or not, the new
        leader's sessions know); any other failure as itself; a cancelled append
        CancelledError (the request is not answered)."""
        try:
            fut.result()
        except LogFailedError as exc:
            raise self._role.commit_failed() from exc

    def _pending(self, fut: asyncio.Future[None] | None) -> asyncio.Future[None] | None:
        """``fut`` while it is not done or did not succeed (the caller waits or settles it);
        None once it succeeded. Raises as :meth:`settled` for an append that failed with
        LogFailedError, so the common failure answers at once."""
        if fut is None or not fut.done() or fut.cancelled():
            return fut
        failure = fut.exception()
        if failure is None:
            return None
        if isinstance(failure, LogFailedError):
            raise self._role.commit_failed() from failure
        return fut

    def _log_failed(self, exc: BaseException) -> None:
        """The log refused or lost an append. Memory now holds a change the log does not, so
        no request may be answered from it any more: a replica stops serving in this very
        step (and its term ends: it rebuilds from etcd), the one server stops for good."""
        reason = f"an append was not committed: {exc}"
        if self._role.step_down(reason):
            self._stop_serving(reason)
        else:  # no term to end: the one server
            self._fatal(exc)

    def _durable(self, log_: Log, command: c.Command, outcome: Outcome, fut: asyncio.Future[None]) -> None:
        """A record's append to ``log_`` finished: on success the command's effects, else a stop."""
        failure = fut.exception() if not fut.cancelled() else asyncio.CancelledError("log append cancelled")
        if failure is not None:
            if log_ is self._log:  # (a log already dropped at a step-down was dealt with then)
                self._log_failed(failure)
            return
        if outcome.wakes:
            self.waiters.wake(outcome.wakes)
        # A store write touches a job's keys and its last use, which can only move the job's next
        # deadline (its collection) later: while the job has a wake-up pending (which
        # reschedules when it fires), a store write needs no new one.
        if type(command) not in c.STORE_WRITES or command.rdzv_id not in self._deadlines:
            self._schedule(command.rdzv_id)
        if outcome.events:
            self.on_events(outcome.events)
        self._maybe_snapshot()

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Future[Any]:
        """Run ``coro`` in the background, holding a reference until it ends and logging its failure."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)

        def done(t: asyncio.Future[Any]) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed.", what, exc_info=t.exception())

        task.add_done_callback(done)
        return task

    async def _sync(self) -> None:
        """Return once every record appended so far is durable; raise as :meth:`settled`
        does if the last one failed (even long ago: what it carried is in memory only)."""
        fut = self._pending(self._last_append)
        if fut is not None:
            await self._committed(fut)

    def _maybe_snapshot(self) -> None:
        """Cut a snapshot every ``snapshot_every`` records, one at a time.

        O(1) on the loop, whatever the state's size: the log rotates its segment at the cut
        and a builder process rebuilds the state there from the previous snapshot and the
        closed segments (storage.compaction); the live machine is never read for it.
        """
        if self._snapshotting or self._log.records_since_snapshot < self.config.snapshot_every:
            return
        self._snapshotting = True
        task = asyncio.ensure_future(self._log.snapshot(self._new_machine))
        self._background.add(task)

        def done(t: asyncio.Future[None]) -> None:
            self._background.discard(t)
            self._snapshotting = False
            failure = None if t.cancelled() else t.exception()
            if isinstance(failure, LogClosedError):
                log.info("A snapshot was abandoned because the log is closing (every record is in the log).")
            elif failure is not None:
                log.error("Writing a snapshot failed: %s; the log keeps growing until one succeeds.", failure)

        task.add_done_callback(done)

    # -- reads ---------------------------------------------------------------------------

    async def read(self, fn: Callable[[], T]) -> T:
        """``fn()``, answered once every record appended so far is durable."""
        value, pending = self.read_now(fn)
        if pending is not None:
            await self._committed(pending)
        return value

    def read_now(self, fn: Callable[[], T]) -> Answer[T]:
        """The synchronous half of :meth:`read`: ``fn()`` now, and the append to wait on
        (see :meth:`submit`). Raises NotReady (not serving), as :meth:`settled`, or as ``fn``."""
        self._check_ready()
        value = fn()
        return value, self._pending(self._last_append)

    # -- queries (what the API reads; it never reaches into the machine or the replica) -----

    async def job_summaries(self, readable: Callable[[str], bool]) -> list[JobSummary]:
        """One summary per job that ``readable(rdzv_id)`` allows. Raises as :meth:`read`."""
        return await self.read(lambda: [e.job.summary() for e in self.machine.jobs.values() if readable(e.job.rdzv_id)])

    async def job_view(self, rdzv_id: str) -> JobView:
        """Job ``rdzv_id``'s membership, as plain data. Raises as :meth:`read`, or NotFound."""
        return await self.read(lambda: self.machine.job(rdzv_id).view(self.now()))

    async def job_timeline(self, rdzv_id: str) -> EventPage:
        """Every event job ``rdzv_id``'s timeline keeps (oldest first), and the server's ``now``,
        at once (the job page's lanes). Raises as :meth:`read`, or NotFound."""

        def timeline() -> EventPage:
            kept = self.machine.job(rdzv_id).timeline
            return EventPage(kept.since(0), kept.first_seq, kept.next_seq, self.now())

        return await self.read(timeline)

    def jobs(self) -> list[Entry]:
        """Every job held, as it stands in memory now (metrics: no durability wait)."""
        return list(self.machine.jobs.values())

    def session_usage(self) -> tuple[int, int]:
        """Clients remembered for exactly-once retries, and the bytes of results kept for them."""
        return len(self.machine.sessions), self.machine.session_bytes

    @property
    def replicated(self) -> bool:
        """Whether this server is one replica of a cluster (``--etcd``)."""
        return self._role.replicated

    def lease_valid(self) -> bool:
        """Whether this replica's election lease is surely alive (the one server: always)."""
        return self._role.lease_valid()

    def leader_url(self) -> str | None:
        """The URL of the replica etcd names leader (this one's own included); None if none, or single."""
        return self._role.leader_url()

    def applied_index(self) -> int:
        """The index of the last record this server applied (a leader: appended)."""
        return self._role.applied()

    async def cluster_view(self) -> dict[str, Any] | None:
        """``GET /v1/cluster`` of a replica; None for the one server (the API draws it).
        Raises NotReady when etcd does not answer."""
        return await self._role.view()

    async def long_poll(
        self, check: Callable[[], T | None], topics: Callable[[], Iterable[Hashable]], hold: float
    ) -> T | None:
        self._check_ready()
        value = await self.waiters.wait_for(check, topics, min(hold, self.config.max_hold))
        await self._sync()
        return value

    def poll_now(self, check: Callable[[], T | None], hold: float) -> Answer[T | None] | None:
        """The synchronous half of :meth:`long_poll`: its answer when it would not park
        (``check()`` holds, or ``hold`` is spent), else None (call :meth:`long_poll`). Raises
        as :meth:`read_now`."""
        self._check_ready()
        value = check()
        if value is None and min(hold, self.config.max_hold) > 0:
            return None
        return value, self._pending(self._last_append)

    # -- operations the API calls ----------------------------------------------------------

    def use(self, rdzv_id: str) -> KeyValueStore:
        """The job's keys for a store read (NotReady first, then JobNotFound); reading is use."""
        self._check_ready()
        return self.machine.use(rdzv_id, self.now())

    async def get(self, rdzv_id: str, scope: int | None, key: bytes, hold: float) -> bytes | None:
        self.use(rdzv_id)  # NotReady, JobNotFound before parking
        return await self.long_poll(
            lambda: self.machine.kv(rdzv_id).get(scope, key), lambda: (key_topic(rdzv_id, scope, key),), hold
        )

    async def multi_get(self, rdzv_id: str, scope: int | None, keys: tuple[bytes, ...], hold: float) -> list[bytes] | None:
        self.use(rdzv_id)  # NotReady, JobNotFound before parking

        def first_missing() -> tuple[Hashable, ...]:
            kv = self.machine.kv(rdzv_id)
            missing = next((k for k in keys if kv.get(scope, k) is None), keys[0] if keys else b"")
            return (key_topic(rdzv_id, scope, missing),)

        return await self.long_poll(lambda: self.machine.kv(rdzv_id).multi_get(scope, keys), first_missing, hold)

    async def events(self, rdzv_id: str, since: int, hold: float, limit: int) -> EventPage:
        """The job's events after ``since``, holding up to ``hold`` s while there are none.

        Raises NotReady, JobNotFound (also when the job is collected while the poll waits)."""
        self._check_ready()
        self.machine.job(rdzv_id)  # JobNotFound before parking

        def newer() -> list[JobEvent] | None:
            found = self.machine.job(rdzv_id).timeline.since(since, limit)
            return found or None

        found = await self.long_poll(newer, lambda: (events_topic(rdzv_id), round_topic(rdzv_id)), hold)
        timeline = self.machine.job(rdzv_id).timeline
        return EventPage(found or [], timeline.first_seq, timeline.next_seq, self.now())

    async def join(self, command: c.Join, rid: tuple[str, int] | None, hold: float) -> dict[str, Any]:
        """Join, then hold until the node has a place (see :meth:`begin_join`)."""
        return await self.begin_join(command, rid, hold)

    def begin_join(
        self, command: c.Join, rid: tuple[str, int] | None, hold: float
    ) -> Coroutine[Any, Any, dict[str, Any]]:
        """The synchronous half of :meth:`join`: apply the join (or, for conflicting settings,
        log the refusal) now, in the order requests arrive; return the rest to await (its
        durability, then :meth:`await_round`). Raises as :meth:`submit`."""
        try:
            result, pending = self.submit(command, rid)
        except (SettingsConflict, HostCordoned) as exc:  # the job's timeline says why this node is not in it, once
            why = Cause.SETTINGS_CONFLICT if isinstance(exc, SettingsConflict) else Cause.CORDONED
            refused = c.Refused(command.rdzv_id, command.node_id, command.addr, why.value, exc.message)
            logged: asyncio.Future[None] | None = None
            if command.rdzv_id not in self.machine.jobs:  # a first node refused: the job exists to say why
                _, logged = self.submit(c.Create(command.rdzv_id, command.settings))
            if not self.machine.already_refused(refused):
                _, logged = self.submit(refused)  # appended after the create: its durability covers both
            return self._refused(logged, exc)
        return self._joined(command, result["round"], pending, hold)

    async def _joined(
        self, command: c.Join, round_: int, pending: asyncio.Future[None] | None, hold: float
    ) -> dict[str, Any]:
        if pending is not None:
            await self._committed(pending)
        return await self.await_round(command.rdzv_id, command.node_id, round_, hold)

    async def _refused(self, logged: asyncio.Future[None] | None, refusal: SettingsConflict | HostCordoned) -> dict[str, Any]:
        if logged is not None:
            await self._committed(logged)
        raise refusal

    async def refuse(self, command: c.Refuse, rid: tuple[Any, ...] | None) -> dict[str, Any]:
        """A node's health check failed: its job's timeline says so, once per repeated refusal."""
        same = c.Refused(command.rdzv_id, command.node_id, command.addr, command.cause, command.detail)
        if self.machine.already_refused(same):
            return {}
        return await self.write(command, rid)

    async def cordons(self) -> tuple[list[Cordon], float]:
        """The cordons in effect (``GET /v1/cordons``), and the ``now`` they are in effect at."""
        def view() -> tuple[list[Cordon], float]:
            now = self.now()
            return self.machine.cordons.listing(now), now

        return await self.read(view)

    def cordon_counts(self) -> dict[str, int]:
        """Cordons in effect by whom (operator, flapping): the metrics' gauge."""
        now = self.now()
        counts = {"operator": 0, "flapping": 0}
        for cordon in self.machine.cordons.cordons.values():
            if cordon.active(now):
                counts[cordon.by] = counts.get(cordon.by, 0) + 1
        return counts

    async def cordon_of(self, host: str) -> tuple[Cordon | None, float]:
        """The cordon in effect on ``host`` (None: none), and the ``now`` it is in effect at."""

        def view() -> tuple[Cordon | None, float]:
            now = self.now()
            return self.machine.cordons.active(host, now), now

        return await self.read(view)

    async def await_round(self, rdzv_id: str, node_id: str, round_: int, hold: float) -> dict[str, Any]:
        """Hold until the node has a place in a formed round >= ``round_``; a heartbeat too."""
        job = self._beat(rdzv_id, node_id)
        # A node still in line has no workers to lose: if this poll drops, its client polls
        # again (or joins again); the TTL and join_timeout are the backstops. Declaring it
        # dead here only made thousands of nodes connecting at once churn.
        with self._node_poll(rdzv_id, node_id, fast_death=False):
            assignment = await self.long_poll(
                lambda: self.machine.assignment(rdzv_id, node_id, round_),
                lambda: (round_topic(rdzv_id), node_topic(rdzv_id, node_id)),
                self._node_hold(hold, job),
            )
        self._beat(rdzv_id, node_id)
        return {"round": round_, "assignment": None if assignment is None else asdict(assignment)}

    def _node_hold(self, hold: float, job: Job) -> float:
        """How long to hold a node's wait for its round: well inside the TTL (an open poll is
        not itself a heartbeat), and jittered so that thousands of polls parked together do
        not all come back, and re-poll, in the same instant."""
        return min(hold, job.settings.heartbeat_ttl / 3) * self._rng.uniform(HOLD_JITTER, 1.0)

    def _beat(self, rdzv_id: str, node_id: str) -> Job:
        """A request from a node is a heartbeat; it also cancels a pending connection-lost check."""
        self._check_ready()
        job = self.machine.heartbeat(rdzv_id, node_id, self.now())
        self._cancel_lost(rdzv_id, node_id)
        return job

    def beat_now(self, rdzv_id: str, node_id: str, round_: int) -> Answer[dict[str, Any]]:
        """A watch with no hold: the node's heartbeat, answered at once with the job's watch
        view (no task, no waiter: thousands of nodes send one every third of their TTL).
        Raises NotReady, JobNotFound."""
        self._beat(rdzv_id, node_id)
        return self.machine.watch_view(rdzv_id, round_), self._pending(self._last_append)

    async def watch(self, rdzv_id: str, node_id: str, round_: int, known: int, hold: float) -> dict[str, Any]:
        """Heartbeat, then hold until num_nodes_waiting != known (see wire.WatchRequest).

        The hold is the client's (up to ``max_hold``, jittered), not capped by the TTL: a parked
        watch is not a heartbeat, so a client that holds it longer than a third of its TTL
        beats meanwhile with watches of no hold (:meth:`beat_now`), as the plug-in does. A
        client that does not (the plug-in before it did) asks for a third of the TTL."""
        self._beat(rdzv_id, node_id)
        hold = hold * self._rng.uniform(HOLD_JITTER, 1.0)

        def changed() -> dict[str, Any] | None:
            if rdzv_id not in self.machine.jobs:
                return {"round": round_, "state": "closed", "num_nodes_waiting": 0, "closed": True}
            view = self.machine.watch_view(rdzv_id, round_)
            if view["closed"]:
                return view
            if known > 0 and view["round"] > round_:
                return None  # it knows to re-join already: a later round's joins tell it nothing new
            return view if view["num_nodes_waiting"] != known else None

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
        self._open_polls[key] = self._open_polls.get(key, 0) + 1
        try:
            yield
        except asyncio.CancelledError:
            self._close_poll(key)
            if fast_death:
                # Dead unless it calls again after the drop: a heartbeat the node sent while
                # this poll was parked says nothing about whether it outlived the connection.
                self.connection_lost(rdzv_id, node_id, self.now())
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
        """A node's long-poll dropped at ``since``: dead unless it calls again within the grace."""
        if self._stopping:
            return
        lost_at = since
        loop = asyncio.get_running_loop()
        self._cancel_lost(rdzv_id, node_id)
        self._lost[(rdzv_id, node_id)] = loop.call_later(
            self.config.disconnect_grace,
            lambda: self.spawn(self._confirm_lost(rdzv_id, node_id, lost_at), f"Confirming node {node_id} lost"),
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
        log.info(
            "Node %s of job %s dropped its connection and did not return: marking it dead.", node_id, rdzv_id,
            extra={"job": rdzv_id, "node": node_id, "cause": Cause.CONNECTION_CLOSED.value},
        )
        result = await self._apply_timer_command(c.Expire(rdzv_id, (node_id,), "dead", Cause.CONNECTION_CLOSED.value))
        if result is not None and result.get("expired"):
            self.on_detected(Cause.CONNECTION_CLOSED.value, self.now() - lost_at)

    # -- a leader's clock ----------------------------------------------------------------------

    async def _run_ticker(self) -> None:
        """While leading: log a Tick whenever nothing was logged for TICK_EVERY_S and a job
        exists, so the clock a new leader resumes from is at most that far behind (the
        clock orders every deadline and the timelines: idle time must not stretch them)."""
        while True:  # cancelled at a step-down or shutdown
            await asyncio.sleep(TICK_EVERY_S)
            if not self.ready or not self.machine.jobs or self.now() - self.machine.clock < TICK_EVERY_S:
                continue
            try:
                await self.write(c.Tick(""))
            except RdzvError as exc:  # not the leader any more, the log busy: the next tick will do
                log.debug("A tick was not logged: %s", exc)

    # -- timer ------------------------------------------------------------------------------

    def _schedule(self, rdzv_id: str) -> None:
        deadline = self.machine.deadline(rdzv_id)
        if deadline is not None:
            self._schedule_at(rdzv_id, deadline)

    def _schedule_at(self, rdzv_id: str, deadline: float) -> None:
        self._deadlines.wake_at(rdzv_id, deadline)

    async def _run_timer(self) -> None:
        deadlines = self._deadlines
        while True:
            deadlines.changed.clear()
            earliest = deadlines.earliest()
            if earliest is None:
                await deadlines.changed.wait()
                continue
            try:
                await asyncio.wait_for(deadlines.changed.wait(), max(0.0, earliest - self.now()))
                continue
            except asyncio.TimeoutError:
                pass
            now = self.now()
            for rdzv_id in deadlines.due(now):
                applied = False
                try:
                    for command in self.machine.due(rdzv_id, now):
                        beats = self._last_beats(command)
                        result = await self._apply_timer_command(command)
                        if result is None:
                            break
                        if beats and result.get("expired"):
                            for beat in beats:  # a silent host died at most this long before
                                self.on_detected(Cause.HEARTBEAT_EXPIRED.value, now - beat)
                    else:
                        applied = True
                except Exception:  # a bug for one job must not stop every job's deadlines
                    log.exception("The timer failed on job %s; its other deadlines still run.", rdzv_id)
                if applied:
                    self._schedule(rdzv_id)
                else:  # the deadline is still due: look again a little later, not in this pass
                    self._schedule_at(rdzv_id, now + TIMER_RETRY_S)

    def _hosts(self, command: c.Command) -> list[str]:
        """The addresses of the nodes a death is about to remove (what quarantine counts by)."""
        entry = self.machine.jobs.get(command.rdzv_id)
        if not isinstance(command, c.Expire) or command.why != Departure.DEAD.value or entry is None:
            return []
        nodes = entry.job.nodes
        return list(dict.fromkeys(nodes[n].addr for n in command.node_ids if n in nodes))

    async def _quarantine(self, rdzv_id: str, hosts: list[str]) -> None:
        """Automatic quarantine: cordon a host whose nodes died ``--quarantine-after`` times within
        ``--quarantine-window``, for ``--quarantine-for``. Decided here, applied (and logged) as an
        ordinary ``cordon`` command, so a change of the flags never makes a replay diverge."""
        k, window = self.config.quarantine_after, self.config.quarantine_window
        if k <= 0:
            return
        now = self.now()
        for host in hosts:
            deaths = self.machine.cordons.deaths_within(host, now, window)
            if deaths < k or self.machine.cordons.active(host, now) is not None:
                continue
            reason = f"{deaths} deaths of its nodes within {window:g} s (--quarantine-after {k})"
            log.warning(
                "Host %s is quarantined for %g s: %s (last in job %s).", host, self.config.quarantine_for, reason, rdzv_id,
                extra={"job": rdzv_id, "host": host, "cause": Cause.FLAPPING.value},
            )
            cordon = c.Cordon(rdzv_id, host=host, reason=reason, duration=self.config.quarantine_for, by=Cause.FLAPPING.value)
            try:
                await self.write(cordon)
            except RdzvError as exc:
                log.warning("Host %s could not be quarantined: %s", host, exc)

    def _last_beats(self, command: c.Command) -> list[float]:
        """The last heartbeats of the nodes a heartbeat expiry is about to mark dead."""
        entry = self.machine.jobs.get(command.rdzv_id)
        if not isinstance(command, c.Expire) or command.why != "dead" or entry is None:
            return []
        beats = entry.job.heartbeats
        return [beats[n] for n in command.node_ids if n in beats]

    async def _apply_timer_command(self, command: c.Command) -> dict[str, Any] | None:
        """Apply what the timer decided; its failure is logged (the result is then None)."""
        hosts = self._hosts(command)
        try:
            result = await self.write(command)
        except RdzvError as exc:
            log.warning("Timer command %s for job %s failed: %s", command.op, command.rdzv_id, exc)
            return None
        except Exception:
            log.exception("Timer command %s for job %s crashed", command.op, command.rdzv_id)
            return None
        if isinstance(command, c.Expire):
            cause = departure_cause(Departure(command.why), Cause(command.cause) if command.cause else None).value
            for node_id in command.node_ids:  # one line per node: an operator filters by node
                log.info(
                    "Job %s: node %s departed (%s).", command.rdzv_id, node_id, cause,
                    extra={"job": command.rdzv_id, "node": node_id, "cause": cause},
                )
            if command.why == Departure.DEAD.value and result.get("expired"):
                await self._quarantine(command.rdzv_id, hosts)
        elif isinstance(command, c.LastCall) and result.get("formed"):
            log.info(
                "Job %s: round %d formed at its last call.", command.rdzv_id, command.round,
                extra={"job": command.rdzv_id, "round": command.round, "cause": Cause.LAST_CALL.value},
            )
        elif isinstance(command, c.Collect):
            log.info("Job %s collected after its TTL.", command.rdzv_id, extra={"job": command.rdzv_id})
        return result
