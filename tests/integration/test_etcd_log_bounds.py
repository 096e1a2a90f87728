"""The replicated log's bounds against a real etcd member on 127.0.0.1 (issue 14):

- a record over what etcd takes is refused by ``check`` before anything is queued, and a
  queue at its bound refuses more; either way the log stays usable;
- one append that etcd does not answer fails the log within the append timeout, instead of
  holding the single writer (and everything queued behind it) through the client's retries;
- ``abandon`` (a step-down) fails the append in flight at once.

Skipped only when etcd is not installed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from etcd_cluster import EtcdCluster, require_etcd, running_etcd
from waiting import wait_until

from rdzv_server.storage.election import Election
from rdzv_server.storage.error import LogClosedError, LogFailedError, LogQueueFullError, RecordTooLargeError
from rdzv_server.storage.etcd_client import EtcdClient
from rdzv_server.storage.etcd_log import MAX_RECORD_BYTES, EtcdLog, NotLeaderError, recover

TTL_S = 2
STEP_S = 10.0


@pytest.fixture
def etcd1() -> Iterator[EtcdCluster]:
    with running_etcd(1) as cluster:  # its own: some tests here stop it
        yield cluster


@pytest.fixture
async def client(etcd1: EtcdCluster) -> AsyncIterator[EtcdClient]:
    etcd = EtcdClient(etcd1.client_urls)
    yield etcd
    await etcd.close()


async def leader_log(client: EtcdClient, **bounds: float) -> tuple[Election, EtcdLog, str]:
    prefix = f"/rdzv-test/{uuid.uuid4().hex[:12]}"
    election = Election(client, prefix, "a", ttl_s=TTL_S)
    fence = await election.campaign(timeout_s=STEP_S)
    log = EtcdLog(client, prefix, fence, last_index=0, snapshot_index=0, **bounds)  # type: ignore[arg-type]
    return election, log, prefix


def pause(etcd: EtcdCluster, sig: signal.Signals) -> None:
    """Stop (SIGSTOP) or resume (SIGCONT) the member, and return once the kernel says it is so
    (``/proc/PID/stat``'s state): a signal is delivered asynchronously, and a test that goes on
    at once can race a member still running (it answered an append "to a stopped member" once,
    on a loaded CI host)."""
    process = etcd.processes[0]
    assert process is not None
    os.kill(process.pid, sig)
    stopped = sig == signal.SIGSTOP
    wait_until(lambda: (_state(process.pid) == "T") == stopped, timeout=10, interval=0.005,
               what=f"etcd {'stopped' if stopped else 'running again'}")


def _state(pid: int) -> str:
    """The process's state letter (R, S, D, T, ...) from /proc."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


async def test_a_record_over_what_etcd_takes_is_refused_before_it_is_queued(client: EtcdClient) -> None:
    election, log, prefix = await leader_log(client)
    await asyncio.wait_for(log.append({"n": 1}), STEP_S)
    big = {"n": 2, "value": b"x" * MAX_RECORD_BYTES}
    with pytest.raises(RecordTooLargeError) as refused:
        log.check(big)
    assert refused.value.size > refused.value.limit == MAX_RECORD_BYTES
    # Just under the limit fits etcd's default --max-request-bytes, in a txn of its own.
    fits = {"n": 2, "value": b"y" * (MAX_RECORD_BYTES - 100)}
    log.check(fits)
    await asyncio.wait_for(log.append(fits), STEP_S)
    recovered, _ = await recover(client, prefix)
    assert [r["n"] for r in recovered.records] == [1, 2]  # no index was spent on the refused one
    await log.close()
    await election.resign()


async def test_a_queue_at_its_bound_refuses_more_and_takes_them_once_it_drains(client: EtcdClient) -> None:
    election, log, _ = await leader_log(client, max_queued_records=2)
    first = log.append({"n": 1})
    await asyncio.sleep(0)  # the writer takes record 1 into its txn
    queued = [log.append({"n": n}) for n in (2, 3)]
    with pytest.raises(LogQueueFullError):
        log.check({"n": 4})
    await asyncio.wait_for(asyncio.gather(first, *queued), STEP_S)
    log.check({"n": 4})  # drained
    await asyncio.wait_for(log.append({"n": 4}), STEP_S)
    await log.close()
    await election.resign()


async def test_an_append_etcd_does_not_answer_fails_within_the_append_timeout(
    client: EtcdClient, etcd1: EtcdCluster
) -> None:
    election, log, _ = await leader_log(client, append_timeout_s=1.0)
    await asyncio.wait_for(log.append({"n": 1}), STEP_S)
    election.stop_keepalive()  # its lease must not be the thing that ends this
    pause(etcd1, signal.SIGSTOP)
    try:
        # Bounded above the 1 s append timeout and below the ~15 s the client alone would retry:
        # the error names the append timeout as its cause.
        with pytest.raises(LogFailedError, match="no answer within 1 s"):
            await asyncio.wait_for(log.append({"n": 2}), 10)
    finally:
        pause(etcd1, signal.SIGCONT)
    await log.close()


async def test_abandon_fails_the_append_in_flight_at_once(client: EtcdClient, etcd1: EtcdCluster) -> None:
    election, log, _ = await leader_log(client)  # the default append timeout: 5 s
    await asyncio.wait_for(log.append({"n": 1}), STEP_S)
    election.stop_keepalive()
    pause(etcd1, signal.SIGSTOP)
    try:
        in_flight = log.append({"n": 2})
        queued_behind = log.append({"n": 3})
        await asyncio.sleep(0.2)  # the txn of record 2 is on its way to a member that does not answer
        assert not in_flight.done()
        log.abandon("the leader stepped down")
        for future in (in_flight, queued_behind):
            with pytest.raises(NotLeaderError, match="stepped down"):
                await asyncio.wait_for(future, 1.0)
        with pytest.raises(LogClosedError):
            log.append({"n": 4})
        await asyncio.wait_for(log.close(), 1.0)  # returns at once
    finally:
        pause(etcd1, signal.SIGCONT)
