"""The client across replicas: a follower's ``not_leader`` sends a request on to the leader it
names, at once and with the same rid, when that leader is one of the client's endpoints;
anything else backs off as for any 503. And ``rdzvctl cluster``'s table and JSON.

Each replica is a tiny fake on 127.0.0.1 (an aiohttp app for HTTP, an asyncio server for the
stream protocol) that either leads (answers) or follows (answers ``not_leader``); the real
replicated server has its own tests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import msgpack
import pytest
from aiohttp import web
from waiting import PATIENCE

from rdzv_client import ctl, frame, wire
from rdzv_client.client import ELECTION_MAX_PAUSE, MAX_LEADER_REDIRECTS, AsyncClient, Client, backoff_delay
from rdzv_client.error import NotLeaderError, RdzvConnectionError, error_from_body

ANSWER = 7  # what a leader answers to an add


class Replica:
    """One fake replica. It leads when ``leader`` is ``LEADS``; otherwise it answers every
    operation with ``not_leader`` naming ``leader`` (a URL, or None: no leader known)."""

    LEADS = "leads"

    def __init__(self) -> None:
        self.leader: str | None = self.LEADS
        self.cluster_doc: dict[str, Any] = {}
        self.seen: list[tuple[str, dict[str, Any]]] = []  # (op, fields) of every operation
        self.http_port = 0
        self.stream_port = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def stream_endpoint(self) -> str:
        return f"127.0.0.1:{self.stream_port}"

    def rids(self) -> list[tuple[str, int]]:
        return [(fields["rid"][0], fields["rid"][1]) for _, fields in self.seen]

    def answer(self, op: str, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        self.seen.append((op, fields))
        if self.leader == self.LEADS:
            return 200, {"value": ANSWER}
        return 503, wire.error_body(wire.ErrorCode.NOT_LEADER, "this replica follows", leader=self.leader)

    # -- HTTP ------------------------------------------------------------------------------

    async def _operation(self, request: web.Request) -> web.Response:
        status, body = self.answer(request.match_info["op"], msgpack.unpackb(await request.read()))
        return web.json_response(body, status=status)

    async def _jobs(self, request: web.Request) -> web.Response:
        status, body = self.answer("jobs", {})
        return web.json_response({"jobs": []} if status == 200 else body, status=status)

    async def _cluster(self, request: web.Request) -> web.Response:
        return web.json_response(self.cluster_doc)

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/jobs/{rdzv_id}/{op}", self._operation),
                web.get("/v1/jobs", self._jobs),
                web.get("/v1/cluster", self._cluster),
            ]
        )
        return app

    # -- stream protocol --------------------------------------------------------------------

    async def serve_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readexactly(len(wire.STREAM_PREFACE))
            requests = frame.FrameDecoder(1 << 20)
            while True:
                while (request := requests.next_frame()) is None:
                    data = await reader.read(1 << 16)
                    if not data:
                        return
                    requests.feed(data)
                tag, op, _, fields = request
                status, body = (200, {}) if op == wire.HELLO_OP else self.answer(op, fields)
                writer.write(wire.frame([tag, status, body]))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


class Replicas:
    """Fake replicas served from one background thread's event loop, so that blocking
    clients (the sync Client, rdzvctl) can use them as well as asyncio ones."""

    def __init__(self, count: int) -> None:
        self.replicas = [Replica() for _ in range(count)]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runners: list[web.AppRunner] = []
        self._servers: list[asyncio.Server] = []

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)

    async def _start(self) -> None:
        for replica in self.replicas:
            runner = web.AppRunner(replica.app(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self._runners.append(runner)
            replica.http_port = runner.addresses[0][1]
            server = await asyncio.start_server(replica.serve_stream, "127.0.0.1", 0)
            self._servers.append(server)
            replica.stream_port = server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        for server in self._servers:
            server.close()
            await server.wait_closed()
        for runner in self._runners:
            await runner.cleanup()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


@pytest.fixture
def replicas() -> Iterator[Callable[[int], list[Replica]]]:
    started: list[Replicas] = []

    def make(count: int) -> list[Replica]:
        group = Replicas(count)
        group.start()
        started.append(group)
        return group.replicas

    yield make
    for group in started:
        group.close()


class Sleeps:
    """The client's sleep: records each backoff and does not wait."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


class ElectedAfter(Sleeps):
    """Sleeps that make ``replica`` the leader once the client has backed off ``count`` times."""

    def __init__(self, count: int, replica: Replica) -> None:
        super().__init__()
        self.count, self.replica = count, replica

    async def __call__(self, seconds: float) -> None:
        await super().__call__(seconds)
        if len(self.delays) == self.count:
            self.replica.leader = Replica.LEADS


