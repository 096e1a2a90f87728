"""The aiohttp application: the route table, thin handlers, metrics, the dashboard.

Handlers decode, call the service, encode; nothing else. Every operation of
``wire.REQUESTS`` is ``POST /v1/jobs/{rdzv_id}/{op}``, served by
:func:`.operation.run_operation` exactly as the stream protocol serves it. A body that
does not decode is answered by the error middleware (and, as an undecodable stream frame,
is not counted under an operation). Limits are explicit settings of :class:`ServerConfig`.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web
from prometheus_client import generate_latest

from rdzv_client import wire

from ..service import Service
from .codec import decode, encode
from .error import error_middleware
from .metric import Metrics
from .operation import run_operation

SERVICE = web.AppKey("service", Service)
METRICS = web.AppKey("metrics", Metrics)


async def operation(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    fields = await decode(request, svc.config.max_body_bytes)
    op, rdzv_id = request.match_info["op"], request.match_info["rdzv_id"]
    status, body = await run_operation(svc, request.app[METRICS], op, rdzv_id, fields)
    return encode(request, body, status=status)


async def list_jobs(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    jobs = await svc.read(lambda: [e.job.summary() for e in svc.machine.jobs.values()])
    return encode(request, {"jobs": jobs})


async def show_job(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    rdzv_id = wire.check_id("rdzv_id", request.match_info["rdzv_id"])
    return encode(request, await svc.read(lambda: svc.machine.job(rdzv_id).describe(svc.now())))


async def healthz(request: web.Request) -> web.Response:
    return encode(request, {"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    if not svc.ready:
        return encode(request, wire.error_body(wire.ErrorCode.NOT_READY, "recovering the log"), status=503)
    return encode(request, {"status": "ready", "recovery_seconds": round(svc.recovery_seconds, 3)})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def dashboard(request: web.Request) -> web.Response:
    page = resources.files("rdzv_server.api").joinpath("static/dashboard.html").read_bytes()
    return web.Response(body=page, content_type="text/html")


def create_app(svc: Service) -> web.Application:
    """The application over a started (or starting) service."""
    app = web.Application(client_max_size=svc.config.max_body_bytes, middlewares=[error_middleware])
    app[SERVICE] = svc
    app[METRICS] = Metrics(svc)
    # The API's table of contents.
    app.add_routes(
        [
            web.get("/", dashboard),
            web.get("/healthz", healthz),
            web.get("/readyz", readyz),
            web.get("/metrics", metrics),
            web.get("/v1/jobs", list_jobs),
            web.get("/v1/jobs/{rdzv_id}", show_job),
            web.post("/v1/jobs/{rdzv_id}/{op:" + "|".join(sorted(wire.REQUESTS)) + "}", operation),
        ]
    )
    return app
