"""Every connection on the server's one port, whatever it speaks: its limits and deadlines.

What it owns:
- :class:`ConnectionTable`: the open connections (undecided, stream, HTTP) against
  ``--max-connections``, the bytes of partly received requests held over all of them
  against ``--max-buffered-bytes``, what to shed when either is reached, and the counters
  ``/metrics`` shows;
- :class:`TrackedConnection`: what a stream or HTTP connection tells the table, and its one
  timer, which enforces ``--idle-timeout`` and ``--read-timeout``;
- :class:`HttpConnection`: aiohttp's ``RequestHandler`` with that accounting, the read
  deadline aiohttp lacks, and ``{"error", "message"}`` JSON for everything its parser refuses;
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
- Refusals are answered, then the connection is half-closed and its input drained for
  :data:`LINGER` seconds, so the client reads the answer instead of a reset. Over TLS, which
  cannot half-close, the answer is followed by TLS's close (close_notify), and the TLS layer
  drains until the client's close_notify or its shutdown timeout (``server.py``).

What it must not know: the operations, the service, the stream framing (``stream.py``
implements :class:`TrackedConnection`'s hooks).
"""

from __future__ import annotations

import abc
import asyncio
import heapq
import logging
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import Any, ClassVar, Protocol, cast

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler

from rdzv_client import wire

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
# Text of a refusal message kept in the answer and the log (aiohttp's include the raw line).
MAX_REASON_CHARS = 200
# Undecided connections that never spoke, then stream and HTTP ones (``protocol`` values).
PROTOCOLS = ("undecided", "stream", "http")
#: Why connections were closed by the server (``rdzv_connections_shed_total{reason}``).
SHED_REASONS = ("idle_timeout", "read_timeout", "buffers_full", "connection_limit")


