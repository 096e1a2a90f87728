"""Hostile input against the real server process: random bodies and frames on every route.

Authenticated (with the server's token), so the fuzz reaches the decoders and the service
behind them. Rules checked, for every request:
- the answer is a 200 or a documented error: a 4xx status, a JSON or msgpack body (as the
  request's Accept asks) ``{"error", "message"}`` whose code is a ``wire.ErrorCode`` with
  exactly that status; never a 5xx (a one-way beat on a stream the server takes has no answer:
  the request behind it is answered first);
- the connection keeps serving (HTTP keep-alive unless the server said ``Connection:
  close``; a stream connection after every well-framed frame), and so does the server;
- afterwards a canary job's keys are exactly as before, and the server log has no traceback.

Bodies: JSON and msgpack of random structures (any field names, types, sizes, huge numbers,
NaN, deep nesting, any Unicode, lone surrogates included), near-valid bodies of each
operation, garbage bytes, odd Content-Types. Frames: random ``[tag, op, rdzv_id, fields]``
of any types and random msgpack, then garbage after the preface. And systematically (the
random fuzz rarely makes one field hostile and the rest valid): each hostile value in each
field of each operation, over HTTP and the stream. One server serves the
module; a long-poll is held 0.05 s at most (``--max-hold``) so that the fuzz stays fast.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import math
import socket
import struct
import urllib.parse
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from raw_stream import FrameReader
from server_process import ServerProcess

from rdzv_client import wire

JSON = wire.CONTENT_TYPE_JSON
MSGPACK = wire.CONTENT_TYPE_MSGPACK
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
VALUE_LIMIT = 1024
BODY_LIMIT = 8192
# The server's frame limit: the body limit plus its FRAME_OVERHEAD for tag, op and id.
FRAME_LIMIT = BODY_LIMIT + 1024
TIMEOUT = 10.0
CANARY = "canary-job"
CANARY_KEYS = {b"canary": b"intact", b"counter": b"41", b"bin\x00\xff": b"\x00" * 100}
# Jobs the fuzz writes to: few, so that its requests meet each other's state (created,
# joined, closed jobs); never the canary.
FUZZ_JOBS = ("fuzz-a", "fuzz-b", "fuzz.c:1", "fuzz-closed")
PREFACE = wire.STREAM_PREFACE
ERROR_CODES = {code.value for code in wire.ErrorCode}

# --------------------------------------------------------------------------- strategies

HOSTILE_TEXT = (
    "\ud800", "a\udfffb", "\x00", "\u202e", "<script>alert(1)</script>", "../../x", "%2e%2e", "é" * 300,
    "x" * 3000, "", " ", "node-1", "10.0.0.1", "NaN", "__proto__", "constructor",
)  # fmt: skip
TEXT = st.one_of(st.text(st.characters(exclude_categories=()), max_size=20), st.sampled_from(HOSTILE_TEXT))
PLAIN_TEXT = st.one_of(st.text(max_size=20), st.sampled_from([t for t in HOSTILE_TEXT if t.isprintable() or t == ""]))
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, 1, 65536, 65537, 1_000_001, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-0.0, 1e308, 5e-324, math.inf, -math.inf, math.nan]),
)
JSON_NUMBERS = st.one_of(NUMBERS, st.sampled_from([10**400, -(10**400)]))  # JSON has no size limit
MSGPACK_NUMBERS = st.one_of(
    st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([2**64 - 1, -(2**63)])
)


def tree(leaves: st.SearchStrategy[Any], keys: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.recursive(
        leaves,
        lambda inner: st.one_of(st.lists(inner, max_size=6), st.dictionaries(keys, inner, max_size=6)),
        max_leaves=25,
    )


JSON_VALUES = tree(st.one_of(st.none(), st.booleans(), JSON_NUMBERS, TEXT), TEXT)
MSGPACK_VALUES = tree(
    st.one_of(st.none(), st.booleans(), MSGPACK_NUMBERS, PLAIN_TEXT, st.binary(max_size=64)),
    st.one_of(PLAIN_TEXT, st.binary(max_size=8)),
)

#: A valid body of every operation; the fuzz changes a few of its fields.
VALID: dict[str, dict[str, Any]] = {
    "set": {"key": "k", "value": "v"},
    "get": {"key": "k"},
    "add": {"key": "n", "amount": 1},
    "compare_set": {"key": "k", "expected": "", "desired": "d"},
    "append": {"key": "k", "value": "v"},
    "multi_get": {"keys": ["a"]},
    "multi_set": {"keys": ["a"], "values": ["b"]},
    "check": {"keys": ["a"]},
    "wait": {"keys": ["a"]},
    "delete_key": {"key": "k"},
    "num_keys": {},
    "list_keys": {},
    "create": {"min_nodes": 1, "max_nodes": 2},
    "join": {"node_id": "n1", "addr": "10.0.0.1", "nproc_per_node": 1, "min_nodes": 1, "max_nodes": 2},
    "await_round": {"node_id": "n1", "round": 0},
    "watch": {"node_id": "n1", "round": 0},
    "beat": {"node_id": "n1", "round": 0},
    "leave": {"node_id": "n1"},
    "close": {},
    "refuse": {"node_id": "n1", "addr": "10.0.0.1", "cause": "health_check_failed", "detail": "ECC"},
    "policy": {},
}
OPS = sorted(wire.REQUESTS)


# Values some field accepts, or just misses (so that most changed bodies still decode and
# reach the service: its limits, its state machine, the log).
NEAR = [
    "k", "k2", "n1", "n2", "x" * (VALUE_LIMIT + 1), "10.0.0.2", "<img src=x onerror=alert(1)>", "", 0, 1, 2, 3, -1,
    0.01, 1e9, 65536, 65537, ["a", "b"], ["a"] * 3, [], ["client-1", 1], ["client-1", 1, 2], ["client-1", 2**63], True, None,
]  # fmt: skip
MSGPACK_NEAR = st.sampled_from([*NEAR, b"k", [b"a", b"b"]])
# JSON's "\ud800" escapes decode to text msgpack (the log) cannot encode.
JSON_NEAR = st.sampled_from([*NEAR, "\ud800", "10.0.0.1\udfff", ["c\ud800", 1]])


@st.composite
def near_valid(draw: st.DrawFn, op: str, values: st.SearchStrategy[Any], near: st.SearchStrategy[Any]) -> dict[str, Any]:
    """``op``'s valid body with up to three fields replaced (or added) by near or random values."""
    fields = dict(VALID[op])
    names = sorted({*fields, "key", "keys", "value", "values", "timeout", "hold", "round", "rid", "node_id", "addr"})
    for name in draw(st.lists(st.sampled_from(names), max_size=3, unique=True)):
        fields[name] = draw(mostly(near, values, one_in=3))
    return fields


