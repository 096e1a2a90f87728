"""Unit tests of the client that need no server: parsing, error mapping, backoff, retry
policy over a scripted transport, the sync client's guards, and rdzvctl's tables."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import random
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any, TypeAlias

import pytest
from waiting import call_within, wait_until

import rdzv_client
from rdzv_client import JobSettings, ctl, wire
from rdzv_client.client import (
    DEFAULT_HEARTBEAT_TTL,
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_LAST_CALL_TIMEOUT,
    AsyncClient,
    Client,
    Endpoint,
    backoff_delay,
    parse_endpoints,
)
from rdzv_client.error import (
    ERROR_CLASSES,
    BadRequestError,
    ConflictError,
    JobClosedError,
    JoinTimeoutError,
    LimitError,
    NotFoundError,
    RdzvConnectionError,
    RdzvError,
    RdzvTimeoutError,
    ServerError,
    UnauthorizedError,
    error_from_body,
)
from rdzv_client.stream import SocketTransport
from rdzv_client.transport import Answer, TransportError, http_answer

# --------------------------------------------------------------------------- endpoints

PORT = wire.DEFAULT_PORT


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("host", [Endpoint("host", PORT)]),
        ("host:1234", [Endpoint("host", 1234)]),
        ("10.0.0.1:29500", [Endpoint("10.0.0.1", 29500)]),
        ("[::1]:5000", [Endpoint("::1", 5000)]),
        ("[::1]", [Endpoint("::1", PORT)]),
        ("fe80::1", [Endpoint("fe80::1", PORT)]),
        ("http://host:80", [Endpoint("host", 80)]),
        ("http://host:80/", [Endpoint("host", 80)]),
        ("https://host", [Endpoint("host", PORT, "https")]),
        ("HTTP://[::1]:7", [Endpoint("::1", 7)]),
        ("a:1, b:2 ,c", [Endpoint("a", 1), Endpoint("b", 2), Endpoint("c", PORT)]),
    ],
)
def test_endpoint_specs_parse_to_host_port_scheme(spec: str, expected: list[Endpoint]) -> None:
    assert list(parse_endpoints(spec)) == expected


@pytest.mark.parametrize(
    "spec",
    ["", " ", "a,,b", "host:", "host:0", "host:65536", "host:x", "[::1", "[::1]x", "ftp://host", "http://h:1/v1", "a b:1"],
)
def test_bad_endpoint_specs_raise_value_error(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_endpoints(spec)


def test_endpoint_url_brackets_ipv6() -> None:
    assert Endpoint("::1", 5).url == "http://[::1]:5"
    assert str(Endpoint("h", 5)) == "h:5"


# --------------------------------------------------------------------------- errors


def test_every_wire_code_maps_to_an_error_class() -> None:
    assert set(ERROR_CLASSES) == set(wire.ErrorCode)


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (wire.ErrorCode.BAD_REQUEST, BadRequestError),
        (wire.ErrorCode.INVALID_ID, BadRequestError),
        (wire.ErrorCode.VALUE_TOO_LARGE, BadRequestError),
        (wire.ErrorCode.BODY_TOO_LARGE, BadRequestError),
        (wire.ErrorCode.UNSUPPORTED_MEDIA_TYPE, BadRequestError),
        (wire.ErrorCode.METHOD_NOT_ALLOWED, BadRequestError),
        (wire.ErrorCode.NOT_FOUND, NotFoundError),
        (wire.ErrorCode.JOB_NOT_FOUND, NotFoundError),
        (wire.ErrorCode.NODE_NOT_FOUND, NotFoundError),
        (wire.ErrorCode.SETTINGS_CONFLICT, ConflictError),
        (wire.ErrorCode.NOT_AN_INTEGER, ConflictError),
        (wire.ErrorCode.JOB_CLOSED, JobClosedError),
        (wire.ErrorCode.JOIN_TIMEOUT, JoinTimeoutError),
        (wire.ErrorCode.UNAUTHORIZED, UnauthorizedError),
        (wire.ErrorCode.NOT_READY, ServerError),
        (wire.ErrorCode.SHUTTING_DOWN, ServerError),
        (wire.ErrorCode.INTERNAL, ServerError),
    ],
)
def test_error_body_maps_code_to_class(code: wire.ErrorCode, cls: type[RdzvError]) -> None:
    err = error_from_body(wire.HTTP_STATUS[code], wire.error_body(code, "why"))
    assert type(err) is cls
    assert err.code is code
    assert err.message == "why"
    assert str(err) == f"why ({code.value})"


@pytest.mark.parametrize(
    ("status", "body", "cls"),
    [
        (404, {"error": "brand_new", "message": "m"}, NotFoundError),
        (409, None, ConflictError),
        (410, "garbage", JobClosedError),
        (401, None, UnauthorizedError),
        (418, None, BadRequestError),
        (502, None, ServerError),
        (302, None, RdzvError),
    ],
)
def test_unknown_codes_map_by_status(status: int, body: object, cls: type[RdzvError]) -> None:
    err = error_from_body(status, body)
    assert type(err) is cls
    assert err.code is None
    assert str(status) in err.message or "brand_new" in err.message


def test_timeouts_are_builtin_timeouts() -> None:
    assert issubclass(RdzvTimeoutError, TimeoutError)
    assert issubclass(JoinTimeoutError, RdzvTimeoutError)
    assert isinstance(RdzvTimeoutError("late"), TimeoutError)
    assert str(RdzvTimeoutError("late")) == "late"


# --------------------------------------------------------------------------- backoff


def test_backoff_is_full_jitter_under_an_exponential_cap() -> None:
    rng = random.Random(7)
    for attempt in range(80):
        ceiling = min(2.0, 0.05 * 2**attempt)
        samples = [backoff_delay(attempt, rng, base=0.05, cap=2.0) for _ in range(200)]
        assert all(0.0 <= s <= ceiling for s in samples)
        assert max(samples) > ceiling * 0.8  # spread over the whole range, not pinned low
        assert min(samples) < ceiling * 0.2


# --------------------------------------------------------------------------- package surface


def test_public_names_are_exactly_these() -> None:
    assert sorted(rdzv_client.__all__) == sorted(
        [
            "Assignment",
            "AsyncClient",
            "BadRequestError",
            "Client",
            "ClientClosedError",
            "ConflictError",
            "CredentialError",
            "HostCordonedError",
            "JobClosedError",
            "JobClosedInLineError",
            "JobSettings",
            "JoinTimeoutError",
            "LimitError",
            "NotFoundError",
            "NotLeaderError",
            "RdzvConnectionError",
            "RdzvError",
            "RdzvTimeoutError",
            "ServerError",
            "TLSConfigError",
            "UnauthorizedError",
            "WatchResult",
            "progress",
        ]
    )
    for name in rdzv_client.__all__:
        assert getattr(rdzv_client, name) is not None


def test_every_error_a_caller_can_get_is_exported() -> None:
    """A user catches what the client raises by its public name: every class of the error
    tree, and the ValueErrors for an unusable token or TLS file."""
    from rdzv_client import credential, error, tls

    raised = {
        cls
        for module in (error, credential, tls)
        for cls in vars(module).values()
        if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == module.__name__
    }
    exported = {getattr(rdzv_client, name) for name in rdzv_client.__all__}
    assert {cls.__name__ for cls in raised - exported} == set()


def test_importing_the_client_does_not_import_torch() -> None:
    code = (
        "import rdzv_client, rdzv_client.ctl, rdzv_client.node, rdzv_client.conf, sys;"
        " assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_client_default_settings_equal_the_wire_defaults() -> None:
    defaults = wire.JobSettings()
    assert defaults.last_call_timeout == DEFAULT_LAST_CALL_TIMEOUT
    assert defaults.join_timeout == DEFAULT_JOIN_TIMEOUT
    assert defaults.heartbeat_ttl == DEFAULT_HEARTBEAT_TTL


def test_create_join_and_refuse_take_the_same_job_settings_and_nothing_of_them_apart() -> None:
    fields = {f.name for f in dataclasses.fields(wire.JobSettings)}
    for cls in (AsyncClient, Client):
        for method in (cls.create_job, cls.join, cls.refuse):
            params = inspect.signature(method).parameters
            assert params["settings"].annotation in ("wire.JobSettings", wire.JobSettings), method
            assert not fields & set(params), method


async def test_create_job_sends_every_setting_the_restart_budget_included() -> None:
    t = ScriptedTransport(ok())
    settings = wire.JobSettings(min_nodes=2, max_nodes=3, last_call_timeout=1.0, join_timeout=60.0, heartbeat_ttl=9.0,
                                max_restarts=4)  # fmt: skip
    await client_over(t).create_job("job", settings)
    (_, body, _), = t.sent
    assert body is not None and {k: body[k] for k in body if k != "rid"} == {
        "min_nodes": 2, "max_nodes": 3, "last_call_timeout": 1.0, "join_timeout": 60.0, "heartbeat_ttl": 9.0,
        "max_restarts": 4,
    }  # fmt: skip


# --------------------------------------------------------------------------- retry policy


def ok(**fields: Any) -> Answer:
    return Answer(200, fields)


def failed(code: wire.ErrorCode, message: str = "no") -> Answer:
    return Answer(wire.HTTP_STATUS[code], wire.error_body(code, message))


Step: TypeAlias = Answer | Exception


class ScriptedTransport:
    """Answers each request with the next step of a script and records what was sent."""

    def __init__(self, *steps: Step) -> None:
        self.steps = list(steps)
        self.sent: list[tuple[str, dict[str, Any] | None, float]] = []
        self.closed = False

    async def call(self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float) -> Answer:
        self.sent.append((endpoint.url + wire.op_path(rdzv_id, op), fields, timeout))
        return self._next()

    async def fetch(self, endpoint: Endpoint, path: str, timeout: float) -> Answer:
        self.sent.append((endpoint.url + path, None, timeout))
        return self._next()

    def _next(self) -> Answer:
        step = self.steps.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    async def aclose(self) -> None:
        self.closed = True


def client_over(transport: ScriptedTransport, endpoint: str = "a:1", budget: float = 5.0) -> AsyncClient:
    return AsyncClient(endpoint, retry_budget=budget, transport=transport, rng=random.Random(1))


async def test_a_retried_write_resends_the_same_rid() -> None:
    t = ScriptedTransport(
        TransportError("connection reset"),
        failed(wire.ErrorCode.NOT_READY),
        failed(wire.ErrorCode.SHUTTING_DOWN),
        ok(value=5),
    )
    c = client_over(t)
    assert await c.add("job", "k", 5) == 5
    rids = [body["rid"] for _, body, _ in t.sent if body is not None]
    assert len(rids) == 4 and all(r == rids[0] for r in rids)
    assert rids[0][0] == c.client_id
    t.steps.append(ok(value=6))
    assert await c.add("job", "k", 1) == 6
    last = t.sent[-1][1]
    assert last is not None and last["rid"] != rids[0]  # a new write, a new rid


class GatedTransport(ScriptedTransport):
    """Holds the first call until ``release`` is set; answers the rest at once."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def call(self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float) -> Answer:
        self.sent.append((op, fields, timeout))
        if len(self.sent) == 1:
            await self.release.wait()
        return ok(value=1)


