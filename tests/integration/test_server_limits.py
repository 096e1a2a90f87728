"""Transport limits against the real server process: what a hostile or broken client can
hold, and for how long.

Each limit is checked as a user would see it: the refused connection gets its documented
error (``{"error", "message"}`` JSON over HTTP, a tag-0 error frame on a stream) and is
closed; the server's memory and ``/metrics`` stay within the budget; a well-behaved client
and ``/healthz`` are still served; the real clients reconnect transparently when the
server closes their idle pooled connections. Limits are lowered by flags so every test is
quick."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import select
import socket
import struct
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import psutil
import pytest
from raw_stream import FrameReader, read_until_eof, stream_frames
from server_process import ServerProcess

from rdzv_client import AsyncClient, Client, JobSettings, RdzvConnectionError, wire

PREFACE = wire.STREAM_PREFACE
MiB = 1024 * 1024
# --read-timeout and --idle-timeout of the deadline server, s.
SHORT = 1.0
# Far longer than any deadline the tests wait for; every wait loop ends by then.
PATIENCE = 15.0


def new_job() -> str:
    return f"limits-{uuid.uuid4().hex[:12]}"


# --------------------------------------------------------------------------- raw clients


def frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def http_response(data: bytes) -> tuple[int, str, dict[str, Any]]:
    """Status, Content-Type and decoded JSON body of one raw HTTP response."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", len(body)))
    return status, headers.get("content-type", ""), json.loads(body[:length])


HELLO_TAG = 2**62  # no test's request uses it


def hello(token: str) -> bytes:
    """The stream protocol's authentication frame."""
    return frame([HELLO_TAG, wire.HELLO_OP, "", {"token": token}])


def with_token(raw: bytes, token: str) -> bytes:
    """A raw HTTP request with an ``Authorization`` header after its ``Host`` line."""
    return raw.replace(b"\r\nHost: x\r\n", f"\r\nHost: x\r\nAuthorization: Bearer {token}\r\n".encode(), 1)


class Stream:
    """A stream connection over a plain socket: preface only, or with ``token`` also the
    hello (its 200 read), so that operations are served."""

    def __init__(self, port: int, *, preface: bool = True, token: str | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=PATIENCE)
        self._frames = FrameReader(self.sock)
        if preface:
            self.sock.sendall(PREFACE)
        if token is not None:
            self.sock.sendall(hello(token))
            assert self.recv()[:2] == [HELLO_TAG, 200]

    def send(self, tag: int, op: str, rdzv_id: str, **fields: Any) -> None:
        self.sock.sendall(frame([tag, op, rdzv_id, fields]))

    def recv(self) -> list[Any]:
        return self._frames.recv()

    def call(self, op: str, rdzv_id: str, **fields: Any) -> list[Any]:
        self.send(7, op, rdzv_id, **fields)
        return self.recv()

    def close(self) -> None:
        self.sock.close()


def wait_closed(sock: socket.socket, deadline: float) -> bool:
    """True once the server has closed ``sock`` (what it sent before is discarded)."""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            return False
        try:
            if not sock.recv(1 << 16):
                return True
        except ConnectionResetError:
            return True
    return False