def mostly(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], one_in: int = 5) -> st.SearchStrategy[Any]:
    """``common``, and one time in ``one_in`` ``rare`` (st.one_of does not weigh its branches)."""
    return st.sampled_from(range(one_in)).flatmap(lambda i: rare if i == 0 else common)


# Mostly the real jobs and operations, sometimes anything.
ROUTE_IDS = mostly(st.sampled_from(FUZZ_JOBS), TEXT.filter(lambda t: t != CANARY))
ROUTE_OPS = mostly(st.sampled_from(OPS), st.sampled_from(["hello", "Set", "join/", "x" * 300]), one_in=10)
CONTENT_TYPES = st.sampled_from(
    [JSON] * 4 + [MSGPACK] * 4 + [f"{JSON}; charset=utf-8", f"{MSGPACK}; q=1", "text/plain", "", "application/x-www-form-urlencoded"]
)


@dataclasses.dataclass(frozen=True)
class Body:
    content_type: str
    data: bytes


@st.composite
def bodies(draw: st.DrawFn, op: str) -> Body:
    """A request body for ``op``: structured (JSON or msgpack), near-valid, huge, deep or garbage."""
    ctype = draw(CONTENT_TYPES)
    as_msgpack = ctype.startswith(MSGPACK)
    values, near = (MSGPACK_VALUES, MSGPACK_NEAR) if as_msgpack else (JSON_VALUES, JSON_NEAR)
    kind = draw(st.sampled_from(["near-valid"] * 6 + ["any", "garbage", "deep", "big"]))
    if kind == "garbage":
        return Body(ctype, draw(st.binary(max_size=200)))
    if kind == "deep":
        depth = draw(st.sampled_from([100, 1000, 100_000]))
        data = b"\x91" * depth + b"\xc0" if as_msgpack else b'{"a":' * depth + b"1" + b"}" * depth
        return Body(ctype, data[: BODY_LIMIT * 2])
    if kind == "big":
        size = draw(st.sampled_from([VALUE_LIMIT, VALUE_LIMIT + 1, BODY_LIMIT - 64, BODY_LIMIT + 1]))
        obj: Any = {**VALID[op], "value": "v" * size, "key": "k" * min(size, 5000)}
    elif kind == "any":
        obj = draw(values)
    else:
        obj = draw(near_valid(op, values, near))
    return Body(ctype, msgpack.packb(obj, use_bin_type=True) if as_msgpack else json.dumps(obj).encode())


