"""The stream protocol against the real server process, driven by a plain blocking socket.

The client here is written from the wire spec (``rdzv_client.wire``, "stream protocol"):
preface, 4-byte big-endian length, msgpack ``[tag, op, rdzv_id, fields]`` out and
``[tag, status, body]`` back. It checks what a user of the stream relies on: every reply
matches what HTTP answers for the same request, both protocols share one port and one
state, requests pipeline and long-polls do not block later requests, protocol errors are
answered before the connection closes, a dropped connection is a dead node, shutdown
answers parked long-polls, and acknowledged writes are durable."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import signal
import socket
import struct
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import psutil
import pytest
from raw_stream import FrameReader
from server_process import ServerProcess
from waiting import metrics

from rdzv_client import wire
from rdzv_server.api.stream import MAX_IN_FLIGHT
from rdzv_server.server import DRAIN_TIMEOUT

PREFACE = b"\x00RDZV1\r\n"
# Generous bound for "promptly": far below every hold and timeout the tests park on.
PROMPTLY = 3.0
DISCONNECT_GRACE = 0.5
# A long-poll's timeout far past a test socket's 10 s patience: when the reply comes in time,
# what the test did answered it, not the timeout.
LONGER_THAN_PATIENCE = 60.0
SMALL_VALUE_LIMIT = 1024
SMALL_BODY_LIMIT = 2048


def new_job() -> str:
    return f"stream-{uuid.uuid4().hex[:12]}"


# --------------------------------------------------------------------------- the client


@dataclasses.dataclass(frozen=True)
class Reply:
    tag: int
    status: int
    body: dict[str, Any]

    @property
    def error(self) -> Any:
        return self.body.get("error")


def encode_frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def hello_frame(tag: int, token: str) -> bytes:
    """The stream protocol's authentication frame (sent right after the preface)."""
    return encode_frame([tag, wire.HELLO_OP, "", {"token": token}])


class Stream:
    """One stream connection: ``call`` for request-reply, ``send``/``recv`` to pipeline.

    With a ``token`` it authenticates first (the hello, its 200 read), as every client does."""

    def __init__(
        self, host: str, port: int, *, preface: bytes = PREFACE, token: str | None = None, timeout: float = 10.0
    ) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._frames = FrameReader(self.sock)
        self._next_tag = 1
        if preface:
            self.sock.sendall(preface)
        if token is not None:
            welcome = self.call(wire.HELLO_OP, "", token=token)
            assert (welcome.status, welcome.body) == (200, {"access": "write", "one_way": ["beat"], "then_watch": ["join", "await_round"], "policy_version": 0}), welcome

    @classmethod
    def to(cls, srv: ServerProcess, **kwargs: Any) -> Stream:
        """A stream to ``srv``, authenticated with its token unless ``token=None`` is given."""
        kwargs.setdefault("token", srv.token)
        return cls("127.0.0.1", srv.port, **kwargs)

    def send(self, tag: int, op: str, rdzv_id: str, fields: dict[str, Any]) -> None:
        self.sock.sendall(encode_frame([tag, op, rdzv_id, fields]))

    def recv(self) -> Reply:
        tag, status, body = self._frames.recv()
        return Reply(tag, status, body)

    def call(self, op: str, rdzv_id: str, **fields: Any) -> Reply:
        tag = self._next_tag
        self._next_tag += 1
        self.send(tag, op, rdzv_id, fields)
        reply = self.recv()
        assert reply.tag == tag, reply
        return reply

    def ok(self, op: str, rdzv_id: str, **fields: Any) -> dict[str, Any]:
        reply = self.call(op, rdzv_id, **fields)
        assert reply.status == 200, reply
        return reply.body

    def nothing_within(self, seconds: float) -> bool:
        """True if no byte arrives within ``seconds`` (the request is parked, not answered)."""
        self.sock.settimeout(seconds)
        try:
            return not self._frames.buffered and not self.sock.recv(1, socket.MSG_PEEK)  # b"": closed, not parked
        except TimeoutError:
            return True
        finally:
            self.sock.settimeout(10.0)

    def at_eof(self) -> bool:
        """True once the server has closed its side (after any frames still unread)."""
        return not self._frames.buffered and self.sock.recv(1) == b""

    def reset(self) -> None:
        """Close abruptly with a reset, as the kernel does for a killed process with unread data."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def stream_to() -> Iterator[Callable[..., Stream]]:
    """Open streams to a server; every one is closed after the test."""
    opened: list[Stream] = []

    def open_stream(srv: ServerProcess, **kwargs: Any) -> Stream:
        opened.append(Stream.to(srv, **kwargs))
        return opened[-1]

    yield open_stream
    for s in opened:
        s.close()


# --------------------------------------------------------------------------- HTTP, for comparison


def http_op(srv: ServerProcess, rdzv_id: str, op: str, fields: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The same operation over HTTP (msgpack both ways): status and decoded body."""
    req = urllib.request.Request(
        srv.url + wire.op_path(urllib.parse.quote(rdzv_id, safe=""), op),
        data=msgpack.packb(fields, use_bin_type=True),
        headers={"Content-Type": wire.CONTENT_TYPE_MSGPACK, "Accept": wire.CONTENT_TYPE_MSGPACK, **srv.auth},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, msgpack.unpackb(resp.read(), raw=False)
    except urllib.error.HTTPError as err:
        with err:
            return err.code, msgpack.unpackb(err.read(), raw=False)


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), resp.read()


