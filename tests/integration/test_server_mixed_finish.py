"""A mixed finish through the real server and client, with the store calls torch's exit barrier
makes (docs/job-fate.md, "A mixed finish"): a finished node's ``wait`` on the barrier's key
returns once another member re-joins, the re-joining node is refused naming the cause, and all
of it survives a restart (it is rebuilt from the log)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_process import ServerProcess
from waiting import wait_for_parked

from rdzv_client import Client, JobSettings
from rdzv_client.error import JobClosedError
from rdzv_client.record import EXIT_BARRIER_COUNT_KEY, EXIT_BARRIER_LAST_MEMBER_KEY

SETTINGS = JobSettings(min_nodes=2, max_nodes=2)


def join(client: Client, job: str, node: str) -> int:
    return client.join(job, node_id=node, addr=f"{node}.host", nproc_per_node=1, settings=SETTINGS, timeout=20).round


def test_a_finished_nodes_barrier_wait_returns_when_the_other_member_re_joins(durable_server: ServerProcess) -> None:
    job = f"mixed-{uuid.uuid4().hex[:8]}"
    with Client(durable_server.endpoint) as client, ThreadPoolExecutor(2) as pool:
        round_ = {f.result() for f in [pool.submit(join, client, job, n) for n in ("a", "b")]}.pop()
        assert client.add(job, EXIT_BARRIER_COUNT_KEY, 1, round=round_) == 1  # a's workers succeeded
        # a's agent, in torch's exit barrier (300 s by default): parked on the server
        released = pool.submit(client.wait, job, [EXIT_BARRIER_LAST_MEMBER_KEY], timeout=60, round=round_)
        wait_for_parked(durable_server, 1)
        with pytest.raises(JobClosedError, match=r"workers_failed_after_finish: node b of round \d+ re-joined"):
            join(client, job, "b")  # b's workers failed: its agent re-joins
        released.result(timeout=30)  # a's wait returned: its agent exits 0
        causes = [(e["kind"], e["cause"]) for e in client.events(job)["events"][-2:]]
        assert causes == [("exit_barrier_released", "workers_failed_after_finish"),
                          ("job_closed", "workers_failed_after_finish")]  # fmt: skip
    durable_server.restart()
    with Client(durable_server.endpoint) as client:
        assert client.job(job)["closed_cause"] == "workers_failed_after_finish"
        client.wait(job, [EXIT_BARRIER_LAST_MEMBER_KEY], timeout=5, round=round_)  # still released
