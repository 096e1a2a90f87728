"""The operation table and the one dispatch both protocols use.

What it owns: ``OPERATIONS`` (each wire operation -> the service calls that serve it) and
the dispatch: check the job id and the caller's grant, validate the fields into the
operation's request record, call the service, map any failure through the one error table
(:func:`.error.error_reply`), and record the metrics. So an operation answers the same
over HTTP and over a stream, errors included.

Two entries, one path:
- :func:`start_operation`, synchronous, for the stream's hot path: most operations never
  wait (a write whose record is already durable, a read of a key that exists), and are
  answered there and then; a write whose record is still being made durable is answered
  from its append's completion (:class:`Durable`); only an operation that parks (a
  long-poll) comes back as a coroutine to run as a task. What a request changes is applied
  in the order requests arrive: a join is applied here, and only its wait for a round is
  left to the task.
- :func:`run_operation`, a coroutine, for HTTP: the same three cases, awaited.

Each operation has a synchronous half (``now``: its answer and the append it still waits
on; what is left of it to run as a task; or None when it parks from the start) and, if it
can park from the start, an asynchronous one (``later``).

What it must not know: HTTP, frames, how bodies are encoded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, NamedTuple

from rdzv_client import wire

from ..core import command as c
from ..service import Answer, Service
from .auth import Grant
from .error import error_reply
from .metric import Metrics

Body = dict[str, Any]
Reply = tuple[int, Body]
#: The synchronous half of an operation: its reply body and the append it waits on (see
#: ``Service.submit``); or, for one that went as far as it could now, the rest of it to run
#: as a task; or None when it has to park from the start (then ``later`` serves it).
Now = Callable[[Service, str, Any], "Answer[Body] | Coroutine[Any, Any, Body] | None"]
#: The asynchronous half: serves an operation that parks.
Later = Callable[[Service, str, Any], Awaitable[Body]]


class Operation(NamedTuple):
    now: Now | None  # None: it always parks
    later: Later | None  # None: it never parks


def _write(svc: Service, rdzv_id: str, req: Any) -> Answer[Body]:
    return svc.submit(req, req.rid)  # a write request is its core command


def _found(value: Any, pending: asyncio.Future[None] | None) -> Answer[Body]:
    return {"found": value is not None, "value": value}, pending


def _get_now(svc: Service, rdzv_id: str, req: wire.GetRequest) -> Answer[Body] | None:
    kv = svc.use(rdzv_id)  # NotReady, JobNotFound before parking
    answer = svc.poll_now(lambda: kv.get(req.round, req.key), req.timeout)
    return None if answer is None else _found(*answer)


async def _get(svc: Service, rdzv_id: str, req: wire.GetRequest) -> Body:
    return _found(await svc.get(rdzv_id, req.round, req.key, req.timeout), None)[0]


def _multi_get_now(svc: Service, rdzv_id: str, req: wire.MultiGetRequest) -> Answer[Body] | None:
    kv = svc.use(rdzv_id)  # NotReady, JobNotFound before parking
    answer = svc.poll_now(lambda: kv.multi_get(req.round, req.keys), req.timeout)
    if answer is None:
        return None
    values, pending = answer
    return {"found": values is not None, "values": values}, pending


async def _multi_get(svc: Service, rdzv_id: str, req: wire.MultiGetRequest) -> Body:
    values = await svc.multi_get(rdzv_id, req.round, req.keys, req.timeout)
    return {"found": values is not None, "values": values}


def _wait_now(svc: Service, rdzv_id: str, req: wire.WaitRequest) -> Answer[Body] | None:
    kv = svc.use(rdzv_id)  # NotReady, JobNotFound before parking
    answer = svc.poll_now(lambda: kv.multi_get(req.round, req.keys), req.timeout)
    return None if answer is None else ({"found": answer[0] is not None}, answer[1])


async def _wait(svc: Service, rdzv_id: str, req: wire.WaitRequest) -> Body:
    values = await svc.multi_get(rdzv_id, req.round, req.keys, req.timeout)
    return {"found": values is not None}


def _check(svc: Service, rdzv_id: str, req: wire.CheckRequest) -> Answer[Body]:
    result, pending = svc.read_now(lambda: svc.use(rdzv_id).check(req.round, req.keys))
    return {"result": result}, pending


def _num_keys(svc: Service, rdzv_id: str, req: wire.NumKeysRequest) -> Answer[Body]:
    count, pending = svc.read_now(lambda: svc.use(rdzv_id).num_keys(req.round))
    return {"count": count}, pending


def _list_keys(svc: Service, rdzv_id: str, req: wire.ListKeysRequest) -> Answer[Body]:
    keys, pending = svc.read_now(lambda: svc.use(rdzv_id).list_keys(req.round, req.prefix))
    return {"keys": keys}, pending


def _join(svc: Service, rdzv_id: str, req: c.Join) -> Coroutine[Any, Any, Body]:
    return svc.begin_join(req, req.rid, req.hold)  # applied now, in the order requests arrive


async def _refuse(svc: Service, rdzv_id: str, req: c.Refuse) -> Body:
    return await svc.refuse(req, req.rid)


async def _await_round(svc: Service, rdzv_id: str, req: wire.AwaitRoundRequest) -> Body:
    return await svc.await_round(rdzv_id, req.node_id, req.round, req.hold)


def _watch_now(svc: Service, rdzv_id: str, req: wire.WatchRequest) -> Answer[Body] | None:
    if req.hold > 0:
        return None  # it parks (the watch proper); one with no hold is a heartbeat, answered now
    view, pending = svc.beat_now(rdzv_id, req.node_id, req.round, req.step)
    return view.body(), pending


def _beat(svc: Service, rdzv_id: str, req: wire.BeatRequest) -> Answer[Body]:
    svc.beat(rdzv_id, req.node_id, None if req.step is None else (req.round, req.step))
    return _NOTHING, None  # soft state: nothing to wait for (a stream sends no reply at all)


async def _watch(svc: Service, rdzv_id: str, req: wire.WatchRequest) -> Body:
    return (await svc.watch(rdzv_id, req.node_id, req.round, req.known, req.hold, req.step)).body()


def _policy(svc: Service, rdzv_id: str, req: wire.PolicyRequest) -> Answer[Body]:
    return svc.effective_policy_now(rdzv_id)


_WRITE = Operation(_write, None)
_NOTHING: Body = {}  # a beat's reply over HTTP (never changed: one map for every reply)

OPERATIONS: dict[str, Operation] = {
    "set": _WRITE,
    "get": Operation(_get_now, _get),
    "add": _WRITE,
    "compare_set": _WRITE,
    "append": _WRITE,
    "multi_get": Operation(_multi_get_now, _multi_get),
    "multi_set": _WRITE,
    "check": Operation(_check, None),
    "wait": Operation(_wait_now, _wait),
    "delete_key": _WRITE,
    "num_keys": Operation(_num_keys, None),
    "list_keys": Operation(_list_keys, None),
    "create": _WRITE,
    "join": Operation(_join, None),
    "await_round": Operation(None, _await_round),
    "watch": Operation(_watch_now, _watch),
    "beat": Operation(_beat, None),
    "leave": _WRITE,
    "close": _WRITE,
    "refuse": Operation(None, _refuse),
    "policy": Operation(_policy, None),
}
assert set(OPERATIONS) == set(wire.REQUESTS), "every wire operation needs a handler"
assert all(o.now is not None or o.later is not None for o in OPERATIONS.values())

#: What a read-only token may do: store reads. Everything else changes state, or speaks for a
#: node (a watch is a heartbeat, and its dropping marks the node dead).
READ_OPERATIONS = frozenset({"get", "multi_get", "wait", "check", "num_keys", "list_keys", "policy"})


def forbidden(grant: Grant, op: str, rdzv_id: str) -> dict[str, Any] | None:
    """The 403 body when ``grant`` does not cover ``op`` on ``rdzv_id``, else None."""
    if grant.allows(op not in READ_OPERATIONS, rdzv_id):
        return None
    what = "only reads" if op not in READ_OPERATIONS else f"only jobs named {grant.job_prefix}*"
    return wire.error_body(wire.ErrorCode.FORBIDDEN, f"this token allows {what}: {op} on job {rdzv_id[:200]} refused")


class Durable:
    """An operation answered once its append is durable: call :meth:`reply` when
    :attr:`append` is done (a cancelled append: the request is not answered, as a cancelled
    task would not be)."""

    __slots__ = ("append", "_body", "_metrics", "_op", "_rdzv_id", "_started", "_svc")

    def __init__(
        self, append: asyncio.Future[None], body: Body, svc: Service, metrics: Metrics, op: str, rdzv_id: str,
        started: float,
    ) -> None:
        self.append = append
        self._body = body
        self._svc = svc
        self._metrics = metrics
        self._op = op
        self._rdzv_id = rdzv_id
        self._started = started

    def reply(self) -> Reply:
        """The reply, the append being done (raises CancelledError if it was cancelled)."""
        try:
            self._svc.settled(self.append)
        except Exception as exc:  # noqa: BLE001 (error_reply logs the traceback of anything unmapped)
            return _failed(self._metrics, self._op, self._rdzv_id, self._started, exc)
        return _answered(self._metrics, self._op, self._started, self._body)


def _answered(metrics: Metrics, op: str, started: float, body: Body) -> Reply:
    metrics.observe(op, "ok", time.perf_counter() - started)
    return 200, body


def _failed(metrics: Metrics, op: str, rdzv_id: str, started: float, exc: Exception) -> Reply:
    status, body = error_reply(exc, f"operation {op} of job {rdzv_id[:200]!r}")
    metrics.observe(op, body["error"], time.perf_counter() - started)
    return status, body


def start_operation(
    svc: Service, metrics: Metrics, grant: Grant, op: str, rdzv_id: str, fields: Any
) -> Reply | Durable | Coroutine[Any, Any, Reply]:
    """Start serving operation ``op`` of job ``rdzv_id`` with the decoded request ``fields``,
    for a caller holding ``grant`` (a request it does not cover is a 403 ``forbidden``).

    Returns the reply (status and body, errors included) when it is known now; a
    :class:`Durable` when it waits for its append; else a coroutine (run it as a task)
    that returns the reply and raises only CancelledError. Never raises. An unknown ``op`` is
    a 404 ``not_found``, as the HTTP route table answers it, and is not counted: its name
    came from the client and would grow the metrics without bound.
    """
    operation = OPERATIONS.get(op)
    if operation is None:
        return 404, wire.error_body(wire.ErrorCode.NOT_FOUND, f"no operation {op[:64]!r}")
    refused = forbidden(grant, op, rdzv_id)
    if refused is not None:
        metrics.auth_failed("forbidden")
        return 403, refused
    started = time.perf_counter()
    try:
        wire.check_id("rdzv_id", rdzv_id)
        req = wire.decode_request(op, fields, rdzv_id)
        answer = None if operation.now is None else operation.now(svc, rdzv_id, req)
    except Exception as exc:  # noqa: BLE001 (error_reply logs the traceback of anything unmapped)
        return _failed(metrics, op, rdzv_id, started, exc)
    if answer is None:
        assert operation.later is not None  # (the table's assert)
        return _parked(svc, metrics, op, rdzv_id, started, operation.later, req)
    if not isinstance(answer, tuple):
        return _finish(metrics, op, rdzv_id, started, answer)
    body, pending = answer
    if pending is None:
        return _answered(metrics, op, started, body)
    return Durable(pending, body, svc, metrics, op, rdzv_id, started)


async def _parked(
    svc: Service, metrics: Metrics, op: str, rdzv_id: str, started: float, later: Later, req: Any
) -> Reply:
    """The reply of an operation that parks from the start (its ``later`` half, begun here)."""
    return await _finish(metrics, op, rdzv_id, started, later(svc, rdzv_id, req))


async def _finish(metrics: Metrics, op: str, rdzv_id: str, started: float, rest: Awaitable[Body]) -> Reply:
    """The reply of an operation once ``rest``, what is left of it, is done."""
    try:
        body = await rest
    except Exception as exc:  # noqa: BLE001 (error_reply logs the traceback of anything unmapped)
        return _failed(metrics, op, rdzv_id, started, exc)
    return _answered(metrics, op, started, body)


async def run_operation(
    svc: Service, metrics: Metrics, grant: Grant, op: str, rdzv_id: str, fields: Any
) -> Reply:
    """Serve operation ``op`` as :func:`start_operation` starts it, to its reply (never
    raises but for cancellation, which propagates: a dropped connection cancels its
    request; the append a write waits on goes on)."""
    started = start_operation(svc, metrics, grant, op, rdzv_id, fields)
    if isinstance(started, tuple):
        return started
    if isinstance(started, Durable):
        await asyncio.wait((started.append,))
        return started.reply()
    return await started
