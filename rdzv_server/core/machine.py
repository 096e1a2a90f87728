"""The server's whole state and its one apply path.

What it owns: every job (its rendezvous state machine and its key-value store), the
exactly-once window of each client, and the server clock's high-water mark.

Rules:
- ``apply(command, now, rid)`` is the only way state changes. It is synchronous and
  deterministic given (state, command, now): replaying the logged commands with their
  logged ``now`` rebuilds the same state. It either applies the whole command or raises
  an :class:`RdzvError` having changed nothing.
- A command carrying ``rid = (client_id, seq, floor)`` is applied at most once: a retry
  gets the recorded result. ``floor`` is the client's lowest seq still awaiting its reply
  (every seq below it was answered), so a session keeps exactly the results its client may
  still retry, whatever the number of threads sharing the client: results below the floor
  are dropped, and a seq below the floor with no result is a stale duplicate, refused.
  A rid without a floor (``(client_id, seq)``) keeps the last ``DEDUP_WINDOW`` results.
  A session outlives its last write by ``session_ttl``. The sessions are part of
  the snapshot, and rebuilt by replay.
- Limits (:class:`Limits`: jobs, keys and bytes per job, sessions, unacknowledged writes
  per session, remembered result bytes) refuse a command before it changes anything. Key
  spaces of every round, far-future ones included, count toward their job's quota. Replay runs with ``limits=None`` and ``replay=True``: a logged
  command was accepted once, so it applies again, whatever the limits are today, and it
  never consults the exactly-once window (a logged command was, by definition, not a
  retry), so replay does not depend on settings. Limits are set (:meth:`set_limits`) once
  replay is done.
- ``due(now)`` only *detects* what the timer must do and returns commands; they take
  effect when applied (and logged) like any other.
- A membership command reaches its job as rendezvous events (``Job.join``, ``depart``,
  ``last_call``, ``close``); the job's dispatcher settles its rules after each event
  (``Job.settle``), so an expiry of several nodes settles after each departure, and the
  wake-ups computed here see the settled state. One store write is also a rendezvous
  event: an ``add`` on torch's exit-barrier count in a round's key space
  (``Job.reach_exit_barrier``, rule 9 of core/rendezvous.py); when the job then releases the
  barrier, its key is set here, in the same apply (``KeyValueStore.put_decided``).
- Reads (``get``, ``assignment`` ...) never change state.

Each applied command reports the wake-up topics it touched (see :class:`Outcome`), so
the server layer wakes exactly the waiters whose condition may now hold.

What it must not know: I/O, asyncio, the wire format, the real clock.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rdzv_client.record import (
    EXIT_BARRIER_COUNT_KEY,
    EXIT_BARRIER_LAST_MEMBER_KEY,
    EXIT_BARRIER_RELEASE_VALUE,
    Assignment,
    FailureReport,
    FailureWire,
    JobSettings,
)

from . import command as c
from .cordon import MAX_CORDONS, CordonTable
from .error import (
    BadRequest,
    HostCordoned,
    JobNotFound,
    NoSuchPolicy,
    RdzvError,
    SessionFull,
    TooManyJobs,
    TooManySessions,
)
from .event import Cause, JobEvent, Kind
from .policy import MAX_POLICIES, PolicyTable, matches, resolve
from .rendezvous import Departure, Job, JobState, Liveness
from .store import KeyValueStore

# Results remembered per client that sends no floor in its rids (an older client, a script).
DEDUP_WINDOW = 128
# A session ends this long after its last write: far longer than a client's retry budget.
DEFAULT_SESSION_TTL = 600.0


@dataclass(frozen=True)
class Limits:
    """What the server holds at most (ServerConfig's limit flags; README "Limits")."""

    max_jobs: int
    max_keys_per_job: int
    max_job_bytes: int
    max_sessions: int
    max_session_writes: int
    max_session_bytes: int


@dataclass
class Session:
    """The exactly-once window of one client: results it may still retry."""

    last_write: float
    floor: int = 0  # every seq below it was answered to the client
    results: OrderedDict[int, dict[str, Any]] = field(default_factory=OrderedDict)  # arrival order
    bytes: int = 0  # bytes held by the results' values (compare_set returns one)


def _result_bytes(result: dict[str, Any]) -> int:
    return sum(len(v) for v in result.values() if isinstance(v, bytes))


@dataclass
class Entry:
    """One job: its membership state machine and its keys."""

    job: Job
    kv: KeyValueStore
    last_used: float = 0.0  # soft state: the latest store request; an idle job in use is kept


class Outcome(NamedTuple):
    """What one applied command did. (A named tuple, not a frozen dataclass: one is built per
    command on the store's hot path, and a tuple is built several times faster.)"""

    result: dict[str, Any]
    wakes: tuple[Hashable, ...] = ()
    replayed: bool = False  # True when a retry got the recorded result
    events: tuple[JobEvent, ...] = ()  # what the command added to its job's timeline


class WatchView(NamedTuple):
    """What a watch answers (the one spelling of the watch reply; the client reads its
    :meth:`body`). A named tuple: one is built per heartbeat."""

    round: int
    state: str
    num_nodes_waiting: int
    closed: bool
    cause: str | None  # why the job closed (None: open, or closed by no one in particular)
    policy_version: int = 0  # the policy table's version (a node refetches its policy when it moves)

    @classmethod
    def collected(cls, round_: int) -> WatchView:
        """The view of a job that was collected while its node watched: closed, nobody waiting."""
        return cls(round_, JobState.CLOSED.value, 0, True, None)

    def body(self) -> dict[str, Any]:
        """The reply's fields, in the wire's order."""
        return {
            "round": self.round,
            "state": self.state,
            "num_nodes_waiting": self.num_nodes_waiting,
            "closed": self.closed,
            "cause": self.cause,
            "policy_version": self.policy_version,
        }


def failure_report(wire: FailureWire | None, now: float) -> FailureReport | None:
    """A command's failure report (checked when it was decoded) with its ages placed on the
    server clock at ``now``: the same on every replay, as ``now`` is logged with it."""
    return None if wire is None else FailureReport.from_wire(wire, now)


def key_topic(rdzv_id: str, scope: int | None, key: bytes) -> Hashable:
    return ("key", rdzv_id, scope, key)


def _watched(job: Job) -> tuple[Any, ...]:
    """What a change must alter to wake the job's watchers. While a round is open, every
    watcher watches an earlier, formed round and sees "at least 1" waiting (rule 4): how many
    more have joined changes nothing it acts on, and waking every parked watch at each of
    thousands of re-joins made a re-formation cost O(nodes^2)."""
    return (job.state, job.round, job.num_nodes_waiting(job.round) if job.state is JobState.COMPLETE else None)


def round_topic(rdzv_id: str) -> Hashable:
    """Woken when a round forms or opens, or the job closes (a departure wakes :func:`node_topic`)."""
    return ("round", rdzv_id)


def node_topic(rdzv_id: str, node_id: str) -> Hashable:
    """Woken when that node departs without the round changing (its own long-poll says why)."""
    return ("node", rdzv_id, node_id)


def events_topic(rdzv_id: str) -> Hashable:
    """Woken when the job's timeline grows."""
    return ("events", rdzv_id)


def watch_topic(rdzv_id: str) -> Hashable:
    """Woken when what watchers see (state, round, num_nodes_waiting) changes."""
    return ("watch", rdzv_id)


@dataclass
class StateMachine:
    max_value_bytes: int
    job_ttl: float
    session_ttl: float = DEFAULT_SESSION_TTL
    jobs: dict[str, Entry] = field(default_factory=dict)
    sessions: OrderedDict[str, Session] = field(default_factory=OrderedDict)  # least recent write first
    clock: float = 0.0  # the latest `now` applied: the server clock resumes from here after a restart
    limits: Limits | None = None  # None: nothing refused (replay, tests)
    session_bytes: int = 0  # over every session's results
    cordons: CordonTable = field(default_factory=CordonTable)  # server-wide: every job's admission reads it
    policies: PolicyTable = field(default_factory=PolicyTable)  # server-wide: every job's settings read it

    # -- the apply path ----------------------------------------------------------------------

    def apply(
        self, command: c.Command, now: float, rid: tuple[Any, ...] | None = None, *, replay: bool = False
    ) -> Outcome:
        """Apply one command. Raises an RdzvError (and changes nothing) on a bad command.

        ``rid`` is ``(client_id, seq)`` or ``(client_id, seq, floor)``; ``replay`` says the
        command comes from the log (see the module docstring).
        """
        session: Session | None = None
        if rid is not None:
            session = self._session(rid[0], now)
            if not replay:
                if session is not None:
                    recorded = session.results.get(rid[1])
                    if recorded is not None:
                        return Outcome(recorded, (), replayed=True)
                    if rid[1] < session.floor:
                        raise BadRequest(
                            f"request {rid[1]} of client {rid[0]} was answered already: a stale duplicate, not applied"
                        )
                self._admit(rid, session, now)
        kind = type(command)
        handler = _HANDLERS[kind]
        if kind in c.STORE_WRITES:  # keys only: no timeline to look at (the same steps, fewer reads)
            outcome: Outcome = handler(self, command, now)
        else:
            before = self.jobs.get(command.rdzv_id)
            seen = before.job.timeline.next_seq if before is not None else 1
            outcome = handler(self, command, now)
            after = self.jobs.get(command.rdzv_id)
            if after is not None and after.job.timeline.next_seq > seen and not outcome.events:
                events = tuple(after.job.timeline.since(seen - 1))
                outcome = outcome._replace(events=events, wakes=(*outcome.wakes, events_topic(command.rdzv_id)))
        if now > self.clock:
            self.clock = now
        self.cordons.prune(now)  # O(1) until a timed cordon ends
        if rid is not None:
            self._record(rid, outcome.result, now, session)
        return outcome

    def replay(self, record: dict[str, Any]) -> None:
        """Apply one log record ``{"cmd", "now", "rid"}`` again (recovery, snapshot building).

        Raises RuntimeError if it fails: a logged command applied once, so it cannot fail
        now unless the log or this code is wrong."""
        rid = record.get("rid")
        try:
            self.apply(c.from_record(record["cmd"]), record["now"], tuple(rid) if rid else None, replay=True)
        except RdzvError as exc:
            raise RuntimeError(f"log replay diverged at {record!r:.500}: {exc}") from exc

    def set_limits(self, limits: Limits | None) -> None:
        """Enforce ``limits`` from now on (the service sets them once recovery is done)."""
        self.limits = limits
        for entry in self.jobs.values():
            self._apply_quota(entry.kv)

    def _apply_quota(self, kv: KeyValueStore) -> KeyValueStore:
        kv.max_keys = self.limits.max_keys_per_job if self.limits else None
        kv.max_bytes = self.limits.max_job_bytes if self.limits else None
        return kv

    def _new_store(self) -> KeyValueStore:
        return self._apply_quota(KeyValueStore(self.max_value_bytes))

    def _entry(self, rdzv_id: str) -> Entry:
        entry = self.jobs.get(rdzv_id)
        if entry is None:
            raise JobNotFound(f"job {rdzv_id} does not exist: a node creates it by joining (or `create` it)")
        return entry

    def _store(self, rdzv_id: str, now: float) -> KeyValueStore:
        """The job's keys for a write at ``now``; the write counts as use of the job."""
        entry = self.jobs.get(rdzv_id)
        if entry is None:
            entry = self._entry(rdzv_id)  # raises JobNotFound
        if now > entry.last_used:
            entry.last_used = now
        return entry.kv

    def _set(self, cmd: c.Set, now: float) -> Outcome:
        self._store(cmd.rdzv_id, now).set(cmd.round, cmd.key, cmd.value)
        return Outcome({}, (key_topic(cmd.rdzv_id, cmd.round, cmd.key),))

    def _add(self, cmd: c.Add, now: float) -> Outcome:
        value = self._store(cmd.rdzv_id, now).add(cmd.round, cmd.key, cmd.amount)
        if cmd.key == EXIT_BARRIER_COUNT_KEY and cmd.round is not None:  # one compare on the hot path
            return self._exit_barrier(cmd, value, now)
        return Outcome({"value": value}, (key_topic(cmd.rdzv_id, cmd.round, cmd.key),))

    def _exit_barrier(self, cmd: c.Add, value: int, now: float) -> Outcome:
        """An ``add`` on torch's exit-barrier count (already applied, returning ``value``): the
        job hears how many nodes of the round finished (rule 9 of core/rendezvous.py), which may
        release the barrier and close the job in this same apply. A store write's outcome carries
        no events by itself (``apply``'s fast path), so this one gathers its own."""
        entry, round_ = self.jobs[cmd.rdzv_id], cmd.round
        assert round_ is not None
        seen = entry.job.timeline.next_seq - 1

        def reached(job: Job) -> dict[str, Any]:
            job.reach_exit_barrier(round_, value, now)
            return {"value": value}

        change = self._membership_change(entry, reached)
        events = tuple(entry.job.timeline.since(seen))
        wakes = (key_topic(cmd.rdzv_id, round_, cmd.key), *change.wakes)
        if events:
            wakes += (events_topic(cmd.rdzv_id),)
        return Outcome(change.result, wakes, events=events)

    def _compare_set(self, cmd: c.CompareSet, now: float) -> Outcome:
        value = self._store(cmd.rdzv_id, now).compare_set(cmd.round, cmd.key, cmd.expected, cmd.desired)
        return Outcome({"value": value}, (key_topic(cmd.rdzv_id, cmd.round, cmd.key),))

    def _append(self, cmd: c.Append, now: float) -> Outcome:
        self._store(cmd.rdzv_id, now).append(cmd.round, cmd.key, cmd.value)
        return Outcome({}, (key_topic(cmd.rdzv_id, cmd.round, cmd.key),))

    def _multi_set(self, cmd: c.MultiSet, now: float) -> Outcome:
        unpaired = cmd.unpaired()
        if unpaired:
            raise BadRequest(unpaired)
        self._store(cmd.rdzv_id, now).multi_set(cmd.round, cmd.keys, cmd.values)
        return Outcome({}, tuple(key_topic(cmd.rdzv_id, cmd.round, k) for k in cmd.keys))

    def _delete_key(self, cmd: c.DeleteKey, now: float) -> Outcome:
        deleted = self._store(cmd.rdzv_id, now).delete_key(cmd.round, cmd.key)
        return Outcome({"deleted": deleted})

    def _create(self, cmd: c.Create, now: float) -> Outcome:
        settings = cmd.settings
        entry = self.jobs.get(cmd.rdzv_id)
        if entry is None:
            self._new_job(cmd.rdzv_id, settings, now, Cause.CREATE)
        else:
            entry.job.adopt_settings(settings, "create")
        return Outcome({})

    def _new_job(self, rdzv_id: str, settings: JobSettings, now: float, cause: Cause) -> Entry:
        if self.limits is not None and len(self.jobs) >= self.limits.max_jobs:
            raise TooManyJobs(
                f"the server holds {len(self.jobs)} jobs, its limit; job {rdzv_id} cannot be created "
                "(finished jobs are collected after --job-ttl; or raise --max-jobs)"
            )
        job = Job(rdzv_id, settings, idle_since=now, opened_at=now)
        held: dict[str, Any] = {}
        if self.policies:  # rule 13 of rendezvous.py: a new job runs with the policies that match it
            job.policy = self.policies.winning(rdzv_id)
            job.settings, job.sources, why = resolve(settings, job.policy, settings, {})
            if why:  # a policy's node count its nodes' own break: the timeline says it was held
                held["held"] = why
        job.timeline.add(now, Kind.JOB_CREATED, cause, job.round, **held)
        entry = self.jobs[rdzv_id] = Entry(job, self._new_store(), last_used=now)
        return entry

    def _join(self, cmd: c.Join, now: float) -> Outcome:
        settings = cmd.settings
        cordon = self.cordons.match(now, cmd.addr, cmd.host)
        if cordon is not None:  # refused before anything changes (the service records the refusal)
            raise HostCordoned(
                f"node {cmd.node_id} cannot join job {cmd.rdzv_id}: {cordon.describe()} "
                f"({'for another ' + format(cordon.until - now, '.0f') + ' s' if cordon.until is not None else 'until uncordoned'}); "
                f"`rdzvctl uncordon {cordon.host}` admits it again"
            )
        entry = self.jobs.get(cmd.rdzv_id)
        if entry is None:
            entry = self._new_job(cmd.rdzv_id, settings, now, Cause.JOIN)
        failure = failure_report(cmd.failure, now)
        return self._membership_change(
            entry,
            lambda job: {
                "round": job.join(
                    cmd.node_id, cmd.addr, cmd.nproc_per_node, settings, now, cmd.master_port, cmd.host, cmd.topology,
                    cmd.step, failure,
                )
            },
        )

    def _leave(self, cmd: c.Leave, now: float) -> Outcome:
        return self._membership_change(
            self._entry(cmd.rdzv_id), lambda job: {"left": job.depart(cmd.node_id, Departure.LEFT, now)}
        )

    def _close(self, cmd: c.Close, now: float) -> Outcome:
        def close(job: Job) -> dict[str, Any]:
            cause = Cause(cmd.cause) if cmd.cause else Cause.CLOSED
            job.close(now, cause, cmd.node_id, failure_report(cmd.failure, now))
            return {}

        return self._membership_change(self._entry(cmd.rdzv_id), close)

    def _last_call(self, cmd: c.LastCall, now: float) -> Outcome:
        entry = self.jobs.get(cmd.rdzv_id)
        if entry is None:
            return Outcome({"formed": False})
        return self._membership_change(entry, lambda job: {"formed": job.last_call(cmd.round, now)})

    def _expire(self, cmd: c.Expire, now: float) -> Outcome:
        entry = self.jobs.get(cmd.rdzv_id)
        if entry is None:
            return Outcome({"expired": 0})
        why, cause = Departure(cmd.why), Cause(cmd.cause) if cmd.cause else None

        def expire(job: Job) -> dict[str, Any]:
            expired = 0
            for node_id in cmd.node_ids:
                node = job.nodes.get(node_id)
                if job.depart(node_id, why, now, cause):
                    expired += 1
                    if why is Departure.DEAD and node is not None:  # automatic quarantine counts it
                        self.cordons.record_death(node.addr, now)
            return {"expired": expired}

        return self._membership_change(entry, expire)

    def _collect(self, cmd: c.Collect, now: float) -> Outcome:
        entry = self.jobs.pop(cmd.rdzv_id, None)
        if entry is None:
            return Outcome({"collected": False})
        return Outcome({"collected": True}, (round_topic(cmd.rdzv_id), watch_topic(cmd.rdzv_id)))

    def _refused(self, cmd: c.Refused, now: float) -> Outcome:
        entry = self.jobs.get(cmd.rdzv_id)
        if entry is not None:
            job = entry.job
            cause = Cause(cmd.why)
            kind = Kind.JOIN_REFUSED if cause is Cause.SETTINGS_CONFLICT else Kind.NODE_REFUSED
            job.timeline.add(now, kind, cause, job.round, cmd.node_id, cmd.addr, reason=cmd.detail)
        return Outcome({})

    def _refuse(self, cmd: c.Refuse, now: float) -> Outcome:
        """A node refused itself (its health check failed): recorded; the job is made if new."""
        entry = self.jobs.get(cmd.rdzv_id)
        if entry is None:
            entry = self._new_job(cmd.rdzv_id, cmd.settings, now, Cause.JOIN)
        job = entry.job
        job.timeline.add(now, Kind.NODE_REFUSED, Cause(cmd.cause), job.round, cmd.node_id, cmd.addr, reason=cmd.detail)
        return Outcome({})

    def _cordon(self, cmd: c.Cordon, now: float) -> Outcome:
        if self.cordons.full(cmd.host):
            raise BadRequest(
                f"the server holds {MAX_CORDONS} cordons, its limit: uncordon hosts before cordoning {cmd.host}"
            )
        cordon = self.cordons.cordon(cmd.host, now, cmd.duration, cmd.reason, cmd.by)
        if cmd.by == Cause.FLAPPING.value:
            self.cordons.forget_deaths(cmd.host)  # its next quarantine counts deaths after this one
        elif cmd.by == Cause.WORKERS_FAILED.value:
            self.cordons.forget_failures(cmd.host)  # ... and failures after this one
        detail = {"host": cordon.host, "reason": cordon.reason, "until": cordon.until}
        outcome = self._host_event(cmd.rdzv_id, cmd.host, now, Kind.HOST_CORDONED, Cause(cmd.by), detail)
        # Nodes of the host still in line (no workers yet) leave the line now: each one's poll
        # answers node_not_found, its client joins again and is refused, naming the cordon. A
        # member of a running round is not disturbed: it is refused at its next join.
        wakes, events = list(outcome.wakes), list(outcome.events)
        for entry in self.jobs.values():
            job = entry.job
            in_line = [n.node_id for n in job.nodes.values() if n.pending and cmd.host in (n.addr, n.host)]
            if in_line:
                seen = job.timeline.next_seq - 1
                change = self._membership_change(
                    entry, lambda job: {"left": [job.depart(n, Departure.LEFT, now, Cause.CORDONED) for n in in_line]}
                )
                wakes += [*change.wakes, events_topic(job.rdzv_id)]
                events += job.timeline.since(seen)
        return Outcome({}, tuple(dict.fromkeys(wakes)), events=tuple(events))

    def _uncordon(self, cmd: c.Uncordon, now: float) -> Outcome:
        cordon = self.cordons.uncordon(cmd.host)
        if cordon is None or not cordon.active(now):
            return Outcome({"uncordoned": False})
        outcome = self._host_event(cmd.rdzv_id, cmd.host, now, Kind.HOST_UNCORDONED, Cause.OPERATOR, {"host": cmd.host})
        return outcome._replace(result={"uncordoned": True})

    def _set_policy(self, cmd: c.SetPolicy, now: float) -> Outcome:
        if self.policies.full(cmd.pattern):
            raise BadRequest(
                f"the server holds {MAX_POLICIES} policies, its limit: unset policies before setting {cmd.pattern}"
            )
        policy = self.policies.set(cmd.pattern, cmd.settings, now, cmd.by)
        return self._policy_changed(cmd.pattern, cmd.by, now, policy.entry())

    def _unset_policy(self, cmd: c.UnsetPolicy, now: float) -> Outcome:
        if self.policies.get(cmd.pattern) is None:
            raise NoSuchPolicy(f"no policy has the pattern {cmd.pattern} (`rdzvctl policy show` lists them)")
        removed = self.policies.unset(cmd.pattern, cmd.keys, now, cmd.by)
        return self._policy_changed(cmd.pattern, cmd.by, now, {"pattern": cmd.pattern, "removed": removed})

    def _policy_changed(self, pattern: str, by: str, now: float, result: dict[str, Any]) -> Outcome:
        """Rule 13 of rendezvous.py: each job ``pattern`` matches takes the policies that now win
        for it; a job whose effective settings moved records ``policy_changed`` and settles."""
        wakes: list[Hashable] = []
        events: list[JobEvent] = []
        for entry in self.jobs.values():
            job = entry.job
            if not matches(pattern, job.rdzv_id):
                continue
            winning = self.policies.winning(job.rdzv_id)
            if winning == job.policy:
                continue
            seen = job.timeline.next_seq - 1
            change = self._membership_change(  # (calls the lambda at once: this pass's winning)
                entry, lambda job: {"moved": job.apply_policy(winning, now, pattern, by)}
            )
            if job.timeline.next_seq - 1 > seen:
                # watch_topic too: its parked watches answer with the new policy_version
                wakes += [*change.wakes, events_topic(job.rdzv_id), watch_topic(job.rdzv_id)]
                events += job.timeline.since(seen)
        return Outcome(result, tuple(dict.fromkeys(wakes)), events=tuple(events))

    def _host_event(
        self, rdzv_id: str, host: str, now: float, kind: Kind, cause: Cause, detail: dict[str, Any]
    ) -> Outcome:
        """Add ``kind`` to the timeline of ``rdzv_id`` (if a job) and of every job with a node on
        ``host`` (by address or host name): where an operator looks for why a node is missing."""
        events: list[JobEvent] = []
        touched: list[Hashable] = []
        for entry in self.jobs.values():
            job = entry.job
            nodes = [n for n in job.nodes.values() if host in (n.addr, n.host) and n.liveness is Liveness.ALIVE]
            if not nodes and job.rdzv_id != rdzv_id:
                continue
            touched.append(events_topic(job.rdzv_id))
            if not nodes:
                events.append(job.timeline.add(now, kind, cause, job.round, **detail))
            for n in nodes:
                events.append(job.timeline.add(now, kind, cause, job.round, n.node_id, n.addr, **detail))
        return Outcome({}, tuple(touched), events=tuple(events))

    def _tick(self, cmd: c.Tick, now: float) -> Outcome:
        return Outcome({})  # apply() moves the clock: that is all a tick does

    def _restarted(self, cmd: c.Restarted, now: float) -> Outcome:
        for entry in self.jobs.values():
            detail = {"reason": cmd.detail} if cmd.detail else {}
            entry.job.timeline.add(now, Kind.SERVER_RESTARTED, Cause(cmd.cause), entry.job.round, **detail)
        return Outcome({}, tuple(events_topic(rdzv_id) for rdzv_id in self.jobs))

    def _membership_change(self, entry: Entry, change: Callable[[Job], dict[str, Any]]) -> Outcome:
        job = entry.job
        before_round = (job.state, job.round)
        before_watch = _watched(job)
        departures, runs, releases = job.departures, job.runs, job.exit_barrier_releases
        result = change(job)
        if job.runs != runs:  # a fresh run in a closed job: it starts with no keys
            entry.kv = self._new_store()
        wakes: list[Hashable] = []
        if job.exit_barrier_releases != releases and job.exit_barrier is not None:
            # Rule 9 released torch's exit barrier: set its key as torch's last member would, so
            # the finished agents' waits return (a write the server decides: never refused).
            round_ = job.exit_barrier.round
            entry.kv.put_decided(round_, EXIT_BARRIER_LAST_MEMBER_KEY, EXIT_BARRIER_RELEASE_VALUE)
            wakes.append(key_topic(job.rdzv_id, round_, EXIT_BARRIER_LAST_MEMBER_KEY))
        if (job.state, job.round) != before_round:
            wakes.append(round_topic(job.rdzv_id))
        elif job.departures != departures:
            # A departure must reach the departed node's own long-poll (join_timeout, dropped
            # from the line), and no other: at thousands of nodes in line, waking them all
            # for each departure made departures cost O(nodes in line) each.
            gone = job.departures - departures
            if gone <= len(job.departed):  # the last `gone` remembered are this change's
                wakes += [node_topic(job.rdzv_id, node_id) for node_id in itertools.islice(reversed(job.departed), gone)]
            else:
                wakes.append(round_topic(job.rdzv_id))
        if _watched(job) != before_watch:
            wakes.append(watch_topic(job.rdzv_id))
        if job.state is JobState.COMPLETE and (job.state, job.round) != before_round:
            entry.kv.drop_rounds_before(job.round - 1)
            if job.blamed is not None:  # rule 12 of rendezvous.py: what quarantine counts by host
                self.cordons.record_failure(*job.blamed)
        return Outcome(result, tuple(wakes))

    # -- exactly-once window ----------------------------------------------------------------

    def _session(self, client_id: str, now: float) -> Session | None:
        """The client's live session (one past its TTL counts as gone)."""
        session = self.sessions.get(client_id)
        if session is None or session.last_write + self.session_ttl < now:
            return None
        return session

    def _admit(self, rid: tuple[Any, ...], session: Session | None, now: float) -> None:
        """Under limits, refuse a write whose session cannot be kept (changes nothing)."""
        limits = self.limits
        if limits is None:
            return
        if session is None:
            if len(self.sessions) >= limits.max_sessions and not self._expired_sessions(now):
                raise TooManySessions(
                    f"the server remembers {len(self.sessions)} client sessions, its limit; a session ends "
                    f"{self.session_ttl:g} s after its last write (or raise --max-sessions)"
                )
        else:
            # What the client says it has read may go before anything is counted against it.
            floor = rid[2] if len(rid) > 2 else session.floor
            self._trim(session, floor)
            if len(session.results) >= limits.max_session_writes and not self._trim(session, floor, full=True):
                raise SessionFull(
                    f"client {rid[0]} has {len(session.results)} writes awaiting their acknowledgement, the limit "
                    "(--max-session-writes): wait for replies before sending more"
                )
        if self.session_bytes > limits.max_session_bytes:
            raise SessionFull(
                f"results kept for retries hold {self.session_bytes} bytes, over --max-session-bytes="
                f"{limits.max_session_bytes}: retry once clients have read their replies"
            )

    def _expired_sessions(self, now: float) -> int:
        """Forget sessions past their TTL (least recent first); return how many."""
        ttl, n = self.session_ttl, 0
        while self.sessions:
            client_id, session = next(iter(self.sessions.items()))
            if session.last_write + ttl >= now:
                break
            del self.sessions[client_id]
            self.session_bytes -= session.bytes
            n += 1
        return n

    def _trim(self, session: Session, floor: int, *, full: bool = False) -> int:
        """Drop the results below ``floor`` (answered: never retried); return how many.

        Results arrive in about seq order, so the oldest are at the front; ``full`` also
        looks past the first result at or above the floor (out-of-order arrivals)."""
        session.floor = max(session.floor, floor)
        results, dropped = session.results, 0
        stale = [s for s in results if s < session.floor] if full else []
        if not full:
            for seq in results:
                if seq >= session.floor:
                    break
                stale.append(seq)
        for seq in stale:
            gone = _result_bytes(results.pop(seq))
            session.bytes -= gone
            self.session_bytes -= gone
            dropped += 1
        return dropped

    def _record(
        self, rid: tuple[Any, ...], result: dict[str, Any], now: float, session: Session | None
    ) -> None:
        """Keep ``result`` for retries of ``rid`` in ``session`` (the client's live session as
        :meth:`apply` found it, not looked up again; None: start one)."""
        client_id, seq = rid[0], rid[1]
        if session is None:  # new, or past its TTL: start afresh
            old = self.sessions.pop(client_id, None)
            if old is not None:
                self.session_bytes -= old.bytes
            session = self.sessions[client_id] = Session(now)
        else:
            self.sessions.move_to_end(client_id)
            if now > session.last_write:
                session.last_write = now
        session.results[seq] = result
        size = _result_bytes(result)
        if size:
            session.bytes += size
            self.session_bytes += size
        if len(rid) > 2:
            self._trim(session, rid[2])  # O(1) when _admit trimmed already
        else:  # no floor: keep the last DEDUP_WINDOW results (an older seq counts as new again)
            while len(session.results) > DEDUP_WINDOW:
                gone = _result_bytes(session.results.popitem(last=False)[1])
                session.bytes -= gone
                self.session_bytes -= gone
        self._expired_sessions(now)  # O(1) while the least recent session is live

    # -- the timer's detection ------------------------------------------------------------

    def deadline(self, rdzv_id: str) -> float | None:
        """When the timer should next look at this job (None: nothing scheduled)."""
        entry = self.jobs.get(rdzv_id)
        if entry is None:
            return None
        job = entry.job
        times = [t for t in (job.next_deadline(), self._collect_at(entry)) if t is not None]
        return min(times) if times else None

    def _collect_at(self, entry: Entry) -> float | None:
        """When a closed or idle job may be forgotten: ``job_ttl`` after it closed or went idle,
        and after its last store request (a store-only job is idle from birth but in use)."""
        job = entry.job
        if job.state is JobState.CLOSED and job.closed_at is not None:
            return max(job.closed_at, entry.last_used) + self.job_ttl
        if job.idle_since is not None:
            return max(job.idle_since, entry.last_used) + self.job_ttl
        return None

    def due(self, rdzv_id: str, now: float) -> list[c.Command]:
        """The commands the timer should apply for this job at ``now`` (may be empty)."""
        entry = self.jobs.get(rdzv_id)
        if entry is None:
            return []
        job = entry.job
        collect_at = self._collect_at(entry)
        if collect_at is not None and collect_at <= now:
            return [c.Collect(rdzv_id)]
        out: list[c.Command] = []
        dead = job.expired(now)
        if dead:
            out.append(c.Expire(rdzv_id, tuple(dead), Departure.DEAD.value))
        late = [n for n in job.join_timed_out(now) if n not in dead]
        if late:
            out.append(c.Expire(rdzv_id, tuple(late), Departure.JOIN_TIMEOUT.value))
        if job.last_call_deadline is not None and job.last_call_deadline <= now:
            out.append(c.LastCall(rdzv_id, job.round))
        return out

    # -- reads ------------------------------------------------------------------------------

    def kv(self, rdzv_id: str) -> KeyValueStore:
        return self._entry(rdzv_id).kv

    def use(self, rdzv_id: str, now: float) -> KeyValueStore:
        """The job's keys for a store read at ``now``: reading is use (soft state, never logged)."""
        entry = self._entry(rdzv_id)
        entry.last_used = max(entry.last_used, now)
        return entry.kv

    def job(self, rdzv_id: str) -> Job:
        return self._entry(rdzv_id).job

    def assignment(self, rdzv_id: str, node_id: str, min_round: int) -> Assignment | None:
        """The node's place (``Job.assignment``), carrying the policy table's version."""
        place = self._entry(rdzv_id).job.assignment(node_id, min_round)
        if place is None or not self.policies.version:
            return place
        return dataclasses.replace(place, policy_version=self.policies.version)

    def heartbeat(self, rdzv_id: str, node_id: str, now: float, progress: tuple[int, int] | None = None) -> Job:
        """Soft-state beat of ``node_id`` (never logged); returns its job. ``progress``: the
        (round, step) its beat reports (rendezvous rule 8's soft steps). Raises JobNotFound."""
        job = self._entry(rdzv_id).job
        job.heartbeat(node_id, now)
        if progress is not None and node_id in job.heartbeats:  # a live node of the job
            job.progress.seen(progress[0], progress[1], now)
        return job

    def already_refused(self, cmd: c.Refused) -> bool:
        """Whether the job's timeline already says ``cmd``: the same refusal (node, address,
        cause and reason) since the job's last event of any other kind.

        A node refused again and again (its client retrying, an agent restarting in a loop)
        is then recorded once, not once per attempt: a misconfigured agent cannot grow the
        log or push the job's other events out of its timeline. A read: changes nothing.
        Bounded by the timeline's capacity.
        """
        entry = self.jobs.get(cmd.rdzv_id)
        if entry is None:
            return False
        for event in entry.job.timeline.newest_first():
            if event.kind not in (Kind.JOIN_REFUSED, Kind.NODE_REFUSED):
                return False
            same = (event.node_id, event.addr, event.cause.value, event.detail.get("reason", ""))
            if same == (cmd.node_id, cmd.addr, cmd.why, cmd.detail):
                return True
        return False

    def watch_view(self, rdzv_id: str, round_: int) -> WatchView:
        """What a node of round ``round_`` watching the job sees now. Raises JobNotFound."""
        job = self._entry(rdzv_id).job
        return WatchView(
            job.round,
            job.state.value,
            job.num_nodes_waiting(round_),
            job.state is JobState.CLOSED,
            job.closed_cause or None,  # why it closed: restart_budget_exhausted stops the agents
            self.policies.version,
        )

    # -- snapshot -----------------------------------------------------------------------------

    def to_snapshot(self) -> dict[str, Any]:
        return {
            "clock": self.clock,
            "jobs": [[e.job.to_snapshot(), e.kv.to_snapshot()] for e in self.jobs.values()],
            "sessions": [[cid, s.last_write, s.floor, list(s.results.items())] for cid, s in self.sessions.items()],
            "cordons": self.cordons.to_snapshot(),
            "policies": self.policies.to_snapshot(),
        }

    def restore(self, data: dict[str, Any]) -> None:
        self.clock = data["clock"]
        self.cordons = CordonTable.from_snapshot(data.get("cordons"))
        self.policies = PolicyTable.from_snapshot(data.get("policies"))
        self.jobs = {}
        for job_data, kv_data in data["jobs"]:
            job = Job.from_snapshot(job_data)
            kv = self._apply_quota(KeyValueStore.from_snapshot(kv_data, self.max_value_bytes))
            self.jobs[job.rdzv_id] = Entry(job, kv, last_used=self.clock)
        self.sessions = OrderedDict()
        self.session_bytes = 0
        for cid, last_write, floor, results in data["sessions"]:
            session = self.sessions[cid] = Session(last_write, floor, OrderedDict((seq, r) for seq, r in results))
            session.bytes = sum(_result_bytes(r) for r in session.results.values())
            self.session_bytes += session.bytes

    def reset_heartbeats(self, now: float) -> None:
        """After a restart: every node, and every job's use, gets one full TTL of grace."""
        for entry in self.jobs.values():
            entry.job.reset_heartbeats(now)
            entry.last_used = now


_HANDLERS: dict[type[c.Command], Callable[[StateMachine, Any, float], Outcome]] = {
    c.Set: StateMachine._set,
    c.Add: StateMachine._add,
    c.CompareSet: StateMachine._compare_set,
    c.Append: StateMachine._append,
    c.MultiSet: StateMachine._multi_set,
    c.DeleteKey: StateMachine._delete_key,
    c.Create: StateMachine._create,
    c.Join: StateMachine._join,
    c.Leave: StateMachine._leave,
    c.Close: StateMachine._close,
    c.LastCall: StateMachine._last_call,
    c.Expire: StateMachine._expire,
    c.Collect: StateMachine._collect,
    c.Refused: StateMachine._refused,
    c.Restarted: StateMachine._restarted,
    c.Tick: StateMachine._tick,
    c.Refuse: StateMachine._refuse,
    c.Cordon: StateMachine._cordon,
    c.Uncordon: StateMachine._uncordon,
    c.SetPolicy: StateMachine._set_policy,
    c.UnsetPolicy: StateMachine._unset_policy,
}
