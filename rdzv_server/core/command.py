"""Commands: every change to the server's state, as a value.

A command is what the apply path executes and what the durable log records. A client's
write request *is* its command (declared once, in :mod:`rdzv_client.record`); the timer
*detects* deadlines and expiries but *executes* them as ordinary commands
(:class:`LastCall`, :class:`Expire`, :class:`Collect`), so replaying the log reproduces
the state exactly without the soft state (heartbeat times) that led to the decision.

Reads are not commands: they never change state and are never logged.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from rdzv_client.record import (
    INLINE_KEY,
    AddRequest,
    AppendRequest,
    CloseRequest,
    Command as Command,
    CompareSetRequest,
    CordonRequest,
    CreateJobRequest,
    DeleteKeyRequest,
    JoinRequest,
    LeaveRequest,
    MultiSetRequest,
    RefuseRequest,
    SetPolicyRequest,
    SetRequest,
    UncordonRequest,
    UnsetPolicyRequest,
)


# The write requests are the commands (and the log records) the client's writes become: declared
# once, in rdzv_client.record (pure data), under the wire's names; here under core's.
Set = SetRequest
Add = AddRequest
CompareSet = CompareSetRequest
Append = AppendRequest
MultiSet = MultiSetRequest
DeleteKey = DeleteKeyRequest
Create = CreateJobRequest
Join = JoinRequest
Leave = LeaveRequest
Close = CloseRequest
Refuse = RefuseRequest
Cordon = CordonRequest
Uncordon = UncordonRequest
SetPolicy = SetPolicyRequest
UnsetPolicy = UnsetPolicyRequest


@dataclass(frozen=True)
class LastCall(Command):
    """Timer: the last-call deadline of ``round`` passed."""

    op: ClassVar[str] = "last_call"
    round: int


@dataclass(frozen=True)
class Expire(Command):
    """Timer: these nodes died (``why="dead"``) or waited too long (``"join_timeout"``)."""

    op: ClassVar[str] = "expire"
    node_ids: tuple[str, ...]
    why: str
    cause: str = ""  # event.Cause: how the death was noticed (empty in records from before causes)


@dataclass(frozen=True)
class Collect(Command):
    """Timer: a closed or idle job outlived the job TTL; forget it."""

    op: ClassVar[str] = "collect"


@dataclass(frozen=True)
class Refused(Command):
    """The service: a join of ``node_id`` was refused (``why``: ``settings_conflict``); it
    changes nothing but the job's timeline, where an operator looks for why a node is missing."""

    op: ClassVar[str] = "refused"
    node_id: str
    addr: str
    why: str
    detail: str = ""


@dataclass(frozen=True)
class Restarted(Command):
    """The service: the server recovered its log and serves again (``rdzv_id`` is ``""``: every job).

    ``cause`` is ``recovery`` (a restart from the local log) or ``leader_changed`` (a
    replica took over as leader; ``detail`` names it). Records before replicas had neither.
    """

    op: ClassVar[str] = "restarted"
    cause: str = "recovery"
    detail: str = ""


@dataclass(frozen=True)
class Tick(Command):
    """The leader: its clock has reached the record's ``now`` (``rdzv_id`` is ``""``).

    It changes nothing but the clock's high-water mark. A replica leading while no command
    is logged writes one now and then, so that a replica taking over resumes the clock from
    about when the old leader died, not from its last command: idle time before a take-over
    does not stretch running deadlines.
    """

    op: ClassVar[str] = "tick"


#: The store writes: each touches one job's keys (and its last use) and nothing else: no
#: membership, no timeline, no cordon. The apply path and the service take a shorter way for them.
STORE_WRITES: frozenset[type[Command]] = frozenset({Set, Add, CompareSet, Append, MultiSet, DeleteKey})

#: The changes of the server-wide policy table: any job's settings may move (its timer looks again).
POLICY_CHANGES: frozenset[type[Command]] = frozenset({SetPolicy, UnsetPolicy})

COMMANDS: dict[str, type[Command]] = {
    c.op: c
    for c in (
        Set, Add, CompareSet, Append, MultiSet, DeleteKey, Create, Join, Leave, Close, LastCall, Expire, Collect,
        Refused, Restarted, Tick, Refuse, Cordon, Uncordon, SetPolicy, UnsetPolicy,
    )
}


def _inline_fields(cls: type[Command]) -> tuple[tuple[str, type[Any], tuple[str, ...]], ...]:
    """Each inline record field of ``cls``: its name, the record's class and its field names."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, hints[f.name], tuple(g.name for g in dataclasses.fields(hints[f.name])))
        for f in dataclasses.fields(cls)
        if f.metadata.get(INLINE_KEY)
    )


#: Per command, its inline record fields (the job settings of create and join), from the declarations.
_INLINE: dict[type[Command], tuple[tuple[str, type[Any], tuple[str, ...]], ...]] = {
    cls: _inline_fields(cls) for cls in COMMANDS.values()
}


def from_record(record: dict[str, Any]) -> Command:
    """Rebuild a command from its log record (lists come back as tuples)."""
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items() if k != "op"}
    cls = COMMANDS[record["op"]]
    for name, inner, names in _INLINE[cls]:
        fields[name] = inner(**{n: fields.pop(n) for n in names if n in fields})
    return cls(**fields)
