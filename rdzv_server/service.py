"""The service: the running server minus HTTP, one facade over its rooms.

What it owns: the facade the API, :mod:`.replication` and ``server.py`` call, over the state
its rooms share (:class:`~.shared.ServiceState`, its base: the one :class:`StateMachine`, the
server clock, parked long-polls, the part it plays). The work is done in its rooms, one
concern each, each given that state and the rooms below it (the service wires them; none
imports the service):

- :mod:`.commit` (:class:`~.commit.Pipeline`): apply, append, what follows once a record is
  durable, reads that wait for durability, long-polls;
- :mod:`.timer` (:class:`~.timer.Timer`): each job's deadlines, the leader's tick, and
  carrying out what the server decided itself;
- :mod:`.liveness` (:class:`~.liveness.Liveness`): heartbeats, a node's own requests, fast
  death detection when a node's watch drops;
- :mod:`.lifecycle` (:class:`~.lifecycle.Lifecycle`): recover, serve, follow, lead, stop.

Rules:
- The service decides nothing: what the server decides on its own (a quarantine, what a
  refused join logs, whether a dropped node died, what a deadline makes due) is core's
  (:mod:`.core.decision`, :meth:`.core.machine.StateMachine.due`), returned as commands that
  the service applies and logs like any other.
- Elapsed time is read only from the :class:`~.clock.Clock` given (tests pass a fake one,
  move it and call :meth:`Service.check_deadlines`): the server clock, each hold, each
  deadline, each check of a dropped node.

What it must not know: HTTP, the wire format (the API translates), etcd (the replication's).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine, Hashable
from typing import Any

from .clock import SYSTEM_CLOCK, Clock
from .commit import Answer, Pipeline
from .config import ServerConfig
from .core import command as c
from .core import decision
from .core.cordon import Cordon
from .core.error import NoSuchPolicy, RdzvError
from .core.event import Cause, EventPage, JobEvent
from .core.machine import Entry, events_topic, key_topic, round_topic
from .core.policy import Policy
from .core.policy import document as policy_document
from .core.rendezvous import JobSummary, JobView
from .core.store import KeyValueStore
from .lifecycle import Lifecycle
from .liveness import Liveness
from .role import Role, Single
from .shared import ServiceState
from .timer import Timer

__all__ = ["Answer", "Service"]


class Service(ServiceState):
    """The running server minus HTTP. Create, ``await start()``, serve, ``begin_stop()``, ``await close()``."""

    def __init__(
        self, config: ServerConfig, join: Callable[[Service], Role] | None = None, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        """``join`` makes this service's replica role (``--etcd``: :func:`.replication.join`);
        ``clock`` is where the service reads elapsed time (tests pass a fake one and call
        :meth:`check_deadlines` after moving it). Raises ValueError for ``--etcd`` without a join."""
        if config.etcd and join is None:
            raise ValueError("with --etcd the service needs a replica role: Service(config, replication.join)")
        super().__init__(config, None if join is None else functools.partial(join, self), clock)

        # The rooms, each given the rooms below it; the commit pipeline's hooks into the rooms
        # above it are wired here (so no room imports another above it, nor the service).
        self.pipeline = pipeline = Pipeline(self)
        self.timer = timer = Timer(self, pipeline)
        self.liveness = liveness = Liveness(self, pipeline, timer)
        self.lifecycle = lifecycle = Lifecycle(self, pipeline, timer, liveness)
        pipeline.wire(
            applied=timer.applied, round_formed=timer.round_formed, step_down=lifecycle.step_down, fatal=lifecycle.fatal
        )
        self.part = Single(pipeline.log_index)  # the part it plays (start() may take another)

        # The facade: each room's own methods, bound here so a request pays no extra call.
        self.write = pipeline.write
        self.submit = pipeline.submit
        self.settled = pipeline.settled
        self.read = pipeline.read
        self.read_now = pipeline.read_now
        self.poll_now = pipeline.poll_now
        self.log_index = pipeline.log_index
        self.await_round = liveness.await_round
        self.beat_now = liveness.beat_now
        self.beat = liveness.beat
        self.watch = liveness.watch
        self.rebuild = lifecycle.rebuild
        self.follow = lifecycle.follow
        self.lead = lifecycle.lead
        self.stop_leading = lifecycle.stop_leading
        self.begin_stop = lifecycle.begin_stop
        self.close = lifecycle.close

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
        await self.lifecycle.start()

    # -- clock -------------------------------------------------------------------------------

    def check_deadlines(self) -> None:
        """Have the timers look at their deadlines and every parked long-poll at its hold now
        (after a fake clock was moved; the real clock needs no call)."""
        self.timer.wake()
        self.liveness.check()
        self.waiters.recheck()

    # -- the part it plays (presentation: the service decides through the role's methods) ------

    @property
    def role(self) -> str:
        """``single`` (no --etcd), else this replica's ``leader``, ``follower`` or ``candidate``."""
        return self.part.role.value

    @property
    def replicated(self) -> bool:
        """Whether this server is one replica of a cluster (``--etcd``)."""
        return self.part.replicated

    def lease_valid(self) -> bool:
        """Whether this replica's election lease is surely alive (the one server: always)."""
        return self.part.lease_valid()

    def leader_url(self) -> str | None:
        """The URL of the replica etcd names leader (this one's own included); None if none, or single."""
        return self.part.leader_url()

    def applied_index(self) -> int:
        """The index of the last record this server applied (a leader: appended)."""
        return self.part.applied()

    async def cluster_view(self) -> dict[str, Any] | None:
        """``GET /v1/cluster`` of a replica; None for the one server (the API draws it).
        Raises NotReady when etcd does not answer."""
        return await self.part.view()

    # -- queries (what the API reads; it never reaches into the machine or the replica) --------

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

    async def cordons(self) -> tuple[list[Cordon], float]:
        """The cordons in effect (``GET /v1/cordons``), and the ``now`` they are in effect at."""

        def view() -> tuple[list[Cordon], float]:
            now = self.now()
            return self.machine.cordons.listing(now), now

        return await self.read(view)

    def cordon_counts(self) -> dict[str, int]:
        """Cordons in effect by whom (operator, flapping): the metrics' gauge."""
        now = self.now()
        counts = {Cause.OPERATOR.value: 0, Cause.FLAPPING.value: 0}
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

    async def policies(self) -> tuple[list[Policy], float]:
        """Every policy, most specific first (``GET /v1/policies``), and the server's ``now``."""
        return await self.read(lambda: (self.machine.policies.listing(), self.now()))

    async def policy(self, pattern: str) -> tuple[Policy, float]:
        """The policy of ``pattern``, and the server's ``now``. Raises NoSuchPolicy, or as :meth:`read`."""

        def view() -> tuple[Policy, float]:
            policy = self.machine.policies.get(pattern)
            if policy is None:
                raise NoSuchPolicy(f"no policy has the pattern {pattern} (`rdzvctl policy show` lists them)")
            return policy, self.now()

        return await self.read(view)

    async def effective_policy(self, rdzv_id: str) -> dict[str, Any]:
        """The effective policy of job ``rdzv_id`` (existing or not): :func:`.core.policy.document`."""
        return await self.read(lambda: self._policy_document(rdzv_id))

    def effective_policy_now(self, rdzv_id: str) -> Answer[dict[str, Any]]:
        """:meth:`effective_policy` now, and the append to wait on (see :meth:`read_now`)."""
        return self.pipeline.read_now(lambda: self._policy_document(rdzv_id))

    def _policy_document(self, rdzv_id: str) -> dict[str, Any]:
        policies = self.machine.policies
        return policy_document(rdzv_id, policies.winning(rdzv_id), policies.version)

    # -- store reads and the timeline --------------------------------------------------------

    def use(self, rdzv_id: str) -> KeyValueStore:
        """The job's keys for a store read (NotReady first, then JobNotFound); reading is use."""
        self.pipeline.check_ready()
        return self.machine.use(rdzv_id, self.now())

    async def get(self, rdzv_id: str, scope: int | None, key: bytes, hold: float) -> bytes | None:
        self.use(rdzv_id)  # NotReady, JobNotFound before parking
        return await self.pipeline.long_poll(
            lambda: self.machine.kv(rdzv_id).get(scope, key), lambda: (key_topic(rdzv_id, scope, key),), hold
        )

    async def multi_get(self, rdzv_id: str, scope: int | None, keys: tuple[bytes, ...], hold: float) -> list[bytes] | None:
        self.use(rdzv_id)  # NotReady, JobNotFound before parking

        def first_missing() -> tuple[Hashable, ...]:
            kv = self.machine.kv(rdzv_id)
            missing = next((k for k in keys if kv.get(scope, k) is None), keys[0] if keys else b"")
            return (key_topic(rdzv_id, scope, missing),)

        return await self.pipeline.long_poll(lambda: self.machine.kv(rdzv_id).multi_get(scope, keys), first_missing, hold)

    async def events(self, rdzv_id: str, since: int, hold: float, limit: int) -> EventPage:
        """The job's events after ``since``, holding up to ``hold`` s while there are none.

        Raises NotReady, JobNotFound (also when the job is collected while the poll waits)."""
        self.pipeline.check_ready()
        self.machine.job(rdzv_id)  # JobNotFound before parking

        def newer() -> list[JobEvent] | None:
            found = self.machine.job(rdzv_id).timeline.since(since, limit)
            return found or None

        found = await self.pipeline.long_poll(newer, lambda: (events_topic(rdzv_id), round_topic(rdzv_id)), hold)
        timeline = self.machine.job(rdzv_id).timeline
        return EventPage(found or [], timeline.first_seq, timeline.next_seq, self.now())

    # -- admission ------------------------------------------------------------------------------

    def begin_join(
        self, command: c.Join, rid: tuple[str, int] | None, hold: float
    ) -> Coroutine[Any, Any, dict[str, Any]]:
        """Apply the join now, in the order requests arrive, and return the rest to await (its
        durability, then :meth:`await_round`). A join refused for a reason its job's timeline
        records is logged as core decides (:func:`.core.decision.refusal`) and the rest
        raises the refusal once that is durable. Raises as :meth:`submit`."""
        try:
            result, pending = self.submit(command, rid)
        except RdzvError as exc:
            logged = decision.refusal(self.machine, command, exc)
            if logged is None:
                raise
            appended: asyncio.Future[None] | None = None
            for refusal in logged:  # in order: the last append's durability covers them all
                _, appended = self.submit(refusal)
            return self._refused(appended, exc)
        return self._joined(command, result["round"], pending, hold)

    async def _joined(
        self, command: c.Join, round_: int, pending: asyncio.Future[None] | None, hold: float
    ) -> dict[str, Any]:
        if pending is not None:
            await self.pipeline.committed(pending)
        return await self.await_round(command.rdzv_id, command.node_id, round_, hold)

    async def _refused(self, appended: asyncio.Future[None] | None, refusal: RdzvError) -> dict[str, Any]:
        if appended is not None:
            await self.pipeline.committed(appended)
        raise refusal

    async def refuse(self, command: c.Refuse, rid: tuple[Any, ...] | None) -> dict[str, Any]:
        """A node's health check failed: its job's timeline says so, once per repeated refusal
        (:func:`.core.decision.self_refusal`)."""
        result: dict[str, Any] = {}
        for logged in decision.self_refusal(self.machine, command):
            result = await self.write(logged, rid)
        return result
