"""Before authentication a connection gets nothing, against the real server process: no
credential echoed, no more than its share of the buffers, no more than a few seconds.

Rules checked (README "Security", rdzv_server/api/connection.py, head.py, aiohttp_seam.py):
- no answer and no log line quotes a credential (the token, the read-only token, the
  dashboard's cookie) when aiohttp's parser refuses a request: a refusal says what was wrong
  and where (which header, which byte), never the request's bytes;
- every answer the server writes itself (parser refusals, shed and refused connections)
  is HTTP/1.1 with the same security headers as the app's answers;
- a request head passing ``--max-head-bytes`` is ``431 headers_too_large``;
- strangers hold at most ``--max-pre-auth-bytes`` of the buffers: 300 connections stalled
  in their heads leave an authenticated 8 MB ``set`` its room, over HTTP and the stream;
- a stream without its hello, and a stranger's unfinished HTTP head, are closed
  ``408 request_timeout`` within ``--auth-timeout``; a token holder's connection is not.

Flags are lowered so that each test takes a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import struct
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from raw_stream import read_until_eof, stream_frames
from server_process import ServerProcess
from waiting import wait_until

from rdzv_client import AsyncClient, Client, JobSettings, wire
from rdzv_server.api.header import DATA_POLICY, SECURITY_HEADERS

MiB = 1024 * 1024
# Every answer, and every close the server owes us, comes well within this.
PATIENCE = 10.0
# --auth-timeout of the deadline server, s.
SHORT = 1.0


def new_job() -> str:
    return f"strangers-{uuid.uuid4().hex[:12]}"


# --------------------------------------------------------------------------- raw HTTP


def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw`` on a new connection; everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as sock:
        with contextlib.suppress(OSError):  # the server may answer and close before all is sent
            sock.sendall(raw)
        return read_until_eof(sock, PATIENCE)


def parse(data: bytes) -> tuple[str, int, dict[str, str], Any]:
    """Version, status, headers (lowercase names) and JSON body of one raw HTTP answer."""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    version, status = lines[0].split()[:2]
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return version, int(status), headers, json.loads(body[: int(headers["content-length"])])


def assert_hardened(headers: dict[str, str]) -> None:
    """The security headers every answer carries (README "Security")."""
    for name, value in SECURITY_HEADERS.items():
        assert headers.get(name.lower()) == value, (name, headers)
    assert headers.get("content-security-policy") == DATA_POLICY


def metrics(srv: ServerProcess) -> dict[str, float]:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=PATIENCE) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def start(folder: Path, *args: str) -> ServerProcess:
    srv = ServerProcess(folder, durable=False, args=args)
    srv.start()
    return srv


@pytest.fixture
def opened() -> Iterator[list[socket.socket]]:
    """Sockets a test opens; all closed after it."""
    socks: list[socket.socket] = []
    yield socks
    for sock in socks:
        sock.close()


# --------------------------------------------------------------------------- no credential echoed


@pytest.fixture(scope="module")
def read_token(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    token = secrets.token_urlsafe(24)
    path = tmp_path_factory.mktemp("read-token") / "read-token"
    path.write_text(token + "\n")
    path.chmod(0o600)
    return path, token


@pytest.fixture
def two_token_server(tmp_path: Path, read_token: tuple[Path, str]) -> Iterator[ServerProcess]:
    """A fresh server (its log starts empty) with the write token and a read-only token."""
    srv = start(tmp_path, "--read-token-file", str(read_token[0]))
    yield srv
    srv.close()


def which_token(srv: ServerProcess, read_token: tuple[Path, str], kind: str) -> str:
    return srv.token if kind == "token" else read_token[1]


GET = b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\n"
BEARER = b"Authorization: Bearer "
Refused = tuple[str, Callable[[bytes], bytes], int, str]
# The requests that quoted their credential (issue "Before authentication a connection gets
# nothing"): (name, request for a token T, status, where the refusal says it struck).
ISSUE_REQUESTS: list[Refused] = [
    ("a bad byte in Authorization", lambda t: GET + BEARER + t + b"\x01\r\n\r\n", 400, "header Authorization"),
    ("9000 bytes after the token", lambda t: GET + BEARER + t + b"a" * 9000 + b"\r\n\r\n", 431, "header Authorization"),
    ("a bad char in ?token=", lambda t: b"GET /?token=" + t + b"\x01 HTTP/1.1\r\nHost: x\r\n\r\n", 400, "the request line"),
    ("bare LF line ends", lambda t: b"GET /v1 HTTP/1.1\nHost: x\n" + BEARER + t + b"\n\n", 400, "the request line"),
    ("PRI then Authorization", lambda t: b"PRI * HTTP/1.1\r\n" + BEARER + t + b"\r\n\r\n", 400, "header Authorization"),
]
MORE_REQUESTS: list[Refused] = [
    ("a bad byte in the cookie", lambda t: GET + b"Cookie: rdzv_token=" + t + b"\x7f\r\n\r\n", 400, "header Cookie"),
    ("a NUL in Authorization", lambda t: GET + BEARER + t + b"\x00\r\n\r\n", 400, "header Authorization"),
    ("bare LF after a header", lambda t: GET + BEARER + t + b"\nX: y\n\n", 400, "header Authorization"),
    ("a long field after it", lambda t: GET + BEARER + t + b"\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n", 431, "a header"),
]


@pytest.mark.parametrize("kind", ["token", "read-only token"])
@pytest.mark.parametrize("requests", [ISSUE_REQUESTS, MORE_REQUESTS], ids=["the issue's requests", "more of them"])
def test_a_refused_request_never_quotes_its_credential_in_the_answer_or_the_log(
    two_token_server: ServerProcess,
    read_token: tuple[Path, str],
    kind: str,
    requests: list[Refused],
) -> None:
    srv = two_token_server
    token = which_token(srv, read_token, kind)
    secrets_ = (srv.token, read_token[1])
    for name, make, status, where in requests:
        data = exchange(srv.port, make(token.encode()))
        for secret in secrets_:
            assert secret.encode() not in data, name
        version, got, headers, body = parse(data)
        assert (version, got) == ("HTTP/1.1", status), (name, data[:300])
        assert body["error"] == ("headers_too_large" if status == 431 else "bad_request"), name
        assert where in body["message"], (name, body["message"])
        assert_hardened(headers)
    assert urllib.request.urlopen(srv.url + "/healthz", timeout=PATIENCE).status == 200  # it serves on
    log = srv.log_text()
    refusals = [line for line in log.splitlines() if "Refused an HTTP request" in line]
    assert len(refusals) == len(requests)  # each logged (fewer than the throttle's 5 per 10 s) ...
    for secret in secrets_:
        assert secret not in log  # ... and none quotes a credential
    assert "Traceback" not in log


@pytest.mark.parametrize(
    "request_for",
    [
        lambda t: GET + BEARER + t + b"\x01\r\n\r\n",
        lambda t: b"GET /?token=" + t + b"%\x1b HTTP/1.1\r\nHost: x\r\n\r\n",
        lambda t: b"GET /?token=" + t + b"%zz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",  # read: 401
    ],
    ids=["Authorization with one bad byte", "?token= with a bad escape", "?token= with a bad escape it reads"],
)
def test_a_token_with_one_bad_byte_never_reaches_the_log(
    two_token_server: ServerProcess, read_token: tuple[Path, str], request_for: Callable[[bytes], bytes]
) -> None:
    srv = two_token_server
    for token in (srv.token, read_token[1]):
        data = exchange(srv.port, request_for(token.encode()))
        assert parse(data)[1] in (400, 401)
        assert token.encode() not in data
    log = srv.log_text()
    assert srv.token not in log and read_token[1] not in log


# --------------------------------------------------------------------------- the head limit


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start(tmp_path_factory.mktemp("strangers"), "--max-head-bytes", "16384")
    yield srv
    srv.close()


def test_a_request_head_larger_than_max_head_bytes_is_431_headers_too_large(server: ServerProcess) -> None:
    fields = b"".join(b"X-Field-%d: %s\r\n" % (i, b"v" * 1000) for i in range(20))  # 20 KiB, each line fine
    version, status, headers, body = parse(exchange(server.port, GET + fields + b"\r\n"))
    assert (version, status, body["error"]) == ("HTTP/1.1", 431, "headers_too_large")
    assert "--max-head-bytes" in body["message"] and "16384" in body["message"]
    assert_hardened(headers)
    # Just under the limit, with the token: served.
    auth = BEARER + server.token.encode() + b"\r\nConnection: close\r\n"
    under = GET + auth + b"".join(b"X-Field-%d: %s\r\n" % (i, b"v" * 1000) for i in range(14)) + b"\r\n"
    assert len(under) < 16384
    assert parse(exchange(server.port, under))[1] == 200


def test_an_answer_to_a_connection_refused_at_the_door_carries_the_security_headers(
    server_factory: Callable[..., ServerProcess], opened: list[socket.socket]
) -> None:
    srv = server_factory(args=("--max-connections", "2"))
    job = new_job()
    with Client(srv.endpoint) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    for _ in range(2):  # two parked long-polls: nothing may be shed
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
        opened.append(sock)
        hello = frame([1, wire.HELLO_OP, "", {"token": srv.token}])
        sock.sendall(wire.STREAM_PREFACE + hello + frame([2, "get", job, {"key": "never", "timeout": PATIENCE}]))

    def refused() -> tuple[str, int, dict[str, str], Any] | None:  # once both connections count
        answer = parse(exchange(srv.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"))
        return answer if answer[1] == 429 else None

    version, status, headers, body = wait_until(refused, what="a third connection refused at the door")
    assert (version, status, body["error"]) == ("HTTP/1.1", 429, "too_many_connections")
    assert_hardened(headers)


# --------------------------------------------------------------------------- the pre-authentication share

STRANGERS = 300
STALLED_HEAD = 30 * 1024  # each stranger's head so far: under --max-head-bytes (32 KiB), never finished


@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A 16 MiB budget, 2 MiB of it (the default 1/8) for strangers; strangers live 30 s, so
    that the share, not the deadline, is what the test sees."""
    srv = start(
        tmp_path_factory.mktemp("crowded"),
        *("--max-value-bytes", str(9 * MiB), "--max-body-bytes", str(10 * MiB)),
        *("--max-buffered-bytes", str(16 * MiB), "--auth-timeout", "30"),
    )
    yield srv
    srv.close()


