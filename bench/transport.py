"""The simulated agents' transport: one pipelined stream connection per endpoint, in asyncio.

What it owns: :class:`AsyncStreamTransport`, a :class:`rdzv_client.transport.Transport` for
:class:`rdzv_client.AsyncClient` that speaks the stream protocol as the torchrun plug-in's
:class:`rdzv_client.stream.PipelinedSocketTransport` does (preface and hello pipelined,
requests tagged, replies handed out by tag, a tag-0 reply the answer of every request on
the connection, beats one-way where the hello said so, a join that parks the node's next
watch where the hello lists ``then_watch``), in one event loop: the bench's simulated agents (:mod:`bench.agents`),
thousands per process, each one connection, as a real agent is. It lives in the bench
because nothing in the product uses it; its frames are read by :mod:`rdzv_client.frame` and
decoded by :func:`rdzv_client.stream.decode_reply`, as the plug-in's are.

Rules it keeps (on top of :mod:`rdzv_client.transport`'s): a pooled connection the server
had closed is replaced once, at once, by a fresh one; callers share one opening of an
endpoint's connection; a request whose answer does not come within its timeout closes the
connection; JSON pages go over HTTP (an :class:`rdzv_client.transport.AiohttpTransport`).

What it must not know: client policy (retries, deadlines, error codes).
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
import time
from typing import Any

from rdzv_client import frame, wire
from rdzv_client.error import ClientClosedError, RdzvConnectionError, ServerError
from rdzv_client.stream import decode_reply, unreadable_reply
from rdzv_client.tls import is_tls_misconfiguration, tls_failure
from rdzv_client.transport import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_RESPONSE_BYTES,
    AiohttpTransport,
    Answer,
    Endpoint,
    KeptWatch,
    TransportError,
    TransportTLS,
    closed_hint,
    kept_round,
)


class _StreamProtocol(asyncio.Protocol):
    """One asyncio stream connection: replies to futures by tag."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.transport: asyncio.Transport | None = None
        self.waiting: dict[int, asyncio.Future[Answer]] = {}
        self.ended: BaseException | Answer | None = None
        self.hello = 0
        # As the plug-in's link: what the hello said goes one-way, when a reply last came, and
        # whether a one-way request was refused (the next goes answered).
        self.one_way: frozenset[str] = frozenset()
        self.one_way_tag = 0  # every one-way request's tag (set at the opening)
        self.answered_at = 0.0
        self.one_way_refused = False
        self.then_watch = False  # the hello said a join may park the node's next watch
        self.greeting: dict[str, Any] | None = None  # the hello's reply, once read
        self.greeted = asyncio.Event()  # set when it is read, or the connection ended without it
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
            except frame.FrameTooLarge as exc:
                self.end(unreadable_reply(exc))
                return
            except ServerError as exc:
                self.end(exc)
                return
            self.answered_at = time.monotonic()
            if tag == 0 or (tag == self.hello and status != 200):
                self.end(Answer(status, body))
                return
            if tag == self.hello:
                self.one_way, self.then_watch, self.greeting = wire.hello_terms(body)
                self.greeted.set()
                continue
            future = self.waiting.pop(tag, None)
            if future is not None and not future.done():
                future.set_result(Answer(status, body))
            elif tag == self.one_way_tag and status >= 300:
                self.one_way_refused = True

    def connection_lost(self, exc: BaseException | None) -> None:
        self.end(exc or EOFError("the server closed the connection"))

    def end(self, why: BaseException | Answer) -> None:
        if self.ended is None:
            self.ended = why
        self.greeted.set()  # no hello reply will come now
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


