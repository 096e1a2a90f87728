"""The process: event loop, HTTP listener, signals, graceful shutdown.

Order of start: bind the listener (``/healthz`` answers, operations answer 503
``not_ready``), recover the log, then print the ready line
``rdzv-server listening on http://HOST:PORT`` that scripts and tests wait for.
Order of stop (SIGTERM/SIGINT): refuse new work and answer parked long-polls with 503
``shutting_down``, drain in-flight requests, flush and close the log, exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web

from .api.app import create_app
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
    site = web.TCPSite(runner, config.host, config.port, reuse_address=True, backlog=LISTEN_BACKLOG)
    await site.start()
    try:
        await svc.start()
        for addr in runner.addresses:
            host, port = addr[0], addr[1]
            shown = f"[{host}]" if ":" in host else host
            print(f"rdzv-server listening on http://{shown}:{port}", flush=True)
            break
        await stop.wait()
        log.info("Shutting down: draining in-flight requests and flushing the log.")
    finally:
        svc.begin_stop()
        await runner.cleanup()
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