def stall_strangers(srv: ServerProcess, opened: list[socket.socket]) -> None:
    """STRANGERS connections, each sending STALLED_HEAD bytes of header fields, no token, no end."""
    line = b"X-Stuffing: " + b"s" * 7000 + b"\r\n"
    head = GET + line * (STALLED_HEAD // len(line)) + b"X-Stuffing: " + b"s" * 2000
    for _ in range(STRANGERS):
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
        opened.append(sock)
        with contextlib.suppress(OSError):  # shed already: its bytes were not wanted
            sock.sendall(head)


def test_300_strangers_stalled_in_their_heads_leave_an_authenticated_8_mb_set_its_room(
    crowded: ServerProcess, opened: list[socket.socket]
) -> None:
    srv = crowded
    job = new_job()
    value = b"v" * (8 * MiB)
    shed_before = metrics(srv).get('rdzv_connections_shed_total{reason="buffers_full"}', 0)
    with Client(srv.endpoint, retry_budget=0.0) as client:  # no retry may hide a refusal
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    stall_strangers(srv, opened)
    m = metrics(srv)
    assert 0 < m["rdzv_pre_auth_buffered_bytes"] <= m["rdzv_pre_auth_buffered_bytes_limit"] == 2 * MiB
    assert m['rdzv_connections_shed_total{reason="buffers_full"}'] > shed_before  # strangers were turned away

    with Client(srv.endpoint, retry_budget=0.0) as client:  # the stream
        client.set(job, "stream", value)
        assert client.get(job, "stream", timeout=1) == value

    async def over_http() -> bytes:
        async with AsyncClient(srv.endpoint, retry_budget=0.0) as aclient:
            await aclient.set(job, "http", value)
            return await aclient.get(job, "http", timeout=1)

    assert asyncio.run(over_http()) == value
    m = metrics(srv)
    assert m["rdzv_pre_auth_buffered_bytes"] <= 2 * MiB and m["rdzv_buffered_bytes"] <= 16 * MiB

    # A refused stranger read its answer: 429 buffers_full, with the security headers.
    answers = [sock for sock in opened if _readable(sock)]
    assert answers
    version, status, headers, body = parse(read_until_eof(answers[0]))
    assert (version, status, body["error"]) == ("HTTP/1.1", 429, "buffers_full")
    assert_hardened(headers)
    assert "Traceback" not in srv.log_text()


def _readable(sock: socket.socket) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


# --------------------------------------------------------------------------- the deadline to authenticate


@pytest.fixture(scope="module")
def deadline_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start(tmp_path_factory.mktemp("auth-deadline"), "--auth-timeout", str(SHORT))
    yield srv
    srv.close()


def test_a_stream_without_its_hello_is_closed_408_within_the_auth_timeout(
    deadline_server: ServerProcess, opened: list[socket.socket]
) -> None:
    srv = deadline_server
    before = metrics(srv).get('rdzv_connections_shed_total{reason="auth_timeout"}', 0)
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
    opened.append(sock)
    sock.sendall(wire.STREAM_PREFACE)
    frames = stream_frames(read_until_eof(sock, PATIENCE))  # raises if still open after our patience
    assert [(f[0], f[1], f[2]["error"]) for f in frames] == [(0, 408, "request_timeout")]
    assert "--auth-timeout" in frames[0][2]["message"]
    assert metrics(srv)['rdzv_connections_shed_total{reason="auth_timeout"}'] >= before + 1


def test_an_unfinished_http_head_without_a_token_is_closed_408_within_the_auth_timeout(
    deadline_server: ServerProcess, opened: list[socket.socket]
) -> None:
    srv = deadline_server
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
    opened.append(sock)
    sock.sendall(GET + b"X-Slow: ")
    version, status, headers, body = parse(read_until_eof(sock, PATIENCE))  # raises if still open after our patience
    assert (version, status, body["error"]) == ("HTTP/1.1", 408, "request_timeout")
    assert "--auth-timeout" in body["message"]
    assert_hardened(headers)


def test_a_token_holders_connection_outlives_the_auth_timeout(deadline_server: ServerProcess) -> None:
    srv = deadline_server
    job = new_job()
    with Client(srv.endpoint, retry_budget=0.0) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        shed_before = metrics(srv).get('rdzv_connections_shed_total{reason="auth_timeout"}', 0)
        idle_before = metrics(srv).get('rdzv_connections_shed_total{reason="idle_timeout"}', 0)
        time.sleep(3 * SHORT)  # its pooled, authenticated connection stays open meanwhile
        client.set(job, "k", "v")
    m = metrics(srv)
    assert m.get('rdzv_connections_shed_total{reason="auth_timeout"}', 0) == shed_before
    assert m.get('rdzv_connections_shed_total{reason="idle_timeout"}', 0) == idle_before
