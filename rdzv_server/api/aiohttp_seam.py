"""aiohttp's insides in one room: the HTTP connection, aiohttp's ``RequestHandler`` with the
server's accounting, and every private part of aiohttp the server relies on.

What it owns:
- :class:`HttpConnection`: aiohttp's ``RequestHandler`` as a :class:`.connection.TrackedConnection`
  (the table's accounting, the read deadline, the head limit ``--max-head-bytes`` aiohttp
  lacks), answering everything aiohttp's parser refuses as ``{"error", "message"}`` JSON that
  says what was wrong and where without quoting a byte of the request (``head.py``);
- :func:`http_factory`: the protocol factory of those connections;
- :data:`PRIVATE_NAMES`: what of aiohttp this module leans on beyond its documented API. Each
  has its own test (``tests/unit/test_aiohttp_seam.py``), so an aiohttp upgrade that removes
  or changes one fails there, by name, and not silently in production.

Rules:
- No other module imports ``aiohttp.web_protocol`` or touches a private name of aiohttp.
- An HTTP request head (from the request's first byte to its empty line) passing
  ``max_head_bytes`` is refused ``431 headers_too_large`` before aiohttp buffers it; aiohttp
  bounds each line and the number of fields itself.
- No answer and no log line quotes the request: a refusal is described from the error's type
  and the request's bytes (:meth:`.head.RequestHead.refusal`), never from aiohttp's message.
- A request is in flight from its dispatch (the wrapped request factory) to the end of
  ``finish_response``; refusals are answered over :class:`.connection.Closing`.

What it must not know: the operations, the service, the app's routes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, cast

from aiohttp import hdrs, web, web_protocol
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler as RequestHandler  # exported: the seam's tests make one

from rdzv_client import wire

from .connection import Closing, ConnectionTable, TrackedConnection, http_error
from .error import code_for_status
from .head import Refusal, RequestHead
from .header import security_headers

#: The parts of aiohttp this module relies on beyond its documented API, each read or written
#: by one function below and tested through it (``tests/unit/test_aiohttp_seam.py``):
#: - ``RequestHandler._messages`` (:func:`queued`, :func:`parsed_since`): the queue
#:   ``data_received`` appends each parsed request to, as ``(message, payload)``;
#: - ``web_protocol._ErrInfo.exc`` (:func:`parser_error`): what aiohttp queues for a request
#:   its parser refused, with the parser's ``HttpProcessingError``;
#: - ``web.Server.request_factory`` (:func:`on_dispatch`): the factory each new
#:   ``RequestHandler`` copies, called with ``(message, payload, protocol, writer, task)``;
#: - ``RequestHandler.transport = None`` (:func:`let_go`): aiohttp then neither writes to nor
#:   closes the transport, which :class:`.connection.Closing` has taken over;
#: - ``RequestHandler.finish_response(request, resp, start_time)`` and
#:   ``handle_error(request, status, exc, message)``: overridden by :class:`HttpConnection`;
#: - ``LineTooLong.args`` (:func:`long_line`): the refused line's first bytes and the limit.
PRIVATE_NAMES = (
    "RequestHandler._messages",
    "web_protocol._ErrInfo.exc",
    "web.Server.request_factory",
    "RequestHandler.transport = None",
    "RequestHandler.finish_response",
    "RequestHandler.handle_error",
    "LineTooLong.args",
)
log = logging.getLogger("rdzv_server.api")

RequestFactory = Callable[..., web.BaseRequest]
#: Whether an ``Authorization`` header (None: absent) holds a valid token of the server.
Authenticates = Callable[[str | None], bool]

# aiohttp's default limit on header fields (RequestHandler's max_headers), when none is given.
_AIOHTTP_MAX_HEADERS = 128


# -------------------------------------------------------------------- aiohttp's private parts


def queued(protocol: RequestHandler) -> int:
    """How many requests wait in the protocol's queue (``RequestHandler._messages``)."""
    return len(protocol._messages)


def parsed_since(protocol: RequestHandler, before: int) -> list[tuple[Any, HttpProcessingError | None]]:
    """What the parser queued after the first ``before`` entries: each message, and the
    parser's error when it is aiohttp's record of a refused request (None: a request)."""
    return [(message, parser_error(message)) for message, _ in itertools.islice(protocol._messages, before, None)]


def parser_error(message: object) -> HttpProcessingError | None:
    """The parser's error if ``message`` is aiohttp's record of a refusal (``_ErrInfo.exc``)."""
    if isinstance(message, web_protocol._ErrInfo) and isinstance(message.exc, HttpProcessingError):
        return message.exc
    return None


def let_go(protocol: RequestHandler) -> None:
    """Make aiohttp forget the protocol's transport: it neither writes to it nor closes it."""
    protocol.transport = None


