"""The stream protocol over blocking sockets: the threaded client's two transports.

What it owns:
- :class:`SocketTransport` (a :class:`~rdzv_client.transport.BlockingTransport`): blocking
  sockets shared by threads. Operations travel as stream-protocol frames (see ``wire``,
  "stream protocol") over pooled connections, one request in flight per connection; the
  JSON pages over HTTP/1.1. ``rdzvctl`` and a plain :class:`Client` use it.
- :class:`PipelinedSocketTransport`, the torchrun plug-in's: the threads of one agent (its
  watch thread, the agent's own calls, its store) send their requests on **one** stream
  connection per endpoint and each waits for the reply with its tag; a reader thread per
  connection hands the replies out. The server so holds one descriptor per node instead of
  one per concurrent call.
- :func:`decode_reply`: what a reply frame holds, for every reader of replies.

Frames are read by :mod:`rdzv_client.frame` (its one blocking read loop); the stream
protocol already pipelines (replies come in completion order, matched by tag, so a parked
long-poll, the watch, does not hold up a store call behind it).

Rules it keeps (on top of :mod:`rdzv_client.transport`'s):
- An ``https://`` endpoint means TLS: the frames travel inside TLS exactly as over plain
  TCP (the handshake is part of opening a connection).
- A stream error frame with tag 0 answers the connection rather than one request (the
  server refused it: ``too_many_connections``, ``buffers_full``, ``request_timeout``): it is
  the answer of every request in flight on it, and the connection, which the server
  closes, is discarded; the next request opens a new one.
- :class:`SocketTransport`: a pooled connection found closed or reset (the server closed it
  after its ``--idle-timeout``, shed it at its connection limit, or restarted while it sat
  idle) is replaced once, at once, by a fresh one. A reply that arrives whole is read from
  one ``recv`` (:func:`frame.receive_one`): two system calls per call.
- :class:`PipelinedSocketTransport`: a connection opens with the preface and the hello (with
  the token if there is one; without, a server with auth off answers it all the same),
  pipelined: requests go out behind it at once. The hello's reply says what the server takes
  one-way (``wire.ONE_WAY_OPS``): :meth:`~PipelinedSocketTransport.notify` sends those (the
  node's beats) with one tag of the connection's own and waits for nothing, while a reply came
  on the connection within the caller's bound and none was refused since. Where the hello also
  lists ``then_watch`` (``wire.THEN_WATCH_OPS``),
  :meth:`~PipelinedSocketTransport.call_then_watch` sends a join with the tag of the node's
  next watch, its waiter set up on that connection first: the server parks that watch when it
  answers with an assignment, and :meth:`~PipelinedSocketTransport.wait_kept` waits for its
  answer as for a watch sent. On a connection whose hello is not answered yet, or that did not
  list it, the join goes plain (an old server never sees the field). A hello refused (tag 0, or its
  own tag with an error) answers every request waiting on that connection, which is then
  closed. A connection that ends (EOF, reset) fails every request in flight on it with
  :class:`TransportError`; one that was opened before the request and fails with nothing
  received since the request went out is stale: the call is resent once, at once, on
  another connection (safe: a write's rid makes it apply once), and a failure there is a
  :class:`TransportError` like any other (never an exception the client does not expect:
  a watch thread killed by one stops the node's heartbeats).
- One thread at a time opens an endpoint's pipelined connection; threads that find it ended
  together wait for that one new connection instead of replacing each other's, and share
  its failure: a thread that waited for an attempt that failed fails at once.
- A pipelined request whose answer does not come within its timeout closes the connection:
  a server silent that long is stuck (or the path is), and the other requests on it would
  wait as long.
- Over TLS the pipelined transport keeps :class:`SocketTransport`'s one connection per call
  in flight: a blocking ``SSLSocket`` cannot be read by the reader thread while another
  thread writes (one OpenSSL object).
- JSON pages (``fetch``) are not operations: they travel over HTTP, on short-lived
  connections.

What it must not know: client policy (retries, deadlines, error codes), event loops.
"""

from __future__ import annotations

import http.client
import itertools
import socket
import ssl
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

from . import frame, wire
from .error import ClientClosedError, RdzvConnectionError, ServerError
from .tls import is_tls_misconfiguration, tls_failure
from .transport import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_CONNECTION_LIMIT,
    DEFAULT_MAX_RESPONSE_BYTES,
    Answer,
    Endpoint,
    KeptWatch,
    TransportError,
    TransportTLS,
    closed_hint,
    forks,
    http_answer,
    json_headers,
    json_request,
    kept_round,
)


