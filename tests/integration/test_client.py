"""The real client against a real server on loopback: every operation, sync and async,
long-poll wakeups and deadlines, exactly-once writes, retries and thread safety."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from server_process import ServerProcess
from waiting import call_within, parked_long_polls, served, wait_for_parked, wait_until

from rdzv_client import (
    AsyncClient,
    Client,
    ConflictError,
    JobClosedError,
    JobSettings,
    NotFoundError,
    RdzvConnectionError,
    RdzvError,
    RdzvTimeoutError,
    WatchResult,
    wire,
)


def new_job() -> str:
    return f"job-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One memory-only server for the module (a start costs ~0.5 s); every test uses its own
    job. The tests' nodes share hosts, and their jobs end: no
    quarantine of a host between tests."""
    srv = ServerProcess(tmp_path_factory.mktemp("client-server"), durable=False, args=("--quarantine-after", "0"))
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def client(server: Any) -> Iterator[Client]:
    with Client(server.endpoint, retry_budget=10.0) as c:
        yield c


@pytest.fixture
async def aclient(server: Any) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(server.endpoint, retry_budget=10.0) as c:
        yield c


@pytest.fixture
def job(client: Client) -> str:
    rdzv_id = new_job()
    client.create_job(rdzv_id, JobSettings(min_nodes=1, max_nodes=4))
    return rdzv_id


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# --------------------------------------------------------------------------- store ops


def test_every_store_operation_through_the_sync_client(client: Client, job: str) -> None:
    before = client.num_keys(job)
    client.set(job, "a", "1")
    client.set(job, b"b", b"\x00\xff")
    assert client.get(job, "a", timeout=1) == b"1"
    assert client.get(job, "b", timeout=1) == b"\x00\xff"
    assert client.add(job, "n", 5) == 5
    assert client.add(job, "n", -2) == 3
    assert client.compare_set(job, "a", "1", "2") == b"2"
    assert client.compare_set(job, "a", "1", "3") == b"2"  # mismatch: unchanged, returns current
    client.append(job, "log", "x")
    client.append(job, "log", "y")
    assert client.get(job, "log", timeout=1) == b"xy"
    client.multi_set(job, ["m/1", "m/2"], [b"one", "two"])
    assert client.multi_get(job, ["m/2", "m/1"], timeout=1) == [b"two", b"one"]
    assert client.check(job, ["a", "m/1"]) is True
    assert client.check(job, ["a", "missing"]) is False
    client.wait(job, ["a", "m/2"], timeout=1)
    assert sorted(client.list_keys(job, "m/")) == [b"m/1", b"m/2"]
    assert set(client.list_keys(job)) >= {b"a", b"b", b"n", b"log", b"m/1", b"m/2"}
    assert client.num_keys(job) == before + 6
    assert client.delete_key(job, "a") is True
    assert client.delete_key(job, "a") is False
    assert client.check(job, ["a"]) is False
    assert client.num_keys(job) == before + 5


async def test_every_store_operation_through_the_async_client(aclient: AsyncClient) -> None:
    job = new_job()
    await aclient.create_job(job, JobSettings(min_nodes=1, max_nodes=2))
    before = await aclient.num_keys(job)
    await aclient.set(job, "a", "1")
    assert await aclient.get(job, "a", timeout=1) == b"1"
    assert await aclient.add(job, "n", 7) == 7
    assert await aclient.compare_set(job, "a", b"1", b"2") == b"2"
    await aclient.append(job, "a", "+")
    assert await aclient.get(job, "a", timeout=1) == b"2+"
    await aclient.multi_set(job, ["x", "y"], ["X", "Y"])
    assert await aclient.multi_get(job, ["x", "y"], timeout=1) == [b"X", b"Y"]
    assert await aclient.check(job, ["x", "y"]) is True
    await aclient.wait(job, ["x"], timeout=1)
    assert set(await aclient.list_keys(job, b"")) >= {b"a", b"n", b"x", b"y"}
    assert await aclient.num_keys(job) == before + 4
    assert await aclient.delete_key(job, "x") is True
    assert await aclient.num_keys(job) == before + 3


