"""The service's clock seam: a deadline is driven by moving a fake clock, not by sleeping.

The service reads elapsed time only through the ``Clock`` it is given (``rdzv_server.clock``);
``check_deadlines()`` has its timer look again after the clock moved."""

from __future__ import annotations

import asyncio

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