# --------------------------------------------------------------------------- servers

# The servers below serve every test of the module, and several tests kill nodes of the same
# made-up hosts (a.local ...): automatic quarantine, which counts a host's deaths across jobs,
# would let one test's deaths refuse the next test's joins.
SHARED = ("--quarantine-after", "0")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One memory-only server for the module (a start costs ~0.5 s); every test uses its own job."""
    srv = ServerProcess(tmp_path_factory.mktemp("stream-server"), durable=False, args=SHARED)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with 1 KiB values and 2 KiB bodies."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("stream-small"),
        durable=False,
        args=(*SHARED, "--max-value-bytes", str(SMALL_VALUE_LIMIT), "--max-body-bytes", str(SMALL_BODY_LIMIT)),
    )
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def grace_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with a short disconnect grace, for the fast death path."""
    srv = ServerProcess(
        tmp_path_factory.mktemp("stream-grace"), durable=False, args=(*SHARED, "--disconnect-grace", str(DISCONNECT_GRACE))
    )
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def job(server: ServerProcess) -> str:
    rdzv_id = new_job()
    status, body = http_op(server, rdzv_id, "create", {"min_nodes": 1, "max_nodes": 2})
    assert status == 200, body
    return rdzv_id


# --------------------------------------------------------------------------- operations


def test_set_then_get_returns_the_value(server: ServerProcess, job: str, stream_to: Callable[..., Stream]) -> None:
    s = stream_to(server)
    assert s.ok("set", job, key=b"k", value=b"\x00\xff raw") == {}
    assert s.ok("get", job, key=b"k") == {"found": True, "value": b"\x00\xff raw"}
    assert s.ok("get", job, key=b"missing") == {"found": False, "value": None}
    s.ok("set", job, key=b"k", value=b"")
    assert s.ok("get", job, key=b"k", timeout=1.0) == {"found": True, "value": b""}


def test_add_compare_set_and_multi_get_answer_as_over_http(
    server: ServerProcess, job: str, stream_to: Callable[..., Stream]
) -> None:
    s = stream_to(server)
    assert s.ok("add", job, key=b"n", amount=5) == {"value": 5}
    assert s.ok("add", job, key=b"n", amount=-7) == {"value": -2}
    assert s.ok("compare_set", job, key=b"c", expected=b"", desired=b"first") == {"value": b"first"}
    assert s.ok("compare_set", job, key=b"c", expected=b"wrong", desired=b"second") == {"value": b"first"}
    assert s.ok("compare_set", job, key=b"c", expected=b"first", desired=b"second") == {"value": b"second"}
    s.ok("multi_set", job, keys=[b"x", b"y"], values=[b"X", b"Y"])
    assert s.ok("multi_get", job, keys=[b"x", b"y", b"n"]) == {"found": True, "values": [b"X", b"Y", b"-2"]}
    assert s.ok("check", job, keys=[b"x", b"nope"]) == {"result": False}
    assert s.ok("num_keys", job) == {"count": 4}
    # The same reads over HTTP give the same bodies.
    assert http_op(server, job, "multi_get", {"keys": [b"x", b"y", b"n"]}) == (200, s.ok("multi_get", job, keys=[b"x", b"y", b"n"]))