def client_of(endpoints: str, sleep: Callable[[float], Awaitable[None]], budget: float = 5.0) -> AsyncClient:
    return AsyncClient(endpoints, retry_budget=budget, rng=random.Random(1), sleep=sleep)


# --------------------------------------------------------------------------- redirects


def test_not_leader_carries_the_leaders_url() -> None:
    body = wire.error_body(wire.ErrorCode.NOT_LEADER, "follows", leader="http://h2:29400")
    error = error_from_body(503, body)
    assert isinstance(error, NotLeaderError) and error.leader == "http://h2:29400"
    assert isinstance(error_from_body(503, {**body, "leader": None}), NotLeaderError)


@pytest.mark.parametrize("form", ["http://127.0.0.1:{port}", "https://127.0.0.1:{port}/", "127.0.0.1:{port}"])
async def test_a_write_sent_to_a_follower_reaches_the_leader_at_once_with_the_same_rid(
    replicas: Callable[[int], list[Replica]], form: str
) -> None:
    """The endpoint's own scheme is used whatever scheme the follower's URL says."""
    follower, leader = replicas(2)
    follower.leader = form.format(port=leader.http_port)
    sleeps = Sleeps()
    async with client_of(f"{follower.endpoint},{leader.endpoint}", sleeps) as c:
        assert await c.add("job", "k", 1) == ANSWER
        assert await c.add("job", "k", 1) == ANSWER  # the client stays with the leader
    assert sleeps.delays == []  # a redirect is no failure to back off from
    assert len(follower.seen) == 1 and len(leader.seen) == 2
    assert follower.rids()[0] == leader.rids()[0]
    assert leader.rids()[1] != leader.rids()[0]


async def test_a_read_sent_to_a_follower_reaches_the_leader_too(replicas: Callable[[int], list[Replica]]) -> None:
    follower, other, leader = replicas(3)
    follower.leader, other.leader = leader.url, None
    sleeps = Sleeps()
    async with client_of(f"{follower.endpoint},{other.endpoint},{leader.endpoint}", sleeps) as c:
        assert await c.jobs() == []
    assert sleeps.delays == [] and other.seen == [] and len(leader.seen) == 1


@pytest.mark.parametrize("names", ["no leader", "itself"])
async def test_a_follower_that_names_no_other_leader_is_left_with_a_backoff(
    replicas: Callable[[int], list[Replica]], names: str
) -> None:
    follower, leader = replicas(2)
    follower.leader = None if names == "no leader" else follower.url
    sleeps = Sleeps()
    async with client_of(f"{follower.endpoint},{leader.endpoint}", sleeps) as c:
        assert await c.add("job", "k", 1) == ANSWER
    assert len(sleeps.delays) == 1
    assert follower.rids() == leader.rids()  # rotated to the next endpoint, same rid


async def test_while_no_replica_leads_retries_pause_briefly_so_the_new_leader_is_found_soon(
    replicas: Callable[[int], list[Replica]],
) -> None:
    """An election lasts about a lease TTL; a grown backoff would add seconds after it."""
    a, b = replicas(2)
    a.leader = b.leader = None
    sleeps = ElectedAfter(10, b)
    async with client_of(f"{a.endpoint},{b.endpoint}", sleeps, budget=60.0) as c:
        assert await c.add("job", "k", 1) == ANSWER
    assert len(sleeps.delays) in (10, 11)  # one more when the next try after the election was at a
    assert max(sleeps.delays) <= ELECTION_MAX_PAUSE
    # Without the cap the same attempts would have waited longer (the backoff's cap is 2 s).
    uncapped = [backoff_delay(i, random.Random(1)) for i in range(10)]
    assert max(uncapped) > ELECTION_MAX_PAUSE


async def test_a_follower_naming_the_dead_leader_until_its_lease_expires_costs_only_brief_pauses(
    replicas: Callable[[int], list[Replica]],
) -> None:
    """Right after the leader dies, followers still name it (its lease has not expired): the
    client bounces between a refused connection and a follower's not_leader. Those refusals
    must not grow the backoff to seconds: the new leader is due within a lease TTL."""
    import socket

    with socket.socket() as s:  # a port nothing listens on: the dead leader
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    a, b = replicas(2)
    a.leader = b.leader = f"http://{dead}"
    sleeps = ElectedAfter(12, b)
    async with client_of(f"{dead},{a.endpoint},{b.endpoint}", sleeps, budget=60.0) as c:
        assert await c.add("job", "k", 1) == ANSWER
    assert len(sleeps.delays) >= 12 and max(sleeps.delays) <= ELECTION_MAX_PAUSE, sleeps.delays


