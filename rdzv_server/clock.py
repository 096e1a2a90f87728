"""The clock seam: where the service reads the time.

What it owns: :class:`Clock`, the one thing the service asks for the time, and
:data:`SYSTEM_CLOCK`, the real one (``time.monotonic``). Tests pass their own (a fake clock
they advance) to drive deadlines without sleeping; nothing patches ``time``.

The server clock itself (monotonic across restarts, resumed from the last logged time) is
the service's; this is only the source of elapsed seconds under it. ``core/`` never reads a
clock: the time is an argument there.

What it must not know: the service, the rendezvous rules.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """A monotonic source of seconds (any origin; only differences matter)."""

    def monotonic(self) -> float: ...


class SystemClock:
    """The real clock: ``time.monotonic()``."""

    __slots__ = ()

    # The C function itself: the service reads the clock on every write.
    monotonic = staticmethod(time.monotonic)


SYSTEM_CLOCK: Clock = SystemClock()
