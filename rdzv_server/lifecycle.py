"""The service's lifecycle and roles: recover, serve, follow, lead, stop.

What it owns: taking up serving (recovery from the data directory, or the replica role's
start), the hand-overs a replica's role drives (:meth:`Lifecycle.follow`,
:meth:`Lifecycle.lead`, :meth:`Lifecycle.stop_leading`), and stopping, for a while (a
step-down) or for good (shutdown, a failed log).

Rules:
- The server clock is monotonic and continues across restarts from the last logged time,
  so deadlines neither fire nor stretch because the server was down; heartbeat times are
  reset when serving starts (each node gets one full TTL of grace).
- Stopping is one step, nothing awaited (:meth:`Lifecycle.halt`), so no request is served in
  between: refuse operations, answer every parked long-poll, drop every pending liveness
  check, stop timing. A step-down also drops the log, failing its pending appends (each
  waiting write answers ``not_leader``); shutdown keeps it to flush it.
- Whether it runs alone, follows or leads is its :class:`~.role.Role`'s business, asked
  through that one interface: a follower's machine changes only by replaying committed
  records, every operation answers ``not_leader``.

What it must not know: HTTP, the wire format, etcd (the replication's), the rendezvous rules.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import TYPE_CHECKING

from .core import command as c
from .core.error import RdzvError, ShuttingDown
from .core.machine import StateMachine
from .storage import FileLog, FsyncPolicy, Recovered, ReplicatedLog, StorageError

if TYPE_CHECKING:
    from .commit import Pipeline
    from .liveness import Liveness
    from .shared import ServiceState
    from .timer import Timer

log = logging.getLogger("rdzv_server")


class Lifecycle:
    """The service's lifecycle (see the module docstring)."""

    def __init__(self, svc: ServiceState, pipeline: Pipeline, timer: Timer, liveness: Liveness) -> None:
        self._svc = svc
        self._pipeline = pipeline
        self._timer = timer
        self._liveness = liveness

    async def start(self) -> None:
        """See :meth:`.service.Service.start`."""
        svc = self._svc
        clock = svc.clock
        started = clock.monotonic()
        if svc.make_role is not None:
            svc.part = svc.make_role()
            await svc.part.start()
            svc.recovery_seconds = clock.monotonic() - started
            return
        data_dir = svc.config.resolved_data_dir()
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
                        FsyncPolicy(svc.config.fsync),
                        truncate_corrupt=svc.config.truncate_corrupt_log,
                        max_queued_records=svc.config.max_log_queue,
                        max_queued_bytes=svc.config.max_log_queue_bytes,
                    )
                except (StorageError, OSError) as exc:
                    raise SystemExit(f"rdzv-server: error: cannot recover {data_dir}: {exc}") from exc
                self._pipeline.log = file_log
                svc.machine = await asyncio.to_thread(self.rebuild, recovered)
            finally:
                if collecting:
                    gc.enable()
            svc.recovered_records = len(recovered.records)
            if recovered.truncated_bytes:
                log.warning(
                    "Recovery dropped a torn tail of %d bytes from the log in %s (a crash mid-write); "
                    "every acknowledged write is before it.",
                    recovered.truncated_bytes,
                    data_dir,
                )
        svc.recovery_seconds = clock.monotonic() - started
        await self._serve(c.Restarted(""), tick=False)
        log.info(
            "Recovered %d jobs (%d log records) in %.3f s from %s.",
            len(svc.machine.jobs),
            svc.recovered_records,
            svc.recovery_seconds,
            data_dir or "memory",
        )

    def rebuild(self, recovered: Recovered) -> StateMachine:
        """Runs in a thread: a fresh machine rebuilt from ``recovered``, touched by nothing else
        until it is swapped in. Raises RuntimeError if a record does not replay."""
        machine = self._svc.new_machine()
        if recovered.snapshot is not None:
            machine.restore(recovered.snapshot)
        for record in recovered.records:
            machine.replay(record)
        return machine

    async def _serve(self, restarted: c.Restarted, *, tick: bool) -> None:
        """Take up serving over the installed machine and log: the clock continues from the last
        logged time, each node gets one full TTL of grace, every deadline is scheduled."""
        svc = self._svc
        svc.resume_clock(svc.machine.clock)
        svc.machine.reset_heartbeats(svc.now())
        svc.waiters.reopen()
        self._timer.start(tick=tick)
        svc.machine.set_limits(svc.config.limits())  # after replay: see StateMachine.apply
        svc.recovered = True
        svc.ready = True
        if svc.machine.jobs:  # every job's timeline says the server was away
            await self._pipeline.write(restarted)

    # -- replicas (driven by replication.py) -----------------------------------------------------

    def follow(self, machine: StateMachine) -> None:
        """Install ``machine`` (rebuilt from etcd) as a follower's; the replication keeps it hot."""
        self._svc.machine = machine
        self._svc.recovered = True

    async def lead(self, replicated: ReplicatedLog, detail: str) -> None:
        """Serve as the leader over ``replicated``, the log the follower's machine has caught up to."""
        self._pipeline.lead(replicated)
        await self._serve(c.Restarted("", "leader_changed", detail), tick=True)

    async def stop_leading(self) -> None:
        """Stop serving at once (a lost lease, a failed append, shutdown): see :meth:`step_down`;
        then wait for the timer and the ticker to end."""
        self.step_down("it stepped down")
        await self._timer.stop()

    # -- stopping --------------------------------------------------------------------------------

    def halt(self, error: RdzvError) -> None:
        """Stop serving in one step, nothing awaited: refuse operations, answer every parked
        long-poll with ``error``, drop every pending liveness check, stop timing."""
        svc = self._svc
        svc.ready = False
        svc.waiters.fail_all(error)
        self._liveness.forget()
        self._timer.cancel()

    def step_down(self, reason: str) -> None:
        """A leader stops (:meth:`halt`, answering with the role's ``unavailable()``) and drops
        its log, failing every pending append (hence every write and read waiting on one)
        with ``not_leader``. What is in memory may hold commands the log never took, so the
        replication rebuilds the machine from etcd before anything is served again. Idempotent."""
        self.halt(self._svc.part.unavailable())
        self._pipeline.abandon(reason)

    def begin_stop(self) -> None:
        """Shutdown, first step: refuse new work and answer parked long-polls (clients retry
        after the restart). The log is kept: :meth:`close` flushes it."""
        self._svc.stopping = True
        self.halt(ShuttingDown("the server is shutting down; retry shortly"))

    async def close(self) -> None:
        """After in-flight requests drained: stop the timer, flush and close the log."""
        svc = self._svc
        self.begin_stop()
        await svc.part.close()  # a replica resigns: another takes over at once
        await self._timer.stop()
        await self._pipeline.log.close()

    def fatal(self, exc: BaseException) -> None:
        """The log failed on the one server: stop for good (``on_fatal`` makes the process exit)."""
        svc = self._svc
        if svc.fatal_error is not None:
            return
        svc.fatal_error = exc
        log.critical("The log failed (%s): stopping, so that no write it did not record is ever served.", exc)
        self.begin_stop()
        if svc.on_fatal is not None:
            svc.on_fatal(exc)
