"""Token auth against the real server process, as a user meets it: raw HTTP, raw stream
frames, the real clients and ``rdzvctl``.

Rules checked (README "Tokens", rdzv_server/api/auth.py):
- a server started as README's first command starts makes its token file (0600, 32 random
  bytes) and logs where it is, never the token; an unauthenticated write is ``401
  unauthorized`` with ``WWW-Authenticate: Bearer`` and changes nothing;
- a missing or wrong token is 401 over HTTP, and over the stream a tag-0 401 frame after
  which the connection closes (anything pipelined behind it is not applied); each is
  counted in ``rdzv_auth_failures_total{reason}``; no token appears in the log, in an
  error message or in a reply;
- a read-only token (``--read-token-file``) reads (HTTP and stream, the job pages too) and
  gets ``403 forbidden`` for every other operation, which changes nothing;
- ``--no-auth`` serves without any token and says so loudly in the log;
- clients find their token in order: ``token=``/``token_file=``, ``RDZV_TOKEN``,
  ``RDZV_TOKEN_FILE``, the default file;
- the dashboard trades ``/?token=`` for an HttpOnly SameSite=Strict cookie that reads and
  never writes;
- ``rdzvctl`` works unchanged against a server whose token is in the default file;
- ``/``, ``/healthz``, ``/livez``, ``/readyz`` and ``/metrics`` need no token.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import http.client
import json
import os
import secrets
import socket
import stat
import struct
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import msgpack
import pytest
from raw_stream import FrameReader
from server_process import ServerProcess

from rdzv_client import AsyncClient, Client, JobSettings, UnauthorizedError, wire
from rdzv_client.wire import default_token_file

# Every answer, and every close the server owes us, comes well within this.
PATIENCE = 10.0
JSON = "application/json"


def new_job() -> str:
    return f"auth-{uuid.uuid4().hex[:12]}"


def a_token() -> str:
    """A token of the server's own shape (43 URL-safe characters), but not the server's."""
    return secrets.token_urlsafe(32)


def write_token(path: Path, token: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path


# --------------------------------------------------------------------------- raw HTTP


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    headers: http.client.HTTPMessage
    body: bytes

    def json(self) -> Any:
        assert self.headers.get_content_type() == JSON, (self.status, self.headers, self.body[:200])
        return json.loads(self.body)


def request(srv: ServerProcess, method: str, path: str, body: bytes | None = None, **headers: str) -> Answer:
    """One request on its own connection; redirects are not followed."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=PATIENCE)
    try:
        conn.request(method, path, body=body, headers={k.replace("_", "-"): v for k, v in headers.items()})
        resp = conn.getresponse()
        return Answer(resp.status, resp.headers, resp.read())
    finally:
        conn.close()


def post(srv: ServerProcess, job: str, op: str, fields: dict[str, Any], **headers: str) -> Answer:
    return request(srv, "POST", wire.op_path(job, op), json.dumps(fields).encode(), Content_Type=JSON, **headers)


def bearer(token: str) -> str:
    return f"Bearer {token}"


def metrics(srv: ServerProcess) -> dict[str, float]:
    """``/metrics`` (no token needed) as {'name{labels}': value}."""
    answer = request(srv, "GET", "/metrics")
    assert answer.status == 200
    out = {}
    for line in answer.body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def auth_failures(srv: ServerProcess) -> dict[str, float]:
    m = metrics(srv)
    return {r: m.get(f'rdzv_auth_failures_total{{reason="{r}"}}', 0.0) for r in ("missing", "wrong", "forbidden")}


def assert_unauthorized(answer: Answer, *secrets_: str) -> None:
    """The documented 401: JSON error body, a Bearer challenge, no token echoed."""
    body = answer.json()
    assert (answer.status, body["error"]) == (401, "unauthorized"), answer
    assert isinstance(body["message"], str) and body["message"]
    assert answer.headers["WWW-Authenticate"].startswith("Bearer")
    for secret in secrets_:
        assert secret not in answer.body.decode("latin-1")


# --------------------------------------------------------------------------- raw stream


def frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def hello(tag: int, **fields: Any) -> bytes:
    return frame([tag, wire.HELLO_OP, "", fields])


