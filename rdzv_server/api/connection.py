"""Every connection on the server's one port, whatever it speaks: its limits and deadlines.

What it owns:
- :class:`ConnectionTable`: the open connections (undecided, stream, HTTP) against
  ``--max-connections``, the bytes of partly received requests held over all of them
  against ``--max-buffered-bytes`` (and, of those, the bytes of connections not yet
  authenticated against ``--max-pre-auth-bytes``), what to shed when a limit is reached, and
  the counters ``/metrics`` shows;
- :class:`TrackedConnection`: what a stream or HTTP connection tells the table, and its one
  timer, which enforces ``--idle-timeout``, ``--read-timeout`` and ``--auth-timeout``;
- :class:`Closing`: the last seconds of a refused connection (answer, half-close, drain, close);
- :class:`LogThrottle`: one source of warnings that hostile clients cannot turn into a flood.

Rules:
- A connection is counted from accept to close. A newcomer at the limit makes room by
  shedding, in this order: an undecided connection that never spoke (oldest first), an idle
  one (nothing in flight, nothing received; least recently active first), one whose request
  has been arriving for over :data:`SLOW_READ` seconds (oldest first, answered
  ``too_many_connections``). A connection with a request in flight (a node's watch) is never
  shed. If nothing can be shed the newcomer is answered ``too_many_connections`` in the
  protocol its first byte names, then closed.
- Bytes are charged before they are buffered and released when their request is served or
  the connection closes. Bytes that would pass the budget shed the largest holder if it holds
  more than the receiving connection would, else the receiving connection is refused
  ``buffers_full``; either way the refused connection's bytes are released at once.
- Idle: no request in flight, nothing partly received and no byte received for
  ``idle_timeout`` -> closed silently (clients reconnect). Read: a request (HTTP headers and
  body) or a stream frame not whole ``read_timeout`` after its first byte -> ``request_timeout``
  and closed. Both run on one lazily re-armed timer per connection, never one per request; the
  hot path only stores a time.
- Before authentication (README "Security"): a connection is a stranger's until it shows a
  valid token (a stream's hello; an HTTP request head with ``Authorization: Bearer`` and a
  token), then a token holder's for its life; with auth off every connection is a token
  holder's. A stranger's bytes are also charged to the pre-authentication share; bytes that
  would pass it shed the stranger holding the most if it holds more than the receiving
  connection would, else the receiving connection is refused ``buffers_full``, so strangers
  never hold more than the share and a real client's small hello or head still gets in. A
  stranger's idle and read deadlines are ``auth_timeout`` when that is shorter, and a stream
  must say its hello within ``auth_timeout`` of its first byte (else ``request_timeout``).
- Time is the table's :class:`Timers` (the event loop in the server): the rules read it once
  per event and take it as ``now`` (:meth:`ConnectionTable.admit`,
  :meth:`TrackedConnection.check_deadlines`), so tests drive them with a fake clock.
- Every HTTP answer written here carries the app's security headers (``header.py``).
- Refusals are answered, then the connection is half-closed and its input drained for
  :data:`LINGER` seconds, so the client reads the answer instead of a reset. Over TLS, which
  cannot half-close, the answer is followed by TLS's close (close_notify), and the TLS layer
  drains until the client's close_notify or its shutdown timeout (``server.py``).

What it must not know: the operations, the service, the stream framing (``stream.py``
implements :class:`TrackedConnection`'s hooks), aiohttp (``aiohttp_seam.py`` implements them
for HTTP; HTTP heads are ``head.py``'s).
"""

from __future__ import annotations

import abc
import asyncio
import heapq
import logging
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import ClassVar, Protocol, cast

from rdzv_client import wire

from .header import security_headers

log = logging.getLogger("rdzv_server.api")

