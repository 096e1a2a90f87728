"""The replicated log and the election against real etcd processes on 127.0.0.1.

Appends are acknowledged only once committed in etcd, group into txns, and are fenced (an
old leader writes nothing); a follower's tail sees every record in order; recovery after a
snapshot gives the snapshot and the records after it; appends carry on when one member of
three is SIGKILLed; of two campaigners exactly one leads and the other takes over within
the lease TTL + 1 s of the leader's last keepalive. Skipped only when etcd is not installed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from etcd_cluster import EtcdCluster, require_etcd

from rdzv_server.storage.election import Election
from rdzv_server.storage.etcd_client import EtcdClient, prefix_end
from rdzv_server.storage.etcd_log import MAX_RECORDS_PER_TXN, EtcdLog, EtcdLogKeys, NotLeaderError, recover, tail

# etcd's shortest lease is 1.5 x its election timeout (1.5 s by default), rounded up.
TTL_S = 2
STEP_S = 10.0  # what any one awaited step may take before the test fails instead of hanging


class Sum:
    """A toy replica: the sum and count of the ``n`` of every record."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {"sum": 0, "count": 0}

    def restore(self, state: dict[str, Any]) -> None:
        self.state = dict(state)

    def replay(self, record: dict[str, Any]) -> None:
        self.state["sum"] += record["n"]
        self.state["count"] += 1

    def to_snapshot(self) -> dict[str, Any]:
        return dict(self.state)


@pytest.fixture(scope="module")
def etcd1() -> Iterator[EtcdCluster]:
    require_etcd()
    cluster = EtcdCluster(1).start()
    yield cluster
    cluster.close()


@pytest.fixture
async def client(etcd1: EtcdCluster) -> AsyncIterator[EtcdClient]:
    etcd = EtcdClient(etcd1.client_urls)
    yield etcd
    await etcd.close()


def new_prefix() -> str:
    return f"/rdzv-test/{uuid.uuid4().hex[:12]}"


async def leader_log(client: EtcdClient, prefix: str, name: str = "a") -> tuple[Election, EtcdLog]:
    election = Election(client, prefix, name, ttl_s=TTL_S)
    fence = await election.campaign(timeout_s=STEP_S)
    log, _ = await EtcdLog.open(client, prefix, fence)
    return election, log


async def stored(client: EtcdClient, prefix: str) -> dict[int, dict[str, Any]]:
    """The records etcd holds under ``prefix``, read back with the plain client."""
    import msgpack

    keys = EtcdLogKeys(prefix)
    result = await client.range(keys.log_dir, prefix_end(keys.log_dir))
    return {keys.index_of(kv.key): msgpack.unpackb(kv.value) for kv in result.kvs}


async def test_an_append_is_acknowledged_only_once_etcd_holds_it(client: EtcdClient) -> None:
    prefix = new_prefix()
    election, log = await leader_log(client, prefix)
    futures = [log.append({"n": n, "tag": b"\x00bin"}) for n in range(1, 4)]
    assert not any(future.done() for future in futures)  # nothing is acknowledged before a round trip
    await asyncio.wait_for(asyncio.gather(*futures), STEP_S)
    assert await stored(client, prefix) == {n: {"n": n, "tag": b"\x00bin"} for n in range(1, 4)}
    head = await client.get(EtcdLogKeys(prefix).head)
    assert head is not None and head.value == b"3"
    await log.close()
    await election.resign()


async def test_records_arriving_during_a_txn_share_the_next_txn_of_at_most_the_cap(client: EtcdClient) -> None:
    prefix = new_prefix()
    election, log = await leader_log(client, prefix)
    first = log.append({"n": 0})
    await asyncio.sleep(0)  # the writer takes record 1 alone and sends its txn
    later = [log.append({"n": n}) for n in range(1, 2 * MAX_RECORDS_PER_TXN + 10)]
    await asyncio.wait_for(asyncio.gather(first, *later), STEP_S)
    keys = EtcdLogKeys(prefix)
    result = await client.range(keys.log_dir, prefix_end(keys.log_dir))
    by_txn: dict[int, list[int]] = {}
    for kv in result.kvs:
        by_txn.setdefault(kv.mod_revision, []).append(keys.index_of(kv.key))
    groups = [sorted(indices) for _, indices in sorted(by_txn.items())]
    assert groups[0] == [1]
    assert [len(group) for group in groups[1:]] == [MAX_RECORDS_PER_TXN, MAX_RECORDS_PER_TXN, 9]
    assert [i for group in groups for i in group] == list(range(1, 2 * MAX_RECORDS_PER_TXN + 11))
    await log.close()
    await election.resign()


async def test_a_leader_whose_lease_was_revoked_appends_nothing(client: EtcdClient) -> None:
    prefix = new_prefix()
    election, log = await leader_log(client, prefix)
    await asyncio.wait_for(log.append({"n": 1}), STEP_S)
    election.stop_keepalive()
    await client.lease_revoke(election.lease_id)  # what an expiry does, without the wait
    with pytest.raises(NotLeaderError, match="no longer leads"):
        await asyncio.wait_for(log.append({"n": 2}), STEP_S)
    with pytest.raises(NotLeaderError):
        await asyncio.wait_for(log.append({"n": 3}), STEP_S)  # failed for good
    assert await stored(client, prefix) == {1: {"n": 1}}
    await log.close()