async def test_every_write_tells_the_server_its_lowest_unanswered_seq() -> None:
    """The floor lets the server forget exactly the results no retry can ask for."""
    t = GatedTransport()
    c = AsyncClient("a:1", transport=t)
    slow = asyncio.ensure_future(c.add("job", "k", 1))  # seq 1, held
    await asyncio.sleep(0)
    for _ in range(3):
        await c.add("job", "k", 1)  # seqs 2..4 answered while 1 is not
    t.release.set()
    await slow
    await c.add("job", "k", 1)  # seq 5: everything before it was answered
    rids = [fields["rid"] for _, fields, _ in t.sent if fields is not None]
    assert [r[1:] for r in rids] == [[1, 1], [2, 1], [3, 1], [4, 1], [5, 5]]


async def test_a_busy_server_shedding_connections_is_retried() -> None:
    t = ScriptedTransport(failed(wire.ErrorCode.TOO_MANY_CONNECTIONS), failed(wire.ErrorCode.BUFFERS_FULL), ok(value=2))
    assert await client_over(t).add("job", "k", 2) == 2
    assert len(t.sent) == 3


async def test_a_limit_that_needs_the_caller_is_raised_at_once() -> None:
    t = ScriptedTransport(failed(wire.ErrorCode.TOO_MANY_KEYS), ok())
    with pytest.raises(LimitError) as info:
        await client_over(t).set("job", "k", "v")
    assert info.value.code is wire.ErrorCode.TOO_MANY_KEYS and len(t.sent) == 1