# How long a refused connection keeps draining the client's bytes after its answer, so that
# closing it sends a FIN after the answer instead of a reset that may discard it.
LINGER = 2.0
# Connections lingering (or waiting for a first byte to learn how to refuse) at once; beyond
# it refusals close at once. Bounds the descriptors refusals use beyond --max-connections.
MAX_CLOSING = 128
# Descriptors kept beyond --max-connections: the log's files, the listening sockets and
# MAX_CLOSING refusals in progress. The limit is clamped to the open-files limit minus this.
FD_RESERVE = 256
# A request still arriving after this long is slow: at the connection limit it may be shed.
SLOW_READ = 1.0
# Shed candidates found by one scan of the connections; the scan is O(connections), so one
# scan serves this many newcomers at the limit.
SHED_SCAN = 256
# After a scan found nothing to shed (every connection busy), newcomers are refused without
# another scan for this long: a flood at the limit must not cost a full scan per connection.
RESCAN_PAUSE = 1.0
# Warnings about misbehaving clients: this many lines per interval, then one summary line.
LOG_INTERVAL = 10.0
LOG_BURST = 5
# Undecided connections that never spoke, then stream and HTTP ones (``protocol`` values).
PROTOCOLS = ("undecided", "stream", "http")
#: Why connections were closed by the server (``rdzv_connections_shed_total{reason}``).
SHED_REASONS = ("idle_timeout", "read_timeout", "auth_timeout", "buffers_full", "connection_limit")


class Timer(Protocol):
    """A scheduled call (asyncio's ``TimerHandle``)."""

    def cancel(self) -> None: ...

    def when(self) -> float: ...


class Timers(Protocol):
    """Where the table and its connections read the time and schedule their deadlines: the
    event loop in the server (``loop.time()``, ``loop.call_at``), a fake clock in tests."""

    def time(self) -> float: ...

    def call_at(self, when: float, callback: Callable[[], object]) -> Timer: ...


class LogThrottle:
    """Log at most ``burst`` lines per ``interval`` seconds; count the rest and say how many.

    The summary line is logged by a loop timer at the end of an interval in which lines were
    suppressed, so a flood costs one timer per interval, not one line per event.
    """

    def __init__(
        self, logger: logging.Logger, timers: Timers, *, interval: float = LOG_INTERVAL, burst: int = LOG_BURST
    ) -> None:
        self._logger = logger
        self._timers = timers
        self._interval = interval
        self._burst = burst
        self._window_end = 0.0
        self._logged = 0
        self._suppressed = 0
        self._summary: Timer | None = None

    def warning(self, msg: str, *args: object) -> None:
        now = self._timers.time()
        if now >= self._window_end:
            self._window_end = now + self._interval
            self._logged = 0
        if self._logged < self._burst:
            self._logged += 1
            self._logger.warning(msg, *args)
            return
        self._suppressed += 1
        if self._summary is None:
            self._summary = self._timers.call_at(self._window_end, self._summarize)

    def _summarize(self) -> None:
        self._summary = None
        if self._suppressed:
            self._logger.warning(
                "... and %d more like it in the last %g s (suppressed).", self._suppressed, self._interval
            )
            self._suppressed = 0


class Sheddable(Protocol):
    """What the table asks of an undecided connection."""

    def close(self) -> None: ...


