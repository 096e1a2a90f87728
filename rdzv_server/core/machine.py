"""The server's whole state and its one apply path.

What it owns: every job (its rendezvous state machine and its key-value store), the
exactly-once window of each client, and the server clock's high-water mark.

Rules:
- ``apply(command, now, rid)`` is the only way state changes. It is synchronous and
  deterministic given (state, command, now): replaying the logged commands with their
  logged ``now`` rebuilds the same state. It either applies the whole command or raises
  an :class:`RdzvError` having changed nothing.
- A command carrying ``rid = (client_id, seq)`` is applied at most once: a retry gets the
  recorded result. The window keeps the last ``DEDUP_WINDOW`` results per client and the
  last ``MAX_CLIENTS`` clients; it is part of the snapshot, and rebuilt by replay.
- ``due(now)`` only *detects* what the timer must do and returns commands; they take
  effect when applied (and logged) like any other.
- Reads (``get``, ``assignment`` ...) never change state.

Each applied command reports the wake-up topics it touched (see :class:`Outcome`), so
the server layer wakes exactly the waiters whose condition may now hold.

What it must not know: I/O, asyncio, the wire format, the real clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from . import command as c
from .error import BadRequest, JobNotFound
from .rendezvous import Assignment, Departure, Job, JobSettings, JobState
from .store import KeyValueStore

# Results remembered per client: a client retries only its last few in-flight writes.
DEDUP_WINDOW = 128
# Clients remembered: one per agent and per worker store; LRU beyond that.
MAX_CLIENTS = 100_000


@dataclass
class Entry:
    """One job: its membership state machine and its keys."""

    job: Job
    kv: KeyValueStore


@dataclass(frozen=True)
class Outcome:
    result: dict[str, Any]
    wakes: tuple[Hashable, ...] = ()
    replayed: bool = False  # True when a retry got the recorded result


def key_topic(rdzv_id: str, scope: int | None, key: bytes) -> Hashable:
    return ("key", rdzv_id, scope, key)


def round_topic(rdzv_id: str) -> Hashable:
    """Woken when a round forms or opens, a pending node departs, or the job closes."""
    return ("round", rdzv_id)


def watch_topic(rdzv_id: str) -> Hashable:
    """Woken when what watchers see (state, round, num_nodes_waiting) changes."""
    return ("watch", rdzv_id)


@dataclass
class StateMachine:
    max_value_bytes: int
    job_ttl: float
    jobs: dict[str, Entry] = field(default_factory=dict)
    sessions: OrderedDict[str, OrderedDict[int, dict[str, Any]]] = field(default_factory=OrderedDict)
    clock: float = 0.0  # the latest `now` applied: the server clock resumes from here after a restart

    # -- the apply path ----------------------------------------------------------------------

    def apply(self, command: c.Command, now: float, rid: tuple[str, int] | None = None) -> Outcome:
        """Apply one command. Raises an RdzvError (and changes nothing) on a bad command."""
        if rid is not None:
            recorded = self._recorded(rid)
            if recorded is not None:
                return Outcome(recorded, (), replayed=True)
        handler = _HANDLERS[type(command)]
        outcome: Outcome = handler(self, command, now)
        self.clock = max(self.clock, now)
        if rid is not None:
            self._record(rid, outcome.result)
        return outcome

    def _entry(self, rdzv_id: str) -> Entry:
        entry = self.jobs.get(rdzv_id)
        if entry is None:
            raise JobNotFound(f"job {rdzv_id} does not exist: a node creates it by joining (or `create` it)")
        return entry

    def _set(self, cmd: c.Set, now: float) -> Outcome:
        self._entry(cmd.rdzv_id).kv.set(cmd.round, cmd.key, cmd.value)
        return Outcome({}, (key_topic(cmd.rdzv_id, cmd.round, cmd.key),))

    def _add(self, cmd: c.Add, now: float) -> Outcome:
        value = self._entry(cmd.rdzv_id).kv.add(cmd.round, cmd.key, cmd.amount)
        return Outcome({"value": value}, (key_topic(cmd.rdzv_id, cmd.round, cmd.key),))

    def _compare_set(self, cmd: c.CompareSet, now: float) -> Outcome:
        value = self._entry(cmd.rdzv_id).kv.compare_set(cmd.round, cmd.key, cmd.expected, cmd.desired)
        return Outcome({"value": value}, (key_topic(cmd.rdzv_id, cmd.round, cmd.key),))

    def _append(self, cmd: c.Append, now: float) -> Outcome:
        self._entry(cmd.rdzv_id).kv.append(cmd.round, cmd.key, cmd.value)
        return Outcome({}, (key_topic(cmd.rdzv_id, cmd.round, cmd.key),))

    def _multi_set(self, cmd: c.MultiSet, now: float) -> Outcome:
        if len(cmd.keys) != len(cmd.values):
            raise BadRequest(f"multi_set got {len(cmd.keys)} keys but {len(cmd.values)} values")
        self._entry(cmd.rdzv_id).kv.multi_set(cmd.round, cmd.keys, cmd.values)
        return Outcome({}, tuple(key_topic(cmd.rdzv_id, cmd.round, k) for k in cmd.keys))

    def _delete_key(self, cmd: c.DeleteKey, now: float) -> Outcome:
        deleted = self._entry(cmd.rdzv_id).kv.delete_key(cmd.round, cmd.key)
        return Outcome({"deleted": deleted})

    def _create(self, cmd: c.Create, now: float) -> Outcome:
        settings = JobSettings(cmd.min_nodes, cmd.max_nodes, cmd.last_call_timeout, cmd.join_timeout, cmd.heartbeat_ttl)
        entry = self.jobs.get(cmd.rdzv_id)
        if entry is None:
            self._new_job(cmd.rdzv_id, settings, now)
        else:
            entry.job.adopt_settings(settings, "create")
        return Outcome({})

    def _new_job(self, rdzv_id: str, settings: JobSettings, now: float) -> Entry:
        job = Job(rdzv_id, settings, idle_since=now)
        entry = self.jobs[rdzv_id] = Entry(job, KeyValueStore(self.max_value_bytes))
        return entry

    def _join(self, cmd: c.Join, now: float) -> Outcome:
        settings = JobSettings(cmd.min_nodes, cmd.max_nodes, cmd.last_call_timeout, cmd.join_timeout, cmd.heartbeat_ttl)
        entry = self.jobs.get(cmd.rdzv_id)
        if entry is None:
            entry = self._new_job(cmd.rdzv_id, settings, now)
        return self._membership_change(
            entry, lambda job: {"round": job.join(cmd.node_id, cmd.addr, cmd.nproc_per_node, settings, now, cmd.master_port)}
        )

    def _leave(self, cmd: c.Leave, now: float) -> Outcome:
        return self._membership_change(
            self._entry(cmd.rdzv_id), lambda job: {"left": job.depart(cmd.node_id, Departure.LEFT, now)}
        )

    def _close(self, cmd: c.Close, now: float) -> Outcome:
        def close(job: Job) -> dict[str, Any]:
            job.close(now)
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
        why = Departure(cmd.why)
        return self._membership_change(
            entry, lambda job: {"expired": sum(job.depart(n, why, now) for n in cmd.node_ids)}
        )

    def _collect(self, cmd: c.Collect, now: float) -> Outcome:
        entry = self.jobs.pop(cmd.rdzv_id, None)
        if entry is None:
            return Outcome({"collected": False})
        return Outcome({"collected": True}, (round_topic(cmd.rdzv_id), watch_topic(cmd.rdzv_id)))

    def _membership_change(self, entry: Entry, change: Callable[[Job], dict[str, Any]]) -> Outcome:
        job = entry.job
        before_round = (job.state, job.round)
        before_watch = (job.state, job.round, job.num_nodes_waiting(job.round))
        departures, runs = job.departures, job.runs
        result = change(job)
        if job.runs != runs:  # a fresh run in a closed job: it starts with no keys
            entry.kv = KeyValueStore(self.max_value_bytes)
        wakes: list[Hashable] = []
        # A departure of a pending node must reach its own long-poll (join_timeout); rare.
        if (job.state, job.round) != before_round or job.departures != departures:
            wakes.append(round_topic(job.rdzv_id))
        if (job.state, job.round, job.num_nodes_waiting(job.round)) != before_watch:
            wakes.append(watch_topic(job.rdzv_id))
        if job.state is JobState.COMPLETE and (job.state, job.round) != before_round:
            entry.kv.drop_rounds_before(job.round - 1)
        return Outcome(result, tuple(wakes))

    # -- exactly-once window ----------------------------------------------------------------

    def _recorded(self, rid: tuple[str, int]) -> dict[str, Any] | None:
        window = self.sessions.get(rid[0])
        return None if window is None else window.get(rid[1])

    def _record(self, rid: tuple[str, int], result: dict[str, Any]) -> None:
        client_id, seq = rid
        window = self.sessions.get(client_id)
        if window is None:
            window = self.sessions[client_id] = OrderedDict()
            while len(self.sessions) > MAX_CLIENTS:
                self.sessions.popitem(last=False)
        else:
            self.sessions.move_to_end(client_id)
        window[seq] = result
        while len(window) > DEDUP_WINDOW:
            window.popitem(last=False)

    # -- the timer's detection ------------------------------------------------------------

    def deadline(self, rdzv_id: str) -> float | None:
        """When the timer should next look at this job (None: nothing scheduled)."""
        entry = self.jobs.get(rdzv_id)
        if entry is None:
            return None
        job = entry.job
        times = [t for t in (job.next_deadline(), self._collect_at(job)) if t is not None]
        return min(times) if times else None

    def _collect_at(self, job: Job) -> float | None:
        if job.state is JobState.CLOSED and job.closed_at is not None:
            return job.closed_at + self.job_ttl
        if job.idle_since is not None:
            return job.idle_since + self.job_ttl
        return None

    def due(self, rdzv_id: str, now: float) -> list[c.Command]:
        """The commands the timer should apply for this job at ``now`` (may be empty)."""
        entry = self.jobs.get(rdzv_id)
        if entry is None:
            return []
        job = entry.job
        collect_at = self._collect_at(job)
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

    def job(self, rdzv_id: str) -> Job:
        return self._entry(rdzv_id).job

    def assignment(self, rdzv_id: str, node_id: str, min_round: int) -> Assignment | None:
        return self._entry(rdzv_id).job.assignment(node_id, min_round)

    def heartbeat(self, rdzv_id: str, node_id: str, now: float) -> Job:
        """Soft-state beat of ``node_id`` (never logged); returns its job. Raises JobNotFound."""
        job = self._entry(rdzv_id).job
        job.heartbeat(node_id, now)
        return job

    def watch_view(self, rdzv_id: str, round_: int) -> dict[str, Any]:
        job = self._entry(rdzv_id).job
        return {
            "round": job.round,
            "state": job.state.value,
            "num_nodes_waiting": job.num_nodes_waiting(round_),
            "closed": job.state is JobState.CLOSED,
        }

    # -- snapshot -----------------------------------------------------------------------------

    def to_snapshot(self) -> dict[str, Any]:
        return {
            "clock": self.clock,
            "jobs": [[e.job.to_snapshot(), e.kv.to_snapshot()] for e in self.jobs.values()],
            "sessions": [[cid, list(window.items())] for cid, window in self.sessions.items()],
        }

    def restore(self, data: dict[str, Any]) -> None:
        self.clock = data["clock"]
        self.jobs = {}
        for job_data, kv_data in data["jobs"]:
            job = Job.from_snapshot(job_data)
            self.jobs[job.rdzv_id] = Entry(job, KeyValueStore.from_snapshot(kv_data, self.max_value_bytes))
        self.sessions = OrderedDict(
            (cid, OrderedDict((seq, result) for seq, result in window)) for cid, window in data["sessions"]
        )

    def reset_heartbeats(self, now: float) -> None:
        for entry in self.jobs.values():
            entry.job.reset_heartbeats(now)


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
}
