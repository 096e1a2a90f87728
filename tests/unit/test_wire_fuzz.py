"""Hostile input to the wire format, in process: every decoder fails only with ``WireError``.

Rules checked (client/wire.py states them): what arrives as bytes (``unpack``,
``load_json``) or as a decoded structure (``decode_request`` for every operation,
``assignment_from_wire``) either decodes or raises :class:`wire.WireError`, whatever its
shape, types, sizes, nesting or text (lone surrogates, NUL, markup); a request that
decodes can be packed as it is logged and decodes back to itself, and shown as JSON; a
strict prefix of a msgpack object is never an object; the client turns any answer body
into an error without raising. Example counts are modest: the whole file runs in seconds.
"""

from __future__ import annotations

import json
import math
import typing
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from rdzv_client import wire
from rdzv_client.error import RdzvError, error_from_body

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OPS = sorted(wire.REQUESTS)
LIMIT = 4096

# Text a hostile client sends: anything Unicode has, surrogates (JSON's "\ud800" decodes to
# one) and control characters included, plus a few known troublemakers.
HOSTILE_TEXT = (
    "\ud800", "a\udfffb", "\x00", "\u202e", "<script>alert(1)</script>", "../../etc/passwd",
    "%00", "é" * 300, "x" * 5000, "", " ", "node-1", "10.0.0.1",
)  # fmt: skip
TEXT = st.one_of(st.text(st.characters(exclude_categories=()), max_size=30), st.sampled_from(HOSTILE_TEXT))
NUMBERS = st.one_of(
    st.integers(),
    st.sampled_from([0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 2**1024, -(2**1100), 65536]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([-0.0, 1e308, -1e308, 5e-324, math.inf, -math.inf, math.nan]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT, st.binary(max_size=64))
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=6), st.tuples(inner, inner), st.dictionaries(TEXT, inner, max_size=6)),
    max_leaves=25,
)

# What msgpack can carry (its ints stop at 64 bits; its text is valid UTF-8).
PACKABLE_TEXT = st.text(max_size=30)
PACKABLE = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(), PACKABLE_TEXT, st.binary(max_size=64)
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=8), st.dictionaries(PACKABLE_TEXT, inner, max_size=8)),
    max_leaves=40,
)


def plausible(hint: Any) -> st.SearchStrategy[Any]:
    """Values near what a field of type ``hint`` accepts (edges and wrong types), so that the
    fuzz reaches each request's own checks and not only the type checks."""
    args = typing.get_args(hint)
    if type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return st.one_of(st.none(), plausible(inner))
    if typing.get_origin(hint) is tuple:
        return st.one_of(st.lists(plausible(args[0]), max_size=5), VALUES)
    if hint is bytes:
        return st.one_of(st.binary(max_size=32), TEXT, st.sampled_from([b"", b"k" * 4096, b"k" * 4097]), VALUES)
    if hint in (int, float):
        return st.one_of(NUMBERS, VALUES)
    if hint is str:
        return st.one_of(st.from_regex(wire.ID_PATTERN, fullmatch=True), TEXT, st.sampled_from(["a" * 255, "a" * 256]), VALUES)
    if hint is bool:
        return st.one_of(st.booleans(), VALUES)
    # rid (Any): [client_id, seq(, floor)] and worse
    return st.one_of(st.lists(st.one_of(TEXT, NUMBERS), max_size=4), VALUES)


#: A valid body of every operation: the fuzz changes a few of its fields, so that most
#: bodies pass every check but the one a changed field meets.
VALID: dict[str, dict[str, Any]] = {
    "set": {"key": b"k", "value": b"v"},
    "get": {"key": b"k"},
    "add": {"key": b"k", "amount": 1},
    "compare_set": {"key": b"k", "expected": b"", "desired": b"d"},
    "append": {"key": b"k", "value": b"v"},
    "multi_get": {"keys": [b"a"]},
    "multi_set": {"keys": [b"a"], "values": [b"b"]},
    "check": {"keys": [b"a"]},
    "wait": {"keys": [b"a"]},
    "delete_key": {"key": b"k"},
    "num_keys": {},
    "list_keys": {},
    "create": {},
    "join": {"node_id": "n", "addr": "a", "nproc_per_node": 1, "min_nodes": 1, "max_nodes": 1},
    "await_round": {"node_id": "n", "round": 0},
    "watch": {"node_id": "n", "round": 0},
    "beat": {"node_id": "n", "round": 0},
    "leave": {"node_id": "n"},
    "close": {},
    "refuse": {"node_id": "n", "addr": "h", "cause": "health_check_failed", "detail": "ECC errors"},
    "policy": {},
}


@st.composite
def request_fields(draw: st.DrawFn, op: str) -> dict[Any, Any]:
    """A body for ``op``: its valid body with one to three fields set to plausible values
    (a field it lacked included), sometimes one dropped, sometimes a stranger added."""
    cls = wire.REQUESTS[op]
    hints = wire.wire_fields(cls)
    fields: dict[Any, Any] = dict(VALID[op])
    names = list(hints)
    if names:
        for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)):
            fields[name] = draw(plausible(hints[name]))
    if fields and draw(st.integers(0, 9)) == 0:
        del fields[draw(st.sampled_from(sorted(fields)))]
    if draw(st.integers(0, 9)) == 0:
        fields[draw(st.one_of(TEXT, NUMBERS, st.binary(max_size=8)))] = draw(VALUES)
    return fields


def test_every_operation_has_a_valid_body_to_start_from() -> None:
    assert sorted(VALID) == OPS
    for op, body in VALID.items():
        assert_decodes_back(op, wire.decode_request(op, body))