def on_dispatch(manager: web.Server, started: Callable[[object, Any], None]) -> None:
    """Call ``started(protocol, payload)`` as each request is dispatched, by wrapping
    ``manager.request_factory`` (which each ``RequestHandler`` copies when it is made: call
    this before making any)."""
    inner: RequestFactory = manager.request_factory

    def request_factory(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
        started(protocol, payload)
        return inner(message, payload, protocol, writer, task)

    manager.request_factory = request_factory


def long_line(exc: LineTooLong) -> tuple[bytes, object]:
    """The first bytes of the line ``exc`` refused (never shown; to be found) and its limit."""
    quoted, limit = (exc.args + (b"", "?"))[:2]  # (the line's first 100 bytes and "...", the limit)
    return (bytes(quoted)[:-3] if isinstance(quoted, (bytes, bytearray)) else b""), limit


# --------------------------------------------------------------------------- refusals


def describe(
    head: RequestHead, exc: BaseException | None, chunk: bytes, head_bytes: int | None, max_fields: int
) -> Refusal:
    """Why and where aiohttp's parser refused a request (:meth:`.head.RequestHead.refusal`),
    ``chunk`` being the bytes it refused it in (its first ``head_bytes`` the head's)."""
    if isinstance(exc, LineTooLong):
        start, limit = long_line(exc)
        return head.long_line(start, limit, chunk, head_bytes)
    return head.refusal(exc, chunk, head_bytes, max_fields)


def classify(status: int, too_large: bool) -> wire.ErrorCode:
    """The wire code of a request aiohttp refused before any handler ran (``too_large``: it
    passed one of the parser's size limits)."""
    if too_large:
        return wire.ErrorCode.HEADERS_TOO_LARGE
    if status in (413, 417):
        return code_for_status(status, wire.ErrorCode.BAD_REQUEST)
    if 400 <= status < 500:
        return wire.ErrorCode.BAD_REQUEST
    return wire.ErrorCode.INTERNAL


def json_error(code: wire.ErrorCode, message: str) -> web.Response:
    """An error answer for aiohttp to write, with the security headers."""
    return web.Response(
        body=wire.dump_json(wire.error_body(code, message)),
        status=wire.HTTP_STATUS[code],
        content_type=wire.CONTENT_TYPE_JSON,
        headers=security_headers(False),
    )


# --------------------------------------------------------------------------- HTTP connections



class HttpConnection(RequestHandler, TrackedConnection):
    """One HTTP connection: aiohttp's protocol, tracked by the table (see the module rules).

    ``data_received`` measures the request head (:class:`RequestHead`), charges bytes and
    starts the read deadline; a request is in flight from its dispatch (:func:`http_factory`
    wraps aiohttp's request factory) to the end of ``finish_response``. Requests aiohttp's
    parser refuses are answered as every refusal is (JSON
    with a documented code and the security headers, over :class:`Closing`), with one
    throttled warning line; neither quotes the request.
    """

    protocol = "http"
    article = "an HTTP"

    def __init__(
        self, manager: web.Server, table: ConnectionTable, authenticates: Authenticates, **settings: Any
    ) -> None:
        super().__init__(manager, loop=asyncio.get_running_loop(), **settings)
        self._max_fields = int(settings.get("max_headers", _AIOHTTP_MAX_HEADERS))
        self.table = table
        self._authenticates = authenticates
        self._in_flight = False
        self._responding = False
        self._payload: Any = None
        self._draining: Any = None  # the body of an answered request that aiohttp still reads away
        self._head = RequestHead()
        self._refusal: tuple[BaseException, Refusal] | None = None  # the parser's error, described

    # -- transport events ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.track(self.table)

    def data_received(self, data: bytes) -> None:
        if not data or self.transport is None:
            super().data_received(data)
            return
        now = self.timers.time()
        self.last_active = now
        if self.reading_since is None and not self._in_flight:
            self.start_reading(now)
        head = self._head
        if self._draining is not None and self._draining.is_eof():
            self._draining = None  # the answered request's body is gone: a new request begins
        if not head.open or self._draining is not None:
            self._receive(data, None)
            return
        taken = head.feed(data)
        if head.size > self.table.max_head_bytes:
            self._refuse_head()
        else:
            self._receive(data, taken)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.untrack()
        super().connection_lost(exc)

    def _receive(self, data: bytes, head_bytes: int | None) -> None:
        """Charge ``data`` (its first ``head_bytes`` are the head; None: no head is being
        read), hand it to aiohttp, and see what its parser made of it.

        A stranger's bytes after the end of its head are charged once the parser has read the
        head (in this same call, before anything else runs): a token in it makes them a token
        holder's, so a client's first request is not refused for strangers' bytes."""
        first = len(data) if self.trusted or head_bytes is None else head_bytes
        if not self.table.charge(self, first):
            return
        before = queued(self)
        super().data_received(data)
        for message, exc in parsed_since(self, before):
            if exc is not None:  # the parser refused it
                if self._refusal is None:
                    self._refusal = (exc, describe(self._head, exc, data, head_bytes, self._max_fields))
            else:
                self._head.close()
                headers = cast(Any, message).headers
                if not self.trusted and self._authenticates(headers.get(hdrs.AUTHORIZATION)):
                    self.table.trust(self)
        if first < len(data) and self.transport is not None:
            self.table.charge(self, len(data) - first)

    def _refuse_head(self) -> None:
        table = self.table
        table.rejected(wire.ErrorCode.HEADERS_TOO_LARGE)
        table.refusals.warning(
            "Refused an HTTP request from %s: 431 headers_too_large (its head passed %d bytes, --max-head-bytes).",
            self._peer(),
            table.max_head_bytes,
        )
        self.shed(
            wire.ErrorCode.HEADERS_TOO_LARGE,
            f"the request head (request line and header fields) is larger than {table.max_head_bytes} bytes "
            "(--max-head-bytes)",
        )

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return str(peer[0]) if isinstance(peer, tuple) and peer else "an unknown address"

    # -- requests ----------------------------------------------------------------------------

    def busy(self) -> bool:
        return self._in_flight

    def reading_counts(self) -> bool:
        if self._in_flight and (self._payload is None or self._payload.is_eof()):
            self.reading_since = None  # the whole request is in: what follows is the next one
            return False
        return True

    def request_started(self, payload: Any) -> None:
        self._in_flight = True
        self._payload = payload
        self._head.close()
        if payload.is_eof():
            self.reading_since = None

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> Any:
        if isinstance(resp, web.HTTPException) and resp.status >= 400:
            # Raised outside the middlewares (an unknown Expect: aiohttp's 417): answer it as JSON,
            # in our words (aiohttp's quote the request's header).
            code = classify(resp.status, False)
            self.table.rejected(code)
            resp = json_error(code, _STATUS_REASONS.get(resp.status, HTTPStatus(resp.status).phrase.lower()))
        self._responding = True
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            self._responding = False
            self._request_finished()

    def _request_finished(self) -> None:
        if self._payload is not None and not self._payload.is_eof():
            self._draining = self._payload  # aiohttp reads the rest away (or closes): not a head
        self._in_flight = False
        self._payload = None
        self.reading_since = None
        self.last_active = self.timers.time()
        self._head.reset()
        if self.held:
            self.table.release(self, self.held)

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        known = self._refusal
        if known is not None and known[0] is exc:
            refusal = known[1]
        else:  # not seen in data_received: what its type says (a body's error, for one)
            refusal = describe(self._head, exc, b"", None, self._max_fields)
        code = classify(status, refusal.too_large)
        self.table.rejected(code)
        if code is wire.ErrorCode.INTERNAL:  # a bug, not the client's doing: keep the traceback
            log.error("Unhandled error serving an HTTP request from %s.", request.remote, exc_info=exc)
            reason = "internal server error; the server log has details"
        else:
            reason = refusal.message
            self.table.refusals.warning(
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
        if code is not wire.ErrorCode.INTERNAL and self.transport is not None:
            # Answered as every refusal is (HTTP/1.1, the security headers, half-close and
            # drain); aiohttp, handed a closed connection, writes nothing of ``resp``.
            self.shed(code, reason)
        return resp

    # -- closing -----------------------------------------------------------------------------

    def shed(self, code: wire.ErrorCode | None, message: str) -> None:
        transport = self.transport
        if transport is None:
            return
        if code is None or self._responding:  # idle, or mid-response: nothing more to say
            self.force_close()
            return
        self.untrack()
        let_go(self)
        Closing(self.table, code, message, http_error(code, message)).adopt(transport)
        self.connection_lost(None)  # aiohttp lets go: the handler is cancelled, the request dropped


# aiohttp's own answers raised outside the middlewares, in words that quote nothing.
_STATUS_REASONS = {417: "this server knows only Expect: 100-continue"}


def http_factory(
    manager: web.Server, table: ConnectionTable, authenticates: Authenticates, **settings: Any
) -> Callable[[], HttpConnection]:
    """The protocol factory of HTTP connections served by ``manager`` (aiohttp's ``web.Server``).

    ``authenticates`` tells a valid ``Authorization`` header (only for the table's accounting:
    the app authenticates every request itself); ``settings`` are ``RequestHandler`` keyword
    arguments (limits, timeouts, logging).
    """

    def started(protocol: object, payload: Any) -> None:
        if isinstance(protocol, HttpConnection):
            protocol.request_started(payload)

    on_dispatch(manager, started)

    def factory() -> HttpConnection:
        return HttpConnection(manager, table, authenticates, **settings)

    return factory