# --------------------------------------------------------------------------- the checks


def assert_documented(status: int, content_type: str, body: bytes, *, as_msgpack: bool) -> Any:
    """A 200, or a 4xx whose body is a documented error in the format asked for."""
    assert status < 500, (status, body[:300])
    assert content_type == (MSGPACK if as_msgpack else JSON), (status, content_type, body[:300])
    decoded = msgpack.unpackb(body, raw=False) if as_msgpack else json.loads(body)
    if status == 200:
        return decoded
    assert 400 <= status < 500, (status, decoded)
    assert isinstance(decoded, dict) and set(decoded) == {"error", "message"}, decoded
    assert decoded["error"] in ERROR_CODES, decoded
    assert wire.HTTP_STATUS[wire.ErrorCode(decoded["error"])] == status, (status, decoded)
    assert isinstance(decoded["message"], str) and decoded["message"], decoded
    return decoded


class Http:
    """One keep-alive connection; it may be reopened only after the server said it closes."""

    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv
        self.conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=TIMEOUT)
        self.conn.auto_open = 0  # a connection the server dropped unannounced is an error
        self.conn.connect()

    def request(self, method: str, path: str, body: Body | None, accept: str) -> tuple[int, str, bytes]:
        headers = {**self.srv.auth, "Accept": accept}
        if body is not None and body.content_type:
            headers["Content-Type"] = body.content_type
        self.conn.request(method, path, body=None if body is None else body.data, headers=headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.will_close:  # announced (an oversized body, say): a new connection is fine
            self.conn.close()
            self.conn.connect()
        return resp.status, resp.headers.get_content_type(), data

    def close(self) -> None:
        self.conn.close()


#: The tag of the request sent behind a one-way one, to tell "taken" from "not yet answered".
PROBE_TAG = 2**62 + 12345


class Stream:
    """One authenticated stream connection (wire "stream protocol")."""

    def __init__(self, srv: ServerProcess) -> None:
        self.sock = socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT)
        self.sock.sendall(PREFACE + wire.frame([1, wire.HELLO_OP, "", {"token": srv.token}]))
        self._frames = FrameReader(self.sock)
        assert self.recv() == [1, 200, {"access": "write", "one_way": ["beat"], "then_watch": ["join", "await_round"], "policy_version": 0}]

    def send_payload(self, payload: bytes) -> None:
        self.sock.sendall(struct.pack(">I", len(payload)) + payload)

    def recv(self) -> Any:
        return self._frames.recv()

    def answer(self, payload: bytes, tag: int | None, *, one_way: bool) -> Any:
        """Send ``payload``; its answer ``[tag, status, body]``, or None for a one-way request
        the server took (answered only when refused: a probe behind it is answered first)."""
        self.send_payload(payload)
        if not one_way:
            return self.recv()
        self.send_payload(wire.pack([PROBE_TAG, "num_keys", CANARY, {}]))
        first = self.recv()
        if first[0] == PROBE_TAG and tag != PROBE_TAG:
            assert first[1] == 200, first
            return None
        assert self.recv()[0] == PROBE_TAG
        return first

    def close(self) -> None:
        self.sock.close()


def canary_keys(srv: ServerProcess) -> dict[bytes, bytes]:
    conn = Http(srv)
    try:
        status, ctype, body = conn.request("POST", wire.op_path(CANARY, "list_keys"), Body(MSGPACK, wire.pack({})), MSGPACK)
        keys = assert_documented(status, ctype, body, as_msgpack=True)["keys"]
        got = Body(MSGPACK, wire.pack({"keys": keys}))
        status, ctype, body = conn.request("POST", wire.op_path(CANARY, "multi_get"), got, MSGPACK)
        values = assert_documented(status, ctype, body, as_msgpack=True)["values"]
        return dict(zip(keys, values))
    finally:
        conn.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = ("--max-hold", "0.05", "--max-value-bytes", str(VALUE_LIMIT), "--max-body-bytes", str(BODY_LIMIT))
    srv = ServerProcess(tmp_path_factory.mktemp("fuzz-server"), durable=False, args=args)
    srv.start()
    conn = Http(srv)
    fields = {"keys": list(CANARY_KEYS), "values": list(CANARY_KEYS.values())}
    for op, body in (("create", {"min_nodes": 1, "max_nodes": 2}), ("multi_set", fields)):
        assert conn.request("POST", wire.op_path(CANARY, op), Body(MSGPACK, wire.pack(body)), MSGPACK)[0] == 200
    settings_ = Body(JSON, b'{"min_nodes": 1, "max_nodes": 2}')
    for job in FUZZ_JOBS:
        assert conn.request("POST", wire.op_path(job, "create"), settings_, JSON)[0] == 200
    assert conn.request("POST", wire.op_path("fuzz-closed", "close"), Body(JSON, b"{}"), JSON)[0] == 200
    conn.close()
    yield srv
    srv.close()


