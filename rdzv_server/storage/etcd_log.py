"""The replicated log: the :class:`~.log.Log` interface kept in etcd v3, written only by the leader.

What it owns: the key layout under a prefix, the leader's write path (grouped, fenced txns),
snapshots stored in etcd with the records they cover deleted, recovery (snapshot plus the
records after it, read at one revision), and the follower's tail (a watch from a revision).

What it must not know: HTTP, what records and states mean, or how leadership is won (the
caller hands over a :class:`~.election.LeaderKey`).

Key layout under ``PREFIX``::

    PREFIX/log/<index:020d>   msgpack(record), the same record dicts the file log keeps
    PREFIX/log-head           the last index written, as decimal text
    PREFIX/snapshot           msgpack({"index": i, "state": state}); covers records 1..i

Zero-padded indices sort as numbers, so a key range is an index range.

How a record becomes durable. ``append`` encodes the record at once (a bad record fails its
caller, and no index is spent on it) and queues it with a future. One writer task sends
everything queued as one txn: *if* the leader's election key still has the create revision
this leader got (the fence), put every record and ``log-head``. A txn etcd answers is
committed by a quorum, so the futures resolve then. Records that arrive while a txn is in
flight share the next one (group commit, as the file log groups fsyncs), up to
:data:`MAX_RECORDS_PER_TXN` records and :data:`MAX_TXN_BYTES` per txn (etcd's
``--max-txn-ops`` and ``--max-request-bytes`` defaults, with room to spare).

Invariants:
- Records get consecutive indices in ``append`` order; one writer sends one txn at a time,
  in order, so the keys in etcd are a prefix of the appended records, without gaps.
- Fencing: a write happens only while the leader's key exists with its create revision. A
  leader whose lease expired (paused, cut off) has lost that key; its txn's compare fails,
  nothing is written, and every pending and later append fails with
  :class:`NotLeaderError`. The log is failed for good: leadership is not regained by the
  same log object (a new campaign gives a new key, and recovery must rerun).
- A txn whose answer was lost (an endpoint died mid-request) is sent again to the next
  endpoint. That is safe: the same puts under the same fence write the same bytes to the
  same keys. An etcd error other than a failed compare fails the log with
  :class:`~.error.LogFailedError`; nothing is acknowledged after it.
- A snapshot at index ``i`` is built only after record ``i`` was committed, from what etcd
  holds (the previous snapshot and records up to ``i``), replayed into a fresh replica.
  One fenced txn writes it and deletes the log keys up to ``i``, so etcd never holds a
  snapshot without the records after it, nor loses a record no snapshot covers.
- Recovery reads the snapshot and the records after it at one etcd revision, and checks
  the indices are contiguous from the snapshot on and end at ``log-head``.
- A follower's tail starts at the revision recovery read at, so it sees every record after
  the recovered ones exactly once, in order (a re-put of an index already seen is skipped).

Limits of this first step: a snapshot is one etcd value, so a state that encodes to more
than about 1 MiB cannot be stored yet (the txn fails with a clear error and the log stays
usable); and it is rebuilt in a thread, not a separate process as :mod:`.compaction` does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgpack

from .election import LeaderKey
from .error import LogClosedError, LogFailedError, SnapshotBuildError, StorageError
from .etcd_client import (
    DeleteRange,
    EtcdClient,
    EtcdError,
    EtcdUnavailableError,
    Put,
    prefix_end,
)
from .log import Recovered, ReplicaFactory

logger = logging.getLogger(__name__)

# etcd refuses a txn with more than 128 operations (--max-txn-ops); one is log-head.
MAX_RECORDS_PER_TXN = 127
# etcd refuses a request over 1.5 MiB (--max-request-bytes); 1 MiB of records leaves room
# for keys and framing. A single larger record still goes alone (and etcd may refuse it).
MAX_TXN_BYTES = 1024 * 1024
# Recovery reads the log in pages of this many keys: bounded requests, few round trips.
RECOVERY_PAGE = 1000
# A follower's watch that breaks is reopened from where it stopped, at most this many times
# in a row (each open tries every endpoint), half a second apart: rides out a member's
# restart or an etcd election, and gives up on a cluster that stays down.
TAIL_RECONNECTS = 20
TAIL_RECONNECT_PAUSE_S = 0.5


class NotLeaderError(LogFailedError):
    """The fence failed: this replica's election key is gone, so it may no longer write.

    A :class:`~.error.LogFailedError`, so code that stops acknowledging on a failed log
    does so here too; the service should step down (stop serving writes, campaign again,
    recover) rather than shut down.
    """


class EtcdLogGapError(StorageError):
    """The log in etcd is not contiguous (a missing index, or records not reaching log-head).

    Nothing this code writes can cause it (records and snapshots are written in single
    txns); it means someone else wrote or deleted keys under the prefix.
    """


@dataclass(frozen=True)
class EtcdLogKeys:
    """The keys of one log under ``prefix`` (see the module docstring)."""

    prefix: str

    @property
    def log_dir(self) -> bytes:
        return self.prefix.rstrip("/").encode() + b"/log/"

    @property
    def head(self) -> bytes:
        return self.prefix.rstrip("/").encode() + b"/log-head"

    @property
    def snapshot(self) -> bytes:
        return self.prefix.rstrip("/").encode() + b"/snapshot"

    def record(self, index: int) -> bytes:
        return self.log_dir + f"{index:020d}".encode()

    def index_of(self, key: bytes) -> int:
        return int(key[len(self.log_dir) :])


@dataclass
class _Pending:
    index: int
    payload: bytes
    future: asyncio.Future[None]


async def recover(client: EtcdClient, prefix: str) -> tuple[Recovered, int]:
    """The snapshot and the records after it, read at one revision; and that revision.

    Tail from ``revision + 1`` to see every later record. Raises
    :class:`EtcdLogGapError` when the stored log is not contiguous and
    :class:`~.etcd_client.EtcdError` when etcd cannot be read.
    """
    keys = EtcdLogKeys(prefix)
    snap = await client.range(keys.snapshot)
    revision = snap.revision
    state: dict[str, Any] | None = None
    snapshot_index = 0
    if snap.kvs:
        stored = msgpack.unpackb(snap.kvs[0].value, raw=False)
        state, snapshot_index = stored["state"], int(stored["index"])
    head_kv = await client.range(keys.head, revision=revision)
    head = int(head_kv.kvs[0].value) if head_kv.kvs else 0
    records: list[dict[str, Any]] = []
    expected = snapshot_index + 1
    start, end = keys.record(expected), prefix_end(keys.log_dir)
    # Bounded: every page moves ``start`` past at least one key, and the range is fixed
    # at ``revision``.
    while True:
        page = await client.range(start, end, limit=RECOVERY_PAGE, revision=revision)
        for kv in page.kvs:
            index = keys.index_of(kv.key)
            if index != expected:
                raise EtcdLogGapError(
                    f"The etcd log under {prefix!r} jumps from record {expected - 1} to {index}; "
                    "something else wrote under this prefix. Use a prefix of its own for every cluster."
                )
            records.append(msgpack.unpackb(kv.value, raw=False))
            expected += 1
        if not page.more or not page.kvs:
            break
        start = page.kvs[-1].key + b"\0"
    last_index = expected - 1
    if head > last_index:
        raise EtcdLogGapError(
            f"The etcd log under {prefix!r} ends at record {last_index}, but its log-head says {head}."
        )
    return Recovered(snapshot=state, records=records, truncated_bytes=0, last_index=last_index), revision


async def tail(
    client: EtcdClient, prefix: str, *, after_index: int, start_revision: int
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Yield ``(index, record)`` for every record after ``after_index``, in order, as it commits.

    ``start_revision`` is the revision after the one :func:`recover` read at. Runs until
    the caller stops iterating. Raises :class:`EtcdLogGapError` if an index is skipped,
    :class:`~.etcd_client.EtcdWatchCompactedError` if etcd compacted the history it needs
    (recover again), and :class:`~.etcd_client.EtcdUnavailableError` after
    :data:`TAIL_RECONNECTS` failed reopenings in a row.
    """
    keys = EtcdLogKeys(prefix)
    next_index = after_index + 1
    revision = start_revision
    failures = 0
    while failures <= TAIL_RECONNECTS:
        try:
            async for batch in client.watch(keys.log_dir, prefix_end(keys.log_dir), start_revision=revision):
                failures = 0
                for event in batch.events:
                    revision = max(revision, event.kv.mod_revision + 1)
                    if event.kind != "PUT":
                        continue  # a snapshot deleting the records it covers
                    index = keys.index_of(event.kv.key)
                    if index < next_index:
                        continue  # a txn sent again after a lost answer: the same bytes
                    if index > next_index:
                        raise EtcdLogGapError(
                            f"The etcd log under {prefix!r} skipped from record {next_index - 1} to {index}."
                        )
                    yield index, msgpack.unpackb(event.kv.value, raw=False)
                    next_index += 1
        except EtcdUnavailableError as exc:
            logger.warning("The tail of the etcd log under %r broke (%s); reopening it.", prefix, exc)
        failures += 1
        await asyncio.sleep(TAIL_RECONNECT_PAUSE_S)
    raise EtcdUnavailableError(
        f"The tail of the etcd log under {prefix!r} could not be reopened {TAIL_RECONNECTS} times in a row."
    )


