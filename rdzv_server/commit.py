"""The commit pipeline: apply, append, and what follows once the record is durable.

What it owns: the durable log the service writes to (the one server's file or memory log, a
leader's replicated log), the last append (what a read waits on), snapshot cutting, and the
service's background tasks.

Rules:
- Every write goes through :meth:`Pipeline.submit` (:meth:`Pipeline.write` awaits it): check
  that the service serves, let the log judge the record (a refused write changed nothing),
  apply (synchronous, nothing awaited), append. Once the record is durable its effects
  follow (:meth:`Pipeline.durable`: wake the waiters, reschedule the job's timer, count its
  events, cut a snapshot), whatever becomes of the request that carried it. A reply is sent
  only after its record is durable.
- Each operation has a synchronous half (:meth:`submit`, :meth:`read_now`, :meth:`poll_now`)
  that answers with its value and the append it still waits on (None: send it now), so the
  stream serves what does not park without a task; the coroutines are built on them.
- Reads answer only after every record appended so far is durable (:meth:`sync`), so no
  client ever observes a write that a crash could still take back.
- An append that failed stops serving in the same step (:meth:`log_failed`): a replica's
  term ends, the one server stops for good.

What it must not know: HTTP, the wire format, etcd, which role the service plays (it asks
the role), the service's other rooms: it is the lowest of them, and tells the timer and the
lifecycle only through the hooks the service wires (:meth:`Pipeline.wire`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine, Hashable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from .core import command as c
from .core.error import LogQueueFull, RecordTooLarge, ShuttingDown
from .core.event import Kind
from .core.machine import Outcome
from .storage import (
    Log,
    LogClosedError,
    LogFailedError,
    LogQueueFullError,
    MemoryLog,
    RecordTooLargeError,
    ReplicatedLog,
)

if TYPE_CHECKING:
    from .shared import ServiceState

log = logging.getLogger("rdzv_server")

T = TypeVar("T")

#: What the synchronous half of an operation gives: its value, and the append whose
#: durability it still waits on (None: it may be sent at once). See :meth:`Pipeline.submit`.
Answer = tuple[T, "asyncio.Future[None] | None"]


class Pipeline:
    """The service's commit pipeline (see the module docstring)."""

    def __init__(self, svc: ServiceState) -> None:
        self._svc = svc
        # The rooms above this one, as :meth:`wire` gives them: told of each durable command
        # (the timer), of an append that failed (the lifecycle: end the term, or stop for good).
        self._applied: Callable[[c.Command], None] = lambda command: None
        self._round_formed: Callable[[str], None] = lambda rdzv_id: None
        self._step_down: Callable[[str], None] = lambda reason: None
        self._fatal: Callable[[BaseException], None] = lambda exc: None
        self.log: Log = MemoryLog()
        self.replicated: ReplicatedLog | None = None  # the log while this replica leads
        self.last_append: asyncio.Future[None] | None = None
        self._snapshotting = False
        self._background: set[asyncio.Future[Any]] = set()

    def wire(
        self,
        *,
        applied: Callable[[c.Command], None],
        round_formed: Callable[[str], None],
        step_down: Callable[[str], None],
        fatal: Callable[[BaseException], None],
    ) -> None:
        """Connect the rooms above: ``applied`` is told of each command once durable,
        ``round_formed`` of each job whose round formed (host-local failures are judged then),
        ``step_down`` ends a replica's term and ``fatal`` stops the one server when an append fails."""
        self._applied, self._round_formed, self._step_down, self._fatal = applied, round_formed, step_down, fatal

    # -- the log in use ----------------------------------------------------------------------

    def lead(self, replicated: ReplicatedLog) -> None:
        """Append to ``replicated`` from now on (a replica takes up leading)."""
        self.log = self.replicated = replicated
        self.last_append = None
        self._snapshotting = False

    def abandon(self, reason: str) -> None:
        """Drop the log, failing every append still pending on a replicated one (each waiting
        write answers ``not_leader`` now); nothing is appended until :meth:`lead`."""
        replicated, self.replicated = self.replicated, None
        if replicated is not None:
            replicated.abandon(reason)
        self.log = MemoryLog()
        self.last_append = None

    def log_index(self) -> int:
        """The index of the last record appended to the replicated log (0 without one: the one
        server's log does not count records)."""
        return self.replicated.last_index if self.replicated is not None else 0

    # -- writes --------------------------------------------------------------------------------

    def check_ready(self) -> None:
        """Raise unless the service serves: ShuttingDown, else the role's ``unavailable()``."""
        svc = self._svc
        if svc.stopping:
            raise ShuttingDown("the server is shutting down; retry shortly")
        if not (svc.ready and svc.part.lease_valid()):
            # Recovering (the one server: not_ready), or following (a replica: not_leader). A
            # leader whose lease estimate ran out (paused past it, or etcd electing a new
            # leader) answers nothing, but does not step down: etcd's answer to its keepalive
            # decides, and a lease etcd kept makes it serve again at once (election.py).
            raise svc.part.unavailable()

    async def write(self, command: c.Command, rid: tuple[Any, ...] | None = None) -> dict[str, Any]:
        """Apply, log, await durability (:meth:`submit`, then its durability). Raises
        RdzvError having changed nothing, or as :meth:`settled` once applied."""
        result, pending = self.submit(command, rid)
        if pending is not None:
            await self.committed(pending)
        return result

    def submit(self, command: c.Command, rid: tuple[Any, ...] | None = None) -> Answer[dict[str, Any]]:
        """The synchronous half of :meth:`write`: apply and append now, nothing awaited.

        Returns the result and None when it may be sent at once (its record is durable
        already: the memory log, a replayed request whose effects are), else the append it
        waits on: send the result once that future is done and :meth:`settled` does not
        raise. Raises RdzvError having changed nothing; ``role.commit_failed()`` when the
        append has already failed.

        The effects of an applied command follow from its record becoming durable, in
        :meth:`durable`, whatever becomes of the request that carried it: a client that
        disconnects mid-fsync cancels only its own wait, as in etcd's apply loop.
        """
        self.check_ready()
        svc = self._svc
        now = svc.now()
        # The record depends only on the command, the time and the rid, so the log can refuse
        # it before it is applied: a refused write changes nothing and costs no leadership.
        record = {"cmd": command.to_record(), "now": now, "rid": list(rid) if rid else None}
        self._admit(command, record)
        outcome: Outcome = svc.machine.apply(command, now, rid)
        if outcome.replayed:  # its effects came with the first application
            return outcome.result, self.pending(self.last_append)
        log_ = self.log
        try:
            fut = log_.append(record)
        except Exception as exc:
            self.log_failed(exc)
            raise
        self.last_append = fut
        if not fut.done():
            fut.add_done_callback(functools.partial(self.durable, log_, command, outcome))
            return outcome.result, fut
        self.durable(log_, command, outcome, fut)
        return outcome.result, self.pending(fut)

    def _admit(self, command: c.Command, record: dict[str, Any]) -> None:
        """Refuse, before anything is applied, a record the log cannot take or should not queue now."""
        try:
            self.log.check(record)
        except RecordTooLargeError as exc:
            raise RecordTooLarge(
                f"job {command.rdzv_id}: this {command.op} would log a record of {exc.size} bytes, but the log takes "
                f"at most {exc.limit} (with --etcd, etcd's request limit): nothing was applied; store less per "
                "request (smaller values, or several multi_set calls)"
            ) from exc
        except LogQueueFullError as exc:
            raise LogQueueFull(f"{exc} Nothing was applied: retry shortly.") from exc

    async def committed(self, fut: asyncio.Future[None]) -> None:
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
            raise self._svc.part.commit_failed() from exc

    def pending(self, fut: asyncio.Future[None] | None) -> asyncio.Future[None] | None:
        """``fut`` while it is not done or did not succeed (the caller waits or settles it);
        None once it succeeded. Raises as :meth:`settled` for an append that failed with
        LogFailedError, so the common failure answers at once."""
        if fut is None or not fut.done() or fut.cancelled():
            return fut
        failure = fut.exception()
        if failure is None:
            return None
        if isinstance(failure, LogFailedError):
            raise self._svc.part.commit_failed() from failure
        return fut

    def log_failed(self, exc: BaseException) -> None:
        """The log refused or lost an append. Memory now holds a change the log does not, so
        no request may be answered from it any more: a replica stops serving in this very
        step (and its term ends: it rebuilds from etcd), the one server stops for good."""
        reason = f"an append was not committed: {exc}"
        if self._svc.part.step_down(reason):
            self._step_down(reason)
        else:  # no term to end: the one server
            self._fatal(exc)

    def durable(self, log_: Log, command: c.Command, outcome: Outcome, fut: asyncio.Future[None]) -> None:
        """A record's append to ``log_`` finished: on success the command's effects, else a stop."""
        failure = fut.exception() if not fut.cancelled() else asyncio.CancelledError("log append cancelled")
        if failure is not None:
            if log_ is self.log:  # (a log already dropped at a step-down was dealt with then)
                self.log_failed(failure)
            return
        svc = self._svc
        if outcome.wakes:
            svc.waiters.wake(outcome.wakes)
        self._applied(command)
        if outcome.events:
            svc.on_events(outcome.events)
            if any(e.kind is Kind.ROUND_FORMED for e in outcome.events):  # (rare: once per round)
                self._round_formed(command.rdzv_id)
        self._maybe_snapshot()

    async def sync(self) -> None:
        """Return once every record appended so far is durable; raise as :meth:`settled`
        does if the last one failed (even long ago: what it carried is in memory only)."""
        fut = self.pending(self.last_append)
        if fut is not None:
            await self.committed(fut)

    # -- reads ---------------------------------------------------------------------------------

    async def read(self, fn: Callable[[], T]) -> T:
        """``fn()``, answered once every record appended so far is durable."""
        value, pending = self.read_now(fn)
        if pending is not None:
            await self.committed(pending)
        return value

    def read_now(self, fn: Callable[[], T]) -> Answer[T]:
        """The synchronous half of :meth:`read`: ``fn()`` now, and the append to wait on
        (see :meth:`submit`). Raises NotReady (not serving), as :meth:`settled`, or as ``fn``."""
        self.check_ready()
        value = fn()
        return value, self.pending(self.last_append)

    async def long_poll(
        self, check: Callable[[], T | None], topics: Callable[[], Iterable[Hashable]], hold: float
    ) -> T | None:
        """``check()`` once it is not None, waiting up to ``hold`` (at most ``max_hold``) s for
        a durable write to a topic of ``topics()`` to make it so; answered as :meth:`read`."""
        self.check_ready()
        svc = self._svc
        value = await svc.waiters.wait_for(check, topics, min(hold, svc.config.max_hold))
        await self.sync()
        return value

    def poll_now(self, check: Callable[[], T | None], hold: float) -> Answer[T | None] | None:
        """The synchronous half of :meth:`long_poll`: its answer when it would not park
        (``check()`` holds, or ``hold`` is spent), else None (call :meth:`long_poll`). Raises
        as :meth:`read_now`."""
        self.check_ready()
        value = check()
        if value is None and min(hold, self._svc.config.max_hold) > 0:
            return None
        return value, self.pending(self.last_append)

    # -- background work -----------------------------------------------------------------------

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

    def _maybe_snapshot(self) -> None:
        """Cut a snapshot every ``snapshot_every`` records, one at a time.

        O(1) on the loop, whatever the state's size: the log rotates its segment at the cut
        and a builder process rebuilds the state there from the previous snapshot and the
        closed segments (storage.compaction); the live machine is never read for it.
        """
        if self._snapshotting or self.log.records_since_snapshot < self._svc.config.snapshot_every:
            return
        self._snapshotting = True
        task = asyncio.ensure_future(self.log.snapshot(self._svc.new_machine))
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
