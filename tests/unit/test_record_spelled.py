"""The one spelling rule of a record (``record.spelled``), read by the log record
(``Command.to_record``) and the wire map (``wire.to_mapping``): fields in declaration order,
the fields one side leaves out left out, an inline record spelled in its place, a field
added later left out while at its default. ``test_wire_recorded.py`` pins the bytes of
every request and command; this checks the rule on records the recordings do not hold."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

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


def test_a_field_added_later_is_left_out_at_its_default_and_kept_otherwise_in_its_place() -> None:
    assert _Later("j", "x").to_record() == {"rdzv_id": "j", "first": "x", "kept": 0, "op": "later"}
    assert list(_Later("j", "x", added="y", also=0).to_record()) == ["rdzv_id", "first", "added", "kept", "also", "op"]
    assert list(_Later("j", "x", also=7).to_record().items()) == [
        ("rdzv_id", "j"), ("first", "x"), ("kept", 0), ("also", 7), ("op", "later")
    ]
    assert wire.to_mapping(_Later("j", "x", added="y", rid=("c", 1))) == {"first": "x", "added": "y", "kept": 0, "rid": ["c", 1]}


def test_the_settings_are_spelled_in_place_on_both_sides_with_only_each_sides_fields() -> None:
    join = c.Join("j", "n", "h", 2, JobSettings(1, 2, max_restarts=3), hold=5.0, rid=("c", 1, 1), host="node7")
    settings = ["min_nodes", "max_nodes", "last_call_timeout", "join_timeout", "heartbeat_ttl", "max_restarts"]
    assert list(join.to_record()) == ["rdzv_id", "node_id", "addr", "nproc_per_node", *settings, "master_port", "host", "op"]
    assert list(wire.to_mapping(join)) == ["node_id", "addr", "nproc_per_node", *settings, "hold", "rid", "master_port", "host"]
    assert "max_restarts" not in c.Create("j", JobSettings(2, 4)).to_record()


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


def test_the_wire_map_holds_lists_and_maps_where_the_record_holds_tuples_and_records() -> None:
    assert wire.to_mapping(_Reply(b"x", parts=(_Part("a", 1),), added="y")) == {
        "first": b"x", "parts": [{"name": "a", "size": 1}], "added": "y", "best": None, "keys": [],
    }
    full = _Reply(b"x", parts=(_Part("a", 1), _Part("b")), best=_Part("c"), keys=(b"k",), hidden="h")
    assert list(wire.to_mapping(full).items()) == [
        ("first", b"x"), ("parts", [{"name": "a", "size": 1}, {"name": "b", "size": 0}]),
        ("best", {"name": "c", "size": 0}), ("keys", [b"k"]),
    ]