def _build_snapshot(
    replica: ReplicaFactory, base: dict[str, Any] | None, records: list[dict[str, Any]], index: int
) -> bytes:
    """Runs in a thread: replay ``records`` onto ``base`` in a fresh replica; encode the snapshot value."""
    fresh = replica()
    if base is not None:
        fresh.restore(base)
    for record in records:
        fresh.replay(record)
    packed: bytes = msgpack.packb({"index": index, "state": fresh.to_snapshot()}, use_bin_type=True)
    return packed


class EtcdLog:
    """The replicated :class:`~.log.Log`, for the leader; see the module docstring.

    Create it with :meth:`open` once :class:`~.election.Election` has returned the fence.
    The client stays the caller's to close.
    """

    def __init__(self, client: EtcdClient, prefix: str, fence: LeaderKey, *, last_index: int, snapshot_index: int):
        """Use :meth:`open`; this only wires what ``open`` recovered."""
        self._client = client
        self._prefix = prefix
        self._keys = EtcdLogKeys(prefix)
        self._fence = fence
        self._last_index = last_index
        self._cut_index = snapshot_index
        self._snapshot_index = snapshot_index  # the snapshot stored in etcd
        self._pending: list[_Pending] = []
        self._latest: asyncio.Future[None] | None = None  # the last appended record's future
        self._wakeup = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._snapshot_task: asyncio.Future[None] | None = None
        self._failure: LogFailedError | None = None
        self._closing = False

    @classmethod
    async def open(cls, client: EtcdClient, prefix: str, fence: LeaderKey) -> tuple[EtcdLog, Recovered]:
        """Recover the log under ``prefix`` and return it, ready for the leader to append to.

        Raises what :func:`recover` raises.
        """
        recovered, _ = await recover(client, prefix)
        snapshot_index = recovered.last_index - len(recovered.records)
        log = cls(client, prefix, fence, last_index=recovered.last_index, snapshot_index=snapshot_index)
        return log, recovered

    @property
    def last_index(self) -> int:
        """The index of the last record appended (committed or not)."""
        return self._last_index

    @property
    def records_since_snapshot(self) -> int:
        """Records appended since the last snapshot's cut (or since the recovered snapshot)."""
        return self._last_index - self._cut_index

    def append(self, record: dict[str, Any]) -> asyncio.Future[None]:
        """Queue ``record`` as the next index; the future resolves once etcd committed it.

        Raises what msgpack raises for a record it cannot encode and
        :class:`~.error.LogClosedError` once closing; the future fails with
        :class:`NotLeaderError` when the fence fails and :class:`~.error.LogFailedError`
        when etcd refuses or cannot be reached.
        """
        if self._closing:
            raise LogClosedError(f"The etcd log under {self._prefix!r} is closed; cannot append.")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._failure is not None:
            future.set_exception(self._failure)
            return future
        payload: bytes = msgpack.packb(record, use_bin_type=True)
        self._last_index += 1
        self._pending.append(_Pending(self._last_index, payload, future))
        self._latest = future
        self._wake_writer()
        return future

    def snapshot(self, replica: ReplicaFactory) -> asyncio.Future[None]:
        """Cut now at the last appended record; see :meth:`.log.Log.snapshot`.

        The returned task waits for that record's commit, rebuilds the state there from
        etcd with ``replica`` (in a thread), then writes it and deletes the records it
        covers in one fenced txn. It fails with :class:`SnapshotBuildError` when rebuilding
        fails, :class:`NotLeaderError` when the fence fails, and
        :class:`~.error.LogFailedError` when a record it covers was not committed.
        """
        if self._closing:
            raise LogClosedError(f"The etcd log under {self._prefix!r} is closed; cannot snapshot.")
        index = self._last_index
        self._cut_index = index
        task = asyncio.ensure_future(self._finish_snapshot(index, replica, self._latest, self._snapshot_task))
        self._snapshot_task = task
        return task

    async def _finish_snapshot(
        self,
        index: int,
        replica: ReplicaFactory,
        committed: asyncio.Future[None] | None,
        before: asyncio.Future[None] | None,
    ) -> None:
        if before is not None:
            await asyncio.wait([before])  # in cut order; its outcome is its own caller's
        if committed is not None:
            await asyncio.shield(committed)
        if self._failure is not None:
            raise self._failure
        base = self._snapshot_index
        if base >= index:
            return
        recovered, _ = await recover(self._client, self._prefix)
        covered = recovered.records[: index - base]
        if recovered.last_index - len(recovered.records) != base or len(covered) != index - base:
            raise SnapshotBuildError(
                f"The etcd log under {self._prefix!r} does not hold records {base + 1}..{index} for the snapshot."
            )
        try:
            value = await asyncio.to_thread(_build_snapshot, replica, recovered.snapshot, covered, index)
        except Exception as exc:  # whatever the replica raised
            raise SnapshotBuildError(f"Rebuilding the snapshot at {index} failed: {exc!r}") from exc
        try:
            result = await self._client.txn(
                [self._fence.fence()],
                [Put(self._keys.snapshot, value), DeleteRange(self._keys.record(0), self._keys.record(index + 1))],
            )
        except EtcdError as exc:
            raise SnapshotBuildError(f"etcd did not store the snapshot at {index}: {exc}") from exc
        if not result.succeeded:
            self._fail(self._not_leader(), [])
            assert self._failure is not None
            raise self._failure
        self._snapshot_index = index
        logger.info("Stored the snapshot at %d in etcd under %r (%d bytes).", index, self._prefix, len(value))

    async def close(self) -> None:
        """Commit everything pending, then stop (idempotent); the client stays open.

        A running snapshot is awaited; its outcome is its caller's.
        """
        if self._closing:
            return
        self._closing = True
        if self._writer is not None:
            self._wake_writer()
            await self._writer
        if self._snapshot_task is not None:
            await asyncio.wait([self._snapshot_task])

    # ----------------------------------------------------------------------- writer

    def _wake_writer(self) -> None:
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(
                self._run_writer(), name=f"rdzv-etcd-log-writer {self._prefix}"
            )
        self._wakeup.set()

    def _take_batch(self) -> list[_Pending]:
        size = 0
        count = 0
        for item in self._pending[:MAX_RECORDS_PER_TXN]:
            if count and size + len(item.payload) > MAX_TXN_BYTES:
                break
            size += len(item.payload)
            count += 1
        batch, self._pending = self._pending[:count], self._pending[count:]
        return batch

    async def _run_writer(self) -> None:
        # Ends when closing with nothing pending, or at the first failure.
        while True:
            if not self._pending:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = self._take_batch()
            ops = [Put(self._keys.record(item.index), item.payload) for item in batch]
            ops.append(Put(self._keys.head, str(batch[-1].index).encode()))
            try:
                result = await self._client.txn([self._fence.fence()], ops)
            except EtcdError as exc:
                error = LogFailedError(
                    f"etcd did not commit records {batch[0].index}..{batch[-1].index} under {self._prefix!r} "
                    f"({exc}); nothing is acknowledged any more."
                )
                error.__cause__ = exc
                self._fail(error, batch)
                return
            if not result.succeeded:
                self._fail(self._not_leader(), batch)
                return
            for item in batch:
                if not item.future.done():  # a caller may have cancelled its wait
                    item.future.set_result(None)

    def _not_leader(self) -> NotLeaderError:
        return NotLeaderError(
            f"Replica {self._fence.name} no longer leads under {self._prefix!r}: its election key "
            f"{self._fence.key.decode(errors='replace')} (created at revision {self._fence.create_revision}) "
            "is gone, so its lease expired or it resigned; it must not write."
        )

    def _fail(self, error: LogFailedError, batch: list[_Pending]) -> None:
        self._failure = error
        waiting = batch + self._pending
        self._pending = []
        logger.error("%s %d pending records are not acknowledged.", error, len(waiting))
        for item in waiting:
            if not item.future.done():
                item.future.set_exception(error)