def test_keys_of_a_round_are_apart_from_the_job_keys(client: Client, job: str) -> None:
    client.set(job, "k", "job-level")
    client.set(job, "k", "round-7", round=7)
    assert client.get(job, "k", timeout=1) == b"job-level"
    assert client.get(job, "k", timeout=1, round=7) == b"round-7"
    assert client.check(job, ["k"], round=8) is False


def test_jobs_do_not_see_each_other_keys(client: Client, job: str) -> None:
    other = new_job()
    client.create_job(other, JobSettings(min_nodes=1, max_nodes=1))
    client.set(job, "shared-name", "mine")
    assert client.check(other, ["shared-name"]) is False


# --------------------------------------------------------------------------- long-polls


def test_a_blocking_get_is_woken_by_a_set_from_another_client(server: Any, client: Client, job: str) -> None:
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(client.get(job, "late", timeout=20)))
    waiter.start()
    wait_for_parked(server, 1)
    with Client(server.endpoint) as other:
        other.set(job, "late", "here")
    waiter.join(timeout=10)
    assert got == [b"here"]  # woken: its one 20 s poll could not have timed out yet


async def test_async_wait_and_multi_get_are_woken_by_sets(server: Any, aclient: AsyncClient) -> None:
    job = new_job()
    await aclient.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    waiting = asyncio.ensure_future(aclient.wait(job, ["p", "q"], timeout=20))
    fetching = asyncio.ensure_future(aclient.multi_get(job, ["p", "q"], timeout=20))
    await asyncio.to_thread(wait_for_parked, server, 2)
    assert not waiting.done()
    await aclient.set(job, "p", "1")  # applied when acknowledged: a woken waiter would be gone
    assert await asyncio.to_thread(parked_long_polls, server) == 2
    assert not waiting.done()
    await aclient.set(job, "q", "2")
    await asyncio.wait_for(waiting, 5)
    assert await asyncio.wait_for(fetching, 5) == [b"1", b"2"]


@pytest.mark.parametrize("op", ["get", "multi_get", "wait"])
def test_blocking_calls_raise_timeout_after_their_timeout(client: Client, job: str, op: str) -> None:
    # How long they wait first: test_server_store's test_a_missing_key_times_out_after_the_callers_timeout.
    with pytest.raises(RdzvTimeoutError):
        if op == "get":
            client.get(job, "never", timeout=1.0)
        elif op == "multi_get":
            client.multi_get(job, ["never", "nor"], timeout=1.0)
        else:
            client.wait(job, ["never"], timeout=1.0)


def test_a_zero_timeout_get_answers_at_once(server: Any, client: Client, job: str) -> None:
    polls = served(server, "get")
    with pytest.raises(TimeoutError):  # within our patience: not held for the server's 30 s
        call_within(lambda: client.get(job, "never", timeout=0), what="the zero-timeout get answered")
    assert served(server, "get") == polls + 1  # one poll, answered at once


# --------------------------------------------------------------------------- exactly-once


def test_a_write_resent_with_the_same_rid_applies_once(client: Client, job: str) -> None:
    rid = client.next_rid()
    req = wire.AddRequest(job, key=b"counter", amount=5, rid=rid)
    first = client.request(job, req)
    again = client.request(job, req)
    assert first == again == {"value": 5}
    assert client.add(job, "counter", 0) == 5
    assert client.request(job, wire.AddRequest(job, key=b"counter", amount=5, rid=client.next_rid())) == {"value": 10}