async def test_a_leader_outside_the_endpoints_is_not_followed_and_is_warned_about_once(
    replicas: Callable[[int], list[Replica]], caplog: pytest.LogCaptureFixture
) -> None:
    a, b, unlisted = replicas(3)
    a.leader = b.leader = unlisted.url
    caplog.set_level(logging.WARNING, logger="rdzv_client.client")
    async with client_of(f"{a.endpoint},{b.endpoint}", asyncio.sleep, budget=0.3) as c:
        with pytest.raises(RdzvConnectionError) as info:
            await c.add("job", "k", 1)
    assert unlisted.seen == []
    assert len(a.seen) + len(b.seen) >= 3  # tried its own endpoints in turn, with backoff
    assert info.value.code is wire.ErrorCode.NOT_LEADER and "leader" in info.value.message
    warned = [r.getMessage() for r in caplog.records if "not one of this client's endpoints" in r.getMessage()]
    assert len(warned) == 1
    assert unlisted.url in warned[0] and a.endpoint in warned[0] and b.endpoint in warned[0]


async def test_leader_redirects_in_a_row_are_bounded_then_back_off(replicas: Callable[[int], list[Replica]]) -> None:
    """Two followers with stale views naming each other: after MAX_LEADER_REDIRECTS hops the
    client backs off and rotates, and so reaches the real leader."""
    a, b, leader = replicas(3)
    a.leader, b.leader = b.url, a.url
    sleeps = Sleeps()
    async with client_of(f"{a.endpoint},{b.endpoint},{leader.endpoint}", sleeps) as c:
        assert await c.add("job", "k", 1) == ANSWER
    assert len(a.seen) + len(b.seen) == MAX_LEADER_REDIRECTS + 1
    assert len(sleeps.delays) == 1
    assert len({*a.rids(), *b.rids(), *leader.rids()}) == 1


async def test_redirects_stay_within_the_retry_budget(replicas: Callable[[int], list[Replica]]) -> None:
    a, b = replicas(2)
    a.leader, b.leader = b.url, a.url
    pauses: list[float] = []

    async def pause(seconds: float) -> None:  # the client's own backoffs, slept for real (its clock is real)
        pauses.append(seconds)
        await asyncio.sleep(seconds)

    async with client_of(f"{a.endpoint},{b.endpoint}", pause, budget=0.3) as c:
        with pytest.raises(RdzvConnectionError) as info:
            await asyncio.wait_for(c.add("job", "k", 1), PATIENCE)  # the redirects do not go on forever
    assert pauses and sum(pauses) <= 0.3 + 1e-3  # backed off between redirect runs, never past its budget
    assert info.value.code is wire.ErrorCode.NOT_LEADER


def test_the_blocking_client_follows_the_leader_over_the_stream_protocol(
    replicas: Callable[[int], list[Replica]],
) -> None:
    follower, other, leader = replicas(3)
    follower.leader = f"http://{leader.stream_endpoint}"
    other.leader = None
    endpoints = ",".join(r.stream_endpoint for r in (follower, other, leader))
    with Client(endpoints, retry_budget=5) as c:
        assert c.add("job", "k", 1) == ANSWER
    assert other.seen == []  # straight to the leader, not to the next endpoint in turn
    assert len(follower.seen) == 1 and follower.rids() == leader.rids()


# --------------------------------------------------------------------------- rdzvctl cluster

NOW = 1_800_000_000.0

CLUSTER: dict[str, Any] = {
    "mode": "replicated",
    "this": "r1",
    "leader": {"id": "r2", "url": "http://h2:29400", "since": NOW - 3 * 3600 - 125},
    "replicas": [
        {"id": "r1", "url": "http://h1:29400", "role": "follower", "since": NOW - 42, "started": NOW - 50,
         "applied_index": 1520},
        {"id": "r2", "url": "http://h2:29400", "role": "leader", "since": NOW - 3 * 3600 - 125,
         "started": NOW - 4 * 3600, "applied_index": 1521},
        {"id": "r3", "url": "http://h3:29400", "role": "candidate", "since": NOW - 2 * 86400 - 5 * 3600,
         "started": NOW - 3 * 86400, "applied_index": 17},
    ],
    "etcd": {
        "prefix": "/rdzv/",
        "endpoints": ["http://e1:2379", "http://e2:2379"],
        "members": [
            {"id": "8e9e05c52164694d", "name": "e1", "client_urls": ["http://e1:2379"],
             "peer_urls": ["http://e1:2380"]},
            {"id": "91bc3c398fb3c146", "name": "", "client_urls": [], "peer_urls": ["http://e2:2380"]},
        ],
    },
}


def _local(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (59.9, "59s"), (60, "1m00s"), (3599, "59m59s"), (3600 + 120, "1h02m"), (86400 * 2 + 3600 * 4, "2d04h"),
     (-3, "0s"), (None, "-")],
)
def test_durations_print_in_their_two_largest_units(seconds: float | None, text: str) -> None:
    assert ctl.format_duration(seconds) == text