@pytest.mark.parametrize(
    ("op", "rdzv_id", "fields", "status", "code"),
    [
        ("get", "no-such-job", {"key": b"k"}, 404, "job_not_found"),
        ("get", "JOB", {"key": b""}, 400, "bad_request"),
        ("get", "JOB", {"key": b"k", "timeout": -1}, 400, "bad_request"),
        ("set", "JOB", {"key": b"k"}, 400, "bad_request"),
        ("set", "JOB", {"key": b"k", "value": b"v", "colour": "red"}, 400, "bad_request"),
        ("get", "bad id", {"key": b"k"}, 400, "invalid_id"),
        ("add", "JOB", {"key": b"text", "amount": 1}, 409, "not_an_integer"),
        ("close", "JOB", {"rid": ["c", "not a seq"]}, 400, "bad_request"),
        ("no_such_op", "JOB", {}, 404, "not_found"),
    ],
)
def test_errors_have_the_http_status_and_code_and_the_connection_stays_usable(
    server: ServerProcess,
    job: str,
    stream_to: Callable[..., Stream],
    op: str,
    rdzv_id: str,
    fields: dict[str, Any],
    status: int,
    code: str,
) -> None:
    rdzv_id = job if rdzv_id == "JOB" else rdzv_id
    s = stream_to(server)
    s.ok("set", job, key=b"text", value=b"not a number")
    reply = s.call(op, rdzv_id, **fields)
    assert (reply.status, reply.error) == (status, code), reply
    assert isinstance(reply.body["message"], str) and reply.body["message"]
    assert "Traceback" not in reply.body["message"]
    http_status, http_body = http_op(server, rdzv_id, op, fields)
    assert (http_status, http_body.get("error")) == (status, code), http_body
    # The connection still serves.
    s.ok("set", job, key=b"after", value=b"fine")
    assert s.ok("get", job, key=b"after") == {"found": True, "value": b"fine"}


# --------------------------------------------------------------------------- one port, two protocols


def test_writes_are_shared_between_stream_and_http_on_the_same_port(
    server: ServerProcess, job: str, stream_to: Callable[..., Stream]
) -> None:
    s = stream_to(server)
    s.ok("set", job, key=b"from-stream", value=b"s")
    assert http_op(server, job, "get", {"key": b"from-stream"}) == (200, {"found": True, "value": b"s"})
    assert http_op(server, job, "set", {"key": b"from-http", "value": b"h"}) == (200, {})
    assert s.ok("get", job, key=b"from-http") == {"found": True, "value": b"h"}
    # A long-poll on the stream is woken by a write over HTTP (its timeout is far past the
    # socket's 10 s patience: only the write can answer it in time).
    s.send(77, "get", job, {"key": b"later", "timeout": LONGER_THAN_PATIENCE})
    assert s.nothing_within(0.3)
    http_op(server, job, "set", {"key": b"later", "value": b"woken"})
    assert s.recv() == Reply(77, 200, {"found": True, "value": b"woken"})


