"""One stream connection per endpoint, shared by every request: the transports of a node.

What it owns:
- :class:`PipelinedSocketTransport`, the blocking transport of the torchrun plug-in: the
  threads of one agent (its watch thread, the agent's own calls, its store) send their
  requests on **one** stream connection per endpoint and each waits for the reply with its
  tag; a reader thread per connection hands the replies out. The server so holds one
  descriptor per node instead of one per concurrent call.
- :class:`AsyncStreamTransport`, the same for :class:`AsyncClient`: one pipelined stream
  connection per endpoint in one event loop (the bench's simulated agents, thousands per
  process, each speaking the protocol the plug-in speaks).

The stream protocol already pipelines (``wire``, "stream protocol"): replies come in
completion order, matched by tag, so a parked long-poll (the watch) does not hold up a
store call behind it.

Rules it keeps (on top of :mod:`rdzv_client.transport`'s):
- A connection opens with the preface and, with a token, the hello, pipelined: requests go
  out behind it at once. A hello refused (tag 0, or its own tag with an error) answers
  every request waiting on that connection, which is then closed.
- A tag-0 reply (the server refusing the connection: ``too_many_connections``,
  ``buffers_full``, ``request_timeout``) is the answer of every request in flight on it;
  the connection is discarded and the next request opens a new one.
- A connection that ends (EOF, reset) fails every request in flight on it with
  :class:`TransportError`; one that was opened before the request and fails with nothing
  received since the request went out is stale: the call is resent once, at once, on
  another connection (safe: a write's rid makes it apply once), and a failure there is a
  :class:`TransportError` like any other (never an exception the client does not expect:
  a watch thread killed by one stops the node's heartbeats).
- One thread at a time opens an endpoint's connection; threads that find it ended together
  wait for that one new connection instead of replacing each other's, and share its
  failure: a thread that waited for an attempt that failed fails at once, as the asyncio
  transport's callers share one opening.
- A request whose answer does not come within its timeout closes the connection: a server
  silent that long is stuck (or the path is), and the other requests on it would wait as long.
- Over TLS (``https://``) the blocking transport keeps the base class's one connection per
  call in flight: a blocking ``SSLSocket`` cannot be read by the reader thread while another
  thread writes (one OpenSSL object). The asyncio transport pipelines over TLS too.
- JSON pages (``fetch``) are not operations: they travel over HTTP as before, on short-lived
  connections.

What it must not know: client policy (retries, deadlines, error codes).
"""

from __future__ import annotations

import asyncio
import itertools
import socket
import ssl
import threading
from typing import Any

from . import frame, wire
from .error import ClientClosedError, RdzvConnectionError, ServerError
from .tls import is_tls_misconfiguration, tls_failure
from .transport import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_CONNECTION_LIMIT,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_READ_BUFSIZE,
    AiohttpTransport,
    Answer,
    Endpoint,
    SocketTransport,
    TransportError,
    _closed_hint,
    _Stale,
    _TLS,
    decode_reply,
)


# --------------------------------------------------------------------------- blocking


class _Slot:
    """One request's wait for its reply (or for the connection's end).

    A lock held from the start and released once, by whoever finishes the slot (the reader
    with the reply, or the link's end): the waiter's ``acquire`` is one futex wait, where a
    ``threading.Event`` builds a condition's waiter lock per wait. Exactly one finisher:
    a slot is finished only by whoever took it out of the link's table under its lock.
    """

    __slots__ = ("_latch", "answer", "error")

    def __init__(self) -> None:
        self._latch = threading.Lock()
        self._latch.acquire()
        self.answer: Answer | None = None
        self.error: BaseException | None = None

    def finish(self) -> None:
        self._latch.release()

    def wait(self, timeout: float) -> bool:
        """True once finished; False when ``timeout`` s passed first."""
        return self._latch.acquire(timeout=max(0.0, timeout))