@pytest.fixture
def unharmed(server: ServerProcess) -> Iterator[ServerProcess]:
    """The server, checked after the test: alive, canary intact, no traceback in its log."""
    yield server
    assert server.proc is not None and server.proc.poll() is None, server.log_text()[-3000:]
    assert canary_keys(server) == CANARY_KEYS
    assert "Traceback" not in server.log_text(), server.log_text()[-5000:]


# --------------------------------------------------------------------------- HTTP


def test_the_canary_is_what_the_fixture_wrote(unharmed: ServerProcess) -> None:
    """The check every other test ends with reads what it should."""
    assert canary_keys(unharmed) == CANARY_KEYS


def assert_still_serving(conn: Http) -> None:
    """The connection (or, after an announced close, a new one) answers the next request."""
    status, _, answer = conn.request("GET", "/livez", None, JSON)
    assert (status, json.loads(answer)) == (200, {"status": "ok"})


def test_random_bodies_to_every_operation_route_get_documented_answers(unharmed: ServerProcess) -> None:
    @settings(FUZZ, max_examples=300)
    @given(data=st.data())
    def fuzz(data: st.DataObject) -> None:
        op = data.draw(ROUTE_OPS)
        rdzv_id = data.draw(ROUTE_IDS)
        body = data.draw(bodies(op if op in VALID else "set"))
        as_msgpack = data.draw(st.booleans())
        path = wire.op_path(urllib.parse.quote(rdzv_id, safe="", errors="surrogatepass"), urllib.parse.quote(op, safe=""))
        conn = Http(unharmed)
        try:
            status, ctype, answer = conn.request("POST", path, body, MSGPACK if as_msgpack else JSON)
            assert_documented(status, ctype, answer, as_msgpack=as_msgpack)
            assert_still_serving(conn)
        finally:
            conn.close()

    fuzz()


# Every field of every operation gets each of these in turn, the rest of the body valid.
HOSTILE_FIELD_VALUES: tuple[Any, ...] = (
    *HOSTILE_TEXT, 2**63, -(2**63) - 1, 2**64, 10**400, math.nan, math.inf, -math.inf, -0.0, 1e308, -1, 0,
    [], {}, [[[[[]]]]], {"a": {"b": {}}}, None, True, ["\ud800", 1], ["x" * 65, 1, 0], [""] * 3,
)  # fmt: skip


@pytest.mark.parametrize("op", OPS)
def test_each_hostile_value_in_each_field_of_an_operation_gets_a_documented_answer(unharmed: ServerProcess, op: str) -> None:
    """Systematic where the random fuzz is sparse: one field hostile, the rest valid, so the
    value meets the operation's own checks, the service and the log."""
    names = sorted({*VALID[op], *wire.wire_fields(wire.REQUESTS[op])})
    conn, stream = Http(unharmed), Stream(unharmed)
    try:
        for tag, (name, value) in enumerate(((n, v) for n in names for v in HOSTILE_FIELD_VALUES), start=1):
            fields = {**VALID[op], name: value}
            status, ctype, answer = conn.request("POST", wire.op_path(FUZZ_JOBS[0], op), Body(JSON, json.dumps(fields).encode()), JSON)
            try:
                assert_documented(status, ctype, answer, as_msgpack=False)
                try:
                    payload = msgpack.packb([tag, op, FUZZ_JOBS[0], fields], use_bin_type=True)
                except (UnicodeEncodeError, OverflowError):
                    continue  # what msgpack cannot carry (lone surrogates, ints past 64 bits)
                answer = stream.answer(payload, tag, one_way=op in wire.ONE_WAY_OPS)
                if answer is not None:
                    assert answer[0] == tag
                    assert_documented(answer[1], MSGPACK, wire.pack(answer[2]), as_msgpack=True)
            except AssertionError as exc:
                raise AssertionError(f"{op} with {name}={value!r:.80}: {exc}") from exc
        assert_still_serving(conn)
    finally:
        conn.close()
        stream.close()


