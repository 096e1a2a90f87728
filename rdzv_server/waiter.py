"""Parked long-polls: who waits for what, and waking exactly them.

What it owns: :class:`Waiters`, the futures of parked long-polls keyed by topic (a key, a
job's round, its watch view, its timeline: ``core.machine``'s ``*_topic``). The service
wakes the topics an applied, durable command names; a woken poll checks its condition
again and parks again if it still does not hold, so a spurious wake costs a check, never a
wrong answer. :meth:`Waiters.fail_all` answers every parked poll at once (shutdown, a
step-down) and refuses new ones until :meth:`Waiters.reopen`.

Rules: a poll is parked on every topic its condition depends on, registered before it
parks and removed when it ends, however it ends (answered, timed out, cancelled); every
wait is bounded by its hold, measured by the service's :class:`~.clock.Clock` (the loop's
timer only wakes a poll to look at the clock again; :meth:`Waiters.recheck` does too, after a
fake clock moved).

What it must not know: what the topics mean, the state machine, the log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

from .clock import Clock

T = TypeVar("T")


def _hold_over(fut: asyncio.Future[None]) -> None:
    """A long-poll's hold is over: wake it (it re-checks, then answers "not yet")."""
    if not fut.done():
        fut.set_result(None)


class Waiters:
    """Parked long-polls, keyed by topic; a write wakes exactly the topics it touched."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._by_topic: dict[Hashable, set[asyncio.Future[None]]] = {}
        self._closed: BaseException | None = None
        # The loop the polls park on, looked up once: asyncio.get_running_loop() costs a getpid()
        # system call per call on Python 3.11 (4% of the server's CPU in a 16,384-node re-formation).
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return sum(len(s) for s in self._by_topic.values())

    def reopen(self) -> None:
        """Park long-polls again after :meth:`fail_all` (a replica that leads again)."""
        self._closed = None

    def wake(self, topics: Iterable[Hashable]) -> None:
        for topic in topics:
            for fut in self._by_topic.pop(topic, ()):
                if not fut.done():
                    fut.set_result(None)

    def recheck(self) -> None:
        """Wake every parked poll: each checks its condition and its hold again (a fake clock moved)."""
        for futs in self._by_topic.values():
            for fut in futs:
                if not fut.done():
                    fut.set_result(None)

    def fail_all(self, exc: BaseException) -> None:
        self._closed = exc
        for futs in self._by_topic.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(exc)
        self._by_topic.clear()

    async def wait_for(
        self, check: Callable[[], T | None], topics: Callable[[], Iterable[Hashable]], hold: float
    ) -> T | None:
        """Return ``check()`` once it is not None, re-checking on every wake; None after ``hold`` s."""
        loop = self._loop
        if loop is None or not loop.is_running():
            loop = self._loop = asyncio.get_running_loop()
        clock = self._clock
        deadline = clock.monotonic() + hold
        while True:
            value = check()
            if value is not None:
                return value
            remaining = deadline - clock.monotonic()
            if remaining <= 0:
                return None
            if self._closed is not None:
                raise self._closed
            fut: asyncio.Future[None] = loop.create_future()
            registered = list(topics())
            for topic in registered:
                self._by_topic.setdefault(topic, set()).add(fut)
            # A timer that resolves the future, not asyncio.wait_for: thousands of watches end
            # by their hold, and wait_for's TimeoutError (raised, caught, its cancel awaited)
            # cost more than the rest of a heartbeat's wait.
            timer = loop.call_later(remaining, _hold_over, fut)
            try:
                await fut
            finally:
                timer.cancel()
                for topic in registered:
                    futs = self._by_topic.get(topic)
                    if futs is not None:
                        futs.discard(fut)
                        if not futs:
                            del self._by_topic[topic]
