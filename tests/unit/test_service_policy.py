"""A policy change moves a running job's deadlines in the service: its timer looks at every
job again (issue 28), driven by a fake clock (the clock seam), never by sleeping."""

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
