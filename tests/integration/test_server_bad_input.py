"""Bad input over raw HTTP: every case gets its status, a stable error code and a message,
in the body format the caller reads, and leaves the server serving with its state intact.

Each case is sent to a server that holds a canary job (a key and a counter); afterwards
the canary is read back and the job list, the key count and the canary values must be
exactly as before."""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from server_process import ServerProcess

from rdzv_client import wire

JSON = "application/json"
MSGPACK = "application/msgpack"
CANARY_JOB = "canary-job"
SMALL_VALUE_LIMIT = 1024
SMALL_BODY_LIMIT = 2048


# --------------------------------------------------------------------------- raw HTTP


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes

    def decoded(self) -> Any:
        if self.content_type == MSGPACK:
            return msgpack.unpackb(self.body, raw=False)
        assert self.content_type == JSON, f"unexpected Content-Type {self.content_type!r}: {self.body[:200]!r}"
        return json.loads(self.body)


def send(
    srv: ServerProcess, method: str, path: str, body: bytes | None = None, ctype: str | None = JSON, accept: str | None = None
) -> Answer:
    headers = dict(srv.auth)  # authenticated: these cases are about the input, not the caller
    if ctype is not None:
        headers["Content-Type"] = ctype
    if accept is not None:
        headers["Accept"] = accept
    req = urllib.request.Request(srv.url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return Answer(resp.status, resp.headers.get_content_type(), resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return Answer(err.code, err.headers.get_content_type(), err.read())


def op(srv: ServerProcess, rdzv_id: str, name: str, fields: dict[str, Any]) -> Any:
    """A well-formed JSON operation that must succeed; its decoded answer."""
    answer = send(srv, "POST", wire.op_path(rdzv_id, name), json.dumps(fields).encode())
    assert answer.status == 200, answer
    return answer.decoded()


def start_server(tmp_path_factory: pytest.TempPathFactory, *args: str) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("bad-input-server"), durable=False, args=args)
    srv.start()
    op(srv, CANARY_JOB, "create", {"min_nodes": 1, "max_nodes": 2})
    op(srv, CANARY_JOB, "set", {"key": "canary", "value": "intact"})
    op(srv, CANARY_JOB, "add", {"key": "counter", "amount": 41})
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server (default limits) for the module, holding the canary job."""
    yield from start_server(tmp_path_factory)


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with 1 KiB values and 2 KiB bodies, holding the canary job."""
    yield from start_server(
        tmp_path_factory, "--max-value-bytes", str(SMALL_VALUE_LIMIT), "--max-body-bytes", str(SMALL_BODY_LIMIT)
    )


def state_of(srv: ServerProcess) -> dict[str, Any]:
    """What no bad request may change."""
    jobs = send(srv, "GET", "/v1/jobs", ctype=None)
    assert jobs.status == 200, jobs
    return {
        "jobs": sorted(j["rdzv_id"] for j in jobs.decoded()["jobs"]),
        "num_keys": op(srv, CANARY_JOB, "num_keys", {})["count"],
        "keys": op(srv, CANARY_JOB, "list_keys", {})["keys"],
        "canary": op(srv, CANARY_JOB, "get", {"key": "canary"})["value"],
        "counter": op(srv, CANARY_JOB, "get", {"key": "counter"})["value"],
    }


def assert_error(answer: Answer, status: int, code: str) -> None:
    body = answer.decoded()
    assert (answer.status, body.get("error")) == (status, code), answer
    assert isinstance(body.get("message"), str) and body["message"], answer
    assert "Traceback" not in body["message"]


# --------------------------------------------------------------------------- the table


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    path: str  # an operation name of the canary job, or an absolute path
    body: bytes | None
    status: int
    code: str
    ctype: str | None = JSON
    method: str = "POST"

    @property
    def url_path(self) -> str:
        return self.path if self.path.startswith("/") else wire.op_path(CANARY_JOB, self.path)


def j(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def m(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


SET_OK = {"key": "victim", "value": "v"}
JOIN_OK = {"node_id": "node-0", "addr": "h", "nproc_per_node": 1, "min_nodes": 1, "max_nodes": 2}
LONG_ID = "a" * 201

CASES = [
    # framing
    Case("msgpack garbage", "set", b"\xc1\xc1\xc1 not msgpack", 400, "bad_request", ctype=MSGPACK),
    Case("msgpack truncated", "set", m(SET_OK)[:-3], 400, "bad_request", ctype=MSGPACK),
    Case("msgpack trailing bytes", "set", m(SET_OK) + b"\x00", 400, "bad_request", ctype=MSGPACK),
    Case("msgpack deeply nested", "set", b"\x91" * 100_000 + b"\xc0", 400, "bad_request", ctype=MSGPACK),
    Case("json malformed", "set", b'{"key": "victim", "value": ', 400, "bad_request"),
    Case("json not utf-8", "set", b'{"key": "\xff\xfe"}', 400, "bad_request"),
    Case("json deeply nested", "set", b"[" * 100_000 + b"]" * 100_000, 400, "bad_request"),
    Case("msgpack list instead of map", "set", m(["victim", "v"]), 400, "bad_request", ctype=MSGPACK),
    Case("json list instead of map", "set", j(["victim", "v"]), 400, "bad_request"),
    Case("json string instead of map", "set", j("victim"), 400, "bad_request"),
    Case("msgpack int map keys", "set", m({1: "victim", 2: "v"}), 400, "bad_request", ctype=MSGPACK),
    # fields
    Case("unknown field", "set", j({**SET_OK, "colour": "red"}), 400, "bad_request"),
    Case("missing field", "set", j({"key": "victim"}), 400, "bad_request"),
    Case("key is an int", "set", j({"key": 5, "value": "v"}), 400, "bad_request"),
    Case("value is a list", "set", j({"key": "victim", "value": ["v"]}), 400, "bad_request"),
    Case("amount is a string", "add", j({"key": "victim", "amount": "1"}), 400, "bad_request"),
    Case("amount is a bool", "add", j({"key": "victim", "amount": True}), 400, "bad_request"),
    Case("amount is a float", "add", j({"key": "victim", "amount": 1.5}), 400, "bad_request"),
    Case("amount beyond int64", "add", j({"key": "victim", "amount": 2**63}), 400, "bad_request"),
    Case("round is a string", "set", j({**SET_OK, "round": "1"}), 400, "bad_request"),
    Case("round beyond int64", "set", j({**SET_OK, "round": 2**70}), 400, "bad_request"),
    Case("timeout is a string", "get", j({"key": "victim", "timeout": "x"}), 400, "bad_request"),
    Case("timeout is negative", "get", j({"key": "victim", "timeout": -1}), 400, "bad_request"),
    Case("timeout NaN (json)", "get", b'{"key": "victim", "timeout": NaN}', 400, "bad_request"),
    Case("timeout inf (json 1e999)", "get", b'{"key": "victim", "timeout": 1e999}', 400, "bad_request"),
    Case("timeout -inf (json)", "wait", b'{"keys": ["victim"], "timeout": -1e999}', 400, "bad_request"),
    Case("timeout NaN (msgpack)", "get", m({"key": "victim", "timeout": float("nan")}), 400, "bad_request", ctype=MSGPACK),
    Case("timeout inf (msgpack)", "multi_get", m({"keys": ["victim"], "timeout": float("inf")}), 400, "bad_request", ctype=MSGPACK),
    Case("hold negative", "watch", j({"node_id": "node-0", "round": 0, "hold": -0.5}), 400, "bad_request"),
    Case("rid not a pair", "set", j({**SET_OK, "rid": "x"}), 400, "bad_request"),
    Case("rid with an int client id", "set", j({**SET_OK, "rid": [1, 2]}), 400, "bad_request"),
    Case("rid with a negative seq", "set", j({**SET_OK, "rid": ["client", -1]}), 400, "bad_request"),
    Case("rid seq beyond uint64", "set", j({**SET_OK, "rid": ["client", 2**70]}), 400, "bad_request"),
    # keys and values
    Case("empty key", "set", j({"key": "", "value": "v"}), 400, "bad_request"),
    Case("key over 4096 bytes", "set", j({"key": "k" * (wire.MAX_KEY_BYTES + 1), "value": "v"}), 400, "bad_request"),
    Case("empty key in a list", "multi_get", j({"keys": ["canary", ""]}), 400, "bad_request"),
    Case("key not encodable (lone surrogate)", "set", b'{"key": "\\ud800", "value": "v"}', 400, "bad_request"),
    Case("multi_set lengths differ", "multi_set", j({"keys": ["victim", "v2"], "values": ["1"]}), 400, "bad_request"),
    # ids and jobs
    Case("unknown job (set)", "/v1/jobs/no-such-job/set", j(SET_OK), 404, "job_not_found"),
    Case("unknown job (get)", "/v1/jobs/no-such-job/get", j({"key": "k"}), 404, "job_not_found"),
    Case("unknown job (membership)", "/v1/jobs/no-such-job", None, 404, "job_not_found", ctype=None, method="GET"),
    Case("rdzv_id with a space", "/v1/jobs/bad%20id/set", j(SET_OK), 400, "invalid_id"),
    Case("rdzv_id of 201 chars", f"/v1/jobs/{LONG_ID}/set", j(SET_OK), 400, "invalid_id"),
    Case("rdzv_id starting with a dot", "/v1/jobs/.hidden/get", j({"key": "k"}), 400, "invalid_id"),
    Case("membership of an illegal id", "/v1/jobs/bad%20id", None, 400, "invalid_id", ctype=None, method="GET"),
    Case("node_id with a space", "join", j({**JOIN_OK, "node_id": "bad node"}), 400, "invalid_id"),
    Case("node_id of 201 chars", "join", j({**JOIN_OK, "node_id": LONG_ID}), 400, "invalid_id"),
    # job settings
    Case("min_nodes > max_nodes (join)", "join", j({**JOIN_OK, "min_nodes": 3, "max_nodes": 2}), 400, "bad_request"),
    Case("min_nodes > max_nodes (create)", "/v1/jobs/new-job/create", j({"min_nodes": 3, "max_nodes": 2}), 400, "bad_request"),
    Case("min_nodes 0", "/v1/jobs/new-job/create", j({"min_nodes": 0, "max_nodes": 2}), 400, "bad_request"),
    Case("nproc_per_node 0", "join", j({**JOIN_OK, "nproc_per_node": 0}), 400, "bad_request"),
    Case("heartbeat_ttl 0", "join", j({**JOIN_OK, "heartbeat_ttl": 0}), 400, "bad_request"),
    Case("empty addr", "join", j({**JOIN_OK, "addr": ""}), 400, "bad_request"),
    # routes and media types
    Case("unsupported Content-Type", "set", b"key,value\nvictim,v\n", 415, "unsupported_media_type", ctype="text/csv"),
    # A browser posts these three cross-site without asking: none may reach an operation.
    Case("JSON sent as text/plain", "set", j(SET_OK), 415, "unsupported_media_type", ctype="text/plain"),
    Case("JSON sent as a form", "set", j(SET_OK), 415, "unsupported_media_type", ctype="application/x-www-form-urlencoded"),
    Case("JSON sent as multipart", "set", j(SET_OK), 415, "unsupported_media_type", ctype="multipart/form-data; boundary=x"),
    Case("an empty form post", "close", b"", 415, "unsupported_media_type", ctype="application/x-www-form-urlencoded"),
    Case("unknown operation route", "frobnicate", j({}), 404, "not_found"),
    Case("unknown top-level route", "/v2/jobs", None, 404, "not_found", ctype=None, method="GET"),
    Case("GET on an operation route", "set", None, 405, "method_not_allowed", ctype=None, method="GET"),
    Case("DELETE on a job", f"/v1/jobs/{CANARY_JOB}", None, 405, "method_not_allowed", ctype=None, method="DELETE"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_a_4xx_with_code_and_message_and_changes_nothing(server: ServerProcess, case: Case) -> None:
    before = state_of(server)
    answer = send(server, case.method, case.url_path, case.body, ctype=case.ctype)
    assert_error(answer, case.status, case.code)
    assert answer.content_type == JSON  # a JSON (or unspecified) caller reads JSON
    assert state_of(server) == before


# --------------------------------------------------------------------------- size limits


def test_an_oversize_value_is_413_value_too_large(small_server: ServerProcess) -> None:
    before = state_of(small_server)
    value = "v" * (SMALL_VALUE_LIMIT + 100)  # the body still fits in SMALL_BODY_LIMIT
    answer = send(small_server, "POST", wire.op_path(CANARY_JOB, "set"), j({"key": "victim", "value": value}))
    assert_error(answer, 413, "value_too_large")
    answer = send(
        small_server, "POST", wire.op_path(CANARY_JOB, "multi_set"), j({"keys": ["ok", "big"], "values": ["1", value]})
    )
    assert_error(answer, 413, "value_too_large")
    assert state_of(small_server) == before  # multi_set is all or nothing


def test_an_oversize_body_is_413_body_too_large(small_server: ServerProcess) -> None:
    before = state_of(small_server)
    body = m({"key": "victim", "value": b"x" * 10_000})
    assert len(body) > SMALL_BODY_LIMIT
    answer = send(small_server, "POST", wire.op_path(CANARY_JOB, "set"), body, ctype=MSGPACK)
    assert_error(answer, 413, "body_too_large")
    answer = send(small_server, "POST", wire.op_path(CANARY_JOB, "set"), j({"key": "victim", "value": "x" * 10_000}))
    assert_error(answer, 413, "body_too_large")
    assert state_of(small_server) == before


def test_an_append_past_the_value_limit_is_413_and_the_value_is_unchanged(small_server: ServerProcess) -> None:
    key = f"grow-{uuid.uuid4().hex[:8]}"
    op(small_server, CANARY_JOB, "append", {"key": key, "value": "a" * 1000})
    answer = send(small_server, "POST", wire.op_path(CANARY_JOB, "append"), j({"key": key, "value": "b" * 100}))
    assert_error(answer, 413, "value_too_large")
    assert op(small_server, CANARY_JOB, "get", {"key": key})["value"] == "a" * 1000
    op(small_server, CANARY_JOB, "append", {"key": key, "value": "c" * 24})  # exactly at the limit is fine
    assert op(small_server, CANARY_JOB, "get", {"key": key})["value"] == "a" * 1000 + "c" * 24
    assert op(small_server, CANARY_JOB, "delete_key", {"key": key})["deleted"] is True


# --------------------------------------------------------------------------- body formats


def test_answers_are_json_for_json_callers_and_msgpack_when_asked(server: ServerProcess) -> None:
    get = wire.op_path(CANARY_JOB, "get")
    plain = send(server, "POST", get, j({"key": "canary"}))
    assert (plain.status, plain.content_type) == (200, JSON)
    assert json.loads(plain.body) == {"found": True, "value": "intact"}

    packed = send(server, "POST", get, m({"key": b"canary"}), ctype=MSGPACK, accept=MSGPACK)
    assert (packed.status, packed.content_type) == (200, MSGPACK)
    assert msgpack.unpackb(packed.body, raw=False) == {"found": True, "value": b"intact"}

    # A JSON request may still ask for msgpack, and errors follow the Accept header too.
    mixed = send(server, "POST", get, j({"key": "canary"}), accept=MSGPACK)
    assert (mixed.status, mixed.content_type) == (200, MSGPACK)
    assert msgpack.unpackb(mixed.body, raw=False)["value"] == b"intact"
    error = send(server, "POST", get, m({"key": b""}), ctype=MSGPACK, accept=MSGPACK)
    assert error.content_type == MSGPACK
    assert_error(error, 400, "bad_request")
    error = send(server, "POST", "/v1/jobs/no-such-job/get", j({"key": "k"}))
    assert error.content_type == JSON
    assert_error(error, 404, "job_not_found")

    jobs = send(server, "GET", "/v1/jobs", ctype=None, accept=MSGPACK)
    assert jobs.content_type == MSGPACK and CANARY_JOB in [x["rdzv_id"] for x in jobs.decoded()["jobs"]]
    doc = send(server, "GET", f"/v1/jobs/{CANARY_JOB}", ctype=None)
    assert doc.content_type == JSON and doc.decoded()["rdzv_id"] == CANARY_JOB


def test_an_empty_body_of_an_accepted_type_is_an_empty_request(server: ServerProcess) -> None:
    for ctype in (JSON, MSGPACK, "application/json; charset=utf-8"):
        answer = send(server, "POST", wire.op_path(CANARY_JOB, "num_keys"), b"", ctype=ctype)
        assert answer.status == 200, answer


def test_the_server_keeps_serving_after_every_bad_request(server: ServerProcess) -> None:
    # Runs after the table in this module: the same connection-level checks, once more.
    assert send(server, "GET", "/healthz", ctype=None).status == 200
    assert send(server, "GET", "/readyz", ctype=None).status == 200
    assert op(server, CANARY_JOB, "get", {"key": "canary"})["value"] == "intact"
    assert op(server, CANARY_JOB, "add", {"key": "counter", "amount": 1})["value"] == 42
    assert op(server, CANARY_JOB, "add", {"key": "counter", "amount": -1})["value"] == 41
