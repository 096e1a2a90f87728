"""The seam below client policy: one exchange with one server, no retries, no interpretation.

What it owns:
- :class:`Transport`, what :class:`AsyncClient` asks of a transport: an operation
  (``call``), a one-way one where the connection takes it (``notify``: the beat), a join
  that also parks the node's next watch where the connection takes it
  (``call_then_watch``, then ``wait_kept`` or ``drop_kept``: :class:`KeptWatch`), a
  read-only page (``fetch``, the JSON GETs) and ``aclose``; and :class:`BlockingTransport`,
  the same as plain blocking methods (``close`` for ``aclose``) for the threaded
  :class:`Client`, which is generated from AsyncClient;
- :class:`AiohttpTransport` (a ``Transport``): everything over HTTP;
- what every transport shares, public for the transports of :mod:`rdzv_client.stream`
  (the blocking ones, over the stream protocol) and the bench's: :class:`Endpoint`,
  :class:`Answer`, :class:`TransportError`, :func:`http_answer`, the JSON page request
  (:func:`json_headers`, :func:`json_request`), :class:`TransportTLS`, :func:`closed_hint`
  and :func:`forks`.

An ``https://`` endpoint means TLS, for every protocol. Every transport uses the one
``ssl.SSLContext`` it is given (:func:`rdzv_client.tls.client_context`; by default one
that trusts the system's store, made on first use: :class:`TransportTLS`).

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
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
import ssl
import threading
from collections.abc import Mapping
from typing import Any, Protocol

import aiohttp

from . import wire
from .error import RdzvConnectionError, ServerError
from .tls import client_context, is_tls_misconfiguration, tls_failure

# A server that does not accept a connection in this long is not going to.
DEFAULT_CONNECT_TIMEOUT = 10.0
# Beyond a request's own hold, an answer this late means the server or the path is stuck.
DEFAULT_REQUEST_TIMEOUT = 30.0
# Every blocking call holds one connection; torch agents run a handful at once, so 128
# leaves room for many threads sharing one client without queueing behind long-polls.
DEFAULT_CONNECTION_LIMIT = 128
# Store replies are small; 64 KiB reads take a typical reply in one go (aiohttp's read size).
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


@dataclasses.dataclass(frozen=True)
class KeptWatch:
    """A watch the server parked for a node when it answered its join (or await_round) with an
    assignment (``wire.THEN_WATCH``): the assignment's ``round``, the watch's ``hold``, and what
    the transport that sent it waits on for its answer (its own business)."""

    round: int
    hold: float
    waiter: Any


def kept_round(answer: Answer) -> int | None:
    """The round of the watch the server parks when it answers a request that carried
    ``then_watch`` with ``answer`` (None: it parks none; see wire, "stream protocol")."""
    if answer.status != 200 or not isinstance(answer.body, dict):
        return None
    assignment = answer.body.get("assignment")
    round_ = assignment.get("round") if isinstance(assignment, dict) else None
    return round_ if type(round_) is int else None


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

    async def notify(
        self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], *, answered_within: float
    ) -> bool:
        """Send ``op`` one-way (``wire.ONE_WAY_OPS``) on an open stream connection whose server
        takes it, when a reply came on it within ``answered_within`` s; False, with nothing
        sent, when it cannot (then the caller sends the request answered)."""
        ...

    async def call_then_watch(
        self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float, *, hold: float
    ) -> tuple[Answer, KeptWatch | None]:
        """:meth:`call` a join or await_round asking the server to park the node's next watch
        (held ``hold`` s) once it answers with an assignment, where the connection's server takes
        ``then_watch`` (its hello said so); the answer, and the watch it parked (None: none,
        or the request went as a plain :meth:`call`)."""
        ...

    async def wait_kept(self, kept: KeptWatch, timeout: float) -> Answer | None:
        """The answer of a watch the server parked (:meth:`call_then_watch`), waiting up to
        ``timeout`` s (raises :class:`TransportError` past it); None when its connection ended
        first (then send the watch)."""
        ...

    def drop_kept(self, kept: KeptWatch) -> None:
        """Forget a parked watch no one will wait on (its answer, when it comes, is dropped)."""
        ...

    async def hello_reply(self, endpoint: Endpoint, timeout: float) -> dict[str, Any] | None:
        """The stream connection's hello reply (opening the connection if none is open),
        waiting up to ``timeout`` s for it; None where there is none (HTTP, a connection per
        call) or it did not come."""
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

    def notify(
        self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], *, answered_within: float
    ) -> bool:
        """:meth:`Transport.notify`, blocking the calling thread no longer than a ``send``."""
        ...

    def call_then_watch(
        self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float, *, hold: float
    ) -> tuple[Answer, KeptWatch | None]:
        """:meth:`Transport.call_then_watch`, blocking."""
        ...

    def wait_kept(self, kept: KeptWatch, timeout: float) -> Answer | None:
        """:meth:`Transport.wait_kept`, blocking."""
        ...

    def drop_kept(self, kept: KeptWatch) -> None:
        """:meth:`Transport.drop_kept`."""
        ...

    def hello_reply(self, endpoint: Endpoint, timeout: float) -> dict[str, Any] | None:
        """:meth:`Transport.hello_reply`, blocking."""
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


def json_request(headers: Mapping[str, str], body: Any) -> tuple[bytes | None, Mapping[str, str]]:
    """A JSON page request's body and headers (no body: a GET's)."""
    if body is None:
        return None, headers
    return wire.dump_json(body), {**headers, "Content-Type": wire.CONTENT_TYPE_JSON}


def _with_token(headers: Mapping[str, str], token: str | None) -> dict[str, str]:
    return {**headers, "Authorization": f"Bearer {token}"} if token else dict(headers)


def json_headers(token: str | None) -> dict[str, str]:
    """The headers of a JSON page request, with the bearer token when there is one."""
    return _with_token(_JSON_HEADERS, token)


class TransportTLS:
    """The transport's TLS context: the one it was given, else the default, made on first use."""

    def __init__(self, context: ssl.SSLContext | None) -> None:
        self._context = context
        self._lock = threading.Lock()

    def context(self) -> ssl.SSLContext:
        with self._lock:
            if self._context is None:
                self._context = client_context()
            return self._context


