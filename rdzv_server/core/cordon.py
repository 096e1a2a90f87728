"""The cordon table: hosts no job may admit, and the deaths that quarantine a host.

What it owns: :class:`Cordon` (one cordoned host: since, until, reason, by whom) and
:class:`CordonTable`, the server-wide table every job's admission consults, with the recent
deaths of each host's nodes that automatic quarantine counts.

Rules:
- A cordon names a host as a node reports it: its host name or its address; a node is
  cordoned when either matches (:meth:`CordonTable.match`). Cordoning a cordoned host
  replaces its cordon (a new reason, a new end).
- A timed cordon is in effect while ``now < until``; past it, it is as if lifted. It is
  dropped from the table by the next change (:meth:`prune`, run by the apply path), so a
  replay drops it at the same point. An untimed one lasts until it is lifted.
- Deaths (a node of the host died: ``connection_closed`` or ``heartbeat_expired``) are kept
  per host, the newest :data:`MAX_DEATHS_PER_HOST`, and for at most :data:`MAX_HOSTS` hosts
  (the host whose last death is oldest is forgotten first): :meth:`deaths_within` is what the
  server's quarantine rule (``--quarantine-after K --quarantine-window W``) reads. The rule
  itself is core's decision (:func:`.decision.quarantine`), applied by the service as an
  ordinary ``cordon`` command with ``by="flapping"``, so the flags may change between
  restarts without replay diverging.
- Host-local failures (a node's workers failed first in its round, see
  ``rendezvous.Job.blamed``) are kept per host likewise, each with its time, its lead (how
  many seconds before any other node of the round failed; None: no other failed) and its
  first line: :meth:`failures_within` is what ``--quarantine-failures K`` (with
  ``--quarantine-failure-lead L`` and the same window) reads, in core's decision
  (:func:`.decision.failure_quarantine`), applied as a ``cordon`` with ``by="workers_failed"``.
- Everything here changes only through the apply path (``machine.StateMachine``), from the
  command and its ``now``; it travels in the snapshot.

What it must not know: I/O, the clock, jobs (the machine tells it the host of a death).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from .event import Cause

#: The most cordons the table holds: an operator's fleet, and more. A cordon beyond it is refused.
MAX_CORDONS = 100_000
#: Deaths kept per host: the largest --quarantine-after the server accepts.
MAX_DEATHS_PER_HOST = 64
#: Hosts whose deaths are kept; the host whose newest death is the oldest is dropped first.
MAX_HOSTS = 100_000


@dataclass(frozen=True)
class Cordon:
    host: str
    since: float
    until: float | None  # None: until lifted
    reason: str
    by: str  # "operator" or "flapping"

    def active(self, now: float) -> bool:
        return self.until is None or now < self.until

    def describe(self) -> str:
        """The cordon in words, as a refused node's error and its timeline show it."""
        who = _CORDONED_BY.get(self.by, "the server (automatic quarantine: its nodes kept dying)")
        reason = f": {self.reason}" if self.reason else ""
        return f"host {self.host} is cordoned by {who}{reason}"



_CORDONED_BY = {
    Cause.OPERATOR.value: "an operator",
    Cause.WORKERS_FAILED.value: (
        "the server (automatic quarantine: workers failed on it while the other nodes' did not)"
    ),
}

#: A host-local failure: when (server clock), its lead in seconds (None: no other node of its
#: round failed), and its first line.
HostFailure = tuple[float, float | None, str]