class RawStream:
    """A stream connection over a plain socket, written from the wire spec."""

    def __init__(self, srv: ServerProcess) -> None:
        self.sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
        self._frames = FrameReader(self.sock)
        self.sock.sendall(wire.STREAM_PREFACE)

    def send(self, *frames: bytes) -> None:
        self.sock.sendall(b"".join(frames))

    def recv(self) -> list[Any]:
        """The next reply frame; ConnectionError once the server has closed."""
        return self._frames.recv()

    def until_closed(self) -> list[list[Any]]:
        """Every frame the server sends before it closes (at most 100; it must close)."""
        frames = []
        for _ in range(100):
            try:
                frames.append(self.recv())
            except ConnectionError:
                return frames
        raise AssertionError(f"the server kept the connection open: {frames[:3]}")

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def streams() -> Iterator[Callable[[ServerProcess], RawStream]]:
    opened: list[RawStream] = []

    def open_stream(srv: ServerProcess) -> RawStream:
        opened.append(RawStream(srv))
        return opened[-1]

    yield open_stream
    for s in opened:
        s.close()


# --------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with the session's default token file (the one every client here finds)."""
    srv = ServerProcess(tmp_path_factory.mktemp("auth-server"), durable=False)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def read_token(tmp_path_factory: pytest.TempPathFactory) -> str:
    return secrets.token_urlsafe(24)  # 32 characters


@pytest.fixture(scope="module")
def read_server(tmp_path_factory: pytest.TempPathFactory, read_token: str) -> Iterator[ServerProcess]:
    """The default token writes; ``read_token`` (from --read-token-file) only reads."""
    folder = tmp_path_factory.mktemp("auth-read-server")
    path = write_token(folder / "read-token", read_token)
    srv = ServerProcess(folder, durable=False, args=("--read-token-file", str(path)))
    srv.start()
    yield srv
    srv.close()


@dataclasses.dataclass(frozen=True)
class Elsewhere:
    """A server whose token is in its own ``--token-file``, not in the default file."""

    srv: ServerProcess
    token_file: Path

    @property
    def token(self) -> str:
        return self.token_file.read_text().strip()


@pytest.fixture(scope="module")
def elsewhere(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Elsewhere]:
    folder = tmp_path_factory.mktemp("auth-elsewhere")
    token_file = folder / "secrets" / "token"  # absent: the server creates it
    srv = ServerProcess(folder, durable=False, args=("--token-file", str(token_file)))
    srv.start()
    yield Elsewhere(srv, token_file)
    srv.close()