def closed_hint(endpoint: Endpoint, exc: BaseException) -> str:
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
        self._json_headers = json_headers(token)
        self._tls = TransportTLS(tls)
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
        data, headers = json_request(self._json_headers, body)
        return await self._send(endpoint, method, path, data, headers, timeout)

    async def notify(
        self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], *, answered_within: float
    ) -> bool:
        """HTTP answers every request: nothing goes one-way (False)."""
        return False

    async def call_then_watch(
        self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float, *, hold: float
    ) -> tuple[Answer, KeptWatch | None]:
        """HTTP has no ``then_watch`` (a stream field): a plain :meth:`call`, no watch parked."""
        return await self.call(endpoint, rdzv_id, op, fields, timeout), None

    async def wait_kept(self, kept: KeptWatch, timeout: float) -> Answer | None:
        return None  # (never kept here)

    def drop_kept(self, kept: KeptWatch) -> None:
        pass  # (never kept here)

    async def hello_reply(self, endpoint: Endpoint, timeout: float) -> dict[str, Any] | None:
        return None  # HTTP has no hello

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
                raise TransportError(f"{str(exc) or type(exc).__name__}{closed_hint(endpoint, exc)}") from exc
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




# --------------------------------------------------------------------------- forks


# Forks this process has been through (its child's count is one more): a transport or client
# notices it was forked by comparing counts, not by asking the kernel for its pid on every call.
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_child=_forked)


def forks() -> int:
    """How many forks this process has been through (one more in each child than in its parent)."""
    return _forks