async def test_client_errors_are_raised_without_retry() -> None:
    t = ScriptedTransport(failed(wire.ErrorCode.NOT_AN_INTEGER, "k holds b'x'"), ok())
    with pytest.raises(ConflictError) as info:
        await client_over(t).add("job", "k", 1)
    assert info.value.code is wire.ErrorCode.NOT_AN_INTEGER
    assert len(t.sent) == 1


async def test_an_internal_server_error_is_not_retried() -> None:
    t = ScriptedTransport(failed(wire.ErrorCode.INTERNAL), ok())
    with pytest.raises(ServerError):
        await client_over(t).set("job", "k", "v")
    assert len(t.sent) == 1


async def test_failover_moves_to_the_next_endpoint_and_stays_there() -> None:
    t = ScriptedTransport(TransportError("refused"), ok(), ok())
    c = client_over(t, "a:1,b:2")
    await c.set("job", "k", "v")
    await c.set("job", "k", "v")
    assert [url for url, _, _ in t.sent] == [
        "http://a:1/v1/jobs/job/set",
        "http://b:2/v1/jobs/job/set",
        "http://b:2/v1/jobs/job/set",
    ]


class FakeClock:
    """The client's clock and pause, moved by hand: a pause moves the clock, nothing sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


async def test_retries_stop_at_the_budget_with_a_connection_error() -> None:
    """The retry budget counts from the first failure on the client's clock: the backoff's
    pauses fill it exactly, and the next failure past it ends the call."""
    t = ScriptedTransport(*[TransportError("refused")] * 10_000)
    clock = FakeClock()
    c = AsyncClient("a:1,b:2", retry_budget=0.5, transport=t, rng=random.Random(1), sleep=clock.sleep, clock=clock)
    with pytest.raises(RdzvConnectionError) as info:
        await c.num_keys("job")
    assert clock.now - 1000.0 == pytest.approx(0.5)
    assert len(t.sent) == len(clock.pauses) + 1 > 2 and all(p >= 0 for p in clock.pauses)
    assert "a:1" in str(info.value) and "b:2" in str(info.value) and "running" in str(info.value)
    assert isinstance(info.value.__cause__, TransportError)


async def test_a_long_polls_deadline_is_the_clients_and_each_re_poll_holds_what_remains() -> None:
    """A get with ``timeout`` re-polls while the server answers "not yet" (after holding it
    as long as asked), asking each time for ``max_hold`` at most and never for more than is
    left of its own deadline, and ends at that deadline."""
    clock = FakeClock()

    class HeldTransport(ScriptedTransport):
        async def call(self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float) -> Answer:
            clock.now += fields["timeout"]  # the server holds it as long as asked
            return await super().call(endpoint, rdzv_id, op, fields, timeout)

    t = HeldTransport(*[ok(found=False, value=None)] * 10)
    c = AsyncClient("a:1", transport=t, max_hold=4.0, sleep=clock.sleep, clock=clock)
    with pytest.raises(RdzvTimeoutError):
        await c.get("job", "k", timeout=9.0)
    holds = [body["timeout"] for _, body, _ in t.sent if body is not None]
    assert holds == [4.0, 4.0, 1.0]
    assert clock.now - 1000.0 == 9.0 and clock.pauses == []


async def test_a_server_that_stays_not_ready_ends_as_a_connection_error_with_its_code() -> None:
    t = ScriptedTransport(*[failed(wire.ErrorCode.NOT_READY)] * 10_000)
    with pytest.raises(RdzvConnectionError) as info:
        await client_over(t, budget=0.2).num_keys("job")
    assert info.value.code is wire.ErrorCode.NOT_READY


async def test_invalid_ids_and_keys_fail_before_any_request() -> None:
    t = ScriptedTransport()
    c = client_over(t)
    with pytest.raises(BadRequestError) as info:
        await c.set("../etc", "k", "v")
    assert info.value.code is wire.ErrorCode.INVALID_ID
    with pytest.raises(BadRequestError):
        await c.set("job", "", "v")
    with pytest.raises(BadRequestError):
        await c.multi_set("job", ["a", "b"], ["1"])
    with pytest.raises(BadRequestError):
        await c.job("bad id")
    assert t.sent == []


async def test_a_malformed_reply_is_a_server_error() -> None:
    t = ScriptedTransport(ok(valu=1))
    with pytest.raises(ServerError):
        await client_over(t).add("job", "k", 1)
    with pytest.raises(ServerError):
        http_answer(200, "text/html", b"<html>", 1 << 20)  # a 2xx the client cannot read


async def test_a_non_wire_error_page_keeps_its_status_and_text() -> None:
    t = ScriptedTransport(http_answer(404, "text/plain", b"404: Not Found", 1 << 20))
    with pytest.raises(NotFoundError) as info:
        await client_over(t).num_keys("job")
    assert "Not Found" in info.value.message


class HoldingTransport:
    """A server that never has the key: holds each long-poll for its timeout (on the client's
    fake clock: nothing sleeps), then says not found."""

    def __init__(self, clock: FakeClock) -> None:
        self.holds: list[float] = []
        self.clock = clock

    async def call(self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float) -> Answer:
        self.holds.append(fields["timeout"])
        self.clock.now += fields["timeout"]
        return ok(found=False, value=None)

    async def fetch(self, endpoint: Endpoint, path: str, timeout: float) -> Answer:
        raise AssertionError("not used")

    async def aclose(self) -> None:
        pass


async def test_the_client_owns_the_long_poll_deadline() -> None:
    clock = FakeClock()
    t = HoldingTransport(clock)
    c = AsyncClient("a", max_hold=0.2, transport=t, sleep=clock.sleep, clock=clock)
    with pytest.raises(RdzvTimeoutError):
        await c.get("job", "k", timeout=0.5)
    assert t.holds == pytest.approx([0.2, 0.2, 0.1])  # re-polled, each hold capped; the last asks what remains
    assert clock.now - 1000.0 == pytest.approx(0.5)  # it gave up at its own deadline, not before or after


async def test_get_returns_the_value_once_found() -> None:
    t = ScriptedTransport(ok(found=False, value=None), ok(found=True, value=b"v"))
    assert await client_over(t).get("job", "k", timeout=5) == b"v"


async def test_join_polls_await_round_until_an_assignment_arrives() -> None:
    assignment: dict[str, Any] = {
        "round": 3,
        "node_rank": 1,
        "num_nodes": 2,
        "world_size": 4,
        "nproc_per_node": 2,
        "global_rank_start": 2,
        "master_addr": "h0",
    }
    t = ScriptedTransport(ok(round=3, assignment=None), ok(round=3, assignment=assignment))
    got = await client_over(t).join(
        "job", node_id="n1", addr="h1", nproc_per_node=2, settings=JobSettings(min_nodes=2, max_nodes=2), timeout=10
    )
    assert got == wire.Assignment(**assignment)
    assert t.sent[1][0].endswith("/await_round")
    assert t.sent[1][1] is not None and t.sent[1][1]["round"] == 3 and t.sent[1][1]["node_id"] == "n1"


async def test_join_timeout_from_the_server_ends_join() -> None:
    t = ScriptedTransport(ok(round=0, assignment=None), failed(wire.ErrorCode.JOIN_TIMEOUT))
    with pytest.raises(JoinTimeoutError):
        await client_over(t).join("job", node_id="n", addr="h", nproc_per_node=1,
            settings=JobSettings(min_nodes=2, max_nodes=2), timeout=9)


# --------------------------------------------------------------------------- sync client guards


class BlockingScriptedTransport:
    """:class:`ScriptedTransport` for the blocking client: the same script, plain methods."""

    def __init__(self, *steps: Step) -> None:
        self.script = ScriptedTransport(*steps)
        self.closed = False

    @property
    def sent(self) -> list[tuple[str, dict[str, Any] | None, float]]:
        return self.script.sent

    def call(self, endpoint: Endpoint, rdzv_id: str, op: str, fields: dict[str, Any], timeout: float) -> Answer:
        self.script.sent.append((endpoint.url + wire.op_path(rdzv_id, op), fields, timeout))
        return self.script._next()

    def fetch(self, endpoint: Endpoint, path: str, timeout: float) -> Answer:
        self.script.sent.append((endpoint.url + path, None, timeout))
        return self.script._next()

    def close(self) -> None:
        self.closed = True


def test_sync_client_calls_after_close_raise_and_close_is_idempotent() -> None:
    t = BlockingScriptedTransport(ok(count=3))
    c = Client("a", transport=t)
    assert c.num_keys("job") == 3
    c.close()
    c.close()
    assert t.closed
    with pytest.raises(RuntimeError, match="closed"):
        c.num_keys("job")


async def test_async_client_calls_after_aclose_raise_and_aclose_is_idempotent() -> None:
    t = ScriptedTransport(ok(count=3))
    c = client_over(t)
    assert await c.num_keys("job") == 3
    await c.aclose()
    await c.aclose()
    assert t.closed
    with pytest.raises(RuntimeError, match="closed"):
        await c.num_keys("job")
    with pytest.raises(RuntimeError, match="closed"):
        await c.get("job", "k", timeout=1)
    assert len(t.sent) == 1


def test_sync_client_retries_with_the_same_rid_and_fails_over() -> None:
    """The generated client keeps the policy: one rid for every retry, failover, the backoff's pauses."""
    pauses: list[float] = []
    t = BlockingScriptedTransport(TransportError("reset"), failed(wire.ErrorCode.NOT_READY), ok(value=5), ok(value=6))
    c = Client("a:1,b:2", transport=t, rng=random.Random(1), sleep=pauses.append)
    assert c.add("job", "k", 5) == 5
    assert c.add("job", "k", 1) == 6
    urls = [url for url, _, _ in t.sent]
    assert urls == ["http://a:1/v1/jobs/job/add", "http://b:2/v1/jobs/job/add", "http://a:1/v1/jobs/job/add",
                    "http://a:1/v1/jobs/job/add"]
    rids = [fields["rid"] for _, fields, _ in t.sent if fields is not None]
    assert rids[0] == rids[1] == rids[2] and rids[3][:2] != rids[0][:2] and rids[0][0] == c.client_id
    assert len(pauses) == 2 and all(0 <= p <= 0.1 for p in pauses)