@pytest.fixture
def fresh_config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty XDG_CONFIG_HOME for this test (servers started in it make their token there)."""
    home = tmp_path / "config-home"
    home.mkdir()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    return home


def start(workdir: Path, *args: str) -> ServerProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    srv = ServerProcess(workdir, durable=False, args=args)
    srv.start()
    return srv


@pytest.fixture
def started() -> Iterator[Callable[..., ServerProcess]]:
    """Servers a test starts in its own environment (after its monkeypatching); closed after it."""
    servers: list[ServerProcess] = []

    def make(workdir: Path, *args: str) -> ServerProcess:
        servers.append(start(workdir, *args))
        return servers[-1]

    yield make
    for srv in servers:
        srv.close()


# --------------------------------------------------------------------------- done when


def test_an_unauthenticated_close_is_401_and_changes_nothing_and_an_authenticated_one_closes(
    fresh_config_home: Path, tmp_path: Path, started: Callable[..., ServerProcess]
) -> None:
    token_file = fresh_config_home / "rdzv-server" / "token"
    assert not token_file.exists()
    srv = started(tmp_path / "srv")  # no auth flag at all: README's `rdzv-server`
    assert token_file.exists()  # made on start
    job = new_job()
    with Client(srv.endpoint) as client:  # finds the token in the default file
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=2))
        failures = auth_failures(srv)

        answer = post(srv, job, "close", {})
        assert_unauthorized(answer, srv.token)
        assert client.job(job)["state"] == "open"
        assert auth_failures(srv)["missing"] == failures["missing"] + 1

        answer = post(srv, job, "close", {}, Authorization=bearer(srv.token))
        assert (answer.status, answer.json()) == (200, {})
        assert client.job(job)["state"] == "closed"


# --------------------------------------------------------------------------- 401 over HTTP


@pytest.mark.parametrize(
    ("authorization", "reason"),
    [
        (lambda token, wrong: None, "missing"),
        (lambda token, wrong: "Basic dXNlcjpwYXNz", "missing"),  # another scheme carries no bearer token
        (lambda token, wrong: "Bearer", "missing"),
        (lambda token, wrong: f"Bearer {wrong}", "wrong"),
        (lambda token, wrong: f"Bearer {token[:-1]}", "wrong"),
        (lambda token, wrong: f"Bearer {token}x", "wrong"),
        (lambda token, wrong: f"Bearer {token} {token}", "wrong"),
    ],
    ids=["none", "basic", "empty bearer", "wrong", "prefix", "longer", "twice"],
)
def test_a_missing_or_wrong_token_is_401_over_http_counted_by_reason_and_changes_nothing(
    server: ServerProcess, authorization: Callable[[str, str], str | None], reason: str
) -> None:
    token, wrong = server.token, a_token()
    presented = authorization(token, wrong)
    headers = {} if presented is None else {"Authorization": presented}
    job, other = new_job(), new_job()
    with Client(server.endpoint) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=2))
        client.set(job, "canary", "intact")
        before = auth_failures(server)
        join = {"node_id": "n", "addr": "h", "nproc_per_node": 1, "min_nodes": 1, "max_nodes": 2}
        answers = [
            request(server, "GET", "/v1/jobs", **headers),
            request(server, "GET", f"/v1/jobs/{job}", **headers),
            post(server, job, "get", {"key": "canary"}, **headers),
            post(server, job, "set", {"key": "canary", "value": "changed"}, **headers),
            post(server, job, "delete_key", {"key": "canary"}, **headers),
            post(server, job, "join", join, **headers),
            post(server, other, "create", {"min_nodes": 1, "max_nodes": 1}, **headers),
        ]
        for answer in answers:
            assert_unauthorized(answer, token, wrong)
        after = auth_failures(server)
        assert after[reason] == before[reason] + len(answers)
        assert sum(after.values()) == sum(before.values()) + len(answers)
        assert client.get(job, "canary", timeout=1) == b"intact"
        doc = client.job(job)
        assert doc["nodes"] == [] and doc["joining"] == [] and doc["state"] == "open"
        assert other not in {j["rdzv_id"] for j in client.jobs()}


def test_the_bearer_scheme_is_case_insensitive_and_a_token_in_the_query_is_not_accepted(server: ServerProcess) -> None:
    assert request(server, "GET", "/v1/jobs", Authorization=f"bearer {server.token}").status == 200
    assert request(server, "GET", "/v1/jobs", Authorization=f"BEARER  {server.token} ").status == 200
    # Only the dashboard page trades ?token= (for a cookie): an API address never carries it.
    assert_unauthorized(request(server, "GET", f"/v1/jobs?token={server.token}"), server.token)


@pytest.mark.parametrize(
    "path",
    [
        "/%761/jobs",
        "/v1/jobs/",
        "//v1/jobs",
        "/v1/./jobs",
        "/x/../v1/jobs",
        "/v1/jobs/../jobs",
        "/V1/jobs",
        "/./v1/jobs",
    ],
)
def test_no_spelling_of_an_api_path_gets_past_auth(server: ServerProcess, path: str) -> None:
    job = new_job()
    with Client(server.endpoint) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        read = request(server, "GET", path)
        assert read.status in (401, 404), read
        assert job.encode() not in read.body
        close = request(server, "POST", path.replace("jobs", f"jobs/{job}/close"), b"{}", Content_Type=JSON)
        assert close.status in (401, 404), close
        assert client.job(job)["state"] == "open"


# --------------------------------------------------------------------------- 401 over the stream


@pytest.mark.parametrize(
    ("first", "reason"),
    [
        (lambda token, job: frame([1, "set", job, {"key": b"canary", "value": b"changed"}]), "missing"),
        (lambda token, job: hello(1), "missing"),
        (lambda token, job: hello(1, token=""), "missing"),
        (lambda token, job: hello(1, token=a_token()), "wrong"),
        (lambda token, job: hello(1, token=token[:-1]), "wrong"),
        (lambda token, job: hello(1, token=token.encode()), "wrong"),  # bytes, not a string
        (lambda token, job: hello(1, token=12345), "wrong"),
    ],
    ids=["operation first", "no token", "empty token", "wrong token", "prefix", "token as bytes", "token not a string"],
)
def test_a_missing_or_wrong_token_on_the_stream_is_a_tag_0_401_then_the_connection_closes(
    server: ServerProcess,
    streams: Callable[[ServerProcess], RawStream],
    first: Callable[[str, str], bytes],
    reason: str,
) -> None:
    job = new_job()
    with Client(server.endpoint) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        client.set(job, "canary", "intact")
        before = auth_failures(server)
        s = streams(server)
        # A write pipelined behind the refused frame must not be applied either.
        s.send(first(server.token, job), frame([2, "set", job, {"key": b"canary", "value": b"pipelined"}]))
        frames = s.until_closed()
        assert [(f[0], f[1], f[2]["error"]) for f in frames] == [(0, 401, "unauthorized")], frames
        assert frames[0][2]["message"] and server.token not in frames[0][2]["message"]
        assert client.get(job, "canary", timeout=1) == b"intact"
        after = auth_failures(server)
        assert after[reason] == before[reason] + 1
        assert sum(after.values()) == sum(before.values()) + 1


def test_the_hello_with_the_token_is_answered_200_and_requests_pipelined_behind_it_are_served(
    server: ServerProcess, streams: Callable[[ServerProcess], RawStream]
) -> None:
    job = new_job()
    s = streams(server)
    s.send(
        hello(9, token=server.token),
        frame([1, "create", job, {"min_nodes": 1, "max_nodes": 1}]),
        frame([2, "set", job, {"key": b"k", "value": b"v"}]),
    )
    assert s.recv() == [9, 200, {"access": "write", "one_way": ["beat"], "then_watch": ["join", "await_round"], "policy_version": 0}]
    assert sorted((r[0], r[1]) for r in (s.recv(), s.recv())) == [(1, 200), (2, 200)]
    s.send(frame([3, "get", job, {"key": b"k"}]))
    assert s.recv() == [3, 200, {"found": True, "value": b"v"}]


def test_the_real_clients_raise_unauthorized_with_a_wrong_token_and_never_show_a_token(
    server: ServerProcess,
) -> None:
    wrong = a_token()
    with Client(server.endpoint, token=wrong, retry_budget=2.0) as client, pytest.raises(UnauthorizedError) as sync:
        client.num_keys("any-job")
    assert sync.value.code is wire.ErrorCode.UNAUTHORIZED

    async def over_http() -> UnauthorizedError:
        async with AsyncClient(server.endpoint, token=wrong, retry_budget=2.0) as aclient:
            with pytest.raises(UnauthorizedError) as caught:
                await aclient.jobs()
            return caught.value

    error = asyncio.run(over_http())
    assert error.code is wire.ErrorCode.UNAUTHORIZED
    for exc in (sync.value, error):
        assert wrong not in str(exc) and server.token not in str(exc)


def test_no_token_reaches_the_log_a_reply_or_the_metrics(read_server: ServerProcess, read_token: str) -> None:
    wrong = a_token()
    job = new_job()
    with Client(read_server.endpoint) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        client.set(job, "k", "v")
    replies = [
        request(read_server, "GET", "/v1/jobs", Authorization=bearer(read_server.token)),
        request(read_server, "GET", f"/v1/jobs/{job}", Authorization=bearer(read_token)),
        request(read_server, "GET", "/v1/jobs", Authorization=bearer(wrong)),
        post(read_server, job, "set", {"key": "k", "value": "w"}, Authorization=bearer(read_token)),
        post(read_server, job, "get", {"key": "k"}, Authorization=bearer(read_token)),
        request(read_server, "GET", f"/?token={wrong}"),
        request(read_server, "GET", "/metrics"),
        request(read_server, "GET", "/healthz"),
        request(read_server, "GET", "/readyz"),
    ]
    with Client(read_server.endpoint, token=wrong, retry_budget=1.0) as bad, pytest.raises(UnauthorizedError):
        bad.num_keys(job)
    log = read_server.log_text()
    assert "Traceback" not in log
    for secret in (read_server.token, read_token, wrong):
        assert secret not in log
        for answer in replies:
            assert secret.encode() not in answer.body
            assert all(secret not in value for value in answer.headers.values())


# --------------------------------------------------------------------------- read-only token


@pytest.fixture
def member_job(read_server: ServerProcess) -> str:
    """A job with a formed round (node "member"), two keys and a counter, made with the write token."""
    job = new_job()
    with Client(read_server.endpoint) as client:
        client.join(
            job,
            node_id="member",
            addr="m.local",
            nproc_per_node=1,
            settings=JobSettings(min_nodes=1, max_nodes=2, last_call_timeout=0.0),
            timeout=PATIENCE,
        )
        client.multi_set(job, ["k/1", "k/2"], ["one", "two"])
        client.add(job, "n", 41)
    return job


def observable_state(srv: ServerProcess, job: str) -> dict[str, Any]:
    """What a read-only token must never change (heartbeat ages aside)."""
    with Client(srv.endpoint) as client:
        doc = client.job(job)
        return {
            "jobs": sorted((j["rdzv_id"], j["state"], j["round"], j["num_nodes"]) for j in client.jobs()),
            "state": doc["state"],
            "round": doc["round"],
            "nodes": [(n["node_id"], n["node_rank"], n["alive"], n["status"]) for n in doc["nodes"]],
            "lines": (doc["joining"], doc["waiting"], doc["standby"]),
            "keys": sorted(client.list_keys(job)),
            "values": client.multi_get(job, ["k/1", "k/2", "n"], timeout=1),
        }


WRITES: list[tuple[str, dict[str, Any]]] = [
    ("set", {"key": "k/1", "value": "changed"}),
    ("add", {"key": "n", "amount": 1}),
    ("compare_set", {"key": "k/1", "expected": "one", "desired": "changed"}),
    ("append", {"key": "k/1", "value": "+"}),
    ("multi_set", {"keys": ["k/1", "k/3"], "values": ["changed", "new"]}),
    ("delete_key", {"key": "k/2"}),
    ("create", {"min_nodes": 1, "max_nodes": 1}),  # on a new job id
    ("join", {"node_id": "intruder", "addr": "i.local", "nproc_per_node": 1, "min_nodes": 1, "max_nodes": 2}),
    ("await_round", {"node_id": "member", "round": 0}),
    ("watch", {"node_id": "member", "round": 0, "known": -1}),
    ("beat", {"node_id": "member", "round": 0}),
    ("leave", {"node_id": "member"}),
    ("close", {}),
    ("refuse", {"node_id": "member", "addr": "10.0.0.1", "cause": "health_check_failed"}),
]
assert {op for op, _ in WRITES} | {"get", "multi_get", "wait", "check", "num_keys", "list_keys", "policy"} == set(wire.REQUESTS)


@pytest.mark.parametrize(("op", "fields"), WRITES, ids=[op for op, _ in WRITES])
def test_a_read_only_token_gets_403_forbidden_for_every_write_over_http_and_nothing_changes(
    read_server: ServerProcess, read_token: str, member_job: str, op: str, fields: dict[str, Any]
) -> None:
    job = new_job() if op == "create" else member_job
    before = observable_state(read_server, member_job)
    failures = auth_failures(read_server)
    answer = post(read_server, job, op, fields, Authorization=bearer(read_token))
    body = answer.json()
    assert (answer.status, body["error"]) == (403, "forbidden"), answer
    assert body["message"] and read_token not in body["message"]
    assert observable_state(read_server, member_job) == before  # a created job would be listed there
    assert auth_failures(read_server)["forbidden"] == failures["forbidden"] + 1


def test_a_read_only_token_gets_403_forbidden_for_every_write_over_the_stream_and_nothing_changes(
    read_server: ServerProcess, read_token: str, member_job: str
) -> None:
    job = member_job
    before = observable_state(read_server, job)
    failures = auth_failures(read_server)
    with Client(read_server.endpoint, token=read_token, retry_budget=2.0) as reader:
        attempts: list[Callable[[], object]] = [
            lambda: reader.set(job, "k/1", "changed"),
            lambda: reader.add(job, "n", 1),
            lambda: reader.compare_set(job, "k/1", "one", "changed"),
            lambda: reader.append(job, "k/1", "+"),
            lambda: reader.multi_set(job, ["k/1"], ["changed"]),
            lambda: reader.delete_key(job, "k/2"),
            lambda: reader.create_job(new_job(), JobSettings(min_nodes=1, max_nodes=1)),
            lambda: reader.join(
                job, node_id="intruder", addr="i", nproc_per_node=1,
                settings=JobSettings(min_nodes=1, max_nodes=2), timeout=2.0
            ),
            lambda: reader.watch(job, "member", round=0),
            lambda: reader.beat(job, "member", round=0),
            lambda: reader.leave(job, "member"),
            lambda: reader.close_job(job),
        ]
        for attempt in attempts:
            with pytest.raises(UnauthorizedError) as caught:
                attempt()
            assert caught.value.code is wire.ErrorCode.FORBIDDEN
            assert read_token not in str(caught.value)
        # The connection is still the reader's: reads go on being served.
        assert reader.get(job, "k/1", timeout=1) == b"one"
    assert observable_state(read_server, job) == before
    assert auth_failures(read_server)["forbidden"] >= failures["forbidden"] + len(attempts)


def test_a_read_only_token_reads_over_the_stream_and_http(
    read_server: ServerProcess, read_token: str, member_job: str, streams: Callable[[ServerProcess], RawStream]
) -> None:
    job = member_job
    with Client(read_server.endpoint, token=read_token) as reader:  # the stream
        assert reader.get(job, "k/1", timeout=1) == b"one"
        assert reader.multi_get(job, ["k/1", "k/2"], timeout=1) == [b"one", b"two"]
        reader.wait(job, ["k/1", "n"], timeout=1)
        assert reader.check(job, ["k/1", "k/9"]) is False
        assert reader.num_keys(job) == 3
        assert sorted(reader.list_keys(job, "k/")) == [b"k/1", b"k/2"]
        assert job in {j["rdzv_id"] for j in reader.jobs()}
        assert [n["node_id"] for n in reader.job(job)["nodes"]] == ["member"]

    async def over_http() -> None:
        async with AsyncClient(read_server.endpoint, token=read_token) as areader:
            assert await areader.get(job, "n", timeout=1) == b"41"
            assert await areader.multi_get(job, ["k/2"], timeout=1) == [b"two"]
            await areader.wait(job, ["k/2"], timeout=1)
            assert await areader.check(job, ["k/1", "k/2"]) is True
            assert await areader.num_keys(job) == 3
            assert sorted(await areader.list_keys(job)) == [b"k/1", b"k/2", b"n"]
            assert job in {j["rdzv_id"] for j in await areader.jobs()}
            assert (await areader.job(job))["state"] == "complete"

    asyncio.run(over_http())
    listed = request(read_server, "GET", "/v1/jobs", Authorization=bearer(read_token))
    assert listed.status == 200 and job in {j["rdzv_id"] for j in listed.json()["jobs"]}
    shown = request(read_server, "GET", f"/v1/jobs/{job}", Authorization=bearer(read_token))
    assert shown.status == 200 and shown.json()["rdzv_id"] == job
    s = streams(read_server)
    s.send(hello(5, token=read_token))
    assert s.recv() == [5, 200, {"access": "read", "one_way": ["beat"], "then_watch": ["join", "await_round"], "policy_version": 0}]


# --------------------------------------------------------------------------- the token file


def test_the_server_creates_its_token_file_0600_with_32_random_bytes_and_logs_where_not_what(
    fresh_config_home: Path, tmp_path: Path, started: Callable[..., ServerProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv = started(tmp_path / "first")
    path = fresh_config_home / "rdzv-server" / "token"
    assert path == default_token_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text().strip()
    assert len(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))) >= 32
    log = srv.log_text()
    assert str(path) in log
    assert token not in log
    with Client(srv.endpoint) as client:
        assert client.jobs() == []

    # Another host's first start (another config home) makes another token.
    other_home = tmp_path / "other-home"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(other_home))
    other = started(tmp_path / "other")
    assert (other_home / "rdzv-server" / "token").read_text().strip() != token
    assert token not in other.log_text()

    # A restart keeps the token it finds, and still logs only where it is.
    monkeypatch.setenv("XDG_CONFIG_HOME", str(fresh_config_home))
    srv.restart()
    assert path.read_text().strip() == token
    assert srv.log_text().count(str(path)) >= 2 and token not in srv.log_text()
    assert request(srv, "GET", "/v1/jobs", Authorization=bearer(token)).status == 200


@pytest.mark.parametrize("which", ["too short", "the write token"])
def test_an_unusable_read_only_token_file_refuses_to_start_naming_the_file_never_the_token(
    tmp_path: Path, server: ServerProcess, which: str
) -> None:
    token = "Zq7shrt9" if which == "too short" else server.token
    path = write_token(tmp_path / "read-token", token)
    srv = ServerProcess(tmp_path, durable=False, args=("--read-token-file", str(path)))
    with pytest.raises(RuntimeError, match="did not start"):
        srv.start()
    srv.close()
    log = srv.log_text()
    assert "rdzv-server: error:" in log and str(path) in log
    assert token not in log and "Traceback" not in log


def test_no_auth_serves_without_any_token_and_warns_loudly(
    fresh_config_home: Path,
    tmp_path: Path,
    started: Callable[..., ServerProcess],
    streams: Callable[[ServerProcess], RawStream],
) -> None:
    srv = started(tmp_path / "open", "--no-auth")
    assert not (fresh_config_home / "rdzv-server" / "token").exists()  # nothing to create
    job = new_job()
    assert post(srv, job, "create", {"min_nodes": 1, "max_nodes": 1}).status == 200
    assert request(srv, "GET", f"/v1/jobs/{job}").json()["rdzv_id"] == job
    s = streams(srv)
    s.send(frame([1, "set", job, {"key": b"k", "value": b"v"}]))  # no hello
    assert s.recv() == [1, 200, {}]
    s.send(hello(2, token="anything at all"))  # a hello is welcome, whatever it carries
    assert s.recv() == [2, 200, {"access": "write", "one_way": ["beat"], "then_watch": ["join", "await_round"], "policy_version": 0}]
    with Client(srv.endpoint) as client:  # no token anywhere (the default file is absent)
        assert client.get(job, "k", timeout=1) == b"v"
    warnings = [line for line in srv.log_text().splitlines() if "AUTH IS OFF" in line]
    assert warnings and all("WARNING" in line for line in warnings)
    assert auth_failures(srv) == {"missing": 0, "wrong": 0, "forbidden": 0}


# --------------------------------------------------------------------------- the clients' lookup order


@dataclasses.dataclass(frozen=True)
class Lookup:
    name: str
    default_file: str  # "absent", "wrong" or "right"
    env: dict[str, str]  # values: "right", "wrong", "right file", "wrong file"
    kwargs: dict[str, str]  # token= / token_file=, same values
    works: bool


LOOKUPS = [
    Lookup("the default file", "right", {}, {}, True),
    Lookup("no token anywhere", "absent", {}, {}, False),
    Lookup("a wrong default file", "wrong", {}, {}, False),
    Lookup("RDZV_TOKEN, no default file", "absent", {"RDZV_TOKEN": "right"}, {}, True),
    Lookup("RDZV_TOKEN beats the default file", "wrong", {"RDZV_TOKEN": "right"}, {}, True),
    Lookup("RDZV_TOKEN_FILE, no default file", "absent", {"RDZV_TOKEN_FILE": "right file"}, {}, True),
    Lookup("RDZV_TOKEN_FILE beats the default file", "wrong", {"RDZV_TOKEN_FILE": "right file"}, {}, True),
    Lookup(
        "RDZV_TOKEN beats RDZV_TOKEN_FILE",
        "absent",
        {"RDZV_TOKEN": "wrong", "RDZV_TOKEN_FILE": "right file"},
        {},
        False,
    ),
    Lookup("token= beats RDZV_TOKEN", "wrong", {"RDZV_TOKEN": "wrong"}, {"token": "right"}, True),
    Lookup("a wrong token= beats a right RDZV_TOKEN", "right", {"RDZV_TOKEN": "right"}, {"token": "wrong"}, False),
    Lookup("token_file= beats RDZV_TOKEN", "wrong", {"RDZV_TOKEN": "wrong"}, {"token_file": "right file"}, True),
    Lookup(
        "a wrong token_file= beats RDZV_TOKEN", "right", {"RDZV_TOKEN": "right"}, {"token_file": "wrong file"}, False
    ),
]


@pytest.mark.parametrize("kind", ["Client (stream)", "AsyncClient (HTTP)"])
@pytest.mark.parametrize("case", LOOKUPS, ids=[c.name for c in LOOKUPS])
def test_clients_find_their_token_in_the_documented_order(
    elsewhere: Elsewhere, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: Lookup, kind: str
) -> None:
    right, wrong = elsewhere.token, a_token()
    values = {
        "right": right,
        "wrong": wrong,
        "right file": str(elsewhere.token_file),
        "wrong file": str(write_token(tmp_path / "wrong-token", wrong)),
    }
    home = tmp_path / "home"
    if case.default_file != "absent":
        write_token(home / "rdzv-server" / "token", values[case.default_file])
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home))
    monkeypatch.delenv("RDZV_TOKEN", raising=False)
    monkeypatch.delenv("RDZV_TOKEN_FILE", raising=False)
    for name, value in case.env.items():
        monkeypatch.setenv(name, values[value])
    kwargs: dict[str, Any] = {k: values[v] for k, v in case.kwargs.items()}

    def sync() -> list[dict[str, Any]]:
        with Client(elsewhere.srv.endpoint, retry_budget=2.0, **kwargs) as client:
            return client.jobs()

    async def via_http() -> list[dict[str, Any]]:
        async with AsyncClient(elsewhere.srv.endpoint, retry_budget=2.0, **kwargs) as aclient:
            return await aclient.jobs()

    call = sync if kind.startswith("Client") else (lambda: asyncio.run(via_http()))
    if case.works:
        assert isinstance(call(), list)
    else:
        with pytest.raises(UnauthorizedError) as caught:
            call()
        assert caught.value.code is wire.ErrorCode.UNAUTHORIZED
        assert right not in str(caught.value) and wrong not in str(caught.value)


# --------------------------------------------------------------------------- the dashboard's cookie


def test_the_dashboard_trades_the_token_for_a_cookie_that_reads_and_never_writes(server: ServerProcess) -> None:
    job = new_job()
    with Client(server.endpoint) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=2))
        wrong = a_token()
        refused = request(server, "GET", f"/?token={wrong}")
        assert (refused.status, refused.json()["error"]) == (401, "unauthorized")
        assert "Set-Cookie" not in refused.headers and wrong.encode() not in refused.body

        traded = request(server, "GET", f"/?token={server.token}")
        assert traded.status == 303 and traded.headers["Location"] == "/"
        (set_cookie,) = traded.headers.get_all("Set-Cookie") or []
        attributes = {part.strip().lower() for part in set_cookie.split(";")[1:]}
        assert {"httponly", "samesite=strict", "path=/"} <= attributes
        cookie = SimpleCookie(set_cookie)["rdzv_token"]
        sent = f"rdzv_token={cookie.value}"

        listed = request(server, "GET", "/v1/jobs", Cookie=sent)
        assert listed.status == 200 and job in {j["rdzv_id"] for j in listed.json()["jobs"]}
        assert request(server, "GET", f"/v1/jobs/{job}", Cookie=sent).json()["state"] == "open"
        # The cookie never writes: a POST with only the cookie is unauthenticated.
        for op, fields in (("close", {}), ("set", {"key": "k", "value": "v"})):
            assert_unauthorized(post(server, job, op, fields, Cookie=sent), server.token)
        assert client.job(job)["state"] == "open" and client.check(job, ["k"]) is False
        # A wrong cookie is a wrong token.
        before = auth_failures(server)["wrong"]
        assert_unauthorized(request(server, "GET", "/v1/jobs", Cookie=f"rdzv_token={wrong}"), wrong)
        assert auth_failures(server)["wrong"] == before + 1


# --------------------------------------------------------------------------- rdzvctl


def rdzvctl(endpoint: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rdzv_client.ctl", "--endpoint", endpoint, *args],
        capture_output=True,
        check=False,
        text=True,
        timeout=60,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("RDZV_")}, **(env or {})},
    )


def test_rdzvctl_works_unchanged_against_a_server_whose_token_is_in_the_default_file(server: ServerProcess) -> None:
    job = new_job()
    missing = rdzvctl(server.endpoint, "kv", "set", job, "k", "v")  # authenticated, so the server's own no
    assert missing.returncode == 1 and missing.stderr.splitlines()[0].endswith("(job_not_found)"), missing.stderr
    with Client(server.endpoint) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    for args in (("kv", "set", job, "k", "v"), ("jobs",), ("show", job)):
        out = rdzvctl(server.endpoint, *args)
        assert out.returncode == 0, out.stderr
    got = rdzvctl(server.endpoint, "kv", "get", job, "k")
    assert (got.returncode, got.stdout) == (0, "v\n")
    closed = rdzvctl(server.endpoint, "close", job)
    assert closed.returncode == 0, closed.stderr
    with Client(server.endpoint) as client:
        assert client.job(job)["state"] == "closed"


def test_rdzvctl_without_the_servers_token_says_unauthorized_and_shows_no_token(elsewhere: Elsewhere) -> None:
    out = rdzvctl(elsewhere.srv.endpoint, "jobs")
    assert out.returncode == 1
    first = out.stderr.splitlines()[0]
    assert first.startswith("rdzvctl: error: ") and first.endswith("(unauthorized)")
    assert elsewhere.token not in out.stderr + out.stdout
    with_env = rdzvctl(elsewhere.srv.endpoint, "jobs", env={"RDZV_TOKEN_FILE": str(elsewhere.token_file)})
    assert with_env.returncode == 0, with_env.stderr


def test_rdzvctl_takes_a_token_file_on_its_command_line(elsewhere: Elsewhere) -> None:
    out = rdzvctl(elsewhere.srv.endpoint, "--token-file", str(elsewhere.token_file), "jobs")
    assert out.returncode == 0, out.stderr


# --------------------------------------------------------------------------- open endpoints


@pytest.mark.parametrize("path", ["/healthz", "/livez", "/readyz", "/metrics", "/"])
def test_health_metrics_and_the_page_need_no_token(server: ServerProcess, path: str) -> None:
    answer = request(server, "GET", path)
    assert answer.status == 200, answer
    assert server.token.encode() not in answer.body