def test_http_routes_and_keep_alive_still_work_on_the_port(server: ServerProcess, job: str) -> None:
    status, _, body = http_get(server.url + "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    status, _, body = http_get(server.url + "/v1/jobs", server.auth)
    assert status == 200 and job in {j["rdzv_id"] for j in json.loads(body)["jobs"]}
    status, ctype, body = http_get(server.url + "/")
    assert status == 200 and ctype.startswith("text/html") and b"<html" in body.lower()
    status, _, body = http_get(server.url + "/metrics")
    assert status == 200 and b"rdzv_requests_total" in body
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        ports = set()
        for _ in range(3):
            conn.request("GET", "/healthz")
            resp = conn.getresponse()
            assert resp.status == 200 and json.loads(resp.read()) == {"status": "ok"}
            assert conn.sock is not None
            ports.add(conn.sock.getsockname()[1])
        assert len(ports) == 1  # one kept-alive connection served all three
    finally:
        conn.close()


def test_stream_operations_are_counted_in_the_metrics(server: ServerProcess, job: str, stream_to: Callable[..., Stream]) -> None:
    def sample(series: str) -> float:
        text = http_get(server.url + "/metrics")[2].decode()
        found = [line for line in text.splitlines() if line.startswith(series + " ")]
        return float(found[0].split()[1]) if found else 0.0

    ok, err = 'rdzv_requests_total{code="ok",op="list_keys"}', 'rdzv_requests_total{code="invalid_id",op="list_keys"}'
    timed = 'rdzv_request_seconds_count{op="list_keys"}'
    before = {series: sample(series) for series in (ok, err, timed)}
    s = stream_to(server)
    for _ in range(3):
        s.ok("list_keys", job)
    assert s.call("list_keys", "bad id").status == 400
    assert sample(ok) == before[ok] + 3
    assert sample(err) == before[err] + 1
    assert sample(timed) == before[timed] + 4


# --------------------------------------------------------------------------- pipelining


def test_a_hundred_pipelined_requests_get_a_hundred_replies_with_their_tags(
    server: ServerProcess, job: str, stream_to: Callable[..., Stream]
) -> None:
    s = stream_to(server)
    tags = range(1000, 1100)
    s.sock.sendall(b"".join(encode_frame([tag, "add", job, {"key": b"n", "amount": 1}]) for tag in tags))
    replies = [s.recv() for _ in tags]
    assert sorted(r.tag for r in replies) == list(tags)
    assert all(r.status == 200 for r in replies)
    assert sorted(r.body["value"] for r in replies) == list(range(1, 101))  # each applied once


def test_a_parked_get_does_not_block_a_later_set_on_the_same_connection(
    server: ServerProcess, job: str, stream_to: Callable[..., Stream]
) -> None:
    s = stream_to(server)
    s.send(1, "get", job, {"key": b"parked", "timeout": LONGER_THAN_PATIENCE})
    s.send(2, "set", job, {"key": b"parked", "value": b"here"})
    first, second = s.recv(), s.recv()  # within the socket's patience: woken by the set, not its timeout
    assert first == Reply(2, 200, {})
    assert second == Reply(1, 200, {"found": True, "value": b"here"})


def test_requests_in_one_read_apply_in_order_a_join_then_a_set_on_the_job_it_created(
    server: ServerProcess, stream_to: Callable[..., Stream]
) -> None:
    """A join parks (waiting for its round) but is applied where it stands among the frames of
    its read: the set behind it finds the job the join created."""
    job = new_job()
    s = stream_to(server)
    settings = {"nproc_per_node": 1, "min_nodes": 2, "max_nodes": 2, "hold": 0.5}
    join = encode_frame([1, "join", job, {"node_id": "a", "addr": "a.local", **settings}])
    s.sock.sendall(join + encode_frame([2, "set", job, {"key": b"k", "value": b"v"}]))
    assert s.recv() == Reply(2, 200, {})
    joined = s.recv()
    assert (joined.tag, joined.status, joined.body["assignment"]) == (1, 200, None)  # no round: one node of two


def test_frames_split_across_reads_and_many_in_one_read_are_all_served(
    server: ServerProcess, job: str, stream_to: Callable[..., Stream]
) -> None:
    s = stream_to(server, preface=b"", token=None)
    data = (
        PREFACE
        + hello_frame(3, server.token)
        + encode_frame([1, "set", job, {"key": b"k", "value": b"v" * 300}])
        + encode_frame([2, "get", job, {"key": b"k"}])
    )
    for i in range(0, len(data), 7):  # preface, hello and frames cut mid-header and mid-body
        s.sock.sendall(data[i : i + 7])
        time.sleep(0.002)
    assert s.recv() == Reply(3, 200, {"access": "write", "one_way": ["beat"], "then_watch": ["join", "await_round"], "policy_version": 0})
    assert s.recv() == Reply(1, 200, {})
    assert s.recv() == Reply(2, 200, {"found": True, "value": b"v" * 300})
    # Then many frames and half of the next in one write; the rest in another.
    batch = b"".join(encode_frame([10 + i, "get", job, {"key": b"k"}]) for i in range(50))
    tail = encode_frame([99, "num_keys", job, {}])
    s.sock.sendall(batch + tail[:5])
    time.sleep(0.05)
    s.sock.sendall(tail[5:])
    replies = [s.recv() for _ in range(51)]
    assert sorted(r.tag for r in replies) == [*range(10, 60), 99]
    assert all(r.status == 200 for r in replies)


def test_a_connection_runs_a_bounded_number_of_requests_at_once_and_answers_them_all(
    server: ServerProcess, job: str, stream_to: Callable[..., Stream]
) -> None:
    def parked() -> float:
        text = http_get(server.url + "/metrics")[2].decode()
        (line,) = [line for line in text.splitlines() if line.startswith("rdzv_waiters ")]
        return float(line.split()[1])

    baseline = parked()
    s = stream_to(server)
    count = MAX_IN_FLIGHT + 500
    s.sock.sendall(b"".join(encode_frame([i, "get", job, {"key": b"gate", "timeout": 20.0}]) for i in range(count)))
    deadline = time.monotonic() + PROMPTLY
    while parked() < baseline + MAX_IN_FLIGHT and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # give the server the chance to read more than it should
    assert parked() == baseline + MAX_IN_FLIGHT
    other = stream_to(server)
    other.ok("set", job, key=b"gate", value=b"open")
    replies = [s.recv() for _ in range(count)]
    assert sorted(r.tag for r in replies) == list(range(count))
    assert all(r.body == {"found": True, "value": b"open"} for r in replies)


def test_a_client_that_reads_late_stops_being_read_and_gets_every_reply(
    server: ServerProcess, job: str, stream_to: Callable[..., Stream]
) -> None:
    value = b"x" * 20_000
    count = 10_000  # 200 MB of replies if the server buffered them all
    s = stream_to(server)
    s.ok("set", job, key=b"big", value=value)
    proc = psutil.Process(server.proc.pid if server.proc else 0)
    rss_before = proc.memory_info().rss
    request = [encode_frame([i, "get", job, {"key": b"big"}]) for i in range(count)]
    sender = threading.Thread(target=lambda: s.sock.sendall(b"".join(request)), daemon=True)
    sender.start()
    time.sleep(1.5)  # the client does not read: the server must stop reading, not buffer
    grown = proc.memory_info().rss - rss_before
    assert grown < 100_000_000, f"the server buffered {grown / 1e6:.0f} MB of replies"
    tags = set()
    for _ in range(count):
        reply = s.recv()
        assert reply.status == 200 and reply.body["value"] == value
        tags.add(reply.tag)
    sender.join(10)
    assert tags == set(range(count))


# --------------------------------------------------------------------------- protocol errors


def test_a_wrong_preface_is_answered_with_a_400_then_the_connection_closes(
    server: ServerProcess, stream_to: Callable[..., Stream]
) -> None:
    for preface in (b"\x00RDZV9\r\n", b"\x00\x00\x00\x10garbage!"):
        s = stream_to(server, preface=preface, token=None)
        reply = s.recv()
        assert (reply.tag, reply.status, reply.error) == (0, 400, "bad_request"), reply
        assert s.at_eof()


def test_an_oversized_frame_is_answered_with_a_413_then_the_connection_closes(
    small_server: ServerProcess, stream_to: Callable[..., Stream]
) -> None:
    job = new_job()
    s = stream_to(small_server)
    s.ok("create", job)
    s.ok("set", job, key=b"k", value=b"v" * SMALL_VALUE_LIMIT)  # at the limit: served
    # A header announcing far more than the limit, whose body the client still sends.
    s.sock.sendall(struct.pack(">I", 200_000) + b"\x93" + b"\x00" * 100_000)
    reply = s.recv()
    assert (reply.tag, reply.status, reply.error) == (0, 413, "body_too_large"), reply
    with contextlib.suppress(ConnectionResetError):  # it may go on discarding, or reset later
        assert s.at_eof()
    # The value at the limit was kept; nothing of the oversized frame was applied.
    assert http_op(small_server, job, "num_keys", {}) == (200, {"count": 1})


def test_a_value_over_the_limit_in_a_frame_under_the_limit_is_a_413_and_the_connection_serves_on(
    small_server: ServerProcess, stream_to: Callable[..., Stream]
) -> None:
    job = new_job()
    s = stream_to(small_server)
    s.ok("create", job)
    reply = s.call("set", job, key=b"k", value=b"v" * (SMALL_VALUE_LIMIT + 1))
    assert (reply.status, reply.error) == (413, "value_too_large"), reply
    assert s.ok("num_keys", job) == {"count": 0}


def test_garbage_msgpack_is_a_400_with_tag_0_and_the_connection_serves_on(
    server: ServerProcess, job: str, stream_to: Callable[..., Stream]
) -> None:
    s = stream_to(server)
    for payload in (b"\xc1", b"\x94\x01", b"\x91\x01\x02"):  # never-used byte, truncated, trailing bytes
        s.sock.sendall(struct.pack(">I", len(payload)) + payload)
        reply = s.recv()
        assert (reply.tag, reply.status, reply.error) == (0, 400, "bad_request"), (payload, reply)
    s.sock.sendall(struct.pack(">I", 0))  # an empty frame
    assert s.recv().status == 400
    s.ok("set", job, key=b"k", value=b"still serving")
    assert s.ok("get", job, key=b"k") == {"found": True, "value": b"still serving"}


@pytest.mark.parametrize(
    ("request_", "tag"),
    [
        ([7, "get", "JOB"], 7),  # three elements
        ([8, "get", "JOB", {"key": b"k"}, "extra"], 8),
        ([9, 5, "JOB", {}], 9),  # op not a string
        ([10, "get", 5, {}], 10),  # rdzv_id not a string
        ([11, "get", "JOB", [b"k"]], 11),  # fields not a map
        ([-1, "get", "JOB", {"key": b"k"}], 0),  # a tag out of range is not a tag
        ([2**63, "get", "JOB", {"key": b"k"}], 0),
        ([True, "get", "JOB", {"key": b"k"}], 0),
        (["12", "get", "JOB", {"key": b"k"}], 0),
        ({"tag": 13}, 0),
        ([], 0),
    ],
)
def test_a_frame_of_the_wrong_shape_is_a_400_with_its_tag(
    server: ServerProcess, job: str, stream_to: Callable[..., Stream], request_: Any, tag: int
) -> None:
    s = stream_to(server)
    if isinstance(request_, list):
        request_ = [job if x == "JOB" else x for x in request_]
    s.sock.sendall(encode_frame(request_))
    reply = s.recv()
    assert (reply.tag, reply.status, reply.error) == (tag, 400, "bad_request"), reply
    assert s.ok("num_keys", job) == {"count": 0}


# --------------------------------------------------------------------------- liveness


def join_two(srv: ServerProcess, stream_to: Callable[..., Stream], job: str) -> tuple[Stream, Stream, int]:
    """Nodes "a" and "b" join a 2-node job, each on its own stream; the formed round."""
    a, b = stream_to(srv), stream_to(srv)
    settings = {"nproc_per_node": 1, "min_nodes": 2, "max_nodes": 2, "heartbeat_ttl": 30.0, "hold": 10.0}
    a.send(1, "join", job, {"node_id": "a", "addr": "a.local", **settings})
    b.send(1, "join", job, {"node_id": "b", "addr": "b.local", **settings})
    got_a, got_b = a.recv(), b.recv()
    assert got_a.status == got_b.status == 200, (got_a, got_b)
    assert got_a.body["assignment"] is not None and got_b.body["assignment"] is not None
    return a, b, got_a.body["round"]


def nodes_alive(srv: ServerProcess, job: str) -> dict[str, bool]:
    body = http_get(srv.url + f"/v1/jobs/{job}", srv.auth)[2]
    return {n["node_id"]: n["alive"] for n in json.loads(body)["nodes"]}


@pytest.mark.parametrize("how", ["reset", "fin"])
def test_a_dropped_stream_with_a_parked_watch_marks_the_node_dead_within_the_grace(
    grace_server: ServerProcess, stream_to: Callable[..., Stream], how: str
) -> None:
    job = new_job()
    a, b, round_ = join_two(grace_server, stream_to, job)
    a.send(5, "watch", job, {"node_id": "a", "round": round_, "known": 0, "hold": 10.0})
    assert a.nothing_within(0.3), "the watch was answered at once, not held"
    a.reset() if how == "reset" else a.close()  # the agent died: its kernel closes the socket
    started = time.monotonic()
    while True:
        seen = b.ok("watch", job, node_id="b", round=round_, known=0, hold=max(0.0, 10.0 - (time.monotonic() - started)))
        if seen["num_nodes_waiting"] > 0 or time.monotonic() - started > 10.0:
            break
    assert seen["num_nodes_waiting"] == 1
    assert nodes_alive(grace_server, job) == {"a": False, "b": True}
    assert departure_cause(grace_server, job, "a") == "connection_closed"  # the grace, not the 30 s TTL


def departure_cause(srv: ServerProcess, job: str, node: str) -> str:
    """Why the server says ``node`` departed (its timeline's one ``node_departed`` about it)."""
    events = json.loads(http_get(srv.url + f"/v1/jobs/{job}/events", srv.auth)[2])["events"]
    (departed,) = [e for e in events if e["kind"] == "node_departed" and e["node_id"] == node]
    return str(departed["cause"])


def test_a_watch_cut_short_by_a_fatal_frame_in_the_same_read_still_counts_as_a_dropped_poll(
    grace_server: ServerProcess, stream_to: Callable[..., Stream]
) -> None:
    """A watch and, in the same read, a header over the frame limit (413, the connection
    closes): the watch was received, so the node held a poll that dropped, and is marked dead
    within the grace as any node whose watch connection drops."""
    job = new_job()
    a, b, round_ = join_two(grace_server, stream_to, job)
    watch = encode_frame([5, "watch", job, {"node_id": "a", "round": round_, "known": 0, "hold": 10.0}])
    a.sock.sendall(watch + struct.pack(">I", 1 << 30))
    reply = a.recv()
    assert (reply.tag, reply.status, reply.error) == (0, 413, "body_too_large"), reply
    started = time.monotonic()
    while True:
        seen = b.ok("watch", job, node_id="b", round=round_, known=0, hold=max(0.0, 10.0 - (time.monotonic() - started)))
        if seen["num_nodes_waiting"] > 0 or time.monotonic() - started > 10.0:
            break
    assert seen["num_nodes_waiting"] == 1
    assert nodes_alive(grace_server, job) == {"a": False, "b": True}


def test_a_watch_answered_on_a_live_stream_keeps_the_node_alive(
    grace_server: ServerProcess, stream_to: Callable[..., Stream]
) -> None:
    job = new_job()
    a, b, round_ = join_two(grace_server, stream_to, job)
    for _ in range(3):  # watches that end by their hold, connection kept: no death
        seen = a.ok("watch", job, node_id="a", round=round_, known=0, hold=0.3)
        assert seen["num_nodes_waiting"] == 0
    time.sleep(DISCONNECT_GRACE + 0.5)
    assert b.ok("watch", job, node_id="b", round=round_, known=0, hold=0.0)["num_nodes_waiting"] == 0
    assert nodes_alive(grace_server, job) == {"a": True, "b": True}


def test_a_beat_is_answered_only_when_refused_and_beats_its_node(
    server: ServerProcess, stream_to: Callable[..., Stream]
) -> None:
    """The hello says the server takes beats one-way; a beat taken gets no reply (the request
    behind it is answered first), and counts: its step is the job's; one refused gets its tag
    and the error, as any request, and the connection serves on. Over HTTP a beat answers {}."""
    job = new_job()
    a, _, round_ = join_two(server, stream_to, job)
    taken = metrics(server).get(BEATS_TAKEN, 0.0)
    beat = {"node_id": "a", "round": round_, "step": 41}
    a.send(7, "beat", job, beat)
    a.send(7, "beat", job, {**beat, "step": 42})
    a.send(7, "beat", job, {**beat, "step": 42})  # the same bytes again
    a.send(8, "beat", "no-such-job", {"node_id": "a", "round": 0})
    a.send(9, "beat", job, {"node_id": "a", "round": round_, "hold": 1.0})  # not a beat's field
    a.send(10, "num_keys", job, {})
    replies = [a.recv() for _ in range(3)]
    assert [(r.tag, r.status, r.error) for r in replies] == [
        (8, 404, "job_not_found"), (9, 400, "bad_request"), (10, 200, None)
    ]
    assert http_op(server, job, "beat", {"node_id": "b", "round": round_}) == (200, {})
    document = json.loads(http_get(server.url + f"/v1/jobs/{job}", server.auth)[2])
    assert [s[1:] for s in document["steps"]] == [[round_, 41], [round_, 42]]
    assert metrics(server)[BEATS_TAKEN] == taken + 3 + 1  # the stream's three and the HTTP one


BEATS_TAKEN = 'rdzv_requests_total{code="ok",op="beat"}'


# --------------------------------------------------------------------------- shutdown and durability


def test_sigterm_answers_a_parked_long_poll_with_503_then_closes_and_exits_zero(
    server_factory: Callable[..., ServerProcess], stream_to: Callable[..., Stream]
) -> None:
    srv = server_factory()
    job = new_job()
    s = stream_to(srv)
    s.ok("create", job)
    s.send(42, "get", job, {"key": b"never-set", "timeout": LONGER_THAN_PATIENCE})
    assert s.nothing_within(0.3)
    assert srv.proc is not None
    srv.proc.send_signal(signal.SIGTERM)
    reply = s.recv()  # within the socket's patience: not the poll's timeout
    assert (reply.tag, reply.status, reply.error) == (42, 503, "shutting_down"), reply
    assert s.at_eof()
    assert srv.proc.wait(DRAIN_TIMEOUT / 2) == 0  # nothing left to drain: it does not wait out the drain timeout


def test_writes_acknowledged_over_the_stream_survive_a_crash(
    durable_server: ServerProcess, stream_to: Callable[..., Stream]
) -> None:
    job = new_job()
    s = stream_to(durable_server)
    s.ok("create", job)
    for i in range(50):
        s.send(i, "set", job, {"key": f"k/{i}".encode(), "value": f"v{i}".encode()})
    assert sorted(s.recv().tag for _ in range(50)) == list(range(50))
    assert s.ok("add", job, key=b"n", amount=7) == {"value": 7}
    s.close()
    durable_server.restart()  # SIGKILL, then start on the same port and data dir
    again = stream_to(durable_server)
    assert again.ok("multi_get", job, keys=[f"k/{i}".encode() for i in range(50)])["values"] == [
        f"v{i}".encode() for i in range(50)
    ]
    assert again.ok("get", job, key=b"n") == {"found": True, "value": b"7"}


def test_the_stream_is_served_on_an_ipv6_host(server_factory: Callable[..., ServerProcess]) -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    srv = server_factory(args=("--host", "::1"))
    s = Stream("::1", srv.port, token=srv.token)
    try:
        job = new_job()
        s.ok("create", job)
        s.ok("set", job, key=b"k", value=b"v6")
        assert s.ok("get", job, key=b"k") == {"found": True, "value": b"v6"}
        status, _, body = http_get(f"http://[::1]:{srv.port}/healthz")
        assert status == 200 and json.loads(body) == {"status": "ok"}
    finally:
        s.close()
