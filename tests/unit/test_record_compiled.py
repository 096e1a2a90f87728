"""The log record built by generated code (``Command.to_record``, compiled once per class)
is the reference reading of the field metadata (``Command.reference_record``), key order
included: the record's bytes are what the log keeps (``test_wire_recorded.py`` pins the
bytes of every command; this checks the rule on values the recordings do not use)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import msgpack

from rdzv_client import wire
from rdzv_client.record import WIRE_KEY, Command, JobSettings, optional, wire_only
from rdzv_server.core import command as c


@dataclasses.dataclass(frozen=True)
class _Later(Command):
    """A command with fields added later (left out at their default) between kept ones."""

    op: ClassVar[str] = "later"
    first: str
    added: str = optional("")
    kept: int = 0
    also: int | None = optional(None)
    rid: tuple[str, int] | None = wire_only(None)


SAMPLES: list[Command] = [
    c.Set("j", b"k", b"v"),
    c.Set("j", b"k", b"v", round=3, rid=("c", 1, 1)),
    c.Add("j", b"k", -5, round=None),
    c.CompareSet("j", b"k", b"", b"d"),
    c.Append("j", b"k", b"v", round=0),
    c.MultiSet("j", (b"a", b"b"), (b"1", b"2")),
    c.DeleteKey("j", b"k"),
    c.Create("j", JobSettings(2, 4, 1.0, 2.0, 3.0, max_restarts=5)),
    c.Join("j", "n", "h", 2, JobSettings(1, 2), host="node7", topology="z/r"),
    c.Leave("j", "n"),
    c.Close("j", cause="agent"),
    c.LastCall("j", 3),
    c.Expire("j", ("a", "b"), "dead", "heartbeat_expired"),
    c.Collect("j"),
    c.Refused("j", "n", "h", "settings_conflict", "other --nnodes"),
    c.Restarted("j"),
    c.Tick(""),
    c.Cordon("", host="node7", reason="r", duration=None),
    c.Uncordon("", host="node7"),
    _Later("j", "x"),
    _Later("j", "x", added="y", kept=2, also=0),
    _Later("j", "x", also=7),
]


def test_the_generated_log_record_is_the_reference_one_in_the_same_order() -> None:
    for command in SAMPLES:
        record, reference = command.to_record(), command.reference_record()
        assert list(record.items()) == list(reference.items()), command
        assert msgpack.packb(record) == msgpack.packb(reference)


def test_a_field_added_later_is_left_out_at_its_default_and_kept_otherwise() -> None:
    assert _Later("j", "x").to_record() == {"rdzv_id": "j", "first": "x", "kept": 0, "op": "later"}
    assert list(_Later("j", "x", added="y", also=0).to_record()) == ["rdzv_id", "first", "added", "kept", "also", "op"]


@dataclasses.dataclass(frozen=True)
class _Part:
    name: str
    size: int = 0


@dataclasses.dataclass(frozen=True)
class _Reply:
    """A record with every kind of wire field: scalars, a tuple of records, a nested record,
    one left out at its default, and one the wire map leaves out."""

    first: bytes
    parts: tuple[_Part, ...] = ()
    added: str = optional("")
    best: _Part | None = None
    keys: tuple[bytes, ...] = ()
    hidden: str = dataclasses.field(default="", metadata={WIRE_KEY: False})


def test_the_generated_wire_map_is_the_reference_one_in_the_same_order() -> None:
    samples: list[object] = [
        *SAMPLES,
        wire.GetRequest(key=b"k", timeout=1.5),
        wire.MultiGetRequest(keys=(b"a", b"b"), timeout=0.0, round=2),
        wire.WatchRequest(node_id="n", round=1, known=2, hold=3.0),
        _Reply(b"x"),
        _Reply(b"x", parts=(_Part("a", 1), _Part("b")), added="y", best=_Part("c"), keys=(b"k",), hidden="h"),
    ]
    for record in samples:
        mapping, reference = wire.to_mapping(record), wire.reference_mapping(record)
        assert list(mapping.items()) == list(reference.items()), record
        assert wire.pack(mapping) == wire.pack(reference)
    assert wire.to_mapping(_Reply(b"x", parts=(_Part("a", 1),), added="y")) == {
        "first": b"x", "parts": [{"name": "a", "size": 1}], "added": "y", "best": None, "keys": [],
    }