class ConnectionTable:
    """The connections of one server; see the module rules. One event loop uses it."""

    def __init__(
        self,
        *,
        timers: Timers,
        max_connections: int,
        max_buffered_bytes: int,
        idle_timeout: float,
        read_timeout: float,
        max_pre_auth_bytes: int,
        max_head_bytes: int,
        auth_timeout: float | None,
    ) -> None:
        """``auth_timeout`` None: auth is off, and every connection is a token holder's.
        ``timers``: the clock of every time the table and its connections store (the loop's)."""
        self.timers = timers
        self.max_connections = max_connections
        self.max_buffered_bytes = max_buffered_bytes
        self.idle_timeout = idle_timeout
        self.read_timeout = read_timeout
        self.max_pre_auth_bytes = max_pre_auth_bytes
        self.max_head_bytes = max_head_bytes
        self.auth_timeout = auth_timeout
        self.undecided: dict[Sheddable, None] = {}  # oldest first
        self.open: dict[TrackedConnection, None] = {}
        self.by_protocol: dict[str, int] = {"stream": 0, "http": 0}
        self.buffered = 0
        self.pre_auth_buffered = 0  # of buffered: held by connections not yet authenticated
        self.closing = 0  # Closing protocols alive (lingering refusals)
        self.shed_total: dict[str, int] = dict.fromkeys(SHED_REASONS, 0)
        self.rejected_total: dict[str, int] = {}
        self.refusals = LogThrottle(log, timers)
        self.limit_log = LogThrottle(log, timers, burst=1)
        self._holders: set[TrackedConnection] = set()
        self._strangers: set[TrackedConnection] = set()  # the holders not yet authenticated
        self._candidates: list[tuple[TrackedConnection, float, bool]] = []  # best last
        self._rescan_at = 0.0

    @property
    def count(self) -> int:
        return len(self.undecided) + len(self.open)

    # -- connections ------------------------------------------------------------------------

    def admit(self, conn: Sheddable, now: float) -> bool:
        """Count a new connection, arrived at ``now``, shedding another at the limit. False:
        refuse the newcomer."""
        if self.count >= self.max_connections and not self._make_room(now):
            self.rejected(wire.ErrorCode.TOO_MANY_CONNECTIONS)
            self._log_limit("refused a new connection (nothing idle to shed)")
            return False
        self.undecided[conn] = None
        return True

    def decided(self, conn: Sheddable) -> None:
        """An undecided connection spoke (it is registered again by its protocol) or closed."""
        self.undecided.pop(conn, None)

    def register(self, conn: TrackedConnection) -> None:
        self.open[conn] = None
        self.by_protocol[conn.protocol] += 1

    def unregister(self, conn: TrackedConnection) -> None:
        if self.open.pop(conn, False) is None:
            self.by_protocol[conn.protocol] -= 1
        if conn.held:
            self.release(conn, conn.held)

    def shed(self, reason: str) -> None:
        self.shed_total[reason] += 1

    def rejected(self, code: wire.ErrorCode) -> None:
        self.rejected_total[code.value] = self.rejected_total.get(code.value, 0) + 1

    def _make_room(self, now: float) -> bool:
        if self.undecided:
            oldest = next(iter(self.undecided))
            self.undecided.pop(oldest)
            oldest.close()
            self.shed("connection_limit")
            self._log_limit("closed a connection that had not spoken")
            return True
        victim = self._victim(now)
        if victim is None:
            return False
        conn, slow = victim
        self.shed("connection_limit")
        if slow:
            conn.shed(
                wire.ErrorCode.TOO_MANY_CONNECTIONS, "the server is at its connection limit and this request was slow"
            )
            self._log_limit(f"shed {conn.article} connection whose request was slow")
        else:
            conn.shed(None, "")
            self._log_limit(f"closed an idle connection ({conn.protocol})")
        self.unregister(conn)  # counted out now, though its descriptor closes on the next loop pass
        return True

    def _victim(self, now: float) -> tuple[TrackedConnection, bool] | None:
        """The next connection to shed (and whether it is slow rather than idle), or None."""
        while True:
            while self._candidates:
                conn, stamp, slow = self._candidates.pop()
                if conn in self.open and not conn.busy():
                    if slow and conn.reading_since == stamp:
                        return conn, True
                    if not slow and conn.reading_since is None and not conn.held and conn.last_active == stamp:
                        return conn, False
            if now < self._rescan_at:
                return None
            found = heapq.nsmallest(SHED_SCAN, self._scan(now - SLOW_READ))
            if not found:
                self._rescan_at = now + RESCAN_PAUSE
                return None
            self._candidates = [(conn, stamp, bool(slow)) for slow, stamp, _, conn in reversed(found)]

    def _scan(self, slow_before: float) -> Iterator[tuple[int, float, int, TrackedConnection]]:
        for conn in self.open:
            if conn.busy():
                continue
            if conn.reading_since is None:
                if not conn.held:
                    yield (0, conn.last_active, id(conn), conn)
            elif conn.reading_since < slow_before:
                yield (1, conn.reading_since, id(conn), conn)

    def _log_limit(self, what: str) -> None:
        self.limit_log.warning(
            "At the connection limit (%d): %s; %d shed and %d refused so far (raise --max-connections or the open-files limit if clients are legitimate).",
            self.max_connections,
            what,
            self.shed_total["connection_limit"],
            self.rejected_total.get(wire.ErrorCode.TOO_MANY_CONNECTIONS.value, 0),
        )

    # -- buffered bytes ----------------------------------------------------------------------

    def charge(self, conn: TrackedConnection, n: int) -> bool:
        """Charge ``n`` more bytes held by ``conn`` (see the module rules). False: they would
        pass a budget, and ``conn`` has been refused ``buffers_full`` and closed."""
        stranger = not conn.trusted
        over_share = stranger and self.pre_auth_buffered + n > self.max_pre_auth_bytes
        if over_share and not self._make_buffer_room(conn, n, True):
            self._refuse_bytes(conn, True)
            return False
        if self.buffered + n > self.max_buffered_bytes and not self._make_buffer_room(conn, n, False):
            self._refuse_bytes(conn, False)
            return False
        if not conn.held:
            self._holders.add(conn)
            if stranger:
                self._strangers.add(conn)
        conn.held += n
        self.buffered += n
        if stranger:
            self.pre_auth_buffered += n
        return True

    def release(self, conn: TrackedConnection, n: int) -> None:
        conn.held -= n
        self.buffered -= n
        if not conn.trusted:
            self.pre_auth_buffered -= n
        if not conn.held:
            self._holders.discard(conn)
            self._strangers.discard(conn)

    def trust(self, conn: TrackedConnection) -> None:
        """``conn`` has shown a valid token: from now on its bytes are a token holder's."""
        if conn.trusted:
            return
        conn.trusted = True
        self.pre_auth_buffered -= conn.held
        self._strangers.discard(conn)

    def _make_buffer_room(self, conn: TrackedConnection, n: int, pre_auth: bool) -> bool:
        """Shed the largest holders (strangers only, for the pre-authentication share) while one
        holds more than ``conn`` would."""
        holders = self._strangers if pre_auth else self._holders
        limit = self.max_pre_auth_bytes if pre_auth else self.max_buffered_bytes
        while (self.pre_auth_buffered if pre_auth else self.buffered) + n > limit:
            victim = max(holders, key=_held, default=None)
            if victim is None or victim is conn or victim.held <= conn.held + n:
                return False
            self.shed("buffers_full")
            self.rejected(wire.ErrorCode.BUFFERS_FULL)
            self.refusals.warning(
                "Shed %s connection holding %d bytes of a partly received request: %s.",
                victim.article,
                victim.held,
                self._full(pre_auth),
            )
            victim.shed(wire.ErrorCode.BUFFERS_FULL, self._full_message(pre_auth))
            self.unregister(victim)
        return True

    def _refuse_bytes(self, conn: TrackedConnection, pre_auth: bool) -> None:
        """``conn`` could not be charged: count it, log it, answer it ``buffers_full``."""
        self.shed("buffers_full")
        self.rejected(wire.ErrorCode.BUFFERS_FULL)
        self.refusals.warning("Refused %s connection's request: %s.", conn.article, self._full(pre_auth))
        conn.shed(wire.ErrorCode.BUFFERS_FULL, self._full_message(pre_auth))
        self.unregister(conn)

    def _full(self, pre_auth: bool) -> str:
        if pre_auth:
            return (
                "the share of the buffers for connections that have not shown a token is full "
                f"(--max-pre-auth-bytes {self.max_pre_auth_bytes})"
            )
        limit = self.max_buffered_bytes
        return f"the server's buffers for partly received requests are full (--max-buffered-bytes {limit})"

    def _full_message(self, pre_auth: bool) -> str:
        if pre_auth:
            return (
                "the server's buffers for connections that have not yet shown a token are full "
                f"({self.max_pre_auth_bytes} bytes); retry shortly"
            )
        return buffers_full_message(self.max_buffered_bytes)


