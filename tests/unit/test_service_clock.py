"""The service's clock seam: a deadline is driven by moving a fake clock, not by sleeping.

The service reads elapsed time only through the ``Clock`` it is given (``rdzv_server.clock``);
``check_deadlines()`` has its timer look again after the clock moved."""

from __future__ import annotations

import asyncio

import pytest

from rdzv_client.record import JobSettings
from rdzv_server.config import ServerConfig
from rdzv_server.core import command as c
from rdzv_server.service import Service

JOB = "job"
SETTINGS = JobSettings(min_nodes=2, max_nodes=4, last_call_timeout=30.0, join_timeout=600.0, heartbeat_ttl=600.0)
# Bounds a wait for something the fake clock already made due (never reached when it works).
PATIENCE = 10.0


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.seconds = 5000.0

    def monotonic(self) -> float:
        return self.seconds


async def test_the_last_call_fires_when_the_fake_clock_passes_it() -> None:
    """min_nodes have joined, max_nodes have not: the round forms at the last call, 30 s of
    the service's clock later; moving the fake clock 31 s forms it, with no real waiting."""
    clock = FakeClock()
    svc = Service(ServerConfig(memory=True), clock=clock)
    await svc.start()
    try:
        await svc.write(c.Join(JOB, "a", "127.0.0.1", 1, SETTINGS))
        joined = await svc.write(c.Join(JOB, "b", "127.0.0.1", 1, SETTINGS))
        job = svc.machine.job(JOB)
        assert job.last_call_deadline == svc.now() + 30.0
        polled = await svc.await_round(JOB, "a", joined["round"], hold=0.0)
        assert polled["assignment"] is None  # not formed: the clock has not moved

        formed = asyncio.ensure_future(svc.await_round(JOB, "a", joined["round"], hold=60.0))
        clock.seconds += 31.0
        assert svc.now() >= job.last_call_deadline
        svc.check_deadlines()
        reply = await asyncio.wait_for(formed, PATIENCE)
        assert reply["assignment"] is not None
        assert svc.machine.job(JOB).num_nodes() == 2
    finally:
        await svc.close()


async def test_the_server_clock_counts_only_what_the_clock_says() -> None:
    clock = FakeClock()
    svc = Service(ServerConfig(memory=True), clock=clock)
    await svc.start()
    try:
        before = svc.now()
        assert svc.now() == before  # real time passed between the reads: the server clock did not move
        clock.seconds += 2.5
        assert svc.now() == before + 2.5
    finally:
        await svc.close()


async def test_a_parked_long_polls_hold_ends_when_the_fake_clock_passes_it() -> None:
    """A get of a key nobody sets holds for its 30 s of the service's clock, not of the loop's:
    moving the fake clock past it answers "not found" at once."""
    clock = FakeClock()
    svc = Service(ServerConfig(memory=True, max_hold=60.0), clock=clock)
    await svc.start()
    try:
        await svc.write(c.Create(JOB, SETTINGS))
        polled = asyncio.ensure_future(svc.get(JOB, None, b"never", hold=30.0))
        await asyncio.sleep(0)  # (one step: it parks)
        assert len(svc.waiters) == 1
        clock.seconds += 31.0
        svc.check_deadlines()
        assert await asyncio.wait_for(polled, PATIENCE) is None
    finally:
        await svc.close()


async def test_a_node_whose_watch_dropped_is_marked_dead_once_the_fake_clock_passes_the_grace() -> None:
    """The fast path of death detection runs on the service's clock: a dropped watch is judged
    (core's ``decision.death_after_drop``) once the fake clock has passed ``--disconnect-grace``."""
    clock = FakeClock()
    config = ServerConfig(memory=True, disconnect_grace=60.0)  # far past PATIENCE: only the fake clock can end it
    svc = Service(config, clock=clock)
    await svc.start()
    try:
        formed = JobSettings(min_nodes=2, max_nodes=2, heartbeat_ttl=600.0)
        await svc.write(c.Join(JOB, "a", "10.0.0.1", 1, formed))
        joined = await svc.write(c.Join(JOB, "b", "10.0.0.2", 1, formed))
        watch = asyncio.ensure_future(svc.watch(JOB, "b", joined["round"], 0, hold=60.0))
        await asyncio.sleep(0)  # (one step: it parks)
        seen = svc.machine.job(JOB).timeline.next_seq - 1
        watch.cancel()  # its connection closed
        with pytest.raises(asyncio.CancelledError):
            await watch
        clock.seconds += 60.0
        svc.check_deadlines()
        page = await asyncio.wait_for(svc.events(JOB, seen, hold=60.0, limit=10), PATIENCE)
        assert [(e.kind.value, e.cause.value, e.node_id) for e in page.events] == [
            ("node_departed", "connection_closed", "b")
        ]
    finally:
        await svc.close()


# A policy change moves a running job's deadlines: the timer looks at every job again (issue 28).
async def test_a_shortened_last_call_forms_the_round_when_the_clock_passes_its_new_deadline() -> None:
    clock = FakeClock()
    svc = Service(ServerConfig(memory=True), clock=clock)
    await svc.start()
    try:
        await svc.write(c.Join(JOB, "a", "127.0.0.1", 1, SETTINGS))
        joined = await svc.write(c.Join(JOB, "b", "127.0.0.1", 1, SETTINGS))
        armed = svc.machine.job(JOB).last_call_deadline
        await svc.write(c.SetPolicy("", pattern="j*", settings={"last_call_timeout": 5.0}))
        assert svc.machine.job(JOB).last_call_deadline == armed - 25.0
        formed = asyncio.ensure_future(svc.await_round(JOB, "a", joined["round"], hold=60.0))
        clock.seconds += 6.0  # past the new deadline, long before the old one
        svc.check_deadlines()
        reply = await asyncio.wait_for(formed, PATIENCE)
        assert reply["assignment"] is not None and reply["assignment"]["policy_version"] == 1
    finally:
        await svc.close()