def http_get(srv: ServerProcess, path: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(srv.url + path, timeout=PATIENCE) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


def metrics(srv: ServerProcess) -> dict[str, float]:
    """``/metrics`` as {'name{labels}': value}."""
    status, body = http_get(srv, "/metrics")
    assert status == 200
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def eventually(check: Callable[[], bool], timeout: float = PATIENCE) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


@pytest.fixture
def opened() -> Iterator[list[Any]]:
    """Sockets and streams a test opens; all closed after it."""
    things: list[Any] = []
    yield things
    for thing in things:
        with contextlib.suppress(OSError):
            thing.close()


# --------------------------------------------------------------------------- servers


def started(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp(name), durable=False, args=args)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """8 MiB bodies and a 16 MiB budget for partly received requests (deadlines at their defaults)."""
    yield from started(
        tmp_path_factory,
        "budget",
        *("--max-value-bytes", str(MiB), "--max-body-bytes", str(8 * MiB), "--max-buffered-bytes", str(16 * MiB)),
    )


@pytest.fixture(scope="module")
def short_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Idle and read timeouts of one second."""
    yield from started(tmp_path_factory, "short", "--idle-timeout", str(SHORT), "--read-timeout", str(SHORT))


# --------------------------------------------------------------------------- buffer budget

STALLED = 7_500_000  # bytes each stalled request sends of its 8 MiB


def rss(srv: ServerProcess) -> int:
    assert srv.proc is not None
    return int(psutil.Process(srv.proc.pid).memory_info().rss)


def test_before_its_hello_a_stream_cannot_make_the_server_buffer_a_large_frame(budget_server: ServerProcess) -> None:
    s = Stream(budget_server.port)
    try:
        s.sock.sendall(struct.pack(">I", 8 * MiB) + b"x" * 1024)  # a stranger announces 8 MiB
        frames = stream_frames(read_until_eof(s.sock))
        assert [(f[0], f[1], f[2]["error"]) for f in frames] == [(0, 413, "body_too_large")]
        assert metrics(budget_server)["rdzv_buffered_bytes"] < 1024
    finally:
        s.close()


def test_stalled_stream_frames_beyond_the_buffer_budget_are_shed_with_buffers_full(
    budget_server: ServerProcess, opened: list[Any]
) -> None:
    srv = budget_server
    before = rss(srv)
    shed_before = metrics(srv).get('rdzv_connections_shed_total{reason="buffers_full"}', 0)
    streams = []
    # Authenticated: before its hello a stream may send a few KiB at most (the next test);
    # after it, a frame is charged to the budget before it is read whole.
    for _ in range(8):  # 60 MB in all, against a 16 MiB budget
        s = Stream(srv.port, token=srv.token)
        opened.append(s)
        s.sock.sendall(struct.pack(">I", 8 * MiB) + b"x" * STALLED)
        streams.append(s)
    assert eventually(
        lambda: metrics(srv).get('rdzv_connections_shed_total{reason="buffers_full"}', 0) - shed_before >= 6
    )
    grown = rss(srv) - before

    refused = []
    for s in streams:
        ready, _, _ = select.select([s.sock], [], [], 0.5)
        if ready:
            refused.append(stream_frames(read_until_eof(s.sock)))
    assert len(refused) >= 6  # at most two 7.5 MB frames fit in 16 MiB
    for frames in refused:
        assert [(f[0], f[1], f[2]["error"]) for f in frames] == [(0, 429, "buffers_full")]
    m = metrics(srv)
    assert m["rdzv_buffered_bytes"] <= m["rdzv_buffered_bytes_limit"] == 16 * MiB
    assert grown < 40 * MiB, f"the server grew by {grown / MiB:.0f} MiB holding stalled frames"

    # The survivors' bytes are released when they go, and a small request is served meanwhile.
    job = new_job()
    fresh = Stream(srv.port, token=srv.token)
    opened.append(fresh)
    assert fresh.call("create", job, min_nodes=1, max_nodes=1)[1] == 200
    for s in streams:
        s.close()
    assert eventually(lambda: metrics(srv)["rdzv_buffered_bytes"] < 1024)


def test_stalled_http_bodies_beyond_the_buffer_budget_get_429_buffers_full_json(
    budget_server: ServerProcess, opened: list[Any]
) -> None:
    srv = budget_server
    # Authenticated: a request without the token is answered 401 before its body is read.
    head = with_token(
        (
            f"POST /v1/jobs/{new_job()}/set HTTP/1.1\r\nHost: x\r\nContent-Type: application/msgpack\r\n"
            f"Content-Length: {8 * MiB}\r\n\r\n"
        ).encode(),
        srv.token,
    )
    rejected_before = metrics(srv).get('rdzv_requests_rejected_total{code="buffers_full"}', 0)
    socks = []
    for _ in range(4):
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
        opened.append(sock)
        sock.sendall(head + b"x" * STALLED)
        socks.append(sock)
    assert eventually(
        lambda: metrics(srv).get('rdzv_requests_rejected_total{code="buffers_full"}', 0) - rejected_before >= 2
    )
    answers = []
    for sock in socks:
        ready, _, _ = select.select([sock], [], [], 0.5)
        if ready:
            answers.append(http_response(read_until_eof(sock)))
    assert len(answers) >= 2
    for status, ctype, body in answers:
        assert (status, ctype, body["error"]) == (429, "application/json", "buffers_full")
        assert "full" in body["message"]
    assert http_get(srv, "/healthz")[0] == 200


# --------------------------------------------------------------------------- read deadline


def trickle(sock: socket.socket, first: bytes, rest: bytes) -> bytes:
    """Send ``first``, then ``rest`` a byte every 0.3 s until the server answers; what it answered."""
    sock.sendall(first)
    deadline = time.monotonic() + PATIENCE
    for byte in rest:
        ready, _, _ = select.select([sock], [], [], 0.3)
        if ready or time.monotonic() > deadline:
            break
        with contextlib.suppress(OSError):
            sock.sendall(bytes([byte]))
    return read_until_eof(sock)


@pytest.mark.parametrize(
    "first",
    [
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ",
        b"POST /v1/jobs/j/set HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 9999\r\n\r\n{",
    ],
    ids=["headers", "body"],
)
def test_an_http_request_that_trickles_in_gets_408_request_timeout_then_closes(
    short_server: ServerProcess, opened: list[Any], first: bytes
) -> None:
    sock = socket.create_connection(("127.0.0.1", short_server.port), timeout=PATIENCE)
    opened.append(sock)
    # With the token: without it, the body's request is answered 401 before its body is read.
    status, ctype, body = http_response(trickle(sock, with_token(first, short_server.token), b"x" * 100))
    assert (status, ctype, body["error"]) == (408, "application/json", "request_timeout")


@pytest.mark.parametrize(
    ("first", "rest"),
    [(PREFACE[:3], PREFACE[3:]), (PREFACE + frame([1, "num_keys", "job", {}])[:5], b"x" * 100)],
    ids=["preface", "frame"],
)
def test_a_stream_frame_that_trickles_in_gets_a_408_frame_then_closes(
    short_server: ServerProcess, opened: list[Any], first: bytes, rest: bytes
) -> None:
    sock = socket.create_connection(("127.0.0.1", short_server.port), timeout=PATIENCE)
    opened.append(sock)
    frames = stream_frames(trickle(sock, first, rest))
    assert [(f[0], f[1], f[2]["error"]) for f in frames] == [(0, 408, "request_timeout")]


# --------------------------------------------------------------------------- idle deadline


def test_connections_with_nothing_in_flight_are_closed_after_the_idle_timeout(
    short_server: ServerProcess, opened: list[Any]
) -> None:
    srv = short_server
    idle_before = metrics(srv).get('rdzv_connections_shed_total{reason="idle_timeout"}', 0)
    socks = []
    for _ in range(200):  # preface only
        s = Stream(srv.port)
        opened.append(s)
        socks.append(s.sock)
    for _ in range(20):  # never spoke
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
        opened.append(sock)
        socks.append(sock)
    for _ in range(20):  # HTTP keep-alive after one answered request
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
        opened.append(sock)
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        sock.recv(1 << 16)
        socks.append(sock)
    deadline = time.monotonic() + PATIENCE
    still_open = [sock for sock in socks if not wait_closed(sock, deadline)]
    assert not still_open
    assert metrics(srv).get('rdzv_connections_shed_total{reason="idle_timeout"}', 0) - idle_before >= len(socks)


def test_a_long_poll_in_flight_outlives_the_idle_and_read_timeouts(
    short_server: ServerProcess, opened: list[Any]
) -> None:
    job = new_job()
    s = Stream(short_server.port, token=short_server.token)
    opened.append(s)
    assert s.call("create", job, min_nodes=1, max_nodes=1)[1] == 200
    hold = 3 * SHORT
    s.send(1, "get", job, key="never", timeout=hold)
    tag, status, body = s.recv()
    assert (tag, status, body["found"]) == (1, 200, False)
    assert s.call("num_keys", job)[1] == 200  # the same connection serves on

    req = urllib.request.Request(
        short_server.url + wire.op_path(job, "get"),
        data=json.dumps({"key": "never", "timeout": hold}).encode(),
        headers={"Content-Type": "application/json", **short_server.auth},
    )
    with urllib.request.urlopen(req, timeout=PATIENCE) as resp:
        assert (resp.status, json.loads(resp.read())["found"]) == (200, False)


def test_the_sync_client_reconnects_when_the_server_closed_its_idle_connection(
    short_server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    job = new_job()
    idle_before = metrics(short_server).get('rdzv_connections_shed_total{reason="idle_timeout"}', 0)
    with caplog.at_level(logging.DEBUG, logger="rdzv_client"), Client(short_server.endpoint, retry_budget=5.0) as c:
        c.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        for i in range(3):
            c.set(job, "k", str(i))
            time.sleep(SHORT + 0.6)  # the server closes the pooled connection meanwhile
            assert c.get(job, "k", timeout=1) == str(i).encode()
    assert metrics(short_server).get('rdzv_connections_shed_total{reason="idle_timeout"}', 0) > idle_before
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


async def test_the_async_client_reconnects_when_the_server_closed_its_idle_connection(
    short_server: ServerProcess, caplog: pytest.LogCaptureFixture
) -> None:
    job = new_job()
    with caplog.at_level(logging.DEBUG, logger="rdzv_client"):
        async with AsyncClient(short_server.endpoint, retry_budget=5.0) as c:
            await c.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
            for i in range(3):
                await c.set(job, "k", str(i))
                await asyncio.sleep(SHORT + 0.6)
                assert await c.get(job, "k", timeout=1) == str(i).encode()
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


# --------------------------------------------------------------------------- connection limit


def test_at_the_connection_limit_idle_connections_are_shed_and_clients_are_served(
    server_factory: Callable[..., ServerProcess], opened: list[Any]
) -> None:
    srv = server_factory(args=("--max-connections", "200"))
    for _ in range(150):  # preface only: idle stream connections
        opened.append(Stream(srv.port))
    for _ in range(100):  # never spoke
        opened.append(socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE))
    assert http_get(srv, "/healthz") == (200, b'{"status":"ok"}')
    job = new_job()
    with Client(srv.endpoint, retry_budget=5.0) as c:
        c.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        c.set(job, "k", "v")
        assert c.get(job, "k", timeout=1) == b"v"
    m = metrics(srv)
    assert m["rdzv_connections_limit"] == 200
    assert sum(v for k, v in m.items() if k.startswith("rdzv_connections{")) <= 200
    assert m['rdzv_connections_shed_total{reason="connection_limit"}'] >= 50
    log = srv.log_text()
    assert "Traceback" not in log
    assert 1 <= len(re.findall("At the connection limit", log)) <= 2  # one line per 10 s at most


def test_at_the_connection_limit_with_every_connection_busy_newcomers_get_too_many_connections(
    server_factory: Callable[..., ServerProcess], opened: list[Any]
) -> None:
    srv = server_factory(args=("--max-connections", "40"))
    job = new_job()
    busy = []
    for i in range(40):  # every slot holds a parked long-poll: nothing may be shed
        s = Stream(srv.port, token=srv.token)
        opened.append(s)
        if i == 0:
            assert s.call("create", job, min_nodes=1, max_nodes=1)[1] == 200
        s.send(1, "get", job, key="never", timeout=PATIENCE)
        assert s.call("num_keys", job)[:2] == [7, 200]  # read after its get: the get is parked
        busy.append(s)

    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
    opened.append(sock)
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    status, ctype, body = http_response(read_until_eof(sock))
    assert (status, ctype, body["error"]) == (429, "application/json", "too_many_connections")

    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
    opened.append(sock)
    sock.sendall(PREFACE + hello(srv.token) + frame([1, "num_keys", job, {}]))  # refused at the door, token or not
    frames = stream_frames(read_until_eof(sock))
    assert [(f[0], f[1], f[2]["error"]) for f in frames] == [(0, 429, "too_many_connections")]

    with Client(srv.endpoint, retry_budget=0.5) as c, pytest.raises(RdzvConnectionError) as err:
        c.num_keys(job)
    assert err.value.code == wire.ErrorCode.TOO_MANY_CONNECTIONS  # the client read the refusal

    for s in busy:
        s.close()
    assert eventually(lambda: http_get(srv, "/healthz")[0] == 200)
    m = metrics(srv)
    assert m['rdzv_requests_rejected_total{code="too_many_connections"}'] >= 3


def test_metrics_show_how_close_each_connection_limit_is(short_server: ServerProcess, opened: list[Any]) -> None:
    for _ in range(3):
        opened.append(Stream(short_server.port))
    for _ in range(2):
        opened.append(socket.create_connection(("127.0.0.1", short_server.port), timeout=PATIENCE))

    def counted(m: dict[str, float]) -> bool:  # once the server has read what each one sent
        stream, undecided = (m.get(f'rdzv_connections{{protocol="{p}"}}', 0) for p in ("stream", "undecided"))
        return stream >= 3 and undecided >= 2

    assert eventually(lambda: counted(metrics(short_server)))
    m = metrics(short_server)
    assert m['rdzv_connections{protocol="stream"}'] >= 3
    assert m['rdzv_connections{protocol="undecided"}'] >= 2
    assert m['rdzv_connections{protocol="http"}'] >= 1  # this scrape
    assert m["rdzv_connections_limit"] >= 1
    assert m["rdzv_buffered_bytes_limit"] == 256 * MiB
    assert m["rdzv_buffered_bytes"] >= 0
    for reason in ("idle_timeout", "read_timeout", "buffers_full", "connection_limit"):
        assert f'rdzv_connections_shed_total{{reason="{reason}"}}' in m