def test_cluster_formats_the_leader_the_replicas_and_the_etcd_members() -> None:
    assert ctl.format_cluster(CLUSTER, NOW).splitlines() == [
        "mode replicated, answered by r1",
        f"leader r2 at http://h2:29400, since {_local(NOW - 3 * 3600 - 125)} (3h02m)",
        "",
        "ID  URL              ROLE       IN ROLE FOR  APPLIED",
        "r1  http://h1:29400  follower   42s          1520",
        "r2  http://h2:29400  leader     3h02m        1521",
        "r3  http://h3:29400  candidate  2d05h        17",
        "",
        "etcd at http://e1:2379,http://e2:2379, prefix /rdzv/",
        "MEMBER_ID         NAME  CLIENT_URLS     PEER_URLS",
        "8e9e05c52164694d  e1    http://e1:2379  http://e1:2380",
        "91bc3c398fb3c146  -     -               http://e2:2380",
    ]


def test_cluster_without_a_leader_says_why() -> None:
    electing = dict(CLUSTER, leader=None)
    assert ctl.format_cluster(electing, NOW).splitlines()[1] == "no leader: an election is under way (requests wait for it)"
    single = {
        "mode": "single",
        "this": "solo",
        "leader": None,
        "replicas": [{"id": "solo", "url": "http://h:29400", "role": "single", "since": NOW - 5, "started": NOW - 5,
                      "applied_index": 3}],
        "etcd": None,
    }
    assert ctl.format_cluster(single, NOW).splitlines() == [
        "mode single, answered by solo",
        "not replicated: this server serves every request itself",
        "",
        "ID    URL             ROLE    IN ROLE FOR  APPLIED",
        "solo  http://h:29400  single  5s           3",
    ]


def test_rdzvctl_cluster_prints_the_table_and_json_from_the_server(
    replicas: Callable[[int], list[Replica]], capsys: pytest.CaptureFixture[str]
) -> None:
    (replica,) = replicas(1)
    replica.cluster_doc = dict(CLUSTER, leader=dict(CLUSTER["leader"], since=time.time() - 125))
    assert ctl.main(["--endpoint", replica.endpoint, "cluster"]) == ctl.EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "mode replicated, answered by r1"
    assert lines[1].startswith("leader r2 at http://h2:29400, since ") and lines[1].endswith("(2m05s)")
    assert lines[3].split() == ["ID", "URL", "ROLE", "IN", "ROLE", "FOR", "APPLIED"]
    assert [line.split()[:3] for line in lines[4:7]] == [
        ["r1", "http://h1:29400", "follower"],
        ["r2", "http://h2:29400", "leader"],
        ["r3", "http://h3:29400", "candidate"],
    ]
    assert ctl.main(["--endpoint", replica.endpoint, "--json", "cluster"]) == ctl.EXIT_OK
    assert json.loads(capsys.readouterr().out) == replica.cluster_doc


def test_rdzvctl_says_when_replicas_answer_but_none_leads(
    replicas: Callable[[int], list[Replica]], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ctl, "DEFAULT_CTL_RETRY_BUDGET", 0.2)
    (follower,) = replicas(1)
    follower.leader = None
    logger = logging.getLogger("rdzv_client")
    before = logger.level
    assert ctl.main(["--endpoint", follower.endpoint, "jobs"]) == ctl.EXIT_CANNOT_CONNECT
    err = capsys.readouterr().err
    assert "(not_leader)" in err and "rdzvctl cluster" in err and "--advertise-url" in err
    # rdzvctl quiets the client's retry notices for its terminal, and only while it runs: called
    # in a process that logs, it leaves the level as it found it (a leaked ERROR hid a later
    # test's retry warnings from its caplog).
    assert logger.level == before != logging.ERROR


def test_with_several_endpoints_a_silent_server_is_left_sooner() -> None:
    """A frozen leader (a paused VM) must not hold a node's heartbeat past its TTL: with
    replicas to try, an endpoint silent for REPLICAS_REQUEST_TIMEOUT beyond the hold counts as failed."""
    from rdzv_client.client import REPLICAS_REQUEST_TIMEOUT
    from rdzv_client.transport import DEFAULT_REQUEST_TIMEOUT

    one, several, chosen = AsyncClient("h1:1"), AsyncClient("h1:1,h2:2"), AsyncClient("h1:1,h2:2", request_timeout=3.0)
    assert one._request_timeout == DEFAULT_REQUEST_TIMEOUT > several._request_timeout == REPLICAS_REQUEST_TIMEOUT
    assert chosen._request_timeout == 3.0