def test_random_paths_and_queries_on_the_read_routes_get_documented_answers(unharmed: ServerProcess) -> None:
    @settings(FUZZ, max_examples=60)
    @given(segment=ROUTE_IDS, query=st.dictionaries(PLAIN_TEXT, TEXT, max_size=3), as_msgpack=st.booleans())
    def fuzz(segment: str, query: dict[str, str], as_msgpack: bool) -> None:
        quoted = urllib.parse.quote(segment, safe="", errors="surrogatepass")
        qs = urllib.parse.urlencode(query, errors="surrogatepass")
        conn = Http(unharmed)
        try:
            for path in (f"/v1/jobs/{quoted}?{qs}", f"/v1/jobs?{qs}", f"/v1/{quoted}"):
                status, ctype, answer = conn.request("GET", path, None, MSGPACK if as_msgpack else JSON)
                # A request line over the parser's limit is refused before its headers are read,
                # so before its Accept is known: that answer is JSON (and closes the connection).
                too_long = status == 431
                assert_documented(status, ctype, answer, as_msgpack=as_msgpack and not too_long)
            assert_still_serving(conn)
        finally:
            conn.close()

    fuzz()


# --------------------------------------------------------------------------- stream

FRAME_PARTS = st.one_of(MSGPACK_VALUES, st.sampled_from(OPS), st.sampled_from(FUZZ_JOBS))


@st.composite
def frames(draw: st.DrawFn) -> tuple[int | None, bytes]:
    """A frame's payload and the tag its answer must carry (None: any, the frame's shape is wrong)."""
    kind = draw(st.sampled_from(["request"] * 6 + ["shape", "garbage"]))
    if kind == "garbage":
        return None, draw(st.binary(max_size=200))
    if kind == "shape":
        return None, msgpack.packb(draw(st.lists(FRAME_PARTS, max_size=6)), use_bin_type=True)
    tag = draw(st.integers(1, 2**63 - 1))
    op = draw(ROUTE_OPS.filter(lambda o: o != wire.HELLO_OP))
    rdzv_id = draw(mostly(st.sampled_from(FUZZ_JOBS), PLAIN_TEXT.filter(lambda t: t != CANARY)))
    # fields that are not a map are a wrong shape, still answered with the frame's tag
    fields = draw(mostly(near_valid(op if op in VALID else "set", MSGPACK_VALUES, MSGPACK_NEAR), MSGPACK_VALUES))
    return tag, msgpack.packb([tag, op, rdzv_id, fields], use_bin_type=True)


def _one_way(payload: bytes) -> bool:
    """Whether ``payload`` is a request frame of a one-way operation (which may go unanswered)."""
    try:
        message = msgpack.unpackb(payload, raw=False)
    except Exception:  # noqa: BLE001 (garbage: answered as such)
        return False
    return isinstance(message, list) and len(message) == 4 and message[1] in wire.ONE_WAY_OPS


def test_random_frames_get_documented_answers_and_the_stream_keeps_serving(unharmed: ServerProcess) -> None:
    @settings(FUZZ, max_examples=300)
    @given(frame=frames())
    def fuzz(frame: tuple[int | None, bytes]) -> None:
        tag, payload = frame
        stream = Stream(unharmed)
        try:
            answer = stream.answer(payload, tag, one_way=_one_way(payload))
            if answer is None:
                return  # a one-way beat, taken: nothing to answer
            got_tag, status, body = answer
            if len(payload) > FRAME_LIMIT:  # the framing can no longer be trusted: answered, then closed
                assert [got_tag, status, body["error"]] == [0, 413, "body_too_large"]
                with pytest.raises(ConnectionError):
                    stream.recv()
                return
            if tag is not None:
                assert got_tag == tag, (got_tag, status, body)
            assert_documented(status, MSGPACK, wire.pack(body), as_msgpack=True)
            stream.send_payload(wire.pack([7, "num_keys", CANARY, {}]))
            assert stream.recv() == [7, 200, {"count": len(CANARY_KEYS)}]
        finally:
            stream.close()

    fuzz()


def test_garbage_after_the_preface_is_answered_or_closed_and_the_server_serves_on(unharmed: ServerProcess) -> None:
    @settings(FUZZ, max_examples=40)
    @given(garbage=st.binary(min_size=1, max_size=300))
    def fuzz(garbage: bytes) -> None:
        stream = Stream(unharmed)
        try:
            stream.sock.sendall(garbage)
            stream.sock.shutdown(socket.SHUT_WR)  # a partial frame never completes: EOF ends it
            while True:  # every reply until the server closes (bounded by the socket timeout)
                try:
                    _tag, status, body = stream.recv()
                except ConnectionError:
                    break
                assert_documented(status, MSGPACK, wire.pack(body), as_msgpack=True)
        finally:
            stream.close()

    fuzz()
