"""The log seam: what the service may ask of durable storage, and the values it gets back.

What it owns: the :class:`Log` protocol (implemented by :class:`~.file_log.FileLog` and
:class:`~.memory_log.MemoryLog`), the :class:`FsyncPolicy` choices, the :class:`Recovered`
value handed to the service at start, and the snapshot cadence default.

What it must not know: what a record means. Records are plain msgpack-able dicts (str keys;
bytes, str, int, float, bool, None, lists and dicts as values) produced by the state
machine; storage keeps them opaquely and gives them back in the order they were appended.
Tuples come back as lists, as msgpack has only one sequence type.

Contract every implementation keeps:
- ``check(record)`` refuses, changing nothing, what ``append`` could not take or should
  not queue now (too large for the log, the queue at its bound); the service checks
  before it applies, so a refused record never touches the state.
- Records get consecutive indices 1, 2, 3, ... in ``append`` order; that order is the
  order on disk and the order of recovery.
- The future ``append`` returns resolves only once the record is durable under the fsync
  policy, and never resolves successfully after a write or fsync has failed.
- ``snapshot(replica)`` covers exactly the records appended before the call. ``snapshot``
  is a plain method that makes the cut before it returns a future for the rest, so the cut
  does not drift even when the caller hands that future to ``ensure_future`` and appends
  more before the event loop runs it (an ``async def`` would only start on the next turn).
- The caller never hands over its live state: nothing proportional to the state's size may
  run on the event loop, and building or encoding a big state there stalls every client.
  The log rebuilds the state at the cut itself, from what it stores (the previous snapshot
  and the records after it), by replaying them into a fresh :class:`Replica` made by the
  factory it is given: the same deterministic apply path as recovery, off the loop.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# Bounds replay at start to about 0.15 s (100k small records, measured) while keeping
# snapshots, which rewrite the whole state, rare enough to cost next to nothing.
DEFAULT_SNAPSHOT_EVERY = 100_000
# Records a log may hold queued (appended, not yet handed to its writer) before it refuses
# more: etcd itself refuses past 5,000 pending proposals; twice that is about 80 etcd txns
# or one large local write, a fraction of a second of backlog when the log keeps up.
DEFAULT_MAX_QUEUED_RECORDS = 10_000
# Bytes of such records: a few maximal values, so a stalled log cannot take the memory.
DEFAULT_MAX_QUEUED_BYTES = 64 * 1024 * 1024


class FsyncPolicy(str, enum.Enum):
    """When an appended record counts as durable (the ``--fsync`` flag's values).

    - ``ALWAYS``: after a write and an fsync that include the record; records queued while
      the previous fsync ran share the next one, but nothing waits to be grouped.
    - ``BATCH``: the same guarantee, with the fsync rate capped (one write every 2 ms at
      most by default); every record that arrived meanwhile shares the next fsync. Fewer
      fsyncs under load, up to one window more latency per write.
    - ``NEVER``: after the bytes are handed to the operating system with ``write()``; a
      process crash loses nothing, a power loss or kernel crash may lose recent records.
    """

    ALWAYS = "always"
    BATCH = "batch"
    NEVER = "never"


@dataclass(frozen=True)
class Recovered:
    """What recovery found in the data directory, for the service to rebuild its state from.

    ``snapshot`` is the state of the newest snapshot that verified (``None`` when there is
    none); ``records`` are the records after it, in order; ``truncated_bytes`` counts the
    bytes dropped from a torn or corrupt tail of the last segment (``0`` when clean);
    ``last_index`` is the index of the last record recovered, the snapshot's index when no
    record follows it, and ``0`` for an empty directory.
    """

    snapshot: dict[str, Any] | None
    records: list[dict[str, Any]]
    truncated_bytes: int
    last_index: int


class Replica(Protocol):
    """The state machine as snapshot building sees it (``core.machine.StateMachine`` fits).

    ``restore`` loads a snapshot's state into a fresh replica; ``replay`` applies one logged
    record again, deterministically (it raises if the record cannot apply: the log and the
    code disagree); ``to_snapshot`` returns the state, msgpack-able.
    """

    def restore(self, state: dict[str, Any]) -> None: ...

    def replay(self, record: dict[str, Any]) -> None: ...

    def to_snapshot(self) -> dict[str, Any]: ...


#: Makes a fresh, empty replica. It must pickle (a module-level class or function, or a
#: ``functools.partial`` of one with plain arguments): it may run in another process.
ReplicaFactory = Callable[[], Replica]


class Log(Protocol):
    """The durable log the service appends every applied operation to."""

    def check(self, record: dict[str, Any]) -> None:
        """Whether the log can take ``record`` now; changes nothing.

        The service calls it *before* applying the command ``record`` carries, so that a
        record the log cannot take is refused with nothing applied. Raises
        :class:`~.error.RecordTooLargeError` when the record is larger than the log takes,
        :class:`~.error.LogQueueFullError` when the records queued for writing are at the
        log's bound, and what :meth:`append` raises for a record msgpack cannot encode.
        """
        ...

    def append(self, record: dict[str, Any]) -> asyncio.Future[None]:
        """Queue ``record`` as the next index; the future resolves once it is durable.

        Called synchronously from the event loop, in apply order. Raises at once what
        msgpack raises for a record it cannot encode (``TypeError`` for an unsupported
        type, ``OverflowError`` or ``ValueError`` for an int or a nesting out of range),
        and :class:`~.error.LogClosedError` once :meth:`close` has begun; a write or
        fsync failure fails the future with :class:`~.error.LogFailedError`.
        """
        ...

    def snapshot(self, replica: ReplicaFactory) -> asyncio.Future[None]:
        """Cut at every record appended so far; the future resolves once the state there is stored.

        The cut happens before this returns, in O(1) on the event loop; the future then
        rebuilds the state at the cut with ``replica`` (see the module docstring), writes
        it atomically and drops the files it makes redundant. Raises
        :class:`~.error.LogClosedError` once closing. The future fails with
        :class:`~.error.LogFailedError` after a write failure, with
        :class:`~.error.SnapshotBuildError` when rebuilding fails, and with the ``OSError``
        of writing the snapshot file itself; the last two leave the log usable (the records
        are still durable in the log, and a later snapshot tries again).
        """
        ...

    @property
    def records_since_snapshot(self) -> int:
        """Records appended since the last snapshot's cut (the service's cue to snapshot)."""
        ...

    async def close(self) -> None:
        """Write and fsync everything pending, then release files and the directory lock."""
        ...


class ReplicatedLog(Log, Protocol):
    """The log a replica leads with (:class:`~.etcd_log.EtcdLog`): a :class:`Log` whose
    leader can lose the right to write at any moment.

    What a step-down needs of it beyond :class:`Log`: to stop *now*, not after flushing.
    Whatever is pending can no longer be committed under this leader's fence, and a caller
    left waiting on it would hang until its own timeout.
    """

    @property
    def last_index(self) -> int:
        """The index of the last record appended (committed or still pending)."""
        ...

    def abandon(self, reason: str) -> None:
        """Stop at once, writing nothing more: fail every pending append (the one in flight
        included) with :class:`~.error.LogFailedError` naming ``reason``, refuse later ones
        (:class:`~.error.LogClosedError`), and stop a snapshot under way. Synchronous and
        idempotent; :meth:`close` afterwards returns at once. An append whose transaction
        was already sent may still have committed: its caller is told only that it is not
        acknowledged."""
        ...