class _Link:
    """One stream connection and the requests waiting on it; its reader thread hands out replies."""

    def __init__(self, sock: socket.socket, hello: int, limit: int) -> None:
        self.sock = sock
        self.hello = hello
        self.limit = limit
        self.lock = threading.Lock()  # slots, ended
        self.send_lock = threading.Lock()  # whole frames, one at a time
        self.slots: dict[int, _Slot] = {}
        self.ended: BaseException | Answer | None = None
        self.received = 0  # replies read so far: a request sent after one is not on a stale link
        self.unpack = wire.Unpack(limit, wire.MAX_REPLY_ITEMS)  # the reader thread's alone

    def expect(self, tag: int) -> _Slot | None:
        """A slot for ``tag``; None when the link has ended."""
        with self.lock:
            if self.ended is not None:
                return None
            slot = self.slots[tag] = _Slot()
            return slot

    def forget(self, tag: int) -> None:
        with self.lock:
            self.slots.pop(tag, None)

    def end(self, why: BaseException | Answer) -> None:
        """Answer (or fail) every waiting request with ``why``; later ones find the link ended."""
        with self.lock:
            if self.ended is None:
                self.ended = why
            slots, self.slots = self.slots, {}
        for slot in slots.values():
            if isinstance(why, Answer):
                slot.answer = why
            else:
                slot.error = why
            slot.finish()
        try:
            socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
        except OSError:
            pass

    def read_replies(self) -> None:
        """The reader thread: hand out every reply until the connection ends."""
        replies = frame.FrameDecoder(self.limit)
        why: BaseException | Answer
        try:
            while True:
                chunk = self.sock.recv(DEFAULT_READ_BUFSIZE)
                if not chunk:
                    raise EOFError("the server closed the connection")
                replies.feed(chunk)
                while True:
                    try:
                        payload = replies.next_payload()
                    except frame.FrameTooLarge as exc:
                        raise ServerError(f"the server's reply of {exc.length} bytes exceeds the client's limit") from exc
                    if payload is None:
                        break
                    tag, status, body = decode_reply(payload, self.unpack)
                    self.received += 1
                    if tag == 0 or (tag == self.hello and status != 200):
                        self.end(Answer(status, body))  # refused: the answer of every request on it
                        return
                    with self.lock:
                        slot = self.slots.pop(tag, None)
                    if slot is not None:
                        slot.answer = Answer(status, body)
                        slot.finish()
        except (OSError, EOFError, ServerError) as exc:
            why = exc
        self.end(why)
        self.sock.close()


class _StaleLink(_Stale):
    """The connection a request went out on was already ending: resend it on another."""

    def __init__(self, link: _Link) -> None:
        super().__init__()
        self.link = link


