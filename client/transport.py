"""The seam below client policy: one exchange with one server, no retries, no interpretation.

What it owns:
- :class:`Transport`, what :class:`AsyncClient` asks of a transport: an operation
  (``call``), a read-only page (``fetch``, the JSON GETs) and ``aclose``; and
  :class:`BlockingTransport`, the same three as plain blocking methods (``close`` for
  ``aclose``) for the threaded :class:`Client`, which is generated from AsyncClient;
- :class:`AiohttpTransport` (a ``Transport``): everything over HTTP;
- :class:`SocketTransport` (a ``BlockingTransport``): blocking sockets, shared by threads.
  Operations travel as stream-protocol frames (see ``wire``, "stream protocol") over pooled
  connections, one request in flight per connection; the JSON pages over HTTP/1.1.

An ``https://`` endpoint means TLS, for both protocols: the stream protocol's frames travel
inside TLS exactly as they do over plain TCP. Both transports use the one
``ssl.SSLContext`` they are given (:func:`rdzv_client.tls.client_context`; by default one
that trusts the system's store, made on first use).

What it must not know: retries, deadlines, error codes (``client.py`` decides all of
them from an :class:`Answer`).

Rules:
- A transport raises :class:`TransportError` only when no complete answer arrived
  (refused, reset, timed out, truncated): the client may retry those.
- A TLS failure that retrying cannot fix (the server's certificate is not trusted, a side
  rejected the handshake, the port does not speak TLS) raises :class:`RdzvConnectionError`
  at once, naming TLS and what to check (:func:`rdzv_client.tls.tls_failure`).
- Any failure during an exchange discards that connection; a pooled connection found
  closed or reset (the server closed it after its ``--idle-timeout``, shed it at its
  connection limit, or restarted while it sat idle) is replaced once, at once, by a fresh
  one. Resending is safe: a write's rid makes it apply once.
- A transport given a token presents it on every exchange: ``Authorization: Bearer`` over
  HTTP, a hello frame pipelined right after the preface on each new stream connection.
  Redirects are never followed (``http.client`` does not; aiohttp is told not to): the token
  goes only to the endpoints the client was given, and a 3xx is answered as an error.
- A stream error frame with tag 0 answers the connection rather than one request (the
  server refused it: ``too_many_connections``, ``buffers_full``, ``request_timeout``); with
  one request in flight per connection it is that request's answer, and the connection,
  which the server closes, is discarded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import io
import itertools
import os
import socket
import ssl
import struct
import threading
from collections.abc import Mapping
from typing import Any, Protocol

import aiohttp

from . import frame, wire
from .error import ClientClosedError, RdzvConnectionError, ServerError
from .tls import client_context, is_tls_misconfiguration, tls_failure

# A server that does not accept a connection in this long is not going to.
DEFAULT_CONNECT_TIMEOUT = 10.0
# Beyond a request's own hold, an answer this late means the server or the path is stuck.
DEFAULT_REQUEST_TIMEOUT = 30.0
# Every blocking call holds one connection; torch agents run a handful at once, so 128
# leaves room for many threads sharing one client without queueing behind long-polls.
DEFAULT_CONNECTION_LIMIT = 128
# Store replies are small; 64 KiB reads take a typical reply in one go.
DEFAULT_READ_BUFSIZE = 64 * 1024
# Bounds what a misbehaving peer can make us buffer; far above any sane multi_get reply.
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
# Bodies above this are handed to aiohttp as a file, written in pieces: aiohttp warns that a
# larger bytes body written at once may block the event loop (its TOO_LARGE_BYTES_BODY).
STREAMED_BODY_BYTES = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """One server address."""

    host: str
    port: int = wire.DEFAULT_PORT
    scheme: str = "http"
    # The hash, worked out once: a transport looks its connections up by endpoint on every call.
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.host, self.port, self.scheme)))

    def __hash__(self) -> int:
        return self._hash

    @property
    def url(self) -> str:
        """The base URL, e.g. ``http://[::1]:29400``."""
        return f"{self.scheme}://{self}"

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclasses.dataclass(frozen=True)
class Answer:
    """A server's answer: the HTTP status and the decoded body (the stream carries the same two)."""

    status: int
    body: Any


class TransportError(Exception):
    """The request got no complete answer: refused, reset, timed out or truncated."""


