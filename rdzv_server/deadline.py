"""The timer's schedule: each job's next wake-up, earliest first.

What it owns: :class:`Deadlines`, a heap of ``(deadline, rdzv_id)`` with at most one live
wake-up per job, and the event that tells the timer its earliest wake-up moved earlier.
The service's timer sleeps until :meth:`Deadlines.earliest` (or until told), takes what
:meth:`Deadlines.due` gives, and asks the state machine what is due for each job; what
it decides is applied as ordinary commands. Times are the server clock's.

Rules: a job's wake-up only moves earlier (:meth:`Deadlines.wake_at` keeps an earlier one:
when it fires the service computes the job's next deadline afresh); superseded heap entries
are dropped as they surface, so the heap holds at most one stale entry per reschedule.

What it must not know: the clock, the state machine, asyncio beyond its one event.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Iterator


class Deadlines:
    """Each job's next wake-up; see the module docstring."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._at: dict[str, float] = {}
        #: Set when the earliest wake-up moved earlier (or someone wants the timer to look again).
        self.changed = asyncio.Event()

    def __contains__(self, rdzv_id: str) -> bool:
        """Whether the job has a wake-up pending."""
        return rdzv_id in self._at

    def clear(self) -> None:
        self._heap.clear()
        self._at.clear()

    def wake_at(self, rdzv_id: str, deadline: float) -> None:
        """Wake for the job at ``deadline``, unless an earlier wake-up is pending."""
        current = self._at.get(rdzv_id)
        if current is not None and current <= deadline:
            return  # an earlier wake-up is pending; it reschedules when it fires
        self._at[rdzv_id] = deadline
        heapq.heappush(self._heap, (deadline, rdzv_id))
        if self._heap[0] == (deadline, rdzv_id):
            self.changed.set()

    def earliest(self) -> float | None:
        """The earliest wake-up (perhaps a superseded one: waking early is harmless)."""
        return self._heap[0][0] if self._heap else None

    def due(self, now: float) -> Iterator[str]:
        """The jobs whose wake-up is at or before ``now``, each once, their wake-ups removed."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, rdzv_id = heapq.heappop(heap)
            if self._at.get(rdzv_id) != deadline:
                continue  # superseded by an earlier one that already ran
            del self._at[rdzv_id]
            yield rdzv_id