def _retrieved(future: asyncio.Future[Answer]) -> None:
    """Mark ``future``'s exception as seen (asyncio logs one never retrieved)."""
    if not future.cancelled():
        future.exception()


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
        self._tls = TransportTLS(tls)
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
                return await self._reply(link, tag, future, endpoint, timeout)
            except (OSError, EOFError) as exc:
                if reused and not fresh and not self._closed and isinstance(exc, (ConnectionError, EOFError)):
                    continue  # a pooled connection the server had closed: once more, on a fresh one
                raise self._failed(endpoint, exc) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _reply(
        self, link: _StreamProtocol, tag: int, future: asyncio.Future[Answer], endpoint: Endpoint, timeout: float
    ) -> Answer:
        """The answer tagged ``tag`` within ``timeout`` s (past it the connection ends:
        TransportError); the connection's end raises as it ended (OSError, EOFError)."""
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError as exc:
            link.waiting.pop(tag, None)
            link.end(TimeoutError(f"no answer within {timeout:g} s"))
            raise TransportError(f"{endpoint}: no answer within {timeout:g} s") from exc

    def _failed(self, endpoint: Endpoint, exc: BaseException) -> Exception:
        """What a call raises for its connection's end ``exc``."""
        if self._closed:
            return ClientClosedError("the rdzv client was closed while this call was in flight")
        return TransportError(f"{endpoint}: {exc or type(exc).__name__}{closed_hint(endpoint, exc)}")

    async def call_then_watch(
        self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float, *, hold: float
    ) -> tuple[Answer, KeptWatch | None]:
        """As the plug-in's (:meth:`rdzv_client.stream.PipelinedSocketTransport.call_then_watch`)."""
        link = self._links.get(endpoint)
        if self._closed or link is None or link.ended is not None or link.transport is None or not link.then_watch:
            return await self.call(endpoint, rdzv_id, op, fields, timeout), None
        loop = asyncio.get_running_loop()
        watch_tag, tag = next(self._tags), next(self._tags)
        watch: asyncio.Future[Answer] = loop.create_future()
        future: asyncio.Future[Answer] = loop.create_future()
        watch.add_done_callback(_retrieved)  # a watch no one waits on may end with its connection
        link.waiting[watch_tag] = watch
        link.waiting[tag] = future
        link.transport.write(wire.frame([tag, op, rdzv_id, {**fields, wire.THEN_WATCH: [watch_tag, hold]}]))
        try:
            answer = await self._reply(link, tag, future, endpoint, timeout)
        except (OSError, EOFError) as exc:
            if not self._closed and isinstance(exc, (ConnectionError, EOFError)):  # once more, plain, on a fresh connection
                return await self.call(endpoint, rdzv_id, op, fields, timeout), None
            raise self._failed(endpoint, exc) from exc
        round_ = kept_round(answer)
        if round_ is None:
            link.waiting.pop(watch_tag, None)
            return answer, None
        return answer, KeptWatch(round_, hold, (link, watch_tag, watch))

    async def wait_kept(self, kept: KeptWatch, timeout: float) -> Answer | None:
        link, tag, watch = kept.waiter
        try:
            answer: Answer = await asyncio.wait_for(watch, timeout)
        except asyncio.TimeoutError as exc:
            link.waiting.pop(tag, None)
            link.end(TimeoutError(f"no answer within {timeout:g} s"))
            raise TransportError(f"no answer to the parked watch within {timeout:g} s") from exc
        except (OSError, EOFError):
            return None  # its connection ended first: send the watch
        return answer

    def drop_kept(self, kept: KeptWatch) -> None:
        link, tag, _ = kept.waiter
        link.waiting.pop(tag, None)

    async def hello_reply(self, endpoint: Endpoint, timeout: float) -> dict[str, Any] | None:
        """As the plug-in's (:meth:`rdzv_client.stream.PipelinedSocketTransport.hello_reply`)."""
        link, _ = await self._link(endpoint, timeout, False)
        try:
            await asyncio.wait_for(link.greeted.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        return link.greeting

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
        link.hello = next(self._tags)  # a hello even without a token: its reply lists what goes one-way
        link.one_way_tag = next(self._tags)
        greeting = {"token": self._token} if self._token else {}
        opening = wire.STREAM_PREFACE + wire.frame([link.hello, wire.HELLO_OP, "", greeting])
        link.transport.write(opening)
        old = self._links.get(endpoint)
        self._links[endpoint] = link
        if old is not None and old.ended is None:
            old.end(EOFError("replaced by a fresh connection"))
        if self._closed:
            link.end(ClientClosedError("this rdzv client is closed"))
        return link

    async def notify(
        self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], *, answered_within: float
    ) -> bool:
        """As the plug-in's (:meth:`rdzv_client.stream.PipelinedSocketTransport.notify`)."""
        link = self._links.get(endpoint)
        if self._closed or link is None or link.ended is not None or link.transport is None or op not in link.one_way:
            return False
        if link.one_way_refused or time.monotonic() - link.answered_at > answered_within:
            link.one_way_refused = False
            return False
        link.transport.write(wire.frame([link.one_way_tag, op, rdzv_id, fields]))
        return True

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