class PipelinedSocketTransport(SocketTransport):
    """:class:`SocketTransport` with one pipelined stream connection per endpoint.

    Any number of threads share it; each operation waits for its own reply while the others'
    requests travel on the same connection. ``fetch`` and closing are the base class's.
    """

    def __init__(
        self,
        *,
        connection_limit: int = DEFAULT_CONNECTION_LIMIT,  # connections over TLS (one per call in flight)
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(
            connection_limit=connection_limit, max_response_bytes=max_response_bytes,
            connect_timeout=connect_timeout,
            token=token, tls=tls,
        )  # fmt: skip
        self._links: dict[Endpoint, _Link] = {}
        self._opening: dict[Endpoint, threading.Lock] = {}
        self._attempts: dict[Endpoint, int] = {}  # attempts to open each endpoint's connection so far
        self._failed: dict[Endpoint, tuple[int, str]] = {}  # the last attempt, when it failed: (its number, why)

    def call(self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float) -> Answer:
        if endpoint.scheme == "https":
            # A blocking SSLSocket must not be read in one thread while another writes (one
            # OpenSSL object): over TLS each call keeps a connection of its own, as before.
            return super().call(endpoint, rdzv_id, op, fields, timeout)
        tag = next(self._tags)
        payload = wire.frame([tag, op, rdzv_id, fields])
        try:
            return self._send_and_wait(endpoint, tag, payload, timeout, stale=None)
        except _StaleLink as exc:
            # Once more, at once, on a connection other than the one that went stale (another
            # thread's new one will do); a failure there is the call's, never stale again.
            return self._send_and_wait(endpoint, tag, payload, timeout, stale=exc.link)

    def _forked(self) -> None:
        super()._forked()
        self._links.clear()  # the parent's; their reader threads did not survive the fork
        self._opening.clear()  # a lock a parent's thread held at the fork would never be released
        self._attempts.clear()
        self._failed.clear()

    def _send_and_wait(self, endpoint: Endpoint, tag: int, payload: bytes, timeout: float, *, stale: _Link | None) -> Answer:
        """Send ``payload`` on the endpoint's connection and wait for the reply tagged ``tag``.

        Raises :class:`_StaleLink` (first try only: ``stale`` None) when the connection was
        open before this request and ended with nothing received since it was sent.
        """
        link, reused = self._link(endpoint, timeout, stale)
        first_try = stale is None
        slot = link.expect(tag)
        if slot is None:  # ended between the lookup and now
            if first_try and reused:
                raise _StaleLink(link)
            raise TransportError(f"{endpoint}: the connection closed as it opened")
        seen = link.received
        try:
            with link.send_lock:
                link.sock.sendall(payload)
        except OSError as exc:
            link.end(exc)
        if not slot.wait(timeout):
            link.forget(tag)
            link.end(TimeoutError(f"no answer within {timeout:g} s"))
            raise TransportError(f"{endpoint}: no answer within {timeout:g} s")
        if slot.answer is not None:
            return slot.answer
        failure = slot.error
        assert failure is not None
        self._raise_if_closed(failure)
        if isinstance(failure, ServerError):
            raise failure
        if is_tls_misconfiguration(failure):
            raise RdzvConnectionError(tls_failure(endpoint, failure)) from failure
        if first_try and reused and link.received == seen and isinstance(failure, (ConnectionError, EOFError)):
            raise _StaleLink(link) from failure
        raise TransportError(f"{endpoint}: {failure or type(failure).__name__}{_closed_hint(endpoint, failure)}") from failure

    def _link(self, endpoint: Endpoint, timeout: float, stale: _Link | None) -> tuple[_Link, bool]:
        """The endpoint's live connection other than ``stale`` (reused: True), else a new one.

        One thread at a time opens an endpoint's connection; the others wait for it and use
        it, so threads that find the old one ended together do not replace each other's.
        """
        with self._lock:
            self._check_usable()
            opening = self._opening.setdefault(endpoint, threading.Lock())
            tried = self._attempts.get(endpoint, 0)  # attempts to open it that ended before we asked
        with opening:
            with self._lock:
                self._check_usable()
                link = self._links.get(endpoint)
                if link is not None and link.ended is None and link is not stale:
                    return link, True
                failed = self._failed.get(endpoint)
            if failed is not None and failed[0] > tried:
                # An attempt that ended while we waited for it failed: ours would fail the same
                # way, after as long (a connect timeout each, one after another, on a host that
                # drops packets). Say so now; the client's retries decide what comes next.
                raise TransportError(failed[1])
            try:
                link = self._open_link(endpoint, timeout)
            except TransportError as exc:
                self._opened(endpoint, str(exc))
                raise
            self._opened(endpoint, None)
            return link, False

    def _opened(self, endpoint: Endpoint, failure: str | None) -> None:
        """Count an attempt to open ``endpoint``'s connection, and how it ended."""
        with self._lock:
            attempt = self._attempts[endpoint] = self._attempts.get(endpoint, 0) + 1
            if failure is None:
                self._failed.pop(endpoint, None)
            else:
                self._failed[endpoint] = (attempt, failure)

    def _open_link(self, endpoint: Endpoint, timeout: float) -> _Link:
        sock, _ = self._checkout(endpoint, timeout, fresh=True)  # connected (and TLS), counted as busy
        hello = next(self._tags) if self._token else 0
        link = _Link(sock, hello, self._max_response_bytes)
        opening = wire.STREAM_PREFACE
        if hello:
            opening += wire.frame([hello, wire.HELLO_OP, "", {"token": self._token}])
        try:
            sock.settimeout(None)  # the reader blocks; each request's timeout is its own wait
            sock.sendall(opening)
        except OSError as exc:
            self._drop(sock)
            self._raise_if_closed(exc)
            raise TransportError(f"{endpoint}: {exc or type(exc).__name__}{_closed_hint(endpoint, exc)}") from exc
        with self._lock:
            old = self._links.get(endpoint)
            self._links[endpoint] = link
        if old is not None and old is not link and old.ended is None:
            old.end(EOFError("replaced by a fresh connection"))
        reader = threading.Thread(target=self._read, args=(link,), name=f"rdzv-stream-{endpoint}", daemon=True)
        reader.start()
        return link

    def _read(self, link: _Link) -> None:
        try:
            link.read_replies()
        finally:
            self._drop(link.sock)

    def _drop(self, sock: socket.socket) -> None:
        with self._lock:
            self._busy.discard(sock)
        sock.close()

    @property
    def connections(self) -> int:
        """Stream connections open now (for tests and the bench)."""
        with self._lock:
            return sum(1 for link in self._links.values() if link.ended is None)


# --------------------------------------------------------------------------- asyncio


class _StreamProtocol(asyncio.Protocol):
    """One asyncio stream connection: replies to futures by tag."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.transport: asyncio.Transport | None = None
        self.waiting: dict[int, asyncio.Future[Answer]] = {}
        self.ended: BaseException | Answer | None = None
        self.hello = 0
        self._replies = frame.FrameDecoder(limit)
        self.unpack = wire.Unpack(limit, wire.MAX_REPLY_ITEMS)  # the event loop's alone

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._replies.feed(data)
        while self.ended is None:
            try:
                payload = self._replies.next_payload()
                if payload is None:
                    return
                tag, status, body = decode_reply(payload, self.unpack)
            except (frame.FrameTooLarge, ServerError) as exc:
                self.end(exc if isinstance(exc, ServerError) else ServerError(f"the server's reply is too large: {exc}"))
                return
            if tag == 0 or (tag == self.hello and status != 200):
                self.end(Answer(status, body))
                return
            future = self.waiting.pop(tag, None)
            if future is not None and not future.done():
                future.set_result(Answer(status, body))

    def connection_lost(self, exc: BaseException | None) -> None:
        self.end(exc or EOFError("the server closed the connection"))

    def end(self, why: BaseException | Answer) -> None:
        if self.ended is None:
            self.ended = why
        waiting, self.waiting = self.waiting, {}
        for future in waiting.values():
            if future.done():
                continue
            if isinstance(why, Answer):
                future.set_result(why)
            else:
                future.set_exception(why)
        if self.transport is not None:
            self.transport.close()


class AsyncStreamTransport:
    """:class:`rdzv_client.transport.Transport` over one pipelined stream connection per endpoint.

    Belongs to the event loop that first uses it. ``fetch`` (the JSON pages) goes over HTTP
    through an :class:`AiohttpTransport` made on first use.
    """

    def __init__(
        self,
        *,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._limit = max_response_bytes
        self._connect_timeout = connect_timeout
        self._token = token
        self._tls = _TLS(tls)
        self._tls_given = tls
        self._tags = itertools.count(1)
        self._links: dict[Endpoint, _StreamProtocol] = {}
        self._opening: dict[Endpoint, asyncio.Future[_StreamProtocol]] = {}
        self._http: AiohttpTransport | None = None
        self._closed = False

    async def call(self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float) -> Answer:
        for fresh in (False, True):
            link, reused = await self._link(endpoint, timeout, fresh)
            tag = next(self._tags)
            future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
            link.waiting[tag] = future
            assert link.transport is not None
            link.transport.write(wire.frame([tag, op, rdzv_id, fields]))
            try:
                return await asyncio.wait_for(future, timeout)
            except asyncio.TimeoutError as exc:
                link.waiting.pop(tag, None)
                link.end(TimeoutError(f"no answer within {timeout:g} s"))
                raise TransportError(f"{endpoint}: no answer within {timeout:g} s") from exc
            except (OSError, EOFError) as exc:
                if self._closed:
                    raise ClientClosedError("the rdzv client was closed while this call was in flight") from exc
                if reused and not fresh and isinstance(exc, (ConnectionError, EOFError)):
                    continue  # a pooled connection the server had closed: once more, on a fresh one
                raise TransportError(f"{endpoint}: {exc or type(exc).__name__}{_closed_hint(endpoint, exc)}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _link(self, endpoint: Endpoint, timeout: float, fresh: bool) -> tuple[_StreamProtocol, bool]:
        if self._closed:
            raise ClientClosedError("this rdzv client is closed")
        link = self._links.get(endpoint)
        if link is not None and link.ended is None and not fresh:
            return link, True
        opening = self._opening.get(endpoint)
        if opening is None:
            opening = self._opening[endpoint] = asyncio.ensure_future(self._open(endpoint, timeout))
            opening.add_done_callback(lambda _: self._opening.pop(endpoint, None))
        return await asyncio.shield(opening), False

    async def _open(self, endpoint: Endpoint, timeout: float) -> _StreamProtocol:
        loop = asyncio.get_running_loop()
        tls = self._tls.context() if endpoint.scheme == "https" else None
        try:
            _, link = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _StreamProtocol(self._limit), endpoint.host, endpoint.port,
                    ssl=tls, server_hostname=endpoint.host if tls is not None else None,
                ),
                min(timeout, self._connect_timeout),
            )  # fmt: skip
        except (OSError, asyncio.TimeoutError) as exc:
            if is_tls_misconfiguration(exc):
                raise RdzvConnectionError(tls_failure(endpoint, exc)) from exc
            raise TransportError(f"{endpoint}: {exc or type(exc).__name__}") from exc
        assert link.transport is not None
        opening = wire.STREAM_PREFACE
        if self._token:
            link.hello = next(self._tags)
            opening += wire.frame([link.hello, wire.HELLO_OP, "", {"token": self._token}])
        link.transport.write(opening)
        old = self._links.get(endpoint)
        self._links[endpoint] = link
        if old is not None and old.ended is None:
            old.end(EOFError("replaced by a fresh connection"))
        if self._closed:
            link.end(ClientClosedError("this rdzv client is closed"))
        return link

    async def connect(self, endpoint: Endpoint, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
        """Open the connection to ``endpoint`` now (preface and hello sent), ahead of the first request."""
        await self._link(endpoint, timeout, False)

    def abort(self) -> None:
        """Drop every connection at once, as the kernel does for a process that dies (the
        bench's killed agents): requests in flight and later calls raise ClientClosedError,
        and nothing reconnects."""
        self._closed = True
        for link in list(self._links.values()):
            if link.transport is not None:
                link.transport.abort()

    async def fetch(self, endpoint: Endpoint, path: str, timeout: float) -> Answer:
        if self._http is None:
            self._http = AiohttpTransport(max_response_bytes=self._limit, token=self._token, tls=self._tls_given)
        return await self._http.fetch(endpoint, path, timeout)

    async def aclose(self) -> None:
        self._closed = True
        links, self._links = self._links, {}
        for link in links.values():
            link.end(ClientClosedError("the rdzv client was closed while this call was in flight"))
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    @property
    def connections(self) -> int:
        """Stream connections open now."""
        return sum(1 for link in self._links.values() if link.ended is None)
