"""A job's timeline: what happened to it, when, to which node, and why.

What it owns: :class:`JobEvent` (one entry) and :class:`Timeline` (a job's bounded history).

Rules:
- Events are made by the apply path only (``rendezvous.Job`` and ``machine.StateMachine``),
  from the command being applied and its ``now``: replaying the log makes the same events
  with the same sequence numbers and times, so a timeline survives a restart (and travels in
  the snapshot with its job).
- Sequence numbers start at 1 and grow by one per event of the job; a reader asks for the
  events after the last one it saw (``since``). At most ``capacity`` events are kept, the
  oldest dropped first; ``first_seq`` tells a reader that it missed some.
- ``time`` is the server clock (seconds, monotonic across restarts); the API turns it into
  wall-clock time for people.
- Every event names its ``cause`` in the words of :class:`Cause`, so an operator can tell a
  node that crashed (connection closed) from one whose host vanished (heartbeat expired)
  from one that finished (left).

What it must not know: I/O, the clock, how events are shown.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

# Events kept per job: a 1,000-node job's formation (a join per node and the round) fits;
# older events are dropped first. About 0.5 KB each (tracemalloc): 0.5 MB a job at most.
DEFAULT_CAPACITY = 1024


class Kind(str, enum.Enum):
    JOB_CREATED = "job_created"
    JOB_CLOSED = "job_closed"
    NODE_JOINED = "node_joined"
    ROUND_FORMED = "round_formed"
    STANDBY_PROMOTED = "standby_promoted"
    NODE_DEPARTED = "node_departed"
    JOIN_REFUSED = "join_refused"
    SERVER_RESTARTED = "server_restarted"
    # Fleet control (README "Fleet control"):
    NODE_REFUSED = "node_refused"  # a node was not admitted: its health check failed, or its host is cordoned
    HOST_CORDONED = "host_cordoned"  # a host of one of the job's nodes was cordoned
    HOST_UNCORDONED = "host_uncordoned"  # ... and its cordon lifted
    RESTART_COUNTED = "restart_counted"  # a failure spent one restart of the job's budget


class Cause(str, enum.Enum):
    """Why: the ``cause`` of each kind of event."""

    # job_created
    JOIN = "join"  # the first node's join made it
    CREATE = "create"  # a client created it (a store-only job, rdzvctl)
    # node_joined: the place the node got in line
    CANDIDATE = "candidate"  # in the round that is forming
    WAITING = "waiting"  # after a round formed: makes the running nodes restart into the next
    STANDBY = "standby"  # max_nodes are in: a spare
    REJOINED = "rejoined"  # a member of the last round is back (its workers restarted)
    # round_formed
    MAX_NODES = "max_nodes"  # max_nodes joined
    MEMBERS_BACK = "members_back"  # every live member of the last round re-joined, spares filled it
    LAST_CALL = "last_call"  # last_call_timeout passed after min_nodes joined
    # node_departed
    CONNECTION_CLOSED = "connection_closed"  # its agent's watch dropped and did not return
    HEARTBEAT_EXPIRED = "heartbeat_expired"  # silent for the heartbeat TTL (a host that vanished)
    LEFT = "left"  # a graceful leave (the agent finished)
    JOIN_TIMEOUT = "join_timeout"  # waited longer than join_timeout for a round
    NOT_REJOINED = "not_rejoined"  # a live member of the last round that the next round formed without
    # join_refused
    SETTINGS_CONFLICT = "settings_conflict"  # the node asked for other --nnodes / --rdzv-conf settings
    # node_refused
    HEALTH_CHECK_FAILED = "health_check_failed"  # the node's health_check command failed before its join
    CORDONED = "cordoned"  # the node's host is cordoned (node_refused; node_departed: taken out of line)
    # host_cordoned, host_uncordoned: OPERATOR (rdzvctl), or
    FLAPPING = "flapping"  # the server quarantined a host whose nodes kept dying
    # restart_counted
    MEMBER_DIED = "member_died"  # a member of the formed round died
    WORKERS_FAILED = "workers_failed"  # a member re-joined its formed round: its workers failed
    # server_restarted
    RECOVERY = "recovery"  # the server restarted and rebuilt its state from its log
    LEADER_CHANGED = "leader_changed"  # another replica took over as leader (--etcd)
    # job_closed
    AGENT = "agent"  # a torchrun agent closed it: its shutdown (the run ended) or set_closed()
    OPERATOR = "operator"  # rdzvctl close
    CLOSED = "closed"  # a client that did not say who it is
    RESTART_BUDGET_EXHAUSTED = "restart_budget_exhausted"  # a failure beyond max_restarts (the server)
    # (a job outliving --job-ttl is collected, timeline and all: that is the end of its story)


@dataclass(frozen=True)
class JobEvent:
    seq: int
    time: float
    kind: Kind
    cause: Cause
    round: int
    node_id: str | None = None
    addr: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)  # per kind: e.g. round_formed has num_nodes


@dataclass(frozen=True)
class EventPage:
    """Some of a job's events at one instant, as plain data (the events query's answer)."""

    events: list[JobEvent]  # oldest first
    first_seq: int  # the oldest kept: a reader that asked for less missed the ones before
    next_seq: int
    now: float



class Timeline:
    """The last ``capacity`` events of one job."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._events: deque[JobEvent] = deque(maxlen=capacity)
        self.next_seq = 1

    def __len__(self) -> int:
        return len(self._events)

    @property
    def first_seq(self) -> int:
        """The oldest sequence number still kept (``next_seq`` when there is none)."""
        return self._events[0].seq if self._events else self.next_seq

    def add(
        self, time: float, kind: Kind, cause: Cause, round_: int, node_id: str | None = None, addr: str | None = None,
        **detail: Any,
    ) -> JobEvent:
        event = JobEvent(self.next_seq, time, kind, cause, round_, node_id, addr, detail)
        self._events.append(event)
        self.next_seq += 1
        return event

    def newest_first(self) -> Iterator[JobEvent]:
        """The events kept, newest first (a reader stops where it has seen enough)."""
        return reversed(self._events)

    def since(self, seq: int, limit: int | None = None) -> list[JobEvent]:
        """The events after ``seq`` (0: all kept), oldest first, at most ``limit``."""
        skip = max(0, seq - self.first_seq + 1)
        out = [self._events[i] for i in range(skip, len(self._events))]
        return out if limit is None else out[:limit]

    # -- snapshot -------------------------------------------------------------------------

    def to_snapshot(self) -> list[Any]:
        return [self.next_seq, [[e.seq, e.time, e.kind.value, e.cause.value, e.round, e.node_id, e.addr, e.detail]
                                for e in self._events]]

    @classmethod
    def from_snapshot(cls, data: list[Any]) -> Timeline:
        timeline = cls()
        timeline.next_seq = data[0]
        for seq, time, kind, cause, round_, node_id, addr, detail in data[1]:
            timeline._events.append(JobEvent(seq, time, Kind(kind), Cause(cause), round_, node_id, addr, dict(detail)))
        return timeline