class _Stale(Exception):
    """A pooled connection turned out to be closed (the server restarted while it sat idle)."""


def unreadable_reply(exc: wire.WireError) -> ServerError:
    """The error of a reply stream the client cannot read on (:mod:`frame`'s refusals)."""
    if isinstance(exc, frame.FrameTooLarge):
        return ServerError(f"the server's reply of {exc.length} bytes exceeds the client's limit")
    if isinstance(exc, frame.TrailingBytes):
        return ServerError("the server sent bytes after its reply, with no request outstanding")
    return ServerError(f"the server sent a frame this client cannot read: {exc}")


def decode_reply(payload: bytes, unpack: wire.Unpack) -> tuple[int, int, Any]:
    """A stream reply frame's ``(tag, status, body)``; raises :class:`ServerError` if it is not one."""
    try:
        message = unpack(payload)
    except wire.WireError as exc:
        raise ServerError(f"the server sent a frame this client cannot read: {exc}") from exc
    if not (isinstance(message, list) and len(message) == 3 and type(message[0]) is int and type(message[1]) is int):
        raise ServerError(f"the server sent a reply frame of the wrong shape: {message!r:.200}")
    return message[0], message[1], message[2]


def _timeval(seconds: float) -> bytes:
    """``seconds`` as the ``struct timeval`` of SO_RCVTIMEO / SO_SNDTIMEO (all zero would mean never)."""
    whole = int(seconds)
    micros = int((seconds - whole) * 1e6)
    return struct.pack("ll", whole, micros if whole or micros else 1)