class CordonTable:
    def __init__(self) -> None:
        self.cordons: dict[str, Cordon] = {}
        self.deaths: OrderedDict[str, deque[float]] = OrderedDict()  # least recent death first
        self.failures: OrderedDict[str, deque[HostFailure]] = OrderedDict()  # least recent failure first
        self.next_end: float | None = None  # no timed cordon ends before it (prune is O(1) until then)

    def __len__(self) -> int:
        return len(self.cordons)

    def cordon(self, host: str, now: float, duration: float | None, reason: str, by: str) -> Cordon:
        until = None if duration is None else now + duration
        cordon = self.cordons[host] = Cordon(host, now, until, reason, by)
        if until is not None and (self.next_end is None or until < self.next_end):
            self.next_end = until
        return cordon

    def full(self, host: str) -> bool:
        """Whether a new cordon of ``host`` would exceed :data:`MAX_CORDONS`."""
        return host not in self.cordons and len(self.cordons) >= MAX_CORDONS

    def uncordon(self, host: str) -> Cordon | None:
        """Lift ``host``'s cordon; returns it (None: it had none)."""
        return self.cordons.pop(host, None)

    def active(self, host: str, now: float) -> Cordon | None:
        cordon = self.cordons.get(host)
        return cordon if cordon is not None and cordon.active(now) else None

    def match(self, now: float, *names: str) -> Cordon | None:
        """The cordon in effect on a node known by ``names`` (its address, its host name)."""
        for name in names:
            if name:
                cordon = self.active(name, now)
                if cordon is not None:
                    return cordon
        return None

    def listing(self, now: float) -> list[Cordon]:
        """The cordons in effect, by host."""
        return [c for _, c in sorted(self.cordons.items()) if c.active(now)]

    def prune(self, now: float) -> list[Cordon]:
        """Drop the timed cordons that ended; returns them. O(1) before ``next_end``, then O(cordons)."""
        if self.next_end is None or now < self.next_end:
            return []
        ended = [c for c in self.cordons.values() if not c.active(now)]
        for c in ended:
            del self.cordons[c.host]
        self.next_end = min((c.until for c in self.cordons.values() if c.until is not None), default=None)
        return ended

    def record_death(self, host: str, now: float) -> None:
        times = self.deaths.get(host)
        if times is None:
            times = self.deaths[host] = deque(maxlen=MAX_DEATHS_PER_HOST)
        times.append(now)
        self.deaths.move_to_end(host)
        while len(self.deaths) > MAX_HOSTS:
            self.deaths.popitem(last=False)

    def deaths_within(self, host: str, now: float, window: float) -> int:
        """How many deaths of ``host``'s nodes happened in ``(now - window, now]``."""
        times = self.deaths.get(host, ())
        return sum(1 for t in times if now - window < t <= now)

    def forget_deaths(self, host: str) -> None:
        """A host quarantined for its deaths starts afresh: the same deaths do not cordon it again."""
        self.deaths.pop(host, None)

    def record_failure(self, host: str, now: float, lead: float | None, message: str) -> None:
        """A round gave way because ``host``'s node failed first (by ``lead`` s, None: alone)."""
        kept = self.failures.get(host)
        if kept is None:
            kept = self.failures[host] = deque(maxlen=MAX_DEATHS_PER_HOST)
        kept.append((now, lead, message))
        self.failures.move_to_end(host)
        while len(self.failures) > MAX_HOSTS:
            self.failures.popitem(last=False)

    def failures_within(self, host: str, now: float, window: float, lead: float) -> list[str]:
        """The first lines of ``host``'s failures in ``(now - window, now]`` that led every other
        node of their round by at least ``lead`` s (or that no other node shared), oldest first."""
        kept = self.failures.get(host, ())
        return [m for t, led, m in kept if now - window < t <= now and (led is None or led >= lead)]

    def forget_failures(self, host: str) -> None:
        """A host quarantined for its failures starts afresh, as :meth:`forget_deaths`."""
        self.failures.pop(host, None)

    # -- snapshot -------------------------------------------------------------------------

    def to_snapshot(self) -> dict[str, Any]:
        return {
            "cordons": [[c.host, c.since, c.until, c.reason, c.by] for c in self.cordons.values()],
            "deaths": [[host, list(times)] for host, times in self.deaths.items()],
            "failures": [[host, [list(f) for f in kept]] for host, kept in self.failures.items()],
        }

    @classmethod
    def from_snapshot(cls, data: dict[str, Any] | None) -> CordonTable:
        table = cls()
        if data:
            for host, since, until, reason, by in data["cordons"]:
                table.cordons[host] = Cordon(host, since, until, reason, by)
            table.next_end = min((c.until for c in table.cordons.values() if c.until is not None), default=None)
            for host, times in data["deaths"]:
                table.deaths[host] = deque(times, maxlen=MAX_DEATHS_PER_HOST)
            for host, kept in data.get("failures", ()):  # (snapshots before issue 27 have none)
                table.failures[host] = deque(((t, lead, m) for t, lead, m in kept), maxlen=MAX_DEATHS_PER_HOST)
        return table
