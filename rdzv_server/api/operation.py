"""The operation table and the one dispatch both protocols use.

What it owns: ``OPERATIONS`` (each wire operation -> the service call that serves it)
and :func:`run_operation`, which takes a decoded request of either protocol (HTTP body or
stream frame) to its status and reply body: check the job id, validate the fields into the
operation's request record, call the service, map any failure through the one error table
(:func:`.error.error_reply`), and record the metrics. So an operation answers the same
over HTTP and over a stream, errors included.

What it must not know: HTTP, frames, how bodies are encoded.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from rdzv_client import wire

from ..core import command as c
from ..service import Service
from .auth import Grant
from .error import error_reply
from .metric import Metrics

Handler = Callable[[Service, str, Any], Awaitable[dict[str, Any]]]


async def _write(svc: Service, rdzv_id: str, req: Any) -> dict[str, Any]:
    return await svc.write(req, req.rid)  # a write request is its core command


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
    return {"result": await svc.read(lambda: svc.use(rdzv_id).check(req.round, req.keys))}


async def _num_keys(svc: Service, rdzv_id: str, req: wire.NumKeysRequest) -> dict[str, Any]:
    return {"count": await svc.read(lambda: svc.use(rdzv_id).num_keys(req.round))}


async def _list_keys(svc: Service, rdzv_id: str, req: wire.ListKeysRequest) -> dict[str, Any]:
    return {"keys": await svc.read(lambda: svc.use(rdzv_id).list_keys(req.round, req.prefix))}


async def _join(svc: Service, rdzv_id: str, req: c.Join) -> dict[str, Any]:
    return await svc.join(req, req.rid, req.hold)


async def _refuse(svc: Service, rdzv_id: str, req: c.Refuse) -> dict[str, Any]:
    return await svc.refuse(req, req.rid)


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
    "refuse": _refuse,
}
assert set(OPERATIONS) == set(wire.REQUESTS), "every wire operation needs a handler"

#: What a read-only token may do: store reads. Everything else changes state, or speaks for a
#: node (a watch is a heartbeat, and its dropping marks the node dead).
READ_OPERATIONS = frozenset({"get", "multi_get", "wait", "check", "num_keys", "list_keys"})


def forbidden(grant: Grant, op: str, rdzv_id: str) -> dict[str, Any] | None:
    """The 403 body when ``grant`` does not cover ``op`` on ``rdzv_id``, else None."""
    if grant.allows(op not in READ_OPERATIONS, rdzv_id):
        return None
    what = "only reads" if op not in READ_OPERATIONS else f"only jobs named {grant.job_prefix}*"
    return wire.error_body(wire.ErrorCode.FORBIDDEN, f"this token allows {what}: {op} on job {rdzv_id[:200]} refused")


async def run_operation(
    svc: Service, metrics: Metrics, grant: Grant, op: str, rdzv_id: str, fields: Any
) -> tuple[int, dict[str, Any]]:
    """Serve operation ``op`` of job ``rdzv_id`` with the decoded request ``fields``, for a
    caller holding ``grant`` (a request it does not cover is a 403 ``forbidden``).

    Returns the status and reply body, errors included (never raises but for
    cancellation, which propagates: a dropped connection cancels its request). An unknown
    ``op`` is a 404 ``not_found``, as the HTTP route table answers it, and is not counted:
    its name came from the client and would grow the metrics without bound.
    """
    handler = OPERATIONS.get(op)
    if handler is None:
        return 404, wire.error_body(wire.ErrorCode.NOT_FOUND, f"no operation {op[:64]!r}")
    refused = forbidden(grant, op, rdzv_id)
    if refused is not None:
        metrics.auth_failed("forbidden")
        return 403, refused
    started = time.perf_counter()
    try:
        wire.check_id("rdzv_id", rdzv_id)
        status, body = 200, await handler(svc, rdzv_id, wire.decode_request(op, fields, rdzv_id))
        code = "ok"
    except Exception as exc:  # noqa: BLE001 (error_reply logs the traceback of anything unmapped)
        status, body = error_reply(exc, f"operation {op} of job {rdzv_id[:200]!r}")
        code = body["error"]
    metrics.observe(op, code, time.perf_counter() - started)
    return status, body