class Transport(Protocol):
    """What :class:`AsyncClient` needs from a transport; see the module rules."""

    async def call(self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float) -> Answer:
        """Send operation ``op`` of job ``rdzv_id`` with its request ``fields``; wait up to ``timeout`` s."""
        ...

    async def fetch(
        self, endpoint: Endpoint, path: str, timeout: float, *, method: str = "GET", body: Any = None
    ) -> Answer:
        """GET ``path`` (a JSON page such as ``/v1/jobs`` or ``/healthz``); or ``method`` (POST,
        DELETE) with ``body`` sent as JSON (the fleet routes: ``/v1/cordons``)."""
        ...

    async def aclose(self) -> None: ...


class BlockingTransport(Protocol):
    """:class:`Transport` for the threaded client: the same exchanges, blocking the calling thread."""

    def call(self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float) -> Answer:
        """Send operation ``op`` of job ``rdzv_id`` with its request ``fields``; wait up to ``timeout`` s."""
        ...

    def fetch(
        self, endpoint: Endpoint, path: str, timeout: float, *, method: str = "GET", body: Any = None
    ) -> Answer:
        """GET ``path`` (a JSON page such as ``/v1/jobs`` or ``/healthz``); or ``method`` (POST,
        DELETE) with ``body`` sent as JSON (the fleet routes: ``/v1/cordons``)."""
        ...

    def close(self) -> None:
        """Close every connection; calls in flight raise :class:`ClientClosedError`."""
        ...


def http_answer(status: int, content_type: str, data: bytes, max_bytes: int) -> Answer:
    """Decode an HTTP body by its content type. A 2xx the client cannot read is a
    :class:`ServerError`; an unreadable error page (a proxy's) keeps its first words."""
    try:
        if content_type == wire.CONTENT_TYPE_MSGPACK:
            return Answer(status, wire.unpack(data, max_bytes, max_items=wire.MAX_REPLY_ITEMS))
        if content_type == wire.CONTENT_TYPE_JSON:
            return Answer(status, wire.load_json(data, max_bytes))
        raise wire.WireError(f"unexpected content type {content_type!r}")
    except wire.WireError as exc:
        if 200 <= status < 300:
            raise ServerError(f"the server sent a reply this client cannot read: {exc}") from exc
        text = data[:200].decode("utf-8", errors="replace").strip()
        return Answer(status, {"message": f"HTTP {status}: {text}" if text else ""})


_MSGPACK_HEADERS = {"Content-Type": wire.CONTENT_TYPE_MSGPACK, "Accept": wire.CONTENT_TYPE_MSGPACK}
_JSON_HEADERS = {"Accept": wire.CONTENT_TYPE_JSON}


def _json_request(headers: Mapping[str, str], body: Any) -> tuple[bytes | None, Mapping[str, str]]:
    """A JSON page request's body and headers (no body: a GET's)."""
    if body is None:
        return None, headers
    return wire.dump_json(body), {**headers, "Content-Type": wire.CONTENT_TYPE_JSON}


def _with_token(headers: Mapping[str, str], token: str | None) -> dict[str, str]:
    return {**headers, "Authorization": f"Bearer {token}"} if token else dict(headers)


class _TLS:
    """The transport's TLS context: the one it was given, else the default, made on first use."""

    def __init__(self, context: ssl.SSLContext | None) -> None:
        self._context = context
        self._lock = threading.Lock()

    def context(self) -> ssl.SSLContext:
        with self._lock:
            if self._context is None:
                self._context = client_context()
            return self._context


def _closed_hint(endpoint: Endpoint, exc: BaseException) -> str:
    """A hint for a connection closed before any answer: a TLS server closes a connection whose
    handshake fails without a word the client can read, so say what may be behind it."""
    if not isinstance(exc, (ConnectionError, EOFError, aiohttp.ServerDisconnectedError)):
        return ""
    if endpoint.scheme == "https":
        return " (a server that requires client certificates, --tls-client-ca, closes TLS connections that bring none)"
    return " (a server with TLS, --tls-cert, closes plain connections: use an https:// endpoint or tls)"