class LogThrottle:
    """Log at most ``burst`` lines per ``interval`` seconds; count the rest and say how many.

    The summary line is logged by a loop timer at the end of an interval in which lines were
    suppressed, so a flood costs one timer per interval, not one line per event.
    """

    def __init__(self, logger: logging.Logger, *, interval: float = LOG_INTERVAL, burst: int = LOG_BURST) -> None:
        self._logger = logger
        self._interval = interval
        self._burst = burst
        self._window_end = 0.0
        self._logged = 0
        self._suppressed = 0
        self._summary: asyncio.TimerHandle | None = None

    def warning(self, msg: str, *args: object) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now >= self._window_end:
            self._window_end = now + self._interval
            self._logged = 0
        if self._logged < self._burst:
            self._logged += 1
            self._logger.warning(msg, *args)
            return
        self._suppressed += 1
        if self._summary is None:
            self._summary = loop.call_at(self._window_end, self._summarize)

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
        max_connections: int,
        max_buffered_bytes: int,
        idle_timeout: float,
        read_timeout: float,
    ) -> None:
        self.max_connections = max_connections
        self.max_buffered_bytes = max_buffered_bytes
        self.idle_timeout = idle_timeout
        self.read_timeout = read_timeout
        self.undecided: dict[Sheddable, None] = {}  # oldest first
        self.open: dict[TrackedConnection, None] = {}
        self.by_protocol: dict[str, int] = {"stream": 0, "http": 0}
        self.buffered = 0
        self.closing = 0  # Closing protocols alive (lingering refusals)
        self.shed_total: dict[str, int] = dict.fromkeys(SHED_REASONS, 0)
        self.rejected_total: dict[str, int] = {}
        self.refusals = LogThrottle(log)
        self.limit_log = LogThrottle(log, burst=1)
        self._holders: set[TrackedConnection] = set()
        self._candidates: list[tuple[TrackedConnection, float, bool]] = []  # best last
        self._rescan_at = 0.0

    @property
    def count(self) -> int:
        return len(self.undecided) + len(self.open)

    # -- connections ------------------------------------------------------------------------

    def admit(self, conn: Sheddable) -> bool:
        """Count a new connection, shedding another at the limit. False: refuse the newcomer."""
        if self.count >= self.max_connections and not self._make_room():
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

    def _make_room(self) -> bool:
        if self.undecided:
            oldest = next(iter(self.undecided))
            self.undecided.pop(oldest)
            oldest.close()
            self.shed("connection_limit")
            self._log_limit("closed a connection that had not spoken")
            return True
        victim = self._victim()
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

    def _victim(self) -> tuple[TrackedConnection, bool] | None:
        """The next connection to shed (and whether it is slow rather than idle), or None."""
        while True:
            while self._candidates:
                conn, stamp, slow = self._candidates.pop()
                if conn in self.open and not conn.busy():
                    if slow and conn.reading_since == stamp:
                        return conn, True
                    if not slow and conn.reading_since is None and not conn.held and conn.last_active == stamp:
                        return conn, False
            now = asyncio.get_running_loop().time()
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
        """Charge ``n`` more bytes held by ``conn``. False: ``conn`` must refuse itself."""
        if self.buffered + n > self.max_buffered_bytes and not self._make_buffer_room(conn, n):
            return False
        if not conn.held:
            self._holders.add(conn)
        conn.held += n
        self.buffered += n
        return True

    def release(self, conn: TrackedConnection, n: int) -> None:
        conn.held -= n
        self.buffered -= n
        if not conn.held:
            self._holders.discard(conn)

    def _make_buffer_room(self, conn: TrackedConnection, n: int) -> bool:
        """Shed the largest holders while one holds more than ``conn`` would."""
        while self.buffered + n > self.max_buffered_bytes:
            victim = max(self._holders, key=_held, default=None)
            if victim is None or victim is conn or victim.held <= conn.held + n:
                return False
            self.shed("buffers_full")
            self.rejected(wire.ErrorCode.BUFFERS_FULL)
            self.refusals.warning(
                "Shed %s connection holding %d bytes of a partly received request: the server's buffers are full (--max-buffered-bytes %d).",
                victim.article,
                victim.held,
                self.max_buffered_bytes,
            )
            victim.shed(wire.ErrorCode.BUFFERS_FULL, buffers_full_message(self.max_buffered_bytes))
            self.unregister(victim)
        return True

    def refuse_bytes(self, conn: TrackedConnection) -> None:
        """``conn`` could not be charged: count it, log it, answer it ``buffers_full``."""
        self.shed("buffers_full")
        self.rejected(wire.ErrorCode.BUFFERS_FULL)
        self.refusals.warning(
            "Refused %s connection's request: the server's buffers for partly received requests are full (--max-buffered-bytes %d).",
            conn.article,
            self.max_buffered_bytes,
        )
        conn.shed(wire.ErrorCode.BUFFERS_FULL, buffers_full_message(self.max_buffered_bytes))
        self.unregister(conn)


def _held(conn: TrackedConnection) -> int:
    return conn.held


def buffers_full_message(limit: int) -> str:
    return f"the server's buffers for partly received requests are full ({limit} bytes); retry shortly"