class SocketTransport:
    """:class:`BlockingTransport` over blocking sockets, shared by any number of threads.

    Operations travel over the stream protocol, inside TLS for ``https://`` endpoints (the
    handshake is part of opening a pooled connection); the JSON pages over HTTP/1.1 (HTTPS).
    """

    def __init__(
        self,
        *,
        connection_limit: int = DEFAULT_CONNECTION_LIMIT,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._token = token
        self._tls = TransportTLS(tls)
        self._json_headers = json_headers(token)
        self._max_idle = connection_limit
        self._max_response_bytes = max_response_bytes
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._idle: dict[Endpoint, list[socket.socket]] = {}
        self._busy: set[socket.socket] = set()
        self._tags = itertools.count(1)
        self._closed = False
        self._forks = forks()
        # A plain TCP connection stays in blocking mode and times out in the kernel
        # (SO_RCVTIMEO, SO_SNDTIMEO): one system call per send and per receive, where a
        # Python socket timeout polls before each and switches modes per call. Each one's
        # timeout as last set, so it is set again only when it changes. (TLS keeps settimeout.)
        self._timeouts: dict[socket.socket, float] = {}
        self._unpack = threading.local()  # each thread's wire.Unpack of replies

    # -- the seam --------------------------------------------------------------------------

    def call(self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float) -> Answer:
        tag = next(self._tags)
        payload = wire.frame([tag, op, rdzv_id, fields])
        try:
            return self._exchange(endpoint, tag, payload, timeout, fresh=False)
        except _Stale:
            return self._exchange(endpoint, tag, payload, timeout, fresh=True)

    def fetch(
        self, endpoint: Endpoint, path: str, timeout: float, *, method: str = "GET", body: Any = None
    ) -> Answer:
        data, headers = json_request(self._json_headers, body)
        return self._http(endpoint, method, path, data, headers, timeout)

    def close(self) -> None:
        """Close every connection, idle or in use; calls in flight raise :class:`ClientClosedError`."""
        with self._lock:
            self._closed = True
            socks = [s for idle in self._idle.values() for s in idle] + list(self._busy)
            self._idle.clear()
            self._timeouts.clear()
        for sock in socks:
            try:
                # Wakes a thread blocked in recv on it. The plain socket's shutdown, also for a
                # TLS one: SSLSocket.shutdown would unwrap it under the reading thread's feet.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    # -- stream exchange ---------------------------------------------------------------------

    def _exchange(self, endpoint: Endpoint, tag: int, payload: bytes, timeout: float, *, fresh: bool) -> Answer:
        sock, reused = self._checkout(endpoint, timeout, fresh)
        ok = False
        try:
            if self._timeouts.get(sock) != timeout:
                self._set_timeout(sock, timeout)
            hello = 0 if reused or not self._token else next(self._tags)
            if reused:
                sock.sendall(payload)
            elif hello:
                greeting = wire.frame([hello, wire.HELLO_OP, "", {"token": self._token}])
                sock.sendall(wire.STREAM_PREFACE + greeting + payload)
            else:
                sock.sendall(wire.STREAM_PREFACE + payload)
            if hello:  # its answer may have the request's behind it (pipelined)
                replies = frame.FrameDecoder(self._max_response_bytes)
                message = self._decode(replies.receive(sock.recv))
                if message[0] == hello and message[1] == 200:  # welcomed: the request's answer is next
                    message = self._decode(replies.receive(sock.recv))
                    if replies.buffered:
                        raise frame.TrailingBytes(replies.buffered)
            else:
                message = self._decode(frame.receive_one(sock.recv, self._max_response_bytes))
            ok = message[0] == tag  # tag 0: the server refused the connection and closes it
        except wire.WireError as exc:  # the frame reader's refusals (decoding raises ServerError)
            raise unreadable_reply(exc) from exc
        except (OSError, EOFError) as exc:
            self._raise_if_closed(exc)
            if isinstance(exc, BlockingIOError):  # the kernel's timeout (_set_timeout): say it as Python would
                raise TransportError(f"{endpoint}: timed out") from exc
            if is_tls_misconfiguration(exc):  # e.g. TLS 1.3: a refused client certificate shows on the first read
                raise RdzvConnectionError(tls_failure(endpoint, exc)) from exc
            if reused and isinstance(exc, (ConnectionError, EOFError)):
                raise _Stale() from exc  # retrying is safe: a write's rid makes it apply once
            raise TransportError(f"{endpoint}: {exc or type(exc).__name__}{closed_hint(endpoint, exc)}") from exc
        finally:
            self._checkin(endpoint, sock, ok)
        if message[0] != tag and not (message[0] == 0 and message[1] >= 400):
            raise ServerError(f"the server sent a reply frame that does not answer request {tag}: {message!r:.200}")
        return Answer(message[1], message[2])

    def _set_timeout(self, sock: socket.socket, timeout: float) -> None:
        """Bound each send and receive on ``sock`` by ``timeout`` seconds: in the kernel for a
        plain connection (a receive that times out raises BlockingIOError), else as Python does."""
        if isinstance(sock, ssl.SSLSocket):
            sock.settimeout(timeout)
        else:
            when = _timeval(timeout)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, when)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, when)
        self._timeouts[sock] = timeout

    def _decode(self, reply: bytes) -> tuple[int, int, Any]:
        """A reply frame's ``(tag, status, body)`` through this thread's decoder (:func:`decode_reply`)."""
        unpack = getattr(self._unpack, "unpack", None)
        if unpack is None:
            unpack = self._unpack.unpack = wire.Unpack(self._max_response_bytes, wire.MAX_REPLY_ITEMS)
        return decode_reply(reply, unpack)

    def _checkout(self, endpoint: Endpoint, timeout: float, fresh: bool) -> tuple[socket.socket, bool]:
        with self._lock:
            self._check_usable()
            idle = self._idle.get(endpoint)
            if idle and not fresh:
                sock = idle.pop()
                self._busy.add(sock)
                return sock, True
        try:
            sock = socket.create_connection((endpoint.host, endpoint.port), timeout=min(timeout, self._connect_timeout))
        except OSError as exc:
            raise TransportError(f"{endpoint}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if endpoint.scheme == "https":
            sock = self._handshake(endpoint, sock)
        else:
            sock.settimeout(None)  # blocking: the exchange's timeout is the kernel's (_set_timeout)
        with self._lock:
            if self._closed:
                sock.close()
                self._check_usable()
            self._busy.add(sock)
        return sock, False

    def _handshake(self, endpoint: Endpoint, sock: socket.socket) -> socket.socket:
        """``sock`` wrapped in TLS, handshake done (within the connect timeout already set)."""
        try:
            return self._tls.context().wrap_socket(sock, server_hostname=endpoint.host)
        except OSError as exc:
            sock.close()
            if is_tls_misconfiguration(exc):
                raise RdzvConnectionError(tls_failure(endpoint, exc)) from exc
            raise TransportError(f"{endpoint}: TLS handshake: {exc or type(exc).__name__}") from exc

    def _checkin(self, endpoint: Endpoint, sock: socket.socket, ok: bool) -> None:
        with self._lock:
            self._busy.discard(sock)
            idle = self._idle.setdefault(endpoint, [])
            if ok and not self._closed and len(idle) < self._max_idle:
                idle.append(sock)
                return
            self._timeouts.pop(sock, None)
        sock.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise ClientClosedError("this rdzv client is closed")
        if forks() != self._forks:  # a forked child must not share its parent's connections
            self._forked()

    def notify(
        self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], *, answered_within: float
    ) -> bool:
        """One-way requests need a connection that outlives the call: none here (False)."""
        return False

    def call_then_watch(
        self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float, *, hold: float
    ) -> tuple[Answer, KeptWatch | None]:
        """A watch parked by the server needs a connection that outlives the call: a plain
        :meth:`call` here (no watch parked)."""
        return self.call(endpoint, rdzv_id, op, fields, timeout), None

    def wait_kept(self, kept: KeptWatch, timeout: float) -> Answer | None:
        return None  # (never kept here)

    def drop_kept(self, kept: KeptWatch) -> None:
        pass  # (never kept here)

    def hello_reply(self, endpoint: Endpoint, timeout: float) -> dict[str, Any] | None:
        return None  # a connection per call: no hello kept

    def _forked(self) -> None:
        """In a forked child: forget the parent's connections (never touched from here)."""
        self._idle.clear()
        self._busy.clear()
        self._timeouts.clear()
        self._forks = forks()

    def _raise_if_closed(self, exc: BaseException) -> None:
        if self._closed:
            raise ClientClosedError("the rdzv client was closed while this call was in flight") from exc

    # -- HTTP/1.1 (the JSON pages) ------------------------------------------------------------

    def _http(
        self, endpoint: Endpoint, method: str, path: str, body: bytes | None, headers: Mapping[str, str], timeout: float
    ) -> Answer:
        with self._lock:
            self._check_usable()
        conn: http.client.HTTPConnection
        if endpoint.scheme == "https":
            context = self._tls.context()
            conn = http.client.HTTPSConnection(endpoint.host, endpoint.port, timeout=timeout, context=context)
        else:
            conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=dict(headers))
            resp = conn.getresponse()
            data = resp.read(self._max_response_bytes + 1)
        except (OSError, http.client.HTTPException) as exc:
            if is_tls_misconfiguration(exc):
                raise RdzvConnectionError(tls_failure(endpoint, exc)) from exc
            raise TransportError(f"{endpoint}: {exc or type(exc).__name__}{closed_hint(endpoint, exc)}") from exc
        finally:
            conn.close()
        if len(data) > self._max_response_bytes:
            raise ServerError(f"the server's reply exceeds the client's limit of {self._max_response_bytes} bytes")
        content_type = (resp.getheader("Content-Type") or "").split(";")[0].strip()
        return http_answer(resp.status, content_type, data, self._max_response_bytes)


