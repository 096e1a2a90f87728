"""What the service's rooms share: the state they read and write, and the server clock.

What it owns: :class:`ServiceState`, the base of :class:`~.service.Service`: the one
:class:`StateMachine` (``machine``), parked long-polls (``waiters``), the part the server
plays (``part``), its flags (``ready``, ``recovered``, ``stopping``), what it tells the
outside (``on_events``, ``on_detected``, ``on_fatal``) and the server clock (:meth:`now`).

Rules:
- The rooms (:mod:`.commit`, :mod:`.timer`, :mod:`.liveness`, :mod:`.lifecycle`) take this
  state, and the rooms below them, as arguments; none imports the service, so the service
  sits above its rooms and the imports have no circle.
- Elapsed time is read only from the :class:`~.clock.Clock` given.

What it must not know: the rooms, HTTP, the wire format, etcd.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

from .clock import Clock
from .config import ServerConfig
from .core import decision
from .core.event import JobEvent
from .core.machine import StateMachine
from .role import Role
from .waiter import Waiters


class ServiceState:
    """The state the service's rooms share (see the module docstring)."""

    #: The part it plays (the service sets it once its commit pipeline exists; start() may take another).
    part: Role

    def __init__(self, config: ServerConfig, make_role: Callable[[], Role] | None, clock: Clock) -> None:
        """``make_role`` makes this server's replica role (``--etcd``), None for the one server;
        ``clock`` is where elapsed time is read."""
        self.config = config
        self.make_role = make_role
        self.clock = clock
        # Fresh machines for the live state, recovery and snapshot builds, all made alike; a
        # partial of the class pickles, so a snapshot builder process can use it. No limits
        # until recovery is done: a logged command applies again whatever today's limits.
        self.new_machine = functools.partial(
            StateMachine,
            max_value_bytes=config.max_value_bytes,
            job_ttl=config.job_ttl,
            session_ttl=config.session_ttl,
        )
        self.machine = self.new_machine()
        self.waiters = Waiters(clock)
        self.quarantine_policy = decision.QuarantinePolicy(
            config.quarantine_after, config.quarantine_window, config.quarantine_for,
            config.quarantine_failures, config.quarantine_failure_lead,
        )
        self.ready = False  # serving operations (the leader, or the one server)
        self.recovered = False  # a state machine is installed (a replica may follow)
        self.stopping = False  # shutting down: nothing is served any more
        self.started_at = time.time()
        self.bound_port: int | None = None  # the port listened on (server.py sets it before start)
        self.recovered_records = 0
        self.recovery_seconds = 0.0
        self._clock_base = 0.0
        self._mono_base = clock.monotonic()
        #: Told what each applied command added to its job's timeline, once it is durable (metrics).
        self.on_events: Callable[[tuple[JobEvent, ...]], None] = lambda events: None
        #: Told how long a node's death took to notice, by cause, when the server marks it dead.
        self.on_detected: Callable[[str, float], None] = lambda cause, seconds: None
        #: Called once when the server must stop (the log failed); server.py exits non-zero.
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.fatal_error: BaseException | None = None

    def now(self) -> float:
        """The server clock: seconds, monotonic, resumed across restarts from the last logged time."""
        return self._clock_base + (self.clock.monotonic() - self._mono_base)

    def resume_clock(self, at: float) -> None:
        """Have the server clock go on from ``at`` (the last logged time) from this instant."""
        self._clock_base = at
        self._mono_base = self.clock.monotonic()
