"""A job's timeline: what happened to it, when, to which node, and why.

What it owns: :class:`JobEvent` (one entry) and :class:`Timeline` (a job's bounded history).
The event vocabulary itself, :class:`Kind` and :class:`Cause`, is declared once in
:mod:`rdzv_client.record`, which both sides import (the client validates the causes it may
send, the API and the page read the kinds), and re-exported here under core's names.

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

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rdzv_client.record import Cause as Cause
from rdzv_client.record import Kind as Kind

# Events kept per job: a 1,000-node job's formation (a join per node and the round) fits;
# older events are dropped first. About 0.5 KB each (tracemalloc): 0.5 MB a job at most.
DEFAULT_CAPACITY = 1024


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
        events = self._events
        if skip * 2 >= len(events):  # the newest few (a command's own events): from the right end
            out = list(itertools.islice(reversed(events), len(events) - skip))
            out.reverse()
        else:
            out = list(itertools.islice(events, skip, None))
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
