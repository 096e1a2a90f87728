"""Timers: each job's deadlines, the leader's tick, and carrying out what core decided on its own.

What it owns: the deadline timer (its schedule is :mod:`.deadline`'s), the ticker a leader
runs, and :meth:`Timer.execute`, which applies a command the server decided itself (an
expiry, a last call, a collection, a quarantine's cordon), logs it for the operator, and
applies what core decides follows from it (:func:`.core.decision.quarantine` after deaths,
:func:`.core.decision.failure_quarantine` after a round formed: :meth:`Timer.round_formed`).

Rules:
- The timer only detects: :meth:`.core.machine.StateMachine.due` says what is due at ``now``;
  it is applied and logged like any other command.
- Elapsed time is the service's clock (:meth:`.shared.ServiceState.now`): the timer sleeps until
  the earliest deadline by that clock, and :meth:`Timer.wake` makes it look again (after a
  fake clock moved).
- A command the service refused (the log's queue full, say) is tried again
  :data:`TIMER_RETRY_S` later, not in the same pass; a failure for one job never stops
  another job's deadlines.
- A leader that logged nothing for :data:`TICK_EVERY_S` logs a :class:`~.core.command.Tick`
  while it holds a job, so that a take-over resumes the clock at most that far behind.

What it must not know: HTTP, the wire format, etcd, how the commit pipeline works.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .core import command as c
from .core import decision
from .core.error import RdzvError
from .core.event import Cause
from .core.rendezvous import Departure, departure_cause
from .deadline import Deadlines

if TYPE_CHECKING:
    from .commit import Pipeline
    from .shared import ServiceState

log = logging.getLogger("rdzv_server")

# A leader that logged nothing for this long logs a Tick (while it holds any job), so that a
# take-over resumes the clock at most this far behind where the old leader's stood.
TICK_EVERY_S = 1.0
# A timer command the service refused (the log's queue full, say) is tried again this much
# later, not at once: the deadline it serves is already due, and retrying in the same pass
# would spin the event loop.
TIMER_RETRY_S = 0.5


def _log_expire(command: c.Expire, result: dict[str, Any]) -> None:
    cause = departure_cause(Departure(command.why), Cause(command.cause) if command.cause else None).value
    for node_id in command.node_ids:  # one line per node: an operator filters by node
        log.info(
            "Job %s: node %s departed (%s).", command.rdzv_id, node_id, cause,
            extra={"job": command.rdzv_id, "node": node_id, "cause": cause},
        )


def _log_last_call(command: c.LastCall, result: dict[str, Any]) -> None:
    if result.get("formed"):
        log.info(
            "Job %s: round %d formed at its last call.", command.rdzv_id, command.round,
            extra={"job": command.rdzv_id, "round": command.round, "cause": Cause.LAST_CALL.value},
        )


def _log_collect(command: c.Collect, result: dict[str, Any]) -> None:
    log.info("Job %s collected after its TTL.", command.rdzv_id, extra={"job": command.rdzv_id})


def _log_quarantine(command: c.Cordon) -> None:
    log.warning(
        "Host %s is quarantined for %g s: %s (last in job %s).", command.host, command.duration, command.reason,
        command.rdzv_id, extra={"job": command.rdzv_id, "host": command.host, "cause": command.by},
    )


#: What the operator's log says once the server applied a command it decided itself.
_APPLIED_LINES: dict[type[c.Command], Callable[[Any, dict[str, Any]], None]] = {
    c.Expire: _log_expire,
    c.LastCall: _log_last_call,
    c.Collect: _log_collect,
}


class Timer:
    """The service's timers (see the module docstring)."""

    def __init__(self, svc: ServiceState, pipeline: Pipeline) -> None:
        self._svc = svc
        self._pipeline = pipeline
        self.deadlines = Deadlines()
        self._task: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None  # a leader's (see TICK_EVERY_S)

    # -- the schedule ------------------------------------------------------------------------

    def start(self, *, tick: bool) -> None:
        """Schedule every job's next deadline afresh and run the timer (and, ``tick``: the ticker)."""
        machine = self._svc.machine
        self.deadlines.clear()
        for rdzv_id in list(machine.jobs):
            self.schedule(rdzv_id)
        self._task = asyncio.create_task(self._run(), name="rdzv-timer")
        if tick:
            self._ticker = asyncio.create_task(self._run_ticker(), name="rdzv-tick")

    def cancel(self) -> None:
        """Stop timing now (nothing awaited); :meth:`stop` waits for the tasks to end."""
        for task in (self._task, self._ticker):
            if task is not None:
                task.cancel()

    async def stop(self) -> None:
        """Stop timing and wait for the timer and the ticker to end."""
        self.cancel()
        for task in (self._task, self._ticker):
            if task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = self._ticker = None

    def wake(self) -> None:
        """Have the timer look at the deadlines now (after a fake clock was moved)."""
        self.deadlines.changed.set()

    def schedule(self, rdzv_id: str) -> None:
        """Wake for job ``rdzv_id`` at its next deadline, as the machine says it is now."""
        deadline = self._svc.machine.deadline(rdzv_id)
        if deadline is not None:
            self.deadlines.wake_at(rdzv_id, deadline)

    def applied(self, command: c.Command) -> None:
        """``command`` is durable: its job's next deadline may have moved."""
        # A store write touches a job's keys and its last use, which can only move the job's next
        # deadline (its collection) later: while the job has a wake-up pending (which
        # reschedules when it fires), a store write needs no new one.
        if type(command) in c.POLICY_CHANGES:  # any job's timeouts may have moved (a rare, operator's change)
            for rdzv_id in list(self._svc.machine.jobs):
                self.schedule(rdzv_id)
        elif type(command) not in c.STORE_WRITES or command.rdzv_id not in self.deadlines:
            self.schedule(command.rdzv_id)

    async def _run(self) -> None:
        svc, deadlines = self._svc, self.deadlines
        while True:
            deadlines.changed.clear()
            earliest = deadlines.earliest()
            if earliest is None:
                await deadlines.changed.wait()
                continue
            try:
                await asyncio.wait_for(deadlines.changed.wait(), max(0.0, earliest - svc.now()))
                continue
            except asyncio.TimeoutError:
                pass
            now = svc.now()
            for rdzv_id in deadlines.due(now):
                applied = False
                try:
                    for command in svc.machine.due(rdzv_id, now):
                        dying = decision.dying(svc.machine, command)
                        result = await self.execute(command, dying.hosts)
                        if result is None:
                            break
                        if result.get("expired"):
                            for beat in dying.beats:  # a silent host died at most this long before
                                svc.on_detected(Cause.HEARTBEAT_EXPIRED.value, now - beat)
                    else:
                        applied = True
                except Exception:  # a bug for one job must not stop every job's deadlines
                    log.exception("The timer failed on job %s; its other deadlines still run.", rdzv_id)
                if applied:
                    self.schedule(rdzv_id)
                else:  # the deadline is still due: look again a little later, not in this pass
                    deadlines.wake_at(rdzv_id, now + TIMER_RETRY_S)

    async def _run_ticker(self) -> None:
        """While leading: log a Tick whenever nothing was logged for TICK_EVERY_S and a job
        exists, so the clock a new leader resumes from is at most that far behind (the
        clock orders every deadline and the timelines: idle time must not stretch them)."""
        svc = self._svc
        while True:  # cancelled at a step-down or shutdown
            await asyncio.sleep(TICK_EVERY_S)
            if not svc.ready or not svc.machine.jobs or svc.now() - svc.machine.clock < TICK_EVERY_S:
                continue
            try:
                await self._pipeline.write(c.Tick(""))
            except RdzvError as exc:  # not the leader any more, the log busy: the next tick will do
                log.debug("A tick was not logged: %s", exc)

    # -- carrying out the server's own decisions ----------------------------------------------

    def round_formed(self, rdzv_id: str) -> None:
        """A round of ``rdzv_id`` formed (its record is durable): apply the quarantine core
        decides for the host whose failure ended the round before (rule 12 of rendezvous.py)."""
        svc = self._svc
        for cordon in decision.failure_quarantine(svc.machine, rdzv_id, svc.now(), svc.quarantine_policy):
            _log_quarantine(cordon)
            self._pipeline.spawn(self._cordon(cordon), f"Quarantining host {cordon.host}")

    async def _cordon(self, cordon: c.Cordon) -> None:
        try:
            await self._pipeline.write(cordon)
        except RdzvError as exc:
            log.warning("Host %s could not be quarantined: %s", cordon.host, exc)

    async def execute(self, command: c.Command, dying: tuple[str, ...] = ()) -> dict[str, Any] | None:
        """Apply ``command``, decided by the server, and say so in the log; then apply the
        quarantine core decides for ``dying``, the hosts whose nodes it marked dead
        (:func:`.core.decision.dying`, read before). Returns its result; None when it failed
        (logged)."""
        svc = self._svc
        try:
            result = await self._pipeline.write(command)
        except RdzvError as exc:
            log.warning("Timer command %s for job %s failed: %s", command.op, command.rdzv_id, exc)
            return None
        except Exception:
            log.exception("Timer command %s for job %s crashed", command.op, command.rdzv_id)
            return None
        line = _APPLIED_LINES.get(type(command))
        if line is not None:
            line(command, result)
        if dying and result.get("expired"):
            for cordon in decision.quarantine(svc.machine, command.rdzv_id, dying, svc.now(), svc.quarantine_policy):
                _log_quarantine(cordon)
                try:
                    await self._pipeline.write(cordon)
                except RdzvError as exc:
                    log.warning("Host %s could not be quarantined: %s", cordon.host, exc)
        return result
