"""Liveness: heartbeats, a node's long-polls, and fast death detection when one drops.

What it owns: the requests a node makes for itself (waiting for its round, the watch, its
heartbeat: the one-way beat, or the watch of no hold an older client sends), the count of
each node's open long-polls, and the pending checks of nodes whose long-poll dropped.

Rules:
- Every request from a node is a heartbeat (soft state, never logged) and cancels a pending
  check of its dropped poll.
- A node's watch dropping (its connection closed: the process died, or its host) starts a
  check that fires ``--disconnect-grace`` later by the service's clock; then core judges it
  (:func:`.core.decision.death_after_drop`: dead unless it called again, or still has a poll open), and
  a death is applied as an ordinary logged expiry (:meth:`.timer.Timer.execute`, which also
  applies the quarantine core decides). A node still in line has no workers to lose: its
  dropped poll starts no check.
- Long-polls of a node are held well inside its TTL (an open poll is not a heartbeat) and
  jittered (:data:`HOLD_JITTER`), so thousands parked together do not come back at once.

What it must not know: HTTP, the wire format, etcd, how the commit pipeline works.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .core import decision
from .core.event import Cause
from .core.machine import WatchView, node_topic, round_topic, watch_topic
from .core.rendezvous import Job

if TYPE_CHECKING:
    from .commit import Answer, Pipeline
    from .shared import ServiceState
    from .timer import Timer

log = logging.getLogger("rdzv_server")

# Node long-polls are held between this fraction and all of their hold (see Liveness.node_hold).
HOLD_JITTER = 0.75

NodeKey = tuple[str, str]  # (rdzv_id, node_id)


class Liveness:
    """The service's liveness room (see the module docstring)."""

    def __init__(self, svc: ServiceState, pipeline: Pipeline, timer: Timer) -> None:
        self._svc = svc
        self._pipeline = pipeline
        self._timer = timer
        self._rng = random.Random()
        self._open_polls: dict[NodeKey, int] = {}
        # Nodes whose watch dropped: when it dropped, and the loop timer that checks it.
        self._lost: dict[NodeKey, tuple[float, asyncio.TimerHandle]] = {}

    # -- heartbeats and a node's own requests ----------------------------------------------------

    def beat(self, rdzv_id: str, node_id: str, progress: tuple[int, int] | None = None) -> Job:
        """A request from a node is a heartbeat (the one-way beat is only that); it also cancels
        a pending connection-lost check. ``progress``: the (round, step) a watch or a beat
        reports. Raises NotReady, JobNotFound."""
        svc = self._svc
        self._pipeline.check_ready()
        job = svc.machine.heartbeat(rdzv_id, node_id, svc.now(), progress)
        self._cancel_lost((rdzv_id, node_id))
        return job

    def node_hold(self, hold: float, job: Job) -> float:
        """How long to hold a node's wait for its round: well inside the TTL (an open poll is
        not itself a heartbeat), and jittered so that thousands of polls parked together do
        not all come back, and re-poll, in the same instant."""
        return min(hold, job.settings.heartbeat_ttl / 3) * self._rng.uniform(HOLD_JITTER, 1.0)

    async def await_round(self, rdzv_id: str, node_id: str, round_: int, hold: float) -> dict[str, Any]:
        """Hold until the node has a place in a formed round >= ``round_``; a heartbeat too."""
        svc = self._svc
        job = self.beat(rdzv_id, node_id)
        # A node still in line has no workers to lose: if this poll drops, its client polls
        # again (or joins again); the TTL and join_timeout are the backstops. Declaring it
        # dead here only made thousands of nodes connecting at once churn.
        with self._node_poll(rdzv_id, node_id, fast_death=False):
            assignment = await self._pipeline.long_poll(
                lambda: svc.machine.assignment(rdzv_id, node_id, round_),
                lambda: (round_topic(rdzv_id), node_topic(rdzv_id, node_id)),
                self.node_hold(hold, job),
            )
        self.beat(rdzv_id, node_id)
        return {"round": round_, "assignment": None if assignment is None else dict(assignment.__dict__)}

    def beat_now(self, rdzv_id: str, node_id: str, round_: int, step: int | None = None) -> Answer[WatchView]:
        """A watch with no hold: the node's heartbeat, answered at once with the job's watch
        view (no task, no waiter: thousands of nodes send one every third of their TTL).
        ``step``: the node's training step, if it reports one. Raises NotReady, JobNotFound."""
        svc = self._svc
        self.beat(rdzv_id, node_id, None if step is None else (round_, step))
        return svc.machine.watch_view(rdzv_id, round_), self._pipeline.pending(self._pipeline.last_append)

    async def watch(
        self, rdzv_id: str, node_id: str, round_: int, known: int, hold: float, step: int | None = None
    ) -> WatchView:
        """Heartbeat, then hold until num_nodes_waiting != known (see wire.WatchRequest).

        The hold is the client's (up to ``max_hold``, jittered), not capped by the TTL: a parked
        watch is not a heartbeat, so a client that holds it longer than a third of its TTL
        beats meanwhile with watches of no hold (:meth:`beat_now`), as the plug-in does. A
        client that does not (the plug-in before it did) asks for a third of the TTL."""
        svc = self._svc
        self.beat(rdzv_id, node_id, None if step is None else (round_, step))
        hold = hold * self._rng.uniform(HOLD_JITTER, 1.0)
        parked_version = svc.machine.policies.version

        def changed() -> WatchView | None:
            if rdzv_id not in svc.machine.jobs:
                return WatchView.collected(round_)
            view = svc.machine.watch_view(rdzv_id, round_)
            if view.closed:
                return view
            if view.policy_version != parked_version:
                # A policy that moved this job's settings (it wakes the job's watches): the node
                # learns of it now, not at its next answered beat (its beats go one-way), so a
                # node-side key (health_check, ...) applies at its next join (issue 28).
                return view
            if known > 0 and view.round > round_:
                return None  # it knows to re-join already: a later round's joins tell it nothing new
            return view if view.num_nodes_waiting != known else None

        with self._node_poll(rdzv_id, node_id):
            view = await self._pipeline.long_poll(changed, lambda: (watch_topic(rdzv_id),), hold)
        if rdzv_id in svc.machine.jobs:
            self.beat(rdzv_id, node_id)
        return view if view is not None else svc.machine.watch_view(rdzv_id, round_)

    # -- fast death detection -------------------------------------------------------------------

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
                self._connection_lost(key, self._svc.now())
            raise
        except BaseException:
            self._close_poll(key)
            raise
        self._close_poll(key)

    def _close_poll(self, key: NodeKey) -> None:
        left = self._open_polls.get(key, 1) - 1
        if left:
            self._open_polls[key] = left
        else:
            self._open_polls.pop(key, None)

    def _connection_lost(self, key: NodeKey, lost_at: float) -> None:
        """A node's long-poll dropped at ``lost_at``: check it once the grace has passed."""
        if self._svc.stopping:
            return
        self._cancel_lost(key)
        self._arm(key, lost_at)

    def _arm(self, key: NodeKey, lost_at: float) -> None:
        svc = self._svc
        delay = max(0.0, lost_at + svc.config.disconnect_grace - svc.now())
        self._lost[key] = (lost_at, asyncio.get_running_loop().call_later(delay, self._due, key))

    def _cancel_lost(self, key: NodeKey) -> None:
        pending = self._lost.pop(key, None)
        if pending is not None:
            pending[1].cancel()

    def forget(self) -> None:
        """Drop every pending check (the service stops serving)."""
        for _, handle in self._lost.values():
            handle.cancel()
        self._lost.clear()

    def check(self) -> None:
        """Look at every pending check now (after a fake clock was moved)."""
        for key in list(self._lost):
            self._due(key)

    def _due(self, key: NodeKey) -> None:
        """A check's time may have come: by the service's clock, confirm it, or wait on."""
        svc = self._svc
        pending = self._lost.pop(key, None)
        if pending is None:
            return
        lost_at, handle = pending
        handle.cancel()
        if svc.now() < lost_at + svc.config.disconnect_grace:  # the loop's timer ran ahead of the clock
            self._arm(key, lost_at)
            return
        self._pipeline.spawn(self._confirm_lost(key, lost_at), f"Confirming node {key[1]} lost")

    async def _confirm_lost(self, key: NodeKey, lost_at: float) -> None:
        svc = self._svc
        if svc.stopping:
            return
        rdzv_id, node_id = key
        expire = decision.death_after_drop(
            svc.machine, rdzv_id, node_id, lost_at, svc.now(), svc.config.disconnect_grace, key in self._open_polls
        )
        if expire is None:
            return  # already gone, or it came back (a newer request, or another poll still open)
        log.info(
            "Node %s of job %s dropped its connection and did not return: marking it dead.", node_id, rdzv_id,
            extra={"job": rdzv_id, "node": node_id, "cause": Cause.CONNECTION_CLOSED.value},
        )
        dying = decision.dying(svc.machine, expire)
        result = await self._timer.execute(expire, dying.hosts)
        if result is not None and result.get("expired"):
            svc.on_detected(Cause.CONNECTION_CLOSED.value, svc.now() - lost_at)
