"""The aiohttp application: the route table, thin handlers, metrics, the dashboard.

Handlers decode, call the service, encode; nothing else. Every operation of
``wire.REQUESTS`` is ``POST /v1/jobs/{rdzv_id}/{op}``; ``OPERATIONS`` below maps each to
the service call that serves it. Limits are explicit settings of :class:`ServerConfig`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from rdzv_client import wire

from ..core import command as c
from ..service import Service
from .codec import decode, encode
from .error import error_middleware

SERVICE = web.AppKey("service", Service)

Handler = Callable[[Service, str, Any], Awaitable[dict[str, Any]]]


def _command(req: wire.Request, rdzv_id: str) -> c.Command:
    """The core command of a write request: same fields, minus the wire-only ones."""
    cls = c.COMMANDS[req.op]
    return cls(rdzv_id=rdzv_id, **{f.name: getattr(req, f.name) for f in dataclasses.fields(cls) if f.name != "rdzv_id"})


async def _write(svc: Service, rdzv_id: str, req: Any) -> dict[str, Any]:
    return await svc.write(_command(req, rdzv_id), req.rid)


async def _get(svc: Service, rdzv_id: str, req: wire.GetRequest) -> dict[str, Any]:
    value = await svc.get(rdzv_id, req.round, req.key, req.timeout)
    return {"found": value is not None, "value": value}


async def _multi_get(svc: Service, rdzv_id: str, req: wire.MultiGetRequest) -> dict[str, Any]:
    values = await svc.multi_get(rdzv_id, req.round, req.keys, req.timeout)
    return {"found": values is not None, "values": values}


async def _wait(svc: Service, rdzv_id: str, req: wire.WaitRequest) -> dict[str, Any]:
    values = await svc.multi_get(rdzv_id, req.round, req.keys, req.timeout)
    return {"found": values is not None}


async def _check(svc: Service, rdzv_id: str, req: wire.CheckRequest) -> dict[str, Any]:
    kv = svc.machine.kv(rdzv_id)
    return {"result": await svc.read(lambda: kv.check(req.round, req.keys))}


async def _num_keys(svc: Service, rdzv_id: str, req: wire.NumKeysRequest) -> dict[str, Any]:
    kv = svc.machine.kv(rdzv_id)
    return {"count": await svc.read(lambda: kv.num_keys(req.round))}


async def _list_keys(svc: Service, rdzv_id: str, req: wire.ListKeysRequest) -> dict[str, Any]:
    kv = svc.machine.kv(rdzv_id)
    return {"keys": await svc.read(lambda: kv.list_keys(req.round, req.prefix))}


async def _join(svc: Service, rdzv_id: str, req: wire.JoinRequest) -> dict[str, Any]:
    return await svc.join(_command(req, rdzv_id), req.rid, req.hold)  # type: ignore[arg-type]


async def _await_round(svc: Service, rdzv_id: str, req: wire.AwaitRoundRequest) -> dict[str, Any]:
    return await svc.await_round(rdzv_id, req.node_id, req.round, req.hold)


async def _watch(svc: Service, rdzv_id: str, req: wire.WatchRequest) -> dict[str, Any]:
    return await svc.watch(rdzv_id, req.node_id, req.round, req.known, req.hold)


OPERATIONS: dict[str, Handler] = {
    "set": _write,
    "get": _get,
    "add": _write,
    "compare_set": _write,
    "append": _write,
    "multi_get": _multi_get,
    "multi_set": _write,
    "check": _check,
    "wait": _wait,
    "delete_key": _write,
    "num_keys": _num_keys,
    "list_keys": _list_keys,
    "create": _write,
    "join": _join,
    "await_round": _await_round,
    "watch": _watch,
    "leave": _write,
    "close": _write,
}
assert set(OPERATIONS) == set(wire.REQUESTS), "every wire operation needs a handler"


class Metrics:
    """Prometheus metrics of one app (its own registry, so several apps can share a process)."""

    def __init__(self, svc: Service) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "rdzv_requests", "Operations served, by operation and result code.", ["op", "code"], registry=self.registry
        )
        self.latency = Histogram(
            "rdzv_request_seconds",
            "Time to serve an operation (long-polls include their hold).",
            ["op"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5, 30),
            registry=self.registry,
        )
        self.registry.register(_StateCollector(svc))


METRICS = web.AppKey("metrics", Metrics)


class _StateCollector:
    def __init__(self, svc: Service) -> None:
        self.svc = svc

    def collect(self) -> Any:
        jobs = self.svc.machine.jobs.values()
        by_state: dict[str, int] = {"open": 0, "complete": 0, "closed": 0}
        nodes = GaugeMetricFamily("rdzv_nodes", "Nodes known to the server, by role or liveness.", labels=["status"])
        counts: dict[str, int] = {}
        for e in jobs:
            by_state[e.job.state.value] += 1
            for (role, liveness), n in e.job.counts.items():
                status = liveness.value if role.value == "member" else role.value
                counts[status] = counts.get(status, 0) + n
        g = GaugeMetricFamily("rdzv_jobs", "Jobs by state.", labels=["state"])
        for state, n in by_state.items():
            g.add_metric([state], n)
        yield g
        for status, n in counts.items():
            nodes.add_metric([status], n)
        yield nodes
        yield GaugeMetricFamily("rdzv_keys", "Keys stored over all jobs.", value=sum(e.kv.total_keys() for e in jobs))
        yield GaugeMetricFamily("rdzv_waiters", "Parked long-polls.", value=len(self.svc.waiters))
        yield GaugeMetricFamily("rdzv_ready", "1 once recovery finished.", value=1 if self.svc.ready else 0)


async def operation(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    op = request.match_info["op"]
    metrics = request.app[METRICS]
    started = time.perf_counter()
    code = "ok"
    try:
        rdzv_id = wire.check_id("rdzv_id", request.match_info["rdzv_id"])
        req = wire.decode_request(op, await decode(request, svc.config.max_body_bytes))
        return encode(request, await OPERATIONS[op](svc, rdzv_id, req))
    except Exception as exc:
        code = str(getattr(getattr(exc, "code", None), "value", getattr(exc, "code", "internal")))
        raise
    finally:
        metrics.requests.labels(op, code).inc()
        metrics.latency.labels(op).observe(time.perf_counter() - started)


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