def _misconfigured_tls(exc: BaseException) -> BaseException | None:
    """The TLS error behind ``exc`` (its causes and aiohttp's wrapped errors included) that
    retrying cannot fix; None when there is none."""
    seen: BaseException | None = exc
    for _ in range(8):  # a short chain; bounded in case of a cycle
        if seen is None:
            return None
        if is_tls_misconfiguration(seen):
            return seen
        inner = getattr(seen, "certificate_error", None) or getattr(seen, "os_error", None)
        seen = inner if isinstance(inner, BaseException) else (seen.__cause__ or seen.__context__)
    return None


# --------------------------------------------------------------------------- HTTP (asyncio)


class AiohttpTransport:
    """:class:`Transport` over one aiohttp session with persistent connections.

    The session is opened on first use, inside the event loop that uses it; a transport
    belongs to that one loop.
    """

    def __init__(
        self,
        *,
        connection_limit: int = DEFAULT_CONNECTION_LIMIT,
        read_bufsize: int = DEFAULT_READ_BUFSIZE,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        token: str | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._msgpack_headers = _with_token(_MSGPACK_HEADERS, token)
        self._json_headers = _with_token(_JSON_HEADERS, token)
        self._tls = _TLS(tls)
        self._connection_limit = connection_limit
        self._read_bufsize = read_bufsize
        self._max_response_bytes = max_response_bytes
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._connection_limit, limit_per_host=0)
            self._session = aiohttp.ClientSession(
                connector=connector,
                read_bufsize=self._read_bufsize,
                timeout=aiohttp.ClientTimeout(total=DEFAULT_REQUEST_TIMEOUT),
                trust_env=False,  # a rendezvous on a cluster network must not go through a proxy
                auto_decompress=False,  # the server never compresses; refuse to inflate
            )
        return self._session

    async def call(self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float) -> Answer:
        path = wire.op_path(rdzv_id, op)
        return await self._send(endpoint, "POST", path, wire.pack(fields), self._msgpack_headers, timeout)

    async def fetch(
        self, endpoint: Endpoint, path: str, timeout: float, *, method: str = "GET", body: Any = None
    ) -> Answer:
        data, headers = _json_request(self._json_headers, body)
        return await self._send(endpoint, method, path, data, headers, timeout)

    async def _send(
        self,
        endpoint: Endpoint,
        method: str,
        path: str,
        body: bytes | None,
        headers: Mapping[str, str],
        timeout: float,
        *,
        retried: bool = False,
    ) -> Answer:
        session = self._open()
        tls: ssl.SSLContext | bool = self._tls.context() if endpoint.scheme == "https" else True
        try:
            async with session.request(
                method,
                endpoint.url + path,
                data=io.BytesIO(body) if body is not None and len(body) > STREAMED_BODY_BYTES else body,
                headers=dict(headers),
                timeout=aiohttp.ClientTimeout(total=timeout),
                ssl=tls,
                # A redirect would carry the token to a URL the answer chose: credentials go only
                # to the endpoints this client was given (a 3xx is an answer like any other).
                allow_redirects=False,
            ) as resp:
                data = await self._read(resp)
                return http_answer(resp.status, resp.content_type, data, self._max_response_bytes)
        except aiohttp.ServerDisconnectedError as exc:
            if retried:  # closed again at once: the server is going away, or refuses us (see _closed_hint)
                raise TransportError(f"{str(exc) or type(exc).__name__}{_closed_hint(endpoint, exc)}") from exc
            # A pooled connection the server closed while idle (--idle-timeout) as we sent on it.
            return await self._send(endpoint, method, path, body, headers, timeout, retried=True)
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            tls_error = _misconfigured_tls(exc)
            if tls_error is not None:
                raise RdzvConnectionError(tls_failure(endpoint, tls_error)) from exc
            raise TransportError(str(exc) or type(exc).__name__) from exc

    async def _read(self, resp: aiohttp.ClientResponse) -> bytes:
        limit = self._max_response_bytes
        if resp.content_length is not None and resp.content_length <= limit:
            return await resp.read()
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_any():
            size += len(chunk)
            if size > limit:
                raise ServerError(f"the server's reply exceeds the client's limit of {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


# --------------------------------------------------------------------------- blocking sockets


class _Stale(Exception):
    """A pooled connection turned out to be closed (the server restarted while it sat idle)."""


# Forks this process has been through (its child's count is one more): a transport notices it
# was forked by comparing counts, not by asking the kernel for its pid on every call.
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def forks() -> int:
    """How many forks this process has been through (one more in each child than in its parent)."""
    return _forks


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
        self._tls = _TLS(tls)
        self._json_headers = _with_token(_JSON_HEADERS, token)
        self._max_idle = connection_limit
        self._max_response_bytes = max_response_bytes
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._idle: dict[Endpoint, list[socket.socket]] = {}
        self._busy: set[socket.socket] = set()
        self._tags = itertools.count(1)
        self._closed = False
        self._forks = _forks
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
        data, headers = _json_request(self._json_headers, body)
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
                message = self._decode(self._read_frame(sock, replies, allow_more=True))
                if message[0] == hello and message[1] == 200:  # welcomed: the request's answer is next
                    message = self._decode(self._read_frame(sock, replies))
            else:
                message = self._decode(self._read_reply(sock))
            ok = message[0] == tag  # tag 0: the server refused the connection and closes it
        except (OSError, EOFError) as exc:
            self._raise_if_closed(exc)
            if isinstance(exc, BlockingIOError):  # the kernel's timeout (_set_timeout): say it as Python would
                raise TransportError(f"{endpoint}: timed out") from exc
            if is_tls_misconfiguration(exc):  # e.g. TLS 1.3: a refused client certificate shows on the first read
                raise RdzvConnectionError(tls_failure(endpoint, exc)) from exc
            if reused and isinstance(exc, (ConnectionError, EOFError)):
                raise _Stale() from exc  # retrying is safe: a write's rid makes it apply once
            raise TransportError(f"{endpoint}: {exc or type(exc).__name__}{_closed_hint(endpoint, exc)}") from exc
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

    def _read_reply(self, sock: socket.socket) -> bytes:
        """The one reply frame's payload off ``sock`` (nothing may follow it): in one read when
        it came whole, as a small reply does; else through a :class:`frame.FrameDecoder`."""
        chunk = sock.recv(DEFAULT_READ_BUFSIZE)
        try:
            whole = frame.frame_end(chunk, 0, self._max_response_bytes) == len(chunk)
        except frame.FrameTooLarge as exc:
            raise ServerError(f"the server's reply of {exc.length} bytes exceeds the client's limit") from exc
        if whole:
            return chunk[frame.HEADER_LEN :]
        if not chunk:
            raise EOFError("the server closed the connection mid-reply")
        replies = frame.FrameDecoder(self._max_response_bytes)
        replies.feed(chunk)
        return self._read_frame(sock, replies)

    def _read_frame(self, sock: socket.socket, replies: frame.FrameDecoder, *, allow_more: bool = False) -> bytes:
        """The next frame's payload off ``sock``, through ``replies`` (this exchange's decoder).
        Only the hello's answer may have bytes behind it (the request's answer, pipelined);
        any other reply with bytes after it is a protocol error."""
        while True:
            try:
                payload = replies.next_payload()
            except frame.FrameTooLarge as exc:
                raise ServerError(f"the server's reply of {exc.length} bytes exceeds the client's limit") from exc
            if payload is not None:
                break
            # The header in one read if it can; then exactly the rest of the frame, no more.
            want = DEFAULT_READ_BUFSIZE if replies.buffered < frame.HEADER_LEN else min(replies.missing(), 1 << 20)
            chunk = sock.recv(want)
            if not chunk:
                raise EOFError("the server closed the connection mid-reply")
            replies.feed(chunk)
        if replies.buffered and not allow_more:
            raise ServerError("the server sent bytes after its reply, with no request outstanding")
        return payload

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
        if _forks != self._forks:  # a forked child must not share its parent's connections
            self._forked()

    def _forked(self) -> None:
        """In a forked child: forget the parent's connections (never touched from here)."""
        self._idle.clear()
        self._busy.clear()
        self._timeouts.clear()
        self._forks = _forks

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
            raise TransportError(f"{endpoint}: {exc or type(exc).__name__}{_closed_hint(endpoint, exc)}") from exc
        finally:
            conn.close()
        if len(data) > self._max_response_bytes:
            raise ServerError(f"the server's reply exceeds the client's limit of {self._max_response_bytes} bytes")
        content_type = (resp.getheader("Content-Type") or "").split(";")[0].strip()
        return http_answer(resp.status, content_type, data, self._max_response_bytes)
