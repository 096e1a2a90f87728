"""The process: event loop, the one listening port, signals, graceful shutdown.

One port serves both protocols: :class:`Listener` reads each connection's first byte and
hands the connection to the stream protocol if it is NUL (no HTTP request starts with
one; see ``wire.STREAM_PREFACE``), else to aiohttp's HTTP server. Every connection is
counted from accept to close by one :class:`.api.connection.ConnectionTable`, which
enforces ``--max-connections`` (clamped below the open-files limit), the buffer budget
and the idle, read and authentication deadlines; a connection that has not spoken within
``--idle-timeout`` (``--auth-timeout`` if shorter, with auth on) is closed.

TLS (``--tls-cert``/``--tls-key``, optionally ``--tls-client-ca`` for mutual TLS) wraps the
port as a whole: the handshake comes first, then :class:`_FirstByte` reads the first
*decrypted* byte, so both protocols, the connection table and the refusals work unchanged
over it. A connection is counted from the end of its handshake; the handshake itself must
finish within ``--read-timeout`` (``--auth-timeout`` if shorter, with auth on: the client has
shown no token yet). A client that does not speak TLS to a TLS port fails its
handshake and is closed (quietly: it is the client's mistake, not the server's).

Order of start: bind the listener (``/healthz`` answers, operations answer 503
``not_ready``), recover the log, then print the ready line
``rdzv-server listening on http://HOST:PORT`` (``https://`` with TLS) that scripts and tests
wait for.
Order of stop (SIGTERM/SIGINT): refuse new work and answer parked long-polls with 503
``shutting_down``, stop accepting connections, drain in-flight requests of both
protocols (stream connections are closed once their replies are out), flush and close
the log, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import ssl
import sys
from collections.abc import Callable
from typing import Any, cast

from aiohttp import web

from rdzv_client import wire
from rdzv_client.tls import no_key_password, ssl_reason

from . import logformat
from .api.app import METRICS, create_app
from .api.auth import TokenError, TokenTable, bearer_token, load_tokens
from .api.aiohttp_seam import http_factory
from .api.connection import FD_RESERVE, LINGER, Closing, ConnectionTable
from .api.stream import StreamServer
from .config import ServerConfig
from .replication import join
from .service import Service

log = logging.getLogger("rdzv_server")

# In-flight requests get this long to finish at shutdown (long-polls are answered at once).
DRAIN_TIMEOUT = 10.0
# Thousands of agents connect at once when a job starts; the default backlog (128) resets
# the rest. The kernel caps it at net.core.somaxconn.
LISTEN_BACKLOG = 65535
# Each node holds one connection: lift the soft fd limit to the hard one.
WANTED_OPEN_FILES = 1 << 20
# The cyclic GC's defaults (700, 10, 10) cost a server that parks thousands of long-polls a
# large share of its CPU: a watch lives seconds, so each one is promoted to the oldest
# generation, and the collections of that generation walk the whole heap (at 4,096 heartbeating
# nodes: 66% of the server's samples in gc_collect_main with py-spy --native; 39% of its CPU
# time in collections by gc.callbacks, 4% with these thresholds). Young collections every
# 50,000 allocations and middle ones every 100th of those let a parked request end before it
# is promoted; reference counting frees everything else as before.
GC_THRESHOLDS = (50_000, 100, 10)
# HTTP request heads: aiohttp's own limits, made explicit. A longer request line or header
# field, or more fields, is answered 431 headers_too_large, and so is a head larger than
# --max-head-bytes in all (the connection table's count); what a head holds while it arrives
# is charged to --max-buffered-bytes (and to --max-pre-auth-bytes until a token is shown).
MAX_HEADER_LINE = 8190
MAX_HEADER_FIELDS = 128
# TLS 1.0 and 1.1 are deprecated (RFC 8996); every client this server has speaks 1.2 or 1.3.
TLS_MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2
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
        table = self._listener.table
        if not table.admit(self, table.timers.time()):
            message = f"the server is at its connection limit ({table.max_connections}); retry shortly"
            Closing(table, wire.ErrorCode.TOO_MANY_CONNECTIONS, message).adopt(transport)
            return
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        # Silent, it has shown no token either: a stranger's connection waits --auth-timeout at most.
        wait = table.idle_timeout if table.auth_timeout is None else min(table.idle_timeout, table.auth_timeout)
        self._timer = asyncio.get_running_loop().call_later(wait, self._idle)

    def _idle(self) -> None:
        self._timer = None
        self._listener.table.shed("idle_timeout")
        self.close()

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
        self._listener.table.decided(self)


class Listener:
    """The server's one port: accepts connections and hands each to HTTP or the stream protocol.

    ``http`` and ``stream`` are protocol factories (:func:`.api.aiohttp_seam.http_factory`
    and :class:`StreamServer`); each owns the connections it is handed, and their shutdown.
    ``table`` counts every connection, from accept on.
    """

    def __init__(self, http: ProtocolFactory, stream: ProtocolFactory, table: ConnectionTable) -> None:
        self.http = http
        self.stream = stream
        self.table = table
        self._server: asyncio.Server | None = None

    async def start(
        self, host: str, port: int, *, tls: ssl.SSLContext | None = None, handshake_timeout: float = 60.0
    ) -> None:
        """Bind and listen, with TLS when ``tls`` is given: a handshake not done within
        ``handshake_timeout`` seconds is aborted. Raises OSError (the port is taken, the host
        is not ours)."""
        loop = asyncio.get_running_loop()
        extra: dict[str, Any] = {}
        if tls is not None:
            extra["ssl"] = tls
            extra["ssl_handshake_timeout"] = handshake_timeout
            if sys.version_info >= (3, 11):  # (uvloop has it on 3.10 too; asyncio from 3.11)
                # Closing a TLS connection waits for the client's close_notify this long: what
                # LINGER is to a plain refusal. A pooled client that is not reading never sends it.
                extra["ssl_shutdown_timeout"] = LINGER
        self._server = await loop.create_server(
            lambda: _FirstByte(self), host, port, reuse_address=True, backlog=LISTEN_BACKLOG, **extra
        )

    def addresses(self) -> list[tuple[str, int]]:
        """The bound (host, port) of each listening socket (port 0 resolved)."""
        sockets = self._server.sockets if self._server is not None else ()
        return [(name[0], name[1]) for name in (sock.getsockname() for sock in sockets)]

    def close(self) -> None:
        """Accept no more connections; close those that have not spoken yet."""
        if self._server is not None:
            self._server.close()
        for first_byte in list(self.table.undecided):
            first_byte.close()


def _raise_open_files_limit() -> None:
    """Lift the soft open-files limit to the hard one (at most WANTED_OPEN_FILES): each node
    holds one connection, so the soft limit (often 1,024) would cap a job at about that."""
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


def _open_files_limit() -> str:
    """The open-files limit, as the start-up line says it."""
    try:
        import resource
    except ImportError:  # not on this platform
        return "unknown"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft_text, hard_text = ("unlimited" if n == resource.RLIM_INFINITY else str(n) for n in (soft, hard))
    return f"{soft_text} (hard {hard_text})"


def connection_limit(wanted: int) -> int:
    """``--max-connections``, clamped so that descriptors remain for the log and for refusals."""
    try:
        import resource
    except ImportError:  # not on this platform
        return wanted
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, soft - min(FD_RESERVE, soft // 4)))


def _tokens(config: ServerConfig) -> TokenTable:
    """The token table, or auth off, loudly. Raises SystemExit when a token file is unusable."""
    token_file = config.resolved_token_file()
    if token_file is None:
        log.warning(
            "AUTH IS OFF (--no-auth): anyone who can reach this port can read and change every job, close it, "
            "or take node rank 0 and point every worker at an address of their choosing. Use it on a trusted "
            "network only."
        )
        return TokenTable(None)
    try:
        return load_tokens(token_file, config.read_token_file)
    except TokenError as exc:
        raise SystemExit(f"rdzv-server: error: {exc}") from exc


def tls_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The server's TLS context (None without ``--tls-cert``): TLS 1.2 at least, and client
    certificates required with ``--tls-client-ca``. Raises SystemExit (a one-line error)
    when a file cannot be read or does not hold what its flag names."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_MINIMUM_VERSION
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key, password=no_key_password)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise SystemExit(
            f"rdzv-server: error: cannot load the TLS certificate {config.tls_cert} and key {config.tls_key} "
            f"(--tls-cert, --tls-key): {ssl_reason(exc)}; give a PEM certificate chain and its unencrypted "
            "PEM private key"
        ) from exc
    if config.tls_client_ca is not None:
        try:
            context.load_verify_locations(cafile=config.tls_client_ca)
        except (OSError, ValueError) as exc:
            raise SystemExit(
                f"rdzv-server: error: cannot load the client CA bundle {config.tls_client_ca} (--tls-client-ca): "
                f"{ssl_reason(exc)}; give the PEM certificate(s) of the CA that signs the clients' certificates"
            ) from exc
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _handshake_timeout(config: ServerConfig, tokens: TokenTable) -> float:
    """A TLS handshake is said by someone who has not shown a token yet: --auth-timeout bounds it."""
    return min(config.read_timeout, config.auth_timeout) if tokens.enabled else config.read_timeout


async def _start(svc: Service) -> SystemExit | None:
    """``svc.start()``; the SystemExit it raises when the server must not serve, returned."""
    try:
        await svc.start()
    except SystemExit as exc:
        return exc
    return None


async def serve(config: ServerConfig, stop: asyncio.Event) -> None:
    tokens = _tokens(config)
    tls = tls_context(config)
    svc = Service(config, join if config.etcd else None)
    svc.on_fatal = lambda exc: stop.set()
    app = create_app(svc, tokens)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=DRAIN_TIMEOUT, access_log=None)
    await runner.setup()
    assert runner.server is not None  # set by setup()
    limit = connection_limit(config.max_connections)
    clamped = f" (--max-connections {config.max_connections} clamped to the open-files limit)"
    log.info(
        "Serving at most %d connections%s, with an open-files limit of %s: room for about %d torchrun nodes "
        "(one connection each); more are refused with too_many_connections. "
        "Raise the hard open-files limit (ulimit -Hn, systemd LimitNOFILE=) for more.",
        limit, clamped if limit < config.max_connections else "", _open_files_limit(), limit,
    )  # fmt: skip
    table = ConnectionTable(
        timers=asyncio.get_running_loop(),
        max_connections=limit,
        max_buffered_bytes=config.max_buffered_bytes,
        idle_timeout=config.idle_timeout,
        read_timeout=config.read_timeout,
        max_pre_auth_bytes=config.pre_auth_bytes(),
        max_head_bytes=config.max_head_bytes,
        # With auth off there is no stranger: every connection is a token holder's.
        auth_timeout=config.auth_timeout if tokens.enabled else None,
    )
    app[METRICS].track_connections(table)
    streams = StreamServer(svc, app[METRICS], table, tokens)
    http = http_factory(
        runner.server,
        table,
        lambda authorization: tokens.grant(bearer_token(authorization)) is not None,
        # The table closes idle connections; aiohttp's own keep-alive close is only a backstop.
        keepalive_timeout=config.idle_timeout + config.read_timeout,
        access_log=None,
        lingering_time=LINGER,
        max_line_size=MAX_HEADER_LINE,
        max_field_size=MAX_HEADER_LINE,
        max_headers=MAX_HEADER_FIELDS,
    )
    listener = Listener(http=http, stream=streams, table=table)
    try:
        await listener.start(config.host, config.port, tls=tls, handshake_timeout=_handshake_timeout(config, tokens))
        svc.bound_port = listener.addresses()[0][1]
        # A replica waits for etcd as long as it takes; SIGTERM meanwhile still stops it.
        starting = asyncio.ensure_future(_start(svc))
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            log.info("Stopped before the start finished.")
            return
        refused = starting.result()
        if refused is not None:  # raised here, not in the task: the shutdown below still runs
            raise refused
        gc.freeze()  # what start-up built (modules, the recovered state) is never garbage: stop walking it
        host, port = listener.addresses()[0]
        shown = f"[{host}]" if ":" in host else host
        scheme = "https" if tls is not None else "http"
        print(f"rdzv-server listening on {scheme}://{shown}:{port}", flush=True)
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
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logformat.formatter(config.log_format))
    logging.basicConfig(level=config.log_level.upper(), handlers=[handler])
    _raise_open_files_limit()
    gc.set_threshold(*GC_THRESHOLDS)
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
