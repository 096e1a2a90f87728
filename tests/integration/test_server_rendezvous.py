"""The rendezvous rules over HTTP, driven by the real async client against a real process:
round completion (max_nodes at once, min_nodes after the last call), node and global
ranks, the membership document, settings conflicts, waiting and standby nodes, rank
stability across rounds, liveness (TTL and dropped watch connections), graceful leave,
close, join_timeout, and the operator routes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import pytest
from server_process import ServerProcess
from waiting import wait_for_parked, wait_until_async

from rdzv_client import (
    AsyncClient,
    ConflictError,
    JobClosedError,
    JobSettings,
    JoinTimeoutError,
    NotFoundError,
    WatchResult,
    wire,
)

# "Well before" bound for things that should happen promptly, far below the timeouts that
# would otherwise make them happen.
PROMPTLY = 3.0
DISCONNECT_GRACE = 0.5
# A third of the shortest heartbeat TTL these tests give (1 s): how often a watcher beats.
BEAT_EVERY = 0.3


def new_job() -> str:
    return f"rdzv-{uuid.uuid4().hex[:12]}"


def start_server(tmp_path_factory: pytest.TempPathFactory, *args: str) -> ServerProcess:
    """A server for every test of the module. Several tests kill nodes of the same made-up hosts
    (a.local ...): automatic quarantine, which counts a host's deaths across jobs, would let one
    test's deaths refuse a later test's joins (as test_server_stream's servers, it is off)."""
    srv = ServerProcess(tmp_path_factory.mktemp("rdzv-server"), durable=False, args=("--quarantine-after", "0", *args))
    srv.start()
    return srv


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One memory-only server for the module (a start costs ~0.5 s); every test uses its own job."""
    srv = start_server(tmp_path_factory)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def grace_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with a short disconnect grace, for the fast death path."""
    srv = start_server(tmp_path_factory, "--disconnect-grace", str(DISCONNECT_GRACE))
    yield srv
    srv.close()


@pytest.fixture
async def aclient(server: ServerProcess) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(server.endpoint, retry_budget=10.0) as c:
        yield c


def joiner(aclient: AsyncClient, rdzv_id: str, **settings: Any) -> Callable[..., Awaitable[wire.Assignment]]:
    """A join function for one job with fixed settings: ``await join("node-a", nproc=2)``."""

    async def join(node_id: str, nproc: int = 1, timeout: float = 20.0) -> wire.Assignment:
        return await aclient.join(
            rdzv_id, node_id=node_id, addr=f"{node_id}.local", nproc_per_node=nproc, timeout=timeout,
            settings=JobSettings(**settings),
        )

    return join


async def pair(aclient: AsyncClient, first: str, second: str, heartbeat_ttl: float) -> tuple[str, int]:
    """A new job whose first round formed with ``first`` and ``second`` (two nodes, at once):
    the job's id and the round."""
    job = new_job()
    join = joiner(aclient, job, min_nodes=2, max_nodes=2, heartbeat_ttl=heartbeat_ttl)
    got = await asyncio.gather(join(first), join(second))
    return job, got[0].round


async def cancel(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def watch_until_waiting(aclient: AsyncClient, rdzv_id: str, node_id: str, round_: int, within: float) -> WatchResult:
    """Heartbeat-and-watch until num_nodes_waiting > 0 (bounded), each watch held at most
    :data:`BEAT_EVERY` (a watch beats when it is sent and answered, not while it is held)."""
    deadline = time.monotonic() + within
    while True:
        hold = max(0.0, min(BEAT_EVERY, deadline - time.monotonic()))
        seen = await aclient.watch(rdzv_id, node_id, round=round_, known=0, hold=hold)
        if seen.num_nodes_waiting > 0:
            return seen
        if time.monotonic() >= deadline:
            raise AssertionError(f"{node_id} never saw num_nodes_waiting > 0 within {within} s")


async def event(aclient: AsyncClient, rdzv_id: str, kind: str, node_id: str | None = None) -> dict[str, Any]:
    """The one event of ``kind`` (about ``node_id``, if given) on the job's timeline: when the
    server applied it (``time``, its own clock) and why (``cause``)."""
    found = [
        e for e in (await aclient.events(rdzv_id))["events"]
        if e["kind"] == kind and (node_id is None or e["node_id"] == node_id)
    ]
    assert len(found) == 1, f"not one {kind} event about {node_id}: {found}"
    return found[0]


def by_rank(assignments: dict[str, wire.Assignment]) -> list[str]:
    return sorted(assignments, key=lambda n: assignments[n].node_rank)


def http_get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), resp.read()


# --------------------------------------------------------------------------- completion


async def test_a_round_completes_at_once_when_max_nodes_have_joined(aclient: AsyncClient) -> None:
    job = new_job()
    join = joiner(aclient, job, min_nodes=2, max_nodes=3, last_call_timeout=30.0)
    got = await asyncio.gather(join("a"), join("b"), join("c"))  # each join gives up after 20 s
    assert (await event(aclient, job, "round_formed"))["cause"] == "max_nodes"  # not the 30 s last call
    assert sorted(a.node_rank for a in got) == [0, 1, 2]
    assert {a.round for a in got} == {got[0].round}
    assert all(a.num_nodes == 3 and a.world_size == 3 for a in got)


async def test_a_round_completes_at_min_nodes_after_the_last_call(aclient: AsyncClient) -> None:
    job = new_job()
    join = joiner(aclient, job, min_nodes=2, max_nodes=4, last_call_timeout=0.5)
    got = await asyncio.gather(join("a"), join("b"))
    # The server's own times: the last call ran its whole length from the min_nodes-th join.
    formed, second = await event(aclient, job, "round_formed"), await event(aclient, job, "node_joined", "b")
    assert formed["cause"] == "last_call" and 0.5 <= formed["time"] - second["time"] < 0.5 + PROMPTLY
    assert sorted(a.node_rank for a in got) == [0, 1]
    assert all(a.num_nodes == 2 for a in got)
    doc = await aclient.job(job)
    assert doc["state"] == "complete" and doc["num_nodes"] == 2


async def test_every_node_learns_node_rank_0s_addr_and_offered_port(aclient: AsyncClient) -> None:
    job = new_job()
    ports = {"n-a": 31001, "n-b": 31002, "n-c": 31003}
    results = await asyncio.gather(
        *(
            aclient.join(job, node_id=n, addr=f"{n}.local", nproc_per_node=1,
                         settings=JobSettings(min_nodes=3, max_nodes=3),
                         master_port=p, timeout=20)
            for n, p in ports.items()
        )
    )
    master = next(n for n, a in zip(ports, results) if a.node_rank == 0)
    assert {(a.master_addr, a.master_port) for a in results} == {(f"{master}.local", ports[master])}


async def test_node_ranks_and_global_ranks_with_heterogeneous_nproc_per_node(aclient: AsyncClient) -> None:
    job = new_job()
    join = joiner(aclient, job, min_nodes=4, max_nodes=4, last_call_timeout=30.0)
    nproc = {"n-a": 3, "n-b": 1, "n-c": 4, "n-d": 2}
    results = await asyncio.gather(*(join(n, nproc=k) for n, k in nproc.items()))
    got = dict(zip(nproc, results))
    order = by_rank(got)
    assert [got[n].node_rank for n in order] == [0, 1, 2, 3]
    start = 0
    for n in order:  # global ranks are the prefix sums of nproc_per_node in node_rank order
        assert got[n].global_rank_start == start
        assert got[n].nproc_per_node == nproc[n]
        start += nproc[n]
    assert {a.world_size for a in results} == {10}
    assert {a.num_nodes for a in results} == {4}
    assert {a.master_addr for a in results} == {f"{order[0]}.local"}

    doc = await aclient.job(job)
    assert doc["rdzv_id"] == job
    assert doc["state"] == "complete"
    assert doc["round"] == results[0].round
    assert (doc["min_nodes"], doc["max_nodes"]) == (4, 4)
    assert doc["num_nodes"] == 4 and doc["world_size"] == 10
    assert doc["waiting"] == [] and doc["standby"] == []
    assert [n["node_id"] for n in doc["nodes"]] == order
    covered: list[int] = []
    for entry in doc["nodes"]:
        a = got[entry["node_id"]]
        assert entry["addr"] == f"{entry['node_id']}.local"
        assert entry["node_rank"] == a.node_rank
        assert entry["nproc_per_node"] == nproc[entry["node_id"]]
        assert entry["global_ranks"] == list(range(a.global_rank_start, a.global_rank_start + a.nproc_per_node))
        assert entry["alive"] is True
        assert isinstance(entry["last_heartbeat_age_s"], (int, float)) and 0 <= entry["last_heartbeat_age_s"] < 10
        covered += entry["global_ranks"]
    assert covered == list(range(10))


async def test_conflicting_settings_are_a_409_settings_conflict(server: ServerProcess, aclient: AsyncClient) -> None:
    job = new_job()
    await joiner(aclient, job, min_nodes=1, max_nodes=1)("first")
    with pytest.raises(ConflictError) as info:
        await joiner(aclient, job, min_nodes=1, max_nodes=2)("second", timeout=5)
    assert info.value.code is wire.ErrorCode.SETTINGS_CONFLICT
    body = {"node_id": "third", "addr": "h", "nproc_per_node": 1, "min_nodes": 1, "max_nodes": 3}
    url = server.url + wire.op_path(job, "join")
    async with aiohttp.ClientSession() as session, session.post(url, json=body, headers=server.auth) as resp:
        assert resp.status == 409
        answer = await resp.json()
    assert answer["error"] == "settings_conflict" and answer["message"]
    doc = await aclient.job(job)
    assert [n["node_id"] for n in doc["nodes"]] == ["first"]
    assert doc["max_nodes"] == 1


# --------------------------------------------------------------------------- later rounds


async def test_a_late_node_is_waiting_members_see_it_and_the_next_round_takes_it(
    server: ServerProcess, aclient: AsyncClient
) -> None:
    job = new_job()
    join = joiner(aclient, job, min_nodes=2, max_nodes=3, last_call_timeout=0.3)
    first = dict(zip(("a", "b"), await asyncio.gather(join("a"), join("b"))))
    round_ = first["a"].round
    assert (await aclient.watch(job, "a", round=round_, known=-1)).num_nodes_waiting == 0
    watching = asyncio.ensure_future(aclient.watch(job, "a", round=round_, known=0, hold=10))
    await asyncio.to_thread(wait_for_parked, server, 1)
    assert not watching.done()
    late = asyncio.ensure_future(join("c"))
    try:
        seen = await asyncio.wait_for(watching, PROMPTLY)  # woken by the arrival, not the 10 s hold
        assert seen.num_nodes_waiting == 1 and seen.state == "complete"
        doc = await aclient.job(job)
        assert [n["node_id"] for n in doc["waiting"]] == ["c"]
        assert doc["standby"] == [] and doc["num_nodes"] == 2
        assert (await aclient.watch(job, "b", round=round_)).num_nodes_waiting == 1
        assert not late.done()  # c waits for the next round
        # The members' agents restart and re-join: the next round has all three.
        second = dict(zip(("b", "a"), await asyncio.gather(join("b"), join("a"))))
        second["c"] = await asyncio.wait_for(late, PROMPTLY)
    finally:
        await cancel(late, watching)
    assert {a.round for a in second.values()} == {round_ + 1}
    assert {n: a.node_rank for n, a in second.items()} == {
        "a": first["a"].node_rank,
        "b": first["b"].node_rank,
        "c": 2,
    }
    assert (await aclient.watch(job, "c", round=round_ + 1)).num_nodes_waiting == 0


async def test_members_that_re_join_keep_their_ranks_whatever_their_arrival_order(aclient: AsyncClient) -> None:
    job = new_job()
    join = joiner(aclient, job, min_nodes=3, max_nodes=3, last_call_timeout=30.0)
    names = ["p", "q", "r"]
    first = dict(zip(names, await asyncio.gather(*(join(n) for n in names))))
    order = by_rank(first)
    # Re-join in reverse rank order: arrival order alone would reverse the ranks.
    tasks = []
    for n in reversed(order):
        tasks.append(asyncio.ensure_future(join(n)))

        async def in_line(node: str = n) -> bool:  # its second node_joined: the server has it
            events = (await aclient.events(job))["events"]
            return sum(e["kind"] == "node_joined" and e["node_id"] == node for e in events) == 2

        await wait_until_async(in_line, timeout=PROMPTLY, what=f"{n} back in line")
    try:
        second = dict(zip(reversed(order), await asyncio.wait_for(asyncio.gather(*tasks), 10)))
    finally:
        await cancel(*tasks)
    assert {a.round for a in second.values()} == {first["p"].round + 1}
    assert {n: a.node_rank for n, a in second.items()} == {n: a.node_rank for n, a in first.items()}
    assert {n: a.global_rank_start for n, a in second.items()} == {n: a.global_rank_start for n, a in first.items()}


async def test_a_node_beyond_max_nodes_is_standby_and_does_not_restart_the_round(aclient: AsyncClient) -> None:
    job = new_job()
    join = joiner(aclient, job, min_nodes=2, max_nodes=2)
    first = await asyncio.gather(join("a"), join("b"))
    spare = asyncio.ensure_future(join("spare"))
    try:

        async def is_standby() -> bool:
            return [n["node_id"] for n in (await aclient.job(job))["standby"]] == ["spare"]

        await wait_until_async(is_standby, timeout=PROMPTLY, what="the spare node is listed as standby")
        assert (await aclient.watch(job, "a", round=first[0].round)).num_nodes_waiting == 0
        assert (await aclient.job(job))["waiting"] == []
    finally:
        await cancel(spare)


# --------------------------------------------------------------------------- liveness


async def test_a_member_that_stops_heartbeating_is_dead_after_the_ttl(aclient: AsyncClient) -> None:
    job = new_job()
    ttl = 1.0
    join = joiner(aclient, job, min_nodes=2, max_nodes=2, heartbeat_ttl=ttl)
    got = await asyncio.gather(join("silent"), join("survivor"))  # "silent" never sends anything again
    seen = await watch_until_waiting(aclient, job, "survivor", got[0].round, within=ttl + 5)
    assert seen.num_nodes_waiting == 1
    # Not before its TTL, on the server's own clock: its join was the last it heard of the node.
    joined, died = await event(aclient, job, "node_joined", "silent"), await event(aclient, job, "node_departed", "silent")
    assert died["cause"] == "heartbeat_expired" and ttl <= died["time"] - joined["time"] < ttl + PROMPTLY
    nodes = {n["node_id"]: n for n in (await aclient.job(job))["nodes"]}
    assert nodes["silent"]["alive"] is False
    assert nodes["survivor"]["alive"] is True


async def test_beats_keep_a_node_alive_while_its_watch_is_parked_longer_than_its_ttl(aclient: AsyncClient) -> None:
    # The plug-in's protocol: the watch is held up to max_hold, and a watch of no hold every
    # third of the TTL (answered at once) is the heartbeat. The server holds the watch as long
    # as asked, not a third of the TTL, so it is re-sent only when something changes.
    ttl = 1.0
    hold = 3 * ttl
    job, round_ = await pair(aclient, "beating", "survivor", ttl)
    parked = time.monotonic()
    watches = [
        asyncio.ensure_future(aclient.watch(job, node, round=round_, known=0, hold=hold))
        for node in ("beating", "survivor")
    ]
    try:
        while not all(w.done() for w in watches):
            for node in ("beating", "survivor"):
                beat = await aclient.watch(job, node, round=round_, known=0, hold=0.0)
                assert beat.num_nodes_waiting == 0
            await asyncio.wait(watches, timeout=ttl / 3)
        held = time.monotonic() - parked
        assert all(w.result().num_nodes_waiting == 0 for w in watches)
    finally:
        await cancel(*watches)
    assert held >= 0.75 * hold - 0.05, f"the watch was answered after {held:.2f} s, not held (jittered) {hold} s"
    nodes = {n["node_id"]: n for n in (await aclient.job(job))["nodes"]}
    assert nodes["beating"]["alive"] is True and nodes["survivor"]["alive"] is True


async def test_a_node_that_stops_beating_while_its_watch_is_parked_is_dead_after_its_ttl(aclient: AsyncClient) -> None:
    # A hung process keeps its connection (and its parked watch) open but sends nothing: an
    # open watch is not a heartbeat, so the TTL finds it however long the watch is held.
    ttl = 1.0
    job, round_ = await pair(aclient, "hung", "survivor", ttl)
    hung = asyncio.ensure_future(aclient.watch(job, "hung", round=round_, known=0, hold=30.0))
    try:
        # The survivor beats by its watches, a third of its TTL each.
        seen = await watch_until_waiting(aclient, job, "survivor", round_, within=ttl + PROMPTLY)
        assert seen.num_nodes_waiting == 1, "the hung node was not found dead"
        # Its own watch is answered too: it is no longer a live member of the round.
        assert (await asyncio.wait_for(hung, PROMPTLY)).num_nodes_waiting == 1
    finally:
        await cancel(hung)
    # Not before its TTL, on the server's own clock: its last beat (its watch) came after the round formed.
    formed, died = await event(aclient, job, "round_formed"), await event(aclient, job, "node_departed", "hung")
    assert died["cause"] == "heartbeat_expired" and died["time"] - formed["time"] >= ttl
    nodes = {n["node_id"]: n for n in (await aclient.job(job))["nodes"]}
    assert nodes["hung"]["alive"] is False and nodes["survivor"]["alive"] is True


async def _open_raw_watch(srv: ServerProcess, rdzv_id: str, node_id: str, round_: int, hold: float) -> asyncio.StreamWriter:
    """Send a watch request on a raw connection and leave it held open (not read)."""
    body = json.dumps({"node_id": node_id, "round": round_, "known": 0, "hold": hold}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
    head = (
        f"POST {wire.op_path(rdzv_id, 'watch')} HTTP/1.1\r\nHost: {srv.endpoint}\r\n"
        f"Authorization: Bearer {srv.token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
    with contextlib.suppress(asyncio.TimeoutError):
        early = await asyncio.wait_for(reader.read(1), 0.3)
        raise AssertionError(f"the watch was answered at once ({early!r}), not held")
    return writer


@pytest.mark.parametrize("beat_while_parked", [False, True], ids=["plain", "beat-while-parked"])
async def test_a_dropped_watch_connection_marks_the_node_dead_within_the_grace(
    grace_server: ServerProcess, beat_while_parked: bool
) -> None:
    async with AsyncClient(grace_server.endpoint, retry_budget=10.0) as aclient:
        job, round_ = await pair(aclient, "crashing", "survivor", 30.0)
        writer = await _open_raw_watch(grace_server, job, "crashing", round_, hold=10.0)
        if beat_while_parked:
            # The node beat (a watch of no hold, on another connection) after its watch parked:
            # what counts is whether it calls again after the drop, not after the watch was sent.
            await aclient.watch(job, "crashing", round=round_, hold=0.0)
        writer.transport.abort()  # the process died: the kernel resets its connection
        seen = await watch_until_waiting(aclient, job, "survivor", round_, within=10.0)  # far before the 30 s TTL
        assert seen.num_nodes_waiting == 1
        assert (await event(aclient, job, "node_departed", "crashing"))["cause"] == "connection_closed"
        nodes = {n["node_id"]: n for n in (await aclient.job(job))["nodes"]}
        assert nodes["crashing"]["alive"] is False and nodes["survivor"]["alive"] is True


async def parked_long_polls(srv: ServerProcess) -> float:
    """The server's ``rdzv_waiters`` gauge: long-polls it holds right now."""
    async with aiohttp.ClientSession() as session, session.get(srv.url + "/metrics") as resp:
        text = await resp.text()
    (line,) = [line for line in text.splitlines() if line.startswith("rdzv_waiters ")]
    return float(line.split()[1])


async def test_a_watch_reconnected_within_the_grace_keeps_the_node_alive(grace_server: ServerProcess) -> None:
    async with AsyncClient(grace_server.endpoint, retry_budget=10.0) as aclient:
        job, round_ = await pair(aclient, "flaky", "survivor", 30.0)
        baseline = await parked_long_polls(grace_server)
        writer = await _open_raw_watch(grace_server, job, "flaky", round_, hold=10.0)
        assert await parked_long_polls(grace_server) == baseline + 1
        writer.transport.abort()

        async def drop_seen() -> bool:
            return await parked_long_polls(grace_server) == baseline

        # The grace starts when the server notices the drop; come back right after that.
        await wait_until_async(drop_seen, timeout=PROMPTLY, what="the server saw the watch connection drop")
        await aclient.watch(job, "flaky", round=round_)
        seen = await aclient.watch(job, "survivor", round=round_, known=0, hold=3 * DISCONNECT_GRACE)
        assert seen.num_nodes_waiting == 0
        nodes = {n["node_id"]: n for n in (await aclient.job(job))["nodes"]}
        assert nodes["flaky"]["alive"] is True


async def test_a_node_whose_other_watch_is_open_when_one_connection_drops_stays_alive(
    grace_server: ServerProcess,
) -> None:
    # The agent already has a new long-poll open when the server notices the old one
    # dropped (a watch cancelled and re-sent at once; the server may read the new request
    # before the old connection's close). The node never stopped watching: it is alive.
    async with AsyncClient(grace_server.endpoint, retry_budget=10.0) as aclient:
        job, round_ = await pair(aclient, "agent", "survivor", 30.0)
        baseline = await parked_long_polls(grace_server)
        writer = await _open_raw_watch(grace_server, job, "agent", round_, hold=10.0)
        newer = asyncio.ensure_future(aclient.watch(job, "agent", round=round_, known=0, hold=4 * DISCONNECT_GRACE))
        try:

            async def both_parked() -> bool:
                return await parked_long_polls(grace_server) == baseline + 2

            await wait_until_async(both_parked, timeout=PROMPTLY, what="both watches of the agent are held")
            writer.transport.abort()
            seen = await aclient.watch(job, "survivor", round=round_, known=0, hold=3 * DISCONNECT_GRACE)
            assert seen.num_nodes_waiting == 0, "the agent was declared dead while its newer watch was open"
            nodes = {n["node_id"]: n for n in (await aclient.job(job))["nodes"]}
            assert nodes["agent"]["alive"] is True
        finally:
            await cancel(newer)


async def test_a_graceful_leave_does_not_raise_num_nodes_waiting(aclient: AsyncClient) -> None:
    ttl = 1.0
    job, round_ = await pair(aclient, "leaver", "stayer", ttl)
    await aclient.leave(job, "leaver")
    assert (await aclient.watch(job, "stayer", round=round_)).num_nodes_waiting == 0
    # Past the leaver's TTL too: a departed node is not then found dead. (The stayer's watches
    # are its heartbeats: held a third of its TTL each, as a client that sends no other beats.)
    deadline = time.monotonic() + 1.5 * ttl
    while time.monotonic() < deadline:
        hold = min(ttl / 3, deadline - time.monotonic())
        seen = await aclient.watch(job, "stayer", round=round_, known=0, hold=hold)
        assert seen.num_nodes_waiting == 0
    nodes = {n["node_id"]: n for n in (await aclient.job(job))["nodes"]}
    assert nodes["leaver"]["alive"] is False and nodes["stayer"]["alive"] is True


# --------------------------------------------------------------------------- close, timeouts


async def test_a_closed_job_refuses_joins_and_watchers_see_it_closed(
    server: ServerProcess, aclient: AsyncClient
) -> None:
    job = new_job()
    got = await joiner(aclient, job, min_nodes=1, max_nodes=2, last_call_timeout=0.0)("member")
    watching = asyncio.ensure_future(aclient.watch(job, "member", round=got.round, known=0, hold=10))
    await asyncio.to_thread(wait_for_parked, server, 1)
    try:
        await aclient.close_job(job)
        seen = await asyncio.wait_for(watching, PROMPTLY)  # the close wakes the long-poll
    finally:
        await cancel(watching)
    assert seen.closed is True and seen.state == "closed"
    again = await aclient.watch(job, "member", round=got.round)
    assert again.closed is True and again.state == "closed"
    with pytest.raises(JobClosedError) as info:
        await joiner(aclient, job, min_nodes=1, max_nodes=2, last_call_timeout=0.0)("newcomer", timeout=5)
    assert info.value.code is wire.ErrorCode.JOB_CLOSED
    assert (await aclient.job(job))["state"] == "closed"


async def test_a_node_waiting_past_join_timeout_gets_join_timeout(aclient: AsyncClient) -> None:
    job = new_job()
    with pytest.raises(JoinTimeoutError) as info:
        await joiner(aclient, job, min_nodes=2, max_nodes=2, join_timeout=0.5)("alone", timeout=20)
    assert info.value.code is wire.ErrorCode.JOIN_TIMEOUT
    joined, left = await event(aclient, job, "node_joined", "alone"), await event(aclient, job, "node_departed", "alone")
    assert left["cause"] == "join_timeout" and 0.5 <= left["time"] - joined["time"] < 0.5 + PROMPTLY  # server's clock
    doc = await aclient.job(job)
    assert doc["joining"] == [] and doc["nodes"] == []


# --------------------------------------------------------------------------- operator routes


async def test_get_jobs_lists_every_job(aclient: AsyncClient) -> None:
    formed, created = new_job(), new_job()
    await joiner(aclient, formed, min_nodes=1, max_nodes=1)("only")
    await aclient.create_job(created, JobSettings(min_nodes=2, max_nodes=5))
    jobs = {j["rdzv_id"]: j for j in await aclient.jobs()}
    assert jobs[formed]["state"] == "complete" and jobs[formed]["num_nodes"] == 1
    assert jobs[created]["state"] == "open" and jobs[created]["num_nodes"] == 0
    assert jobs[created]["max_nodes"] == 5
    for j in (jobs[formed], jobs[created]):
        assert {"rdzv_id", "state", "round", "num_nodes"} <= set(j)


def test_health_readiness_metrics_and_dashboard_routes(server: ServerProcess) -> None:
    status, ctype, body = http_get(server.url + "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, ctype, body = http_get(server.url + "/readyz")
    assert status == 200 and json.loads(body)["status"] == "ready"
    create = urllib.request.Request(
        server.url + wire.op_path(new_job(), "create"),
        data=b"{}",
        headers={"Content-Type": "application/json", **server.auth},
    )
    with urllib.request.urlopen(create, timeout=10) as resp:  # at least one operation counted
        assert resp.status == 200
    status, ctype, body = http_get(server.url + "/metrics")
    text = body.decode()
    assert status == 200 and ctype.startswith("text/plain")
    assert "rdzv_requests_total" in text
    assert "rdzv_jobs" in text
    status, ctype, body = http_get(server.url + "/")
    assert status == 200 and ctype.startswith("text/html")
    assert b"<html" in body.lower()


async def test_a_node_dropped_from_the_line_while_still_waiting_joins_again_and_gets_its_place(
    aclient: AsyncClient,
) -> None:
    # An overloaded host can poll later than the TTL: the server drops it from the line. The
    # waiting client must take its place again rather than fail the whole rendezvous.
    rdzv_id = new_job()
    join = joiner(aclient, rdzv_id, min_nodes=2, max_nodes=2, heartbeat_ttl=1.5)
    waiting = asyncio.create_task(join("a"))

    async def a_in_line() -> bool:
        try:
            return any(n["node_id"] == "a" for n in (await aclient.job(rdzv_id))["joining"])
        except NotFoundError:
            return False  # not created yet

    await wait_until_async(a_in_line, timeout=10, what="a joins the line")
    await aclient.leave(rdzv_id, "a")  # what the server does to a node it thinks is gone
    await wait_until_async(a_in_line, timeout=10, what="a takes its place again")
    b = await join("b")
    a = await asyncio.wait_for(waiting, 20)
    assert {a.node_rank, b.node_rank} == {0, 1}
    assert a.round == b.round