def _held(conn: TrackedConnection) -> int:
    return conn.held


def buffers_full_message(limit: int) -> str:
    return f"the server's buffers for partly received requests are full ({limit} bytes); retry shortly"


class TrackedConnection(abc.ABC):
    """A stream or HTTP connection as the table sees it, with its one deadline timer.

    Subclasses call :meth:`track` when connected and :meth:`untrack` when closed (both
    idempotent), store ``last_active`` when bytes arrive or a request finishes (read from
    :attr:`timers`, the table's clock: one time base for every stored time), call
    :meth:`start_reading` at the first byte of a request or frame and clear
    ``reading_since`` when it is whole, ask the table to :meth:`~ConnectionTable.trust` them
    once they have shown a valid token, and implement :meth:`busy`, :meth:`shed` and
    :meth:`reading_counts`.
    """

    protocol: ClassVar[str]
    #: How log lines name it ("a stream connection").
    article: ClassVar[str]
    #: What a stranger of this protocol must show within ``auth_timeout`` of its first byte
    #: (None: nothing as a whole; each request head has its read deadline shortened instead).
    must_authenticate: ClassVar[str | None] = None
    last_active: float = 0.0
    reading_since: float | None = None
    held: int = 0
    #: Has shown a valid token (or auth is off): its bytes are not a stranger's.
    trusted: bool = False
    #: The table counting it and the table's clock (set by :meth:`track`).
    table: ConnectionTable
    timers: Timers
    _deadline: Timer | None = None
    _auth_due: float | None = None

    def track(self, table: ConnectionTable) -> None:
        """Count this connection in ``table`` from now (the table's clock)."""
        timers = table.timers
        now = timers.time()
        self.table = table
        self.timers = timers
        self.last_active = now
        self.reading_since = None
        self.held = 0
        self.trusted = table.auth_timeout is None
        due = now + self._limits()[0]
        if not self.trusted and self.must_authenticate is not None and table.auth_timeout is not None:
            self._auth_due = now + table.auth_timeout
            due = min(due, self._auth_due)
        self._deadline = timers.call_at(due, self._on_deadline)
        table.register(self)

    def untrack(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.table.unregister(self)

    @abc.abstractmethod
    def busy(self) -> bool:
        """Whether a request is in flight (being served: not idle, never shed)."""

    @abc.abstractmethod
    def shed(self, code: wire.ErrorCode | None, message: str) -> None:
        """Close now: silently if ``code`` is None, else after answering it with ``message``."""

    def reading_counts(self) -> bool:
        """Whether the request being read is late by the client's doing (not held back by us)."""
        return True

    def _limits(self) -> tuple[float, float]:
        """The idle and read timeouts that apply now: a stranger's are cut to ``auth_timeout``."""
        table = self.table
        if self.trusted or table.auth_timeout is None:
            return table.idle_timeout, table.read_timeout
        return min(table.idle_timeout, table.auth_timeout), min(table.read_timeout, table.auth_timeout)

    def start_reading(self, now: float) -> None:
        self.reading_since = now
        due = now + self._limits()[1]
        timer = self._deadline
        if timer is not None and timer.when() > due:
            timer.cancel()
            self._deadline = self.timers.call_at(due, self._on_deadline)

    def _on_deadline(self) -> None:
        self._deadline = None
        self.check_deadlines(self.timers.time())

    def check_deadlines(self, now: float) -> None:
        """Apply the idle, read and authentication deadlines at ``now``: shed this connection
        if one has passed, else schedule the next look (one timer per connection)."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        table = self.table
        if self not in table.open:
            return
        idle, read = self._limits()
        stranger = not self.trusted and table.auth_timeout is not None
        if stranger and self._auth_due is not None and now >= self._auth_due:
            self._late(
                "auth_timeout",
                f"it sent no {self.must_authenticate} with a valid token within %g s of its first byte "
                "(--auth-timeout)",
                f"no {self.must_authenticate} within {table.auth_timeout:g} s of the connection's first byte "
                "(--auth-timeout)",
            )
            return
        if self.reading_since is not None and self.reading_counts():
            due = self.reading_since + read
            if now >= due:
                if read < table.read_timeout:  # a stranger's head, cut short by --auth-timeout
                    self._late(
                        "auth_timeout",
                        "its request did not arrive whole within %g s, and it has not shown a token (--auth-timeout)",
                        f"the request did not arrive whole within {read:g} s of its first byte (--auth-timeout: "
                        "the time a connection gets to show its token)",
                    )
                else:
                    self._late(
                        "read_timeout",
                        "its request did not arrive whole within %g s (--read-timeout)",
                        f"the request did not arrive whole within {read:g} s of its first byte",
                    )
                return
        elif self.reading_since is None and not self.busy():
            due = self.last_active + idle
            if now >= due:
                table.shed("idle_timeout")
                self.shed(None, "")
                self.untrack()
                return
        else:  # serving a request, or reading one we hold back: look again later
            due = now + min(idle, read)
        if stranger and self._auth_due is not None:
            due = min(due, self._auth_due)
        self._deadline = self.timers.call_at(due, self._on_deadline)

    def _late(self, reason: str, what: str, message: str) -> None:
        """Close with ``request_timeout``: ``what`` (a %g stands for the limit) logged, ``message`` answered."""
        table = self.table
        table.shed(reason)
        table.rejected(wire.ErrorCode.REQUEST_TIMEOUT)
        limit = table.auth_timeout if reason == "auth_timeout" else table.read_timeout
        table.refusals.warning(f"Closed %s connection: {what}.", self.article, limit)
        self.shed(wire.ErrorCode.REQUEST_TIMEOUT, message)
        self.untrack()


# --------------------------------------------------------------------------- refusals


# The security headers of a JSON answer, as header lines (an answer written below the app).
_HARDENING = "".join(f"{name}: {value}\r\n" for name, value in security_headers(False).items())


def http_error(code: wire.ErrorCode, message: str) -> bytes:
    """A whole HTTP/1.1 error response (JSON body, the security headers, ``Connection:
    close``) as bytes."""
    status = wire.HTTP_STATUS[code]
    body = wire.dump_json(wire.error_body(code, message))
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {wire.CONTENT_TYPE_JSON}\r\n"
        f"Content-Length: {len(body)}\r\n{_HARDENING}Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


def stream_error(code: wire.ErrorCode, message: str) -> bytes:
    """A stream error frame with tag 0 (it answers the connection, not one request)."""
    return wire.frame([0, wire.HTTP_STATUS[code], wire.error_body(code, message)])


class Closing(asyncio.Protocol):
    """The last seconds of a connection the server refused (see the module rules).

    With ``reply`` it is written at once; without, the first bytes say which protocol the
    client speaks and the refusal (``code``, ``message``) is answered in it. Then our side is
    half-closed, what the client still sends is discarded, and the connection is closed at its
    EOF or after :data:`LINGER` seconds.
    """

    def __init__(self, table: ConnectionTable, code: wire.ErrorCode, message: str, reply: bytes | None = None) -> None:
        self._table = table
        self._code = code
        self._message = message
        self._reply = reply
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def adopt(self, transport: asyncio.BaseTransport) -> None:
        """Take over a connected transport from its current protocol."""
        transport.set_protocol(self)
        self.connection_made(transport)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        if self._table.closing >= MAX_CLOSING:  # too many at once: no courtesy left
            if self._reply is not None:
                self._transport.write(self._reply)
                self._transport.close()
            else:
                self._transport.abort()
            return
        self._table.closing += 1
        self._timer = asyncio.get_running_loop().call_later(LINGER, self._transport.close)
        if self._reply is not None:
            self._answer(self._reply)
        else:
            self._transport.resume_reading()  # a protocol handing over may have paused it

    def data_received(self, data: bytes) -> None:
        if self._reply is None and data and self._transport is not None:
            if data[:1] == b"\x00":
                self._reply = stream_error(self._code, self._message)
            else:
                self._reply = http_error(self._code, self._message)
            self._answer(self._reply)

    def _answer(self, reply: bytes) -> None:
        transport = self._transport
        assert transport is not None
        transport.write(reply)
        transport.resume_reading()  # drain, whatever the previous protocol paused
        if transport.can_write_eof():
            transport.write_eof()
        else:
            # TLS has no half-close (write_eof is not supported): its close_notify is the
            # nearest thing. Closing flushes the answer, sends close_notify and reads (and
            # discards) what the client still sends until its own close_notify, for the
            # server's ssl_shutdown_timeout: the same courtesy, done by the TLS layer.
            transport.close()

    def eof_received(self) -> bool | None:
        return None  # the client is done: close (after what we wrote is flushed)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._table.closing -= 1
        self._transport = None