async def test_after_a_takeover_the_old_leader_writes_nothing_and_the_new_one_continues(client: EtcdClient) -> None:
    prefix = new_prefix()
    old, old_log = await leader_log(client, prefix, "old")
    await asyncio.wait_for(old_log.append({"n": 1}), STEP_S)
    old.stop_keepalive()  # paused: its lease runs out
    new, new_log = await leader_log(client, prefix, "new")
    with pytest.raises(NotLeaderError):
        await asyncio.wait_for(old_log.append({"n": 99}), STEP_S)
    await asyncio.wait_for(new_log.append({"n": 2}), STEP_S)
    assert await stored(client, prefix) == {1: {"n": 1}, 2: {"n": 2}}
    await old_log.close()
    await new_log.close()
    await new.resign()


async def test_a_follower_tail_sees_every_record_in_order_across_a_snapshot(client: EtcdClient) -> None:
    prefix = new_prefix()
    election, log = await leader_log(client, prefix)
    await asyncio.wait_for(log.append({"n": 1}), STEP_S)
    recovered, revision = await recover(client, prefix)
    assert recovered.last_index == 1

    async def follow(count: int) -> list[tuple[int, dict[str, Any]]]:
        seen = []
        async for item in tail(client, prefix, after_index=recovered.last_index, start_revision=revision + 1):
            seen.append(item)
            if len(seen) == count:
                break
        return seen

    follower = asyncio.ensure_future(follow(300))
    for n in range(2, 302):
        log.append({"n": n})
        if n % 37 == 0:
            await asyncio.sleep(0.01)  # several txns, not one
        if n == 150:
            await asyncio.wait_for(log.snapshot(Sum), STEP_S)  # deletes records the tail already saw
    seen = await asyncio.wait_for(follower, STEP_S)
    assert seen == [(n, {"n": n}) for n in range(2, 302)]
    await log.close()
    await election.resign()


async def test_recovery_after_a_snapshot_gives_the_snapshot_and_the_records_after_it(client: EtcdClient) -> None:
    prefix = new_prefix()
    election, log = await leader_log(client, prefix)
    for n in range(1, 11):
        log.append({"n": n})
    await asyncio.wait_for(log.snapshot(Sum), STEP_S)
    assert log.records_since_snapshot == 0
    await asyncio.wait_for(asyncio.gather(*[log.append({"n": n}) for n in range(11, 16)]), STEP_S)
    recovered, _ = await recover(client, prefix)
    assert recovered.snapshot == {"sum": 55, "count": 10}
    assert recovered.records == [{"n": n} for n in range(11, 16)]
    assert recovered.last_index == 15
    assert sorted(await stored(client, prefix)) == list(range(11, 16))  # the covered records are gone
    await log.close()
    # A new leader continues after the recovered index.
    await election.resign()
    election, log = await leader_log(client, prefix, "b")
    await asyncio.wait_for(log.append({"n": 16}), STEP_S)
    recovered, _ = await recover(client, prefix)
    assert recovered.last_index == 16 and recovered.records[-1] == {"n": 16}
    await log.close()
    await election.resign()


async def test_appends_carry_on_when_one_of_three_members_is_killed() -> None:
    require_etcd()
    cluster = EtcdCluster(3).start()
    client = EtcdClient(cluster.client_urls)
    try:
        prefix = new_prefix()
        election, log = await leader_log(client, prefix)
        acked = 0
        for n in range(1, 401):
            future = log.append({"n": n})
            if n % 20 == 0:
                await asyncio.wait_for(future, STEP_S)
                acked = n
            if n == 100:
                cluster.kill(0)  # the endpoint the client uses first
        assert acked == 400
        recovered, _ = await recover(client, prefix)
        assert recovered.records == [{"n": n} for n in range(1, 401)]
        await log.close()
        await election.resign()
    finally:
        await client.close()
        cluster.close()


async def test_of_two_campaigners_one_leads_and_the_other_takes_over_within_the_ttl(client: EtcdClient) -> None:
    prefix = new_prefix()
    first = Election(client, prefix, "first", ttl_s=TTL_S)
    second = Election(client, prefix, "second", ttl_s=TTL_S)
    fence = await first.campaign(timeout_s=STEP_S)
    with pytest.raises(TimeoutError):
        await second.campaign(timeout_s=TTL_S + 0.5)  # longer than a lease: keepalives hold it
    assert first.is_leader and not second.is_leader
    leader = await second.leader()
    assert leader == fence and leader.name == "first"
    first.stop_keepalive()  # the leader's process stops renewing
    stopped = time.monotonic()
    await second.campaign(timeout_s=TTL_S + 1)
    took = time.monotonic() - stopped
    assert second.is_leader and not first.is_leader
    assert took <= TTL_S + 1
    leader = await first.leader()
    assert leader is not None and leader.name == "second"
    await second.resign()
    assert await first.leader() is None