class TrackedConnection(abc.ABC):
    """A stream or HTTP connection as the table sees it, with its one deadline timer.

    Subclasses call :meth:`_track` when connected and :meth:`_untrack` when closed (both
    idempotent), store ``last_active`` when bytes arrive or a request finishes, call
    :meth:`_start_reading` at the first byte of a request or frame and clear
    ``reading_since`` when it is whole, and implement :meth:`busy`, :meth:`shed` and
    :meth:`_reading_counts`.
    """

    protocol: ClassVar[str]
    #: How log lines name it ("a stream connection").
    article: ClassVar[str]
    last_active: float = 0.0
    reading_since: float | None = None
    held: int = 0
    _table: ConnectionTable
    _deadline: asyncio.TimerHandle | None = None

    def _track(self, table: ConnectionTable, loop: asyncio.AbstractEventLoop) -> None:
        now = loop.time()
        self._table = table
        self._clock = loop
        self.last_active = now
        self.reading_since = None
        self.held = 0
        self._deadline = loop.call_at(now + table.idle_timeout, self._check_deadlines)
        table.register(self)

    def _untrack(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._table.unregister(self)

    @abc.abstractmethod
    def busy(self) -> bool:
        """Whether a request is in flight (being served: not idle, never shed)."""

    @abc.abstractmethod
    def shed(self, code: wire.ErrorCode | None, message: str) -> None:
        """Close now: silently if ``code`` is None, else after answering it with ``message``."""

    def _reading_counts(self) -> bool:
        """Whether the request being read is late by the client's doing (not held back by us)."""
        return True

    def _start_reading(self, now: float) -> None:
        self.reading_since = now
        due = now + self._table.read_timeout
        timer = self._deadline
        if timer is not None and timer.when() > due:
            timer.cancel()
            self._deadline = self._clock.call_at(due, self._check_deadlines)

    def _check_deadlines(self) -> None:
        self._deadline = None
        table = self._table
        if self not in table.open:
            return
        now = self._clock.time()
        if self.reading_since is not None and self._reading_counts():
            due = self.reading_since + table.read_timeout
            if now >= due:
                table.shed("read_timeout")
                table.rejected(wire.ErrorCode.REQUEST_TIMEOUT)
                table.refusals.warning(
                    "Closed %s connection: its request did not arrive whole within %g s (--read-timeout).",
                    self.article,
                    table.read_timeout,
                )
                self.shed(
                    wire.ErrorCode.REQUEST_TIMEOUT,
                    f"the request did not arrive whole within {table.read_timeout:g} s of its first byte",
                )
                self._untrack()
                return
        elif self.reading_since is None and not self.busy():
            due = self.last_active + table.idle_timeout
            if now >= due:
                table.shed("idle_timeout")
                self.shed(None, "")
                self._untrack()
                return
        else:  # serving a request, or reading one we hold back: look again later
            due = now + min(table.idle_timeout, table.read_timeout)
        self._deadline = self._clock.call_at(due, self._check_deadlines)


# --------------------------------------------------------------------------- refusals


def http_error(code: wire.ErrorCode, message: str) -> bytes:
    """A whole HTTP/1.1 error response (JSON body, ``Connection: close``) as bytes."""
    status = wire.HTTP_STATUS[code]
    body = wire.dump_json(wire.error_body(code, message))
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {wire.CONTENT_TYPE_JSON}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
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


# --------------------------------------------------------------------------- HTTP


def _reason(exc: BaseException | None, fallback: str) -> str:
    text = getattr(exc, "message", None) or str(exc or "") or fallback
    first = " ".join(str(text).split())  # aiohttp's parser messages span lines
    return first[:MAX_REASON_CHARS]


def classify(status: int, exc: BaseException | None) -> wire.ErrorCode:
    """The wire code of a request aiohttp refused before any handler ran."""
    if isinstance(exc, LineTooLong) or (isinstance(exc, BadHttpMessage) and "Too many headers" in exc.message):
        return wire.ErrorCode.HEADERS_TOO_LARGE
    if status == 417:
        return wire.ErrorCode.EXPECTATION_FAILED
    if status == 413:
        return wire.ErrorCode.BODY_TOO_LARGE
    if 400 <= status < 500:
        return wire.ErrorCode.BAD_REQUEST
    return wire.ErrorCode.INTERNAL


def json_error(code: wire.ErrorCode, message: str) -> web.Response:
    return web.Response(
        body=wire.dump_json(wire.error_body(code, message)),
        status=wire.HTTP_STATUS[code],
        content_type=wire.CONTENT_TYPE_JSON,
    )


RequestFactory = Callable[..., web.BaseRequest]


class HttpConnection(RequestHandler, TrackedConnection):
    """One HTTP connection: aiohttp's protocol, tracked by the table (see the module rules).

    ``data_received`` charges bytes and starts the read deadline; a request is in flight from
    its dispatch (:func:`http_factory` wraps aiohttp's request factory) to the end of
    ``finish_response``. Errors aiohttp answers itself (its parser's 400s, an unknown
    ``Expect``) become JSON with a documented code and one throttled warning line.
    """

    protocol = "http"
    article = "an HTTP"

    def __init__(self, manager: web.Server, table: ConnectionTable, **settings: Any) -> None:
        super().__init__(manager, loop=asyncio.get_running_loop(), **settings)
        self._table = table
        self._deadline = None
        self._in_flight = False
        self._responding = False
        self._payload: Any = None

    # -- transport events ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._track(self._table, self._loop)

    def data_received(self, data: bytes) -> None:
        if not data or self.transport is None:
            super().data_received(data)
            return
        now = self._loop.time()
        self.last_active = now
        if self.reading_since is None and not self._in_flight:
            self._start_reading(now)
        if not self._table.charge(self, len(data)):
            self._table.refuse_bytes(self)
            return
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._untrack()
        super().connection_lost(exc)

    # -- requests ----------------------------------------------------------------------------

    def busy(self) -> bool:
        return self._in_flight

    def _reading_counts(self) -> bool:
        if self._in_flight and (self._payload is None or self._payload.is_eof()):
            self.reading_since = None  # the whole request is in: what follows is the next one
            return False
        return True

    def request_started(self, payload: Any) -> None:
        self._in_flight = True
        self._payload = payload
        if payload.is_eof():
            self.reading_since = None

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> Any:
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            # Raised outside the middlewares (an unknown Expect: aiohttp's 417): answer it as JSON.
            code = classify(resp.status, None)
            self._table.rejected(code)
            resp = json_error(code, _reason(None, resp.text or resp.reason))
        self._responding = True
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._responding = False
            self._request_finished()

    def _request_finished(self) -> None:
        self._in_flight = False
        self._payload = None
        self.reading_since = None
        self.last_active = self._loop.time()
        if self.held:
            self._table.release(self, self.held)

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        code = classify(status, exc)
        reason = _reason(exc, message or "the request could not be read")
        self._table.rejected(code)
        if code is wire.ErrorCode.INTERNAL:  # a bug, not the client's doing: keep the traceback
            log.error("Unhandled error serving an HTTP request from %s.", request.remote, exc_info=exc)
            reason = "internal server error; the server log has details"
        else:
            self._table.refusals.warning(
                "Refused an HTTP request from %s: %d %s (%s).",
                request.remote,
                wire.HTTP_STATUS[code],
                code.value,
                reason,
            )
        if request.writer.output_size > 0:
            raise ConnectionError("the response had begun; the connection is closed instead")
        resp = json_error(code, reason)
        resp.force_close()
        return resp

    # -- closing -----------------------------------------------------------------------------

    def shed(self, code: wire.ErrorCode | None, message: str) -> None:
        transport = self.transport
        if transport is None:
            return
        if code is None or self._responding:  # idle, or mid-response: nothing more to say
            self.force_close()
            return
        self._untrack()
        self.transport = None  # aiohttp neither writes to it nor closes it now
        Closing(self._table, code, message, http_error(code, message)).adopt(transport)
        self.connection_lost(None)  # aiohttp lets go: the handler is cancelled, the request dropped


def http_factory(manager: web.Server, table: ConnectionTable, **settings: Any) -> Callable[[], HttpConnection]:
    """The protocol factory of HTTP connections served by ``manager`` (aiohttp's ``web.Server``).

    ``settings`` are ``RequestHandler`` keyword arguments (limits, timeouts, logging).
    """
    inner: RequestFactory = manager.request_factory

    def request_factory(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
        if isinstance(protocol, HttpConnection):
            protocol.request_started(payload)
        return inner(message, payload, protocol, writer, task)

    manager.request_factory = request_factory

    def factory() -> HttpConnection:
        return HttpConnection(manager, table, **settings)

    return factory
