"""Hostile and broken HTTP over raw sockets: requests aiohttp's own parser refuses, and
bytes that are not HTTP at all, against the real server process.

Every one is answered with the documented error shape (``{"error", "message"}``,
``Content-Type: application/json``) and a documented code and status; the server log gets
one short warning line per refusal, rate-limited, and never a traceback; the server serves
on."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from server_process import ServerProcess

from rdzv_client import wire

# Every refusal is answered and closed well within this.
PATIENCE = 10.0
# The server logs this many refusal lines per interval, then one summary line.
LOG_BURST = 5


@dataclasses.dataclass(frozen=True)
class Hostile:
    name: str
    raw: bytes
    status: int
    code: str
    # Refused by an operation's handler, after auth: the request carries the token, so the
    # refusal is the media type's and not the missing token's. (aiohttp's parser refuses the
    # others before any handler runs, token or not.)
    authenticated: bool = False

    def with_token(self, token: str) -> bytes:
        if not self.authenticated:
            return self.raw
        return self.raw.replace(b"\r\nHost: x\r\n", f"\r\nHost: x\r\nAuthorization: Bearer {token}\r\n".encode(), 1)


def post(path: str, *headers: str, body: bytes = b"{}") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


OP = "/v1/jobs/hostile/num_keys"
TLS_CLIENT_HELLO = bytes.fromhex("16030100a5010000a10303") + bytes(32) + b"\x00\x00\x02\x13\x01\x01\x00"

HOSTILE = [
    Hostile(
        "Content-Length not a number",
        post(OP, "Content-Length: abc", "Content-Type: application/json"),
        400,
        "bad_request",
    ),
    Hostile(
        "negative Content-Length", post(OP, "Content-Length: -2", "Content-Type: application/json"), 400, "bad_request"
    ),
    Hostile("two different Content-Lengths", post(OP, "Content-Length: 2", "Content-Length: 3"), 400, "bad_request"),
    Hostile("no Host header", b"GET /healthz HTTP/1.1\r\n\r\n", 400, "bad_request"),
    Hostile("bare LF line ends", b"GET /healthz HTTP/1.1\nHost: x\n\n", 400, "bad_request"),
    Hostile("unknown method", b"FOO / HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request"),
    Hostile("not HTTP at all", b"\x16\x17garbage\r\n\r\n", 400, "bad_request"),
    Hostile("TLS ClientHello on the plain port", TLS_CLIENT_HELLO, 400, "bad_request"),
    Hostile("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, "bad_request"),
    Hostile(
        "an 8 KiB header",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n",
        431,
        "headers_too_large",
    ),
    Hostile(
        "an 8 KiB request line", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431, "headers_too_large"
    ),
    Hostile(
        "200 header fields",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n",
        431,
        "headers_too_large",
    ),
    Hostile(
        "Content-Length with Transfer-Encoding",
        post(
            OP, "Content-Length: 5", "Transfer-Encoding: chunked", "Content-Type: application/json", body=b"0\r\n\r\n"
        ),
        400,
        "bad_request",
    ),
    Hostile(
        "a bad chunk size",
        post(OP, "Transfer-Encoding: chunked", "Content-Type: application/json", body=b"zz\r\n"),
        400,
        "bad_request",
    ),
    Hostile("a NUL in a header value", b"GET /healthz HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", 400, "bad_request"),
    Hostile("a header without a colon", b"GET /healthz HTTP/1.1\r\nHost: x\r\nnocolon\r\n\r\n", 400, "bad_request"),
    Hostile(
        "Expect: bogus",
        post(OP, "Expect: bogus", "Content-Type: application/json", "Content-Length: 2", "Connection: close"),
        417,
        "expectation_failed",
    ),
    Hostile(
        "form post",
        post(OP, "Content-Type: application/x-www-form-urlencoded", "Content-Length: 2", "Connection: close"),
        415,
        "unsupported_media_type",
        authenticated=True,
    ),
    # No Content-Type: what a cross-site fetch() sends; urllib cannot leave the header out.
    Hostile(
        "a body without Content-Type",
        post(OP, "Content-Length: 2", "Connection: close"),
        415,
        "unsupported_media_type",
        authenticated=True,
    ),
    Hostile(
        "no body and no Content-Type",
        post("/v1/jobs/hostile/close", "Content-Length: 0", "Connection: close", body=b""),
        415,
        "unsupported_media_type",
        authenticated=True,
    ),
]


def exchange(port: int, raw: bytes) -> tuple[int, str, Any]:
    """Send ``raw``; the status, Content-Type and JSON body of the one response."""
    with socket.create_connection(("127.0.0.1", port), timeout=PATIENCE) as sock:
        with contextlib.suppress(OSError):  # the server may answer and close before all is sent
            sock.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
            chunk = sock.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split()[1]), headers.get("content-type", ""), json.loads(body[: _length(data)])


def _length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("hostile-http"), durable=False)
    srv.start()
    yield srv
    srv.close()


@pytest.mark.parametrize("case", HOSTILE, ids=[c.name for c in HOSTILE])
def test_a_hostile_request_gets_a_documented_json_error(server: ServerProcess, case: Hostile) -> None:
    status, ctype, body = exchange(server.port, case.with_token(server.token))
    assert (status, ctype, body.get("error")) == (case.status, wire.CONTENT_TYPE_JSON, case.code)
    assert wire.HTTP_STATUS[wire.ErrorCode(case.code)] == status
    assert isinstance(body.get("message"), str) and body["message"]
    assert "Traceback" not in body["message"]


def test_refusals_are_logged_in_short_rate_limited_lines_without_tracebacks(server: ServerProcess) -> None:
    for _ in range(50):
        assert exchange(server.port, b"FOO / HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 400
    with urllib.request.urlopen(server.url + "/healthz", timeout=PATIENCE) as resp:
        assert resp.status == 200  # and it serves on
    log = server.log_text()
    assert "Traceback" not in log
    refusals = [line for line in log.splitlines() if "Refused an HTTP request" in line]
    assert len(refusals) <= 2 * LOG_BURST  # this test's 50, and the table's before it, in one or two intervals
    assert all(len(line) < 400 for line in log.splitlines())
    assert "aiohttp" not in log