def assert_decodes_back(op: str, req: wire.Request) -> None:
    """A decoded request survives what the server does with it: log it (msgpack), show it (JSON)."""
    mapping = wire.to_mapping(req)
    assert wire.decode_request(op, wire.unpack(wire.pack(mapping), wire.MAX_KEY_BYTES * 16)) == req
    json.loads(wire.dump_json(mapping))


# --------------------------------------------------------------------------- bytes in


@FUZZ
@given(data=st.binary(max_size=512), max_bytes=st.integers(0, 1024))
def test_unpack_of_any_bytes_decodes_or_raises_wire_error(data: bytes, max_bytes: int) -> None:
    try:
        wire.unpack(data, max_bytes)
    except wire.WireError:
        pass


@FUZZ
@given(value=PACKABLE)
def test_unpack_of_a_packed_structure_round_trips_or_raises_wire_error(value: Any) -> None:
    packed = wire.pack(value)
    try:
        decoded = wire.unpack(packed, LIMIT, max_items=8)
    except wire.WireError:
        return
    assert wire.pack(decoded) == packed


@FUZZ
@given(value=PACKABLE, data=st.data())
def test_a_strict_prefix_of_a_packed_structure_is_a_wire_error(value: Any, data: st.DataObject) -> None:
    packed = wire.pack(value)
    cut = data.draw(st.integers(0, len(packed) - 1))
    with pytest.raises(wire.WireError):
        wire.unpack(packed[:cut], LIMIT)


@pytest.mark.parametrize("depth", [100, 10_000, 200_000])
def test_deep_nesting_is_a_wire_error_or_decodes(depth: int) -> None:
    for data in (b"\x91" * depth + b"\xc0", b"[" * depth + b"]" * depth):
        try:
            wire.unpack(data, len(data)) if data[:1] == b"\x91" else wire.load_json(data, len(data))
        except wire.WireError:
            pass


@FUZZ
@given(data=st.one_of(st.binary(max_size=256), VALUES.map(lambda v: json.dumps(v, default=repr).encode())))
def test_load_json_of_any_bytes_decodes_or_raises_wire_error(data: bytes) -> None:
    try:
        wire.load_json(data, LIMIT)
    except wire.WireError:
        pass


# --------------------------------------------------------------------------- structures in


@pytest.mark.parametrize("op", OPS)
@settings(FUZZ, max_examples=40)
@given(body=VALUES)
def test_decode_request_of_any_structure_decodes_or_raises_wire_error(op: str, body: Any) -> None:
    try:
        req = wire.decode_request(op, body)
    except wire.WireError:
        return
    assert_decodes_back(op, req)


@pytest.mark.parametrize("op", OPS)
@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_decode_request_of_near_valid_fields_decodes_or_raises_wire_error(op: str, data: st.DataObject) -> None:
    fields = data.draw(request_fields(op))
    try:
        req = wire.decode_request(op, fields)
    except wire.WireError:
        return
    assert_decodes_back(op, req)


def rid_outcome(convert: Any, value: Any) -> tuple[str, Any]:
    try:
        return "ok", convert(value)
    except wire.WireError as exc:
        return "error", str(exc)


@FUZZ
@given(value=st.one_of(plausible(tuple[Any, ...] | None), st.tuples(TEXT, NUMBERS, NUMBERS).map(list)))
@example(["c", 2**63, 0])
@example(["c", 2**63 - 1, 2**63 - 1])
@example(["c", 5, 6])
@example(["c", 1, -1])
@example(["", 1, 0])
@example(["x" * (wire.MAX_CLIENT_ID_CHARS + 1), 1, 0])
@example(["x" * wire.MAX_CLIENT_ID_CHARS, 1, 0])
@example(["\ud800", 1, 0])
@example(["é", 1, 0])
@example(["c", True, 0])
@example(("c", 1, 0))
def test_a_request_id_taken_at_first_sight_is_one_the_rules_accept(value: Any) -> None:
    assert rid_outcome(wire._convert_rid, value) == rid_outcome(wire._checked_rid, value)


@pytest.mark.parametrize(
    "op, body",
    [
        ("join", {**VALID["join"], "addr": "10.0.0.1\ud800"}),
        ("join", {**VALID["join"], "node_id": "\udfff"}),
        ("set", {**VALID["set"], "rid": ["client\ud800", 1]}),
        ("set", {"key": "k\ud800", "value": "v"}),
        ("get", {"key": "\udc80"}),
    ],
)
def test_a_lone_surrogate_in_text_is_a_wire_error_not_a_log_failure(op: str, body: dict[str, Any]) -> None:
    """JSON's "\\ud800" decodes to text that msgpack cannot encode: a server that accepted it
    failed to log the request and stopped (found by this file's fuzz)."""
    with pytest.raises(wire.WireError, match="Unicode|not valid"):
        wire.decode_request(op, body)


@FUZZ
@given(op=TEXT, body=VALUES)
def test_an_unknown_operation_is_a_wire_error(op: str, body: Any) -> None:
    if op in wire.REQUESTS:
        return
    with pytest.raises(wire.WireError):
        wire.decode_request(op, body)


@FUZZ
@given(body=st.one_of(VALUES, request_fields("join").map(lambda f: {**f, "node_rank": 0, "extra": 1})))
def test_an_assignment_from_a_reply_decodes_or_raises_wire_error(body: Any) -> None:
    try:
        wire.assignment_from_wire(body)
    except wire.WireError:
        pass


# --------------------------------------------------------------------------- answers in (the client)


@FUZZ
@given(status=st.integers(100, 999), body=st.one_of(VALUES, st.fixed_dictionaries({"error": TEXT, "message": VALUES})))
def test_the_client_turns_any_answer_body_into_an_error_without_raising(status: int, body: Any) -> None:
    error = error_from_body(status, body)
    assert isinstance(error, RdzvError)
    assert str(error)