def test_a_forked_child_numbers_its_writes_apart_from_its_parent(client: Client, job: str) -> None:
    """Parent and child go on from the same client after a fork: each of their writes is applied
    (on one client id the parent's next write would take the child's rid, and get its result)."""
    assert client.add(job, "counter", 1) == 1
    pid = os.fork()
    if pid == 0:  # the child: one add, its outcome as the exit code
        try:
            os._exit(0 if client.add(job, "counter", 10) == 11 else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert client.add(job, "counter", 100) == 111


# --------------------------------------------------------------------------- errors


def test_server_errors_map_onto_the_client_tree(client: Client, job: str) -> None:
    client.set(job, "text", "abc")
    with pytest.raises(ConflictError) as conflict:
        client.add(job, "text", 1)
    assert conflict.value.code is wire.ErrorCode.NOT_AN_INTEGER
    client.join(job, node_id="n0", addr="h", nproc_per_node=1,
        settings=JobSettings(min_nodes=1, max_nodes=4, last_call_timeout=0), timeout=10)
    with pytest.raises(ConflictError) as settings:  # a job with live nodes keeps its settings
        client.create_job(job, JobSettings(min_nodes=2, max_nodes=3))
    assert settings.value.code is wire.ErrorCode.SETTINGS_CONFLICT
    with pytest.raises(NotFoundError):
        client.job(new_job())


def test_nothing_listening_is_a_connection_error_within_the_budget() -> None:
    port = free_port()
    with Client(f"127.0.0.1:{port}", retry_budget=0.5) as c:
        with pytest.raises(RdzvConnectionError) as info:
            call_within(lambda: c.set("job", "k", "v"), what="giving up")  # its 0.5 s budget, not the 30 s default
    assert f"127.0.0.1:{port}" in str(info.value)


def test_health_and_readiness(client: Client) -> None:
    assert client.healthy() is True
    assert client.ready() is True


def test_failover_skips_a_dead_endpoint(server: Any) -> None:
    with Client(f"127.0.0.1:{free_port()},{server.endpoint}", retry_budget=10.0) as c:
        job = new_job()
        c.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        c.set(job, "k", "v")
        assert c.get(job, "k", timeout=1) == b"v"


# --------------------------------------------------------------------------- restarts


def test_calls_retry_through_a_server_restart_and_acknowledged_writes_survive(
    durable_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with Client(durable_server.endpoint, retry_budget=30.0) as c:
        job = new_job()
        c.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        c.set(job, "before", "the kill")
        assert c.add(job, "n", 1) == 1
        results: list[object] = []

        def call(fn: Any) -> threading.Thread:
            t = threading.Thread(target=lambda: results.append(fn()))
            t.start()
            return t

        held = call(lambda: c.get(job, "after", timeout=30))  # a long-poll open across the kill
        wait_for_parked(durable_server, 1)
        durable_server.close()  # SIGKILL (and release the fixture's pipe to it)
        write = call(lambda: c.add(job, "n", 1))  # sent while nothing listens: retried
        wait_until(
            lambda: any(r.getMessage().startswith(f"Request for add on job {job} ") for r in caplog.records),
            what="the add refused while nothing listens, and retried",
        )
        durable_server.start()  # same port, same data dir
        write.join(timeout=30)
        c.set(job, "after", "restart")
        held.join(timeout=30)
        assert sorted(map(repr, results)) == sorted(map(repr, [2, b"restart"]))
        assert c.get(job, "before", timeout=1) == b"the kill"


def test_a_write_retried_after_a_restart_with_its_rid_applies_once(durable_server: Any) -> None:
    with Client(durable_server.endpoint, retry_budget=30.0) as c:
        job = new_job()
        c.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        req = wire.AddRequest(job, key=b"n", amount=3, rid=c.next_rid())
        assert c.request(job, req) == {"value": 3}
        durable_server.close()  # SIGKILL; start() brings it back on the same port and data dir
        durable_server.start()
        assert c.request(job, req) == {"value": 3}  # the recorded answer, not a second add
        assert c.add(job, "n", 0) == 3


# --------------------------------------------------------------------------- threads


def test_sixteen_threads_share_one_client_exactly(client: Client, job: str) -> None:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(200):
                client.add(job, "total", 1)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert client.add(job, "total", 0) == 16 * 200


# --------------------------------------------------------------------------- rendezvous


async def test_two_nodes_join_and_get_ranks(aclient: AsyncClient) -> None:
    job = new_job()

    async def join(node: str, nproc: int) -> wire.Assignment:
        return await aclient.join(
            job, node_id=node, addr=f"{node}.local", nproc_per_node=nproc,
            settings=JobSettings(min_nodes=2, max_nodes=2), timeout=20
        )

    a, b = await asyncio.gather(join("node-a", 2), join("node-b", 3))
    assert {a.node_rank, b.node_rank} == {0, 1}
    assert a.world_size == b.world_size == 5
    assert a.round == b.round and a.num_nodes == 2
    first = a if a.node_rank == 0 else b
    second = b if first is a else a
    assert first.global_rank_start == 0
    assert second.global_rank_start == first.nproc_per_node
    assert a.master_addr == b.master_addr == f"{'node-a' if first is a else 'node-b'}.local"
    seen = await aclient.watch(job, "node-a", round=a.round)
    assert seen == WatchResult(round=a.round, state="complete", num_nodes_waiting=0, closed=False)
    doc = await aclient.job(job)
    assert doc["num_nodes"] == 2 and [n["node_rank"] for n in doc["nodes"]] == [0, 1]
    assert any(j["rdzv_id"] == job for j in await aclient.jobs())


def test_a_join_that_cannot_complete_raises_its_own_timeout(client: Client) -> None:
    job = new_job()
    with pytest.raises(RdzvTimeoutError):
        client.join(job, node_id="lonely", addr="h", nproc_per_node=1,
            settings=JobSettings(min_nodes=2, max_nodes=2), timeout=1.0)
    (joined,) = client.job(job)["joining"]  # its own timeout ended it: the server still has it in line
    assert joined["node_id"] == "lonely"


def test_a_closed_job_with_live_nodes_refuses_joins(client: Client) -> None:
    job = new_job()
    client.join(job, node_id="n0", addr="h", nproc_per_node=1,
        settings=JobSettings(min_nodes=1, max_nodes=1), timeout=10)
    client.close_job(job)  # n0 is still alive: its run is over, and no one may join it
    assert client.watch(job, "n0", round=0).closed is True
    with pytest.raises(JobClosedError):
        client.join(job, node_id="n1", addr="h", nproc_per_node=1,
            settings=JobSettings(min_nodes=1, max_nodes=1), timeout=5)


@pytest.fixture
async def redirecting() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    """A server on loopback that answers every request with a 307 to a second one, which
    records the headers of whatever reaches it: ``(first endpoint, what the second saw)``."""
    from aiohttp import web

    seen: list[dict[str, str]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        return web.json_response({"jobs": []})

    second = web.Application()
    second.router.add_route("*", "/{tail:.*}", record)
    second_runner = web.AppRunner(second)
    await second_runner.setup()
    second_site = web.TCPSite(second_runner, "127.0.0.1", 0)
    await second_site.start()
    second_port = second_runner.addresses[0][1]

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect(f"http://127.0.0.1:{second_port}{request.path_qs}")

    first = web.Application()
    first.router.add_route("*", "/{tail:.*}", redirect)
    first_runner = web.AppRunner(first)
    await first_runner.setup()
    first_site = web.TCPSite(first_runner, "127.0.0.1", 0)
    await first_site.start()
    try:
        yield f"127.0.0.1:{first_runner.addresses[0][1]}", seen
    finally:
        await first_runner.cleanup()
        await second_runner.cleanup()


async def test_the_clients_follow_no_redirect_so_the_token_stays_with_the_endpoints_given(
    redirecting: tuple[str, list[dict[str, str]]],
) -> None:
    endpoint, seen = redirecting
    async with AsyncClient(endpoint, token="s3cret-token", retry_budget=0) as aclient:
        with pytest.raises(RdzvError) as write:
            await aclient.set("job", "k", "v")
        with pytest.raises(RdzvError) as page:
            await aclient.jobs()
    sync = Client(endpoint, token="s3cret-token", retry_budget=0)
    try:
        with pytest.raises(RdzvError) as sync_page:
            await asyncio.to_thread(sync.jobs)
    finally:
        sync.close()
    for raised in (write.value, page.value, sync_page.value):  # the 3xx is the answer
        assert isinstance(raised, RdzvError) and "HTTP 307" in str(raised), raised
    assert seen == [], f"a redirect carried the request (and its token) to another server: {seen}"