def test_sync_client_retries_stop_at_the_budget() -> None:
    t = BlockingScriptedTransport(*[failed(wire.ErrorCode.NOT_READY)] * 10_000)
    with pytest.raises(RdzvConnectionError) as info:
        Client("a:1", transport=t, retry_budget=0.2).num_keys("job")
    assert info.value.code is wire.ErrorCode.NOT_READY and len(t.sent) > 1


def test_sync_client_re_polls_a_long_poll_until_found() -> None:
    t = BlockingScriptedTransport(ok(found=False, value=None), ok(found=True, value=b"v"))
    assert Client("a", transport=t, sleep=lambda _: None).get("job", "k", timeout=5) == b"v"
    assert len(t.sent) == 2


@pytest.fixture
def silent_server() -> Iterator[tuple[str, list[socket.socket]]]:
    """A loopback listener that accepts connections and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    yield f"127.0.0.1:{listener.getsockname()[1]}", accepted
    stop.set()
    th.join(timeout=5)
    listener.close()
    for sock in accepted:
        sock.close()


def test_sync_client_close_ends_calls_in_flight(silent_server: tuple[str, list[socket.socket]]) -> None:
    endpoint, accepted = silent_server
    c = Client(endpoint, max_hold=30)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            c.get("job", "k", timeout=30)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            errors.append(exc)

    threads = [threading.Thread(target=blocked) for _ in range(3)]
    for th in threads:
        th.start()
    wait_until(lambda: len(accepted) >= 3, what="three connections accepted")
    assert len(accepted) == 3  # each blocked call holds its own connection
    c.close()
    for th in threads:
        th.join(timeout=5)
    assert not any(th.is_alive() for th in threads)  # ended by close(), not by their 30 s polls
    assert len(errors) == 3
    assert all(isinstance(e, RdzvError) and "closed" in str(e) for e in errors)
    with pytest.raises(RuntimeError, match="closed"):
        c.num_keys("job")


def test_socket_transport_times_out_as_a_transport_error(silent_server: tuple[str, list[socket.socket]]) -> None:
    endpoint, _ = silent_server
    with Client(endpoint, retry_budget=0.0, request_timeout=0.2) as c:
        with pytest.raises(RdzvConnectionError) as info:
            call_within(lambda: c.num_keys("job"), what="timing out")  # its 0.2 s, not the 30 s default
        assert isinstance(info.value.__cause__, TransportError) and "timed out" in str(info.value.__cause__)


def test_socket_transport_refused_is_a_transport_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]  # bound, then closed: nobody listens there
    t = SocketTransport()
    with pytest.raises(TransportError):
        t.call(Endpoint("127.0.0.1", port), "job", "num_keys", {}, 1.0)


# --------------------------------------------------------------------------- rdzvctl tables

MEMBERSHIP: dict[str, Any] = {
    "rdzv_id": "train-1",
    "state": "complete",
    "round": 2,
    "min_nodes": 1,
    "max_nodes": 3,
    "num_nodes": 2,
    "world_size": 6,
    "nodes": [
        {
            "node_id": "node-a",
            "addr": "10.0.0.1",
            "node_rank": 0,
            "nproc_per_node": 2,
            "global_ranks": [0, 1],
            "alive": True,
            "last_heartbeat_age_s": 0.43,
        },
        {
            "node_id": "node-bb",
            "addr": "10.0.0.2",
            "node_rank": 1,
            "nproc_per_node": 4,
            "global_ranks": [2, 3, 4, 5],
            "alive": False,
            "last_heartbeat_age_s": 31.0,
        },
    ],
    "waiting": [{"node_id": "node-c", "addr": "10.0.0.3", "nproc_per_node": 2, "alive": True, "last_heartbeat_age_s": 1}],
    "joining": [],
    "standby": [{"node_id": "node-d", "addr": "10.0.0.4", "nproc_per_node": 2, "alive": True}],
}


def test_show_formats_an_aligned_membership_table() -> None:
    assert ctl.format_membership(MEMBERSHIP) == "\n".join(
        [
            "job train-1  state complete  round 2  nodes 2 (1..3)  world_size 6",
            "",
            "NODE_RANK  NODE_ID  ADDR      NPROC  RANKS  ALIVE  HEARTBEAT",
            "0          node-a   10.0.0.1  2      0-1    yes    0.4s",
            "1          node-bb  10.0.0.2  4      2-5    no     31.0s",
            "",
            "waiting (1):",
            "  NODE_ID  ADDR      NPROC  ALIVE  HEARTBEAT",
            "  node-c   10.0.0.3  2      yes    1.0s",
            "",
            "standby (1):",
            "  NODE_ID  ADDR      NPROC  ALIVE  HEARTBEAT",
            "  node-d   10.0.0.4  2      yes    -",
        ]
    )


def test_show_says_the_crash_loop_count_and_the_goodput_when_the_job_has_them() -> None:
    doc = dict(MEMBERSHIP, max_fast_failures=5, fast_failures=2, min_round_seconds=120.0, goodput=0.8125,
               progress=[{"round": 1, "step": 1200}, {"round": 2, "step": None}])
    assert ctl.format_membership(doc).splitlines()[1:3] == [
        "fast failures in a row 2 of 5 (min_round_seconds 120.0)", "goodput 81.2 %  last step 1200"
    ]
    off = dict(MEMBERSHIP, max_fast_failures=0, fast_failures=0, goodput=None, progress=[])
    assert ctl.format_membership(off) == ctl.format_membership(MEMBERSHIP)


def test_show_of_an_empty_job_says_so() -> None:
    doc = dict(MEMBERSHIP, nodes=[], waiting=[], standby=[], num_nodes=0, world_size=0, state="open")
    assert ctl.format_membership(doc).splitlines()[-1] == "no nodes in the current round"


def test_jobs_formats_a_table() -> None:
    jobs = [
        {"rdzv_id": "a", "state": "open", "round": 0, "num_nodes": 1, "world_size": None},
        {"rdzv_id": "long-job", "state": "complete", "round": 12, "num_nodes": 16, "world_size": 128},
    ]
    assert ctl.format_jobs(jobs).splitlines() == [
        "RDZV_ID   STATE     ROUND  NODES  WORLD_SIZE",
        "a         open      0      1      -",
        "long-job  complete  12     16     128",
    ]
    assert ctl.format_jobs([]) == "no jobs"


@pytest.mark.parametrize(
    ("ranks", "text"), [([], "-"), ([4], "4"), ([0, 1], "0-1"), ([0, 1, 2, 5], "0-2,5"), ([1, 3], "1,3")]
)
def test_global_ranks_print_as_ranges(ranks: list[int], text: str) -> None:
    assert ctl.format_ranks(ranks) == text


def test_ctl_usage_errors_exit_2() -> None:
    with pytest.raises(SystemExit) as info:
        ctl.main(["--endpoint", "h:notaport", "jobs"])
    assert info.value.code == ctl.EXIT_USAGE
    with pytest.raises(SystemExit) as info:
        ctl.main(["kv", "get", "job"])
    assert info.value.code == ctl.EXIT_USAGE


async def test_the_policy_is_read_as_an_operation_and_from_the_page_of_a_server_without_it() -> None:
    doc = {"job": "job", "settings": {"min_nodes": 2}, "sources": {"min_nodes": "policy j*"}, "version": 3}
    new = ScriptedTransport(Answer(200, doc))
    assert await client_over(new).effective_policy("job") == doc
    assert [url for url, _, _ in new.sent] == ["http://a:1" + wire.op_path("job", "policy")]
    # A server before the operation: 404 not_found for it, then its page (GET /v1/policy).
    old = ScriptedTransport(failed(wire.ErrorCode.NOT_FOUND), Answer(200, doc))
    assert await client_over(old).effective_policy("job") == doc
    assert [url for url, _, _ in old.sent] == ["http://a:1" + wire.op_path("job", "policy"), "http://a:1/v1/policy?job=job"]
