"""The service's apply loop, in process over a real durable log (fsync always): an applied
command's effects do not depend on whether the request that carried it is still there, and
nothing is served before recovery ends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from waiting import wait_until_async

from rdzv_client import wire
from rdzv_server.api.auth import OPEN
from rdzv_server.api.metric import Metrics
from rdzv_server.api.operation import Durable, run_operation, start_operation
from rdzv_server.config import ServerConfig
from rdzv_client.record import JobSettings
from rdzv_server.core import command as c
from rdzv_server.service import Service
from rdzv_server.storage import LogQueueFullError

JOB = "job"


def join(node: str, *, min_nodes: int = 2, max_nodes: int = 4, last_call: float = 0.3) -> c.Join:
    return c.Join(JOB, node, "127.0.0.1", 1, JobSettings(min_nodes, max_nodes, last_call, 600.0, 600.0))


async def started(tmp_path: Path) -> Service:
    svc = Service(ServerConfig(data_dir=tmp_path / "data", fsync="always"))
    await svc.start()
    return svc


async def parked(svc: Service, count: int) -> None:
    """Until ``svc`` holds ``count`` parked long-polls (bounded)."""

    async def holds() -> bool:
        return len(svc.waiters) >= count

    await wait_until_async(holds, what=f"{count} long-polls parked")


async def test_a_join_cancelled_during_its_fsync_still_schedules_the_last_call(tmp_path: Path) -> None:
    """The min_nodes-th join's client hangs up while its record is being fsynced: the
    record is applied and durable, so its last-call deadline must still fire on time."""
    svc = await started(tmp_path)
    try:
        await svc.write(join("a"))
        request = asyncio.ensure_future(svc.write(join("b")))
        await asyncio.sleep(0)  # applied, its append in flight (fsync in a thread)
        assert svc.machine.job(JOB).last_call_deadline is not None
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        async def complete() -> bool:  # the last call is 0.3 s; without its timer the round stays open
            return svc.machine.job(JOB).state.value == "complete"

        await wait_until_async(complete, timeout=5, what="the round formed by its last call")
        assert svc.machine.job(JOB).num_nodes() == 2
    finally:
        await svc.close()


async def test_a_cancelled_write_still_wakes_the_waiters_of_its_key(tmp_path: Path) -> None:
    svc = await started(tmp_path)
    try:
        await svc.write(c.Create(JOB, JobSettings(1, 1, 1.0, 600.0, 600.0)))
        waiting = asyncio.ensure_future(svc.get(JOB, None, b"k", hold=10.0))
        await parked(svc, 1)
        request = asyncio.ensure_future(svc.write(c.Set(JOB, b"k", b"v")))
        await asyncio.sleep(0)
        request.cancel()
        assert await asyncio.wait_for(waiting, 5.0) == b"v"
    finally:
        await svc.close()


READS = {
    "get": {"key": "k", "timeout": 0},
    "multi_get": {"keys": ["k"], "timeout": 0},
    "wait": {"keys": ["k"], "timeout": 0},
    "check": {"keys": ["k"]},
    "num_keys": {},
    "list_keys": {},
    "await_round": {"node_id": "a", "round": 0, "hold": 0},
    "watch": {"node_id": "a", "round": 0, "known": 0, "hold": 0},
    "set": {"key": "k", "value": "v"},
}


async def test_an_operation_is_answered_now_from_its_append_or_as_a_task_only_when_it_parks(tmp_path: Path) -> None:
    """The stream's fast path: what does not wait is answered at once, a write whose record is
    being fsynced from its append's completion, and only a request that parks needs a task."""
    svc = await started(tmp_path)
    metrics = Metrics(svc)
    try:
        await svc.write(c.Create(JOB, JobSettings(1, 1, 1.0, 600.0, 600.0)))
        add = start_operation(svc, metrics, OPEN, "add", JOB, {"key": b"n", "amount": 1})
        assert isinstance(add, Durable)
        assert not add.append.done()  # applied, its record with the writer thread
        await asyncio.wait((add.append,))
        assert add.reply() == (200, {"value": 1})
        assert start_operation(svc, metrics, OPEN, "get", JOB, {"key": b"n"}) == (200, {"found": True, "value": b"1"})
        parked = start_operation(svc, metrics, OPEN, "get", JOB, {"key": b"later", "timeout": 10.0})
        assert asyncio.iscoroutine(parked)
        polling = asyncio.ensure_future(parked)
        await svc.write(c.Set(JOB, b"later", b"here"))
        assert await asyncio.wait_for(polling, 5.0) == (200, {"found": True, "value": b"here"})
    finally:
        await svc.close()


@pytest.mark.parametrize("op", sorted(READS))
async def test_every_operation_is_not_ready_until_recovery_ends(op: str) -> None:
    """Before recovery ends nothing is known, not even which jobs exist: a 404 would be a lie
    the client does not retry; 503 not_ready is retried."""
    svc = Service(ServerConfig(memory=True))  # not started: recovering
    status, body = await run_operation(svc, Metrics(svc), OPEN, op, "any-job", READS[op])
    assert (status, body["error"]) == (503, wire.ErrorCode.NOT_READY.value)


async def test_an_events_poll_parks_until_the_job_has_something_new(tmp_path: Path) -> None:
    svc = await started(tmp_path)
    try:
        await svc.write(join("a"))
        seen = await svc.events(JOB, 0, hold=0.0, limit=100)
        assert [e.kind.value for e in seen.events] == ["job_created", "node_joined"]
        waiting = asyncio.ensure_future(svc.events(JOB, seen.next_seq - 1, hold=10.0, limit=100))
        await parked(svc, 1)
        assert not waiting.done()
        await svc.write(join("b"))
        news = await asyncio.wait_for(waiting, 5.0)
        assert [(e.kind.value, e.cause.value, e.node_id) for e in news.events] == [("node_joined", "candidate", "b")]
        assert (await svc.events(JOB, news.next_seq - 1, hold=0.0, limit=100)).events == []
    finally:
        await svc.close()


async def test_a_timer_command_the_log_refuses_is_tried_again_later_without_spinning(tmp_path: Path) -> None:
    """A due deadline whose command the log refuses (its queue full, say) is looked at again
    a little later: retrying it in the same pass would hold the event loop for as long as the
    log refuses, so no request, and no step-down, could be served meanwhile."""
    svc = await started(tmp_path)
    try:
        await svc.write(join("a", min_nodes=1, max_nodes=2, last_call=0.2))
        loop = asyncio.get_running_loop()
        busy_until = loop.time() + 1.2
        refusals = 0
        check = svc.pipeline.log.check

        def busy(record: dict[str, object]) -> None:  # the log's queue, full for 1.2 s
            nonlocal refusals
            if loop.time() < busy_until:
                refusals += 1
                raise LogQueueFullError("busy")
            check(record)

        svc.pipeline.log.check = busy  # type: ignore[method-assign]
        gaps = []
        for _ in range(300):  # bounded: the round forms once the log takes the last call
            started_at = loop.time()
            await asyncio.sleep(0.01)
            gaps.append(loop.time() - started_at)
            if svc.machine.job(JOB).state.value == "complete":
                break
        assert svc.machine.job(JOB).state.value == "complete"
        assert 1 <= refusals <= 10, refusals  # one try per TIMER_RETRY_S, not one per loop pass
        assert max(gaps) < 0.5, max(gaps)  # the loop kept running meanwhile
    finally:
        await svc.close()