# --------------------------------------------------------------------------- pipelined


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

    def __init__(self, sock: socket.socket, hello: int, one_way_tag: int, limit: int) -> None:
        self.sock = sock
        self.hello = hello
        self.one_way_tag = one_way_tag  # every one-way request's: the server takes the same bytes again at once
        self.limit = limit
        self.lock = threading.Lock()  # slots, ended
        self.send_lock = threading.Lock()  # whole frames, one at a time
        self.slots: dict[int, _Slot] = {}
        self.ended: BaseException | Answer | None = None
        self.received = 0  # replies read so far: a request sent after one is not on a stale link
        # What the server's hello said it takes one-way (none until its reply is read: an old
        # server's says nothing), when a reply last came (time.monotonic), and whether a one-way
        # request was refused (then the next one goes answered, through the client's policy).
        self.one_way: frozenset[str] = frozenset()
        self.answered_at = 0.0
        self.one_way_refused = False
        self.then_watch = False  # the hello said a join may park the node's next watch (wire.THEN_WATCH)
        self.greeting: dict[str, Any] | None = None  # the hello's reply, once read
        self.greeted = threading.Event()  # set when it is read, or the link ended without it
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
        self.greeted.set()  # no hello reply will come now
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
                tag, status, body = decode_reply(replies.receive(self.sock.recv), self.unpack)
                self.received += 1
                self.answered_at = time.monotonic()
                if tag == 0 or (tag == self.hello and status != 200):
                    self.end(Answer(status, body))  # refused: the answer of every request on it
                    return
                if tag == self.hello:
                    self.one_way, self.then_watch, self.greeting = wire.hello_terms(body)
                    self.greeted.set()
                    continue
                with self.lock:
                    slot = self.slots.pop(tag, None)
                if slot is not None:
                    slot.answer = Answer(status, body)
                    slot.finish()
                elif tag == self.one_way_tag and status >= 300:  # a one-way request refused
                    self.one_way_refused = True
        except frame.FrameTooLarge as exc:
            why = unreadable_reply(exc)
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

    def notify(
        self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], *, answered_within: float
    ) -> bool:
        """Send ``op`` one-way on the endpoint's open connection, waiting for nothing, when its
        server's hello listed it (``wire.ONE_WAY_OPS``), no one-way request was refused on it
        since the last went out, and a reply came on it within ``answered_within`` s (so a
        server that froze is still found out by an answered request within that long). False,
        with nothing sent, otherwise (no connection open, over TLS, an old server): send the
        request answered instead, which also opens a connection.
        """
        if endpoint.scheme == "https":
            return False
        with self._lock:
            if self._closed or forks() != self._forks:
                return False
            link = self._links.get(endpoint)
        if link is None or link.ended is not None or op not in link.one_way:
            return False
        if link.one_way_refused or time.monotonic() - link.answered_at > answered_within:
            link.one_way_refused = False
            return False
        try:
            with link.send_lock:
                link.sock.sendall(wire.frame([link.one_way_tag, op, rdzv_id, fields]))
        except OSError as exc:
            link.end(exc)
            return False
        return True

    def call_then_watch(
        self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float, *, hold: float
    ) -> tuple[Answer, KeptWatch | None]:
        """As :meth:`call`, the request carrying ``then_watch`` (a tag whose waiter is set up on
        the endpoint's open connection first) when that connection's server listed it in its
        hello; otherwise (no connection open, its hello not answered yet, an old server, TLS) a
        plain :meth:`call`. The watch the server parked comes back when it answered with an
        assignment; on any other answer the tag is forgotten (the server parked nothing)."""
        link = None
        if endpoint.scheme != "https":
            with self._lock:
                self._check_usable()
                link = self._links.get(endpoint)
        watch_tag = next(self._tags)
        watch = None if link is None or not link.then_watch else link.expect(watch_tag)
        if link is None or watch is None:
            return self.call(endpoint, rdzv_id, op, fields, timeout), None
        tag = next(self._tags)
        payload = wire.frame([tag, op, rdzv_id, {**fields, wire.THEN_WATCH: [watch_tag, hold]}])
        try:
            answer = self._send_on(link, True, endpoint, tag, payload, timeout, first_try=True)
        except _StaleLink:
            # Once more, plain, on another connection (as call does): a new one's hello is not
            # answered yet, so whether it takes then_watch is not known.
            link.forget(watch_tag)
            return self._send_and_wait(endpoint, tag, wire.frame([tag, op, rdzv_id, fields]), timeout, stale=link), None
        except BaseException:
            link.forget(watch_tag)
            raise
        round_ = kept_round(answer)
        if round_ is None:
            link.forget(watch_tag)
            return answer, None
        return answer, KeptWatch(round_, hold, (link, watch_tag, watch))

    def wait_kept(self, kept: KeptWatch, timeout: float) -> Answer | None:
        link, tag, slot = kept.waiter
        if not slot.wait(timeout):
            link.forget(tag)
            link.end(TimeoutError(f"no answer within {timeout:g} s"))
            raise TransportError(f"no answer to the parked watch within {timeout:g} s")
        answer: Answer | None = slot.answer  # None: its connection ended first (slot.error says how)
        return answer

    def drop_kept(self, kept: KeptWatch) -> None:
        link, tag, _ = kept.waiter
        link.forget(tag)

    def hello_reply(self, endpoint: Endpoint, timeout: float) -> dict[str, Any] | None:
        """The hello reply of the endpoint's connection, opened now if none is (over TLS, where
        each call has a connection of its own: None)."""
        if endpoint.scheme == "https":
            return None
        link, _ = self._link(endpoint, timeout, None)
        link.greeted.wait(timeout)
        return link.greeting

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
        return self._send_on(link, reused, endpoint, tag, payload, timeout, first_try=stale is None)

    def _send_on(
        self, link: _Link, reused: bool, endpoint: Endpoint, tag: int, payload: bytes, timeout: float, *, first_try: bool
    ) -> Answer:
        """:meth:`_send_and_wait` on ``link`` (``reused``: it was open before this request)."""
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
        raise TransportError(f"{endpoint}: {failure or type(failure).__name__}{closed_hint(endpoint, failure)}") from failure

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
        # A hello even without a token (a server with auth off answers it whatever it carries):
        # its reply says what the server takes one-way.
        hello = next(self._tags)
        link = _Link(sock, hello, next(self._tags), self._max_response_bytes)
        greeting = {"token": self._token} if self._token else {}
        opening = wire.STREAM_PREFACE + wire.frame([hello, wire.HELLO_OP, "", greeting])
        try:
            sock.settimeout(None)  # the reader blocks; each request's timeout is its own wait
            sock.sendall(opening)
        except OSError as exc:
            self._drop(sock)
            self._raise_if_closed(exc)
            raise TransportError(f"{endpoint}: {exc or type(exc).__name__}{closed_hint(endpoint, exc)}") from exc
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
