"""The process: event loop, the one listening port, signals, graceful shutdown.

One port serves both protocols: :class:`Listener` reads each connection's first byte and
hands the connection to the stream protocol if it is NUL (no HTTP request starts with
one; see ``wire.STREAM_PREFACE``), else to aiohttp's HTTP server.

Order of start: bind the listener (``/healthz`` answers, operations answer 503
``not_ready``), recover the log, then print the ready line
``rdzv-server listening on http://HOST:PORT`` that scripts and tests wait for.
Order of stop (SIGTERM/SIGINT): refuse new work and answer parked long-polls with 503
``shutting_down``, stop accepting connections, drain in-flight requests of both
protocols (stream connections are closed once their replies are out), flush and close
the log, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web

from .api.app import METRICS, create_app
from .api.stream import StreamServer
from .config import ServerConfig
from .service import Service

log = logging.getLogger("rdzv_server")

# In-flight requests get this long to finish at shutdown (long-polls are answered at once).
DRAIN_TIMEOUT = 10.0
# Thousands of agents connect at once when a job starts; the default backlog (128) resets
# the rest. The kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 65535
# Each node holds a connection or two: lift the soft fd limit to the hard one.
WANTED_OPEN_FILES = 1 << 20
# A connection that sends nothing is closed after this long, as aiohttp closes an idle
# keep-alive connection (its keepalive_timeout default).
FIRST_BYTE_TIMEOUT = 75.0
#: The first byte of a stream connection (its preface); no HTTP request starts with it.
STREAM_FIRST_BYTE = b"\x00"

ProtocolFactory = Callable[[], asyncio.BaseProtocol]


class _FirstByte(asyncio.Protocol):
    """A new connection until its first byte says which protocol it speaks."""

    def __init__(self, listener: Listener) -> None:
        self._listener = listener
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._listener.undecided.add(self)
        self._timer = asyncio.get_running_loop().call_later(FIRST_BYTE_TIMEOUT, self._transport.close)

    def data_received(self, data: bytes) -> None:
        transport = self._transport
        if transport is None or not data:
            return
        self._forget()
        factory = self._listener.stream if data[:1] == STREAM_FIRST_BYTE else self._listener.http
        protocol: Any = factory()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        protocol.data_received(data)

    def eof_received(self) -> bool | None:
        return None  # closed before saying anything: nothing to serve

    def connection_lost(self, exc: BaseException | None) -> None:
        self._forget()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._forget()

    def _forget(self) -> None:
        self._transport = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._listener.undecided.discard(self)


class Listener:
    """The server's one port: accepts connections and hands each to HTTP or the stream protocol.

    ``http`` and ``stream`` are protocol factories (aiohttp's ``web.Server`` and
    :class:`StreamServer`); each owns the connections it is handed, and their shutdown.
    """

    def __init__(self, http: ProtocolFactory, stream: ProtocolFactory) -> None:
        self.http = http
        self.stream = stream
        self.undecided: set[_FirstByte] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> None:
        """Bind and listen. Raises OSError (the port is taken, the host is not ours)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _FirstByte(self), host, port, reuse_address=True, backlog=LISTEN_BACKLOG
        )

    def addresses(self) -> list[tuple[str, int]]:
        """The bound (host, port) of each listening socket (port 0 resolved)."""
        sockets = self._server.sockets if self._server is not None else ()
        return [(name[0], name[1]) for name in (sock.getsockname() for sock in sockets)]

    def close(self) -> None:
        """Accept no more connections; close those that have not spoken yet."""
        if self._server is not None:
            self._server.close()
        for first_byte in list(self.undecided):
            first_byte.close()


def _raise_open_files_limit() -> None:
    try:
        import resource
    except ImportError:  # not on this platform
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(WANTED_OPEN_FILES, hard) if hard != resource.RLIM_INFINITY else WANTED_OPEN_FILES
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("Could not raise the open-files limit from %d to %d: %s", soft, target, exc)


async def serve(config: ServerConfig, stop: asyncio.Event) -> None:
    svc = Service(config)
    svc.on_fatal = lambda exc: stop.set()
    app = create_app(svc)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=DRAIN_TIMEOUT, access_log=None)
    await runner.setup()
    assert runner.server is not None  # set by setup()
    streams = StreamServer(svc, app[METRICS])
    listener = Listener(http=runner.server, stream=streams)
    try:
        await listener.start(config.host, config.port)
        await svc.start()
        host, port = listener.addresses()[0]
        shown = f"[{host}]" if ":" in host else host
        print(f"rdzv-server listening on http://{shown}:{port}", flush=True)
        await stop.wait()
        log.info("Shutting down: draining in-flight requests and flushing the log.")
    finally:
        svc.begin_stop()
        listener.close()
        await asyncio.gather(streams.shutdown(DRAIN_TIMEOUT), runner.cleanup())
        await svc.close()
    if svc.fatal_error is not None:
        raise SystemExit(f"rdzv-server: stopped because the log failed: {svc.fatal_error}")


def run(config: ServerConfig) -> int:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    _raise_open_files_limit()
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # optional: plain asyncio is fine, just slower
        pass

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(config, stop)

    try:
        asyncio.run(main())
    except OSError as exc:
        print(f"rdzv-server: error: {exc} (is another server already on port {config.port}? try --port)", file=sys.stderr)
        return 1
    return 0
