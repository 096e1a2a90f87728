"""The replicated log: the :class:`~.log.Log` interface kept in etcd v3, written only by the leader.

What it owns: the key layout under a prefix, the leader's write path (grouped, fenced txns),
snapshots stored in etcd in parts with the records they cover deleted, compaction of etcd's
history, recovery (snapshot plus the records after it, read at one revision), and the
follower's tail (a watch from a revision).

What it must not know: HTTP, what records and states mean, or how leadership is won (the
caller hands over a :class:`~.election.LeaderKey`).

Key layout under ``PREFIX``::

    PREFIX/log/<index:020d>                 msgpack(record), the same record dicts the file log keeps
    PREFIX/log-head                         the last index written, as decimal text
    PREFIX/snapshot-meta                    msgpack({"index": i, "parts": n, "bytes": b, "sha256": digest})
    PREFIX/snapshot/<index:020d>/<part:06d> part k of msgpack(state at i), 512 KiB at most

The snapshot at ``i`` covers records ``1..i``; its parts, joined in order, are ``b`` bytes
whose SHA-256 is ``digest``. Zero-padded numbers sort as numbers, so a key range is an
index range; ``snapshot-meta`` sorts outside ``snapshot/``, so no range over parts touches it.

How a record becomes durable. ``append`` encodes the record at once (a bad record fails its
caller, and no index is spent on it) and queues it with a future. One writer task sends
everything queued as one txn: *if* the leader's election key still has the create revision
this leader got (the fence) *and* ``log-head`` is the index just before the batch, put
every record and ``log-head``. A txn etcd answers is committed by a quorum, so the futures
resolve then. Records that arrive while a txn is in flight share the next one (group
commit, as the file log groups fsyncs), up to :data:`MAX_RECORDS_PER_TXN` records and
:data:`MAX_TXN_BYTES` per txn (etcd's ``--max-txn-ops`` and ``--max-request-bytes``
defaults, with room to spare).

How a snapshot is stored. etcd refuses any request over 1.5 MiB, and a txn is one request,
so a state of tens of MB cannot be one value. The snapshot at ``i`` is written in steps:
1. the stored snapshot, its meta's mod revision and the records up to ``i`` are read at one
   revision, as recovery reads them;
2. one fenced txn deletes every part except the stored snapshot's (what an abandoned
   snapshot left behind, at any index);
3. a child process rebuilds the state at ``i`` (see below) and encodes it;
4. each part of at most :data:`SNAPSHOT_PART_BYTES` is put by a fenced txn of its own, a
   few in flight at once; a deposed leader cannot write even one part;
5. one fenced txn, also compared on ``snapshot-meta``'s mod revision as read in step 1,
   puts ``snapshot-meta``, deletes the records up to ``i`` and deletes the parts of every
   index below ``i`` (the previous snapshot's);
6. etcd's history is compacted at the revision of the *previous* snapshot's commit, so one
   snapshot interval of history stays readable (a follower tailing a little behind keeps its
   watch). A follower whose watch asks for compacted history gets
   :class:`~.etcd_client.EtcdWatchCompactedError` from :func:`tail` and must recover again.
   Compaction is cluster-wide: anything else kept in the same etcd loses its history before
   that revision too (etcd's own ``--auto-compaction-*`` does the same).
A leader that dies between steps leaves parts no meta names; recovery ignores them (it reads
only the meta's index) and the next snapshot's step 2 deletes them.

Why a child process rebuilds the snapshot (as :mod:`.compaction` does for the file log), and
not a thread: decoding the previous snapshot, replaying and encoding the new one cost time
proportional to the state, and msgpack holds the GIL for a whole ``packb``/``unpackb`` call,
so in a thread a 20 MB state stalls the event loop about as long as on the loop itself. A
fresh interpreter (``python -c``, never ``fork()`` in a threaded process, nor multiprocessing's
spawn, which would run the server's ``__main__`` again) has its own GIL. It is cheap here:
the parent already holds the encoded inputs read from etcd and hands them over undecoded
through a pipe; the child sends back the encoded state and its digest. Starting it costs
about 0.3 s per snapshot (an interpreter and this module's imports), against a stall of
about a second avoided for a 20 MB state.

Invariants:
- Records get consecutive indices in ``append`` order; one writer sends one txn at a time,
  in order, so the keys in etcd are a prefix of the appended records, without gaps.
- Fencing: a write (records, parts, meta) happens only while the leader's key exists with
  its create revision. A leader whose lease expired (paused, cut off) has lost that key;
  its txn's compare fails, nothing is written, and every pending and later append fails
  with :class:`NotLeaderError`. The log is failed for good: leadership is not regained by
  the same log object (a new campaign gives a new key, and recovery must rerun).
- No overwrite: a record txn also compares ``log-head`` with the index before its batch, so
  a leader opened at a stale ``last_index`` fails with :class:`EtcdLogHeadMismatchError`
  instead of overwriting committed records.
- A txn whose answer was lost (an endpoint died mid-request) is sent again to the next
  endpoint. Puts of parts are safe to repeat; for records and meta, a repeat whose first
  attempt committed fails its compare, and the failure branch's reads show that etcd holds
  exactly the bytes asked for (log-head at the batch's end and every record of the batch;
  the meta), which counts as success. An etcd error other than a failed compare fails
  the log with :class:`~.error.LogFailedError`; nothing is acknowledged after it.
- A snapshot at index ``i`` is built only after record ``i`` was committed, from what etcd
  holds (the previous snapshot and records up to ``i``). Its meta is written only after
  all its parts, in the txn that deletes the records up to ``i``, so etcd never names a
  snapshot whose parts are incomplete, never holds a snapshot without the records after it,
  and never loses a record no snapshot covers.
- Recovery reads the meta, the meta's parts, ``log-head`` and the records after the
  snapshot, all at one etcd revision; it checks the parts' keys, count, size and SHA-256
  against the meta (else :class:`EtcdSnapshotCorruptError`) and that the indices are
  contiguous from the snapshot on and end at ``log-head`` (else :class:`EtcdLogGapError`).
  A read whose revision a new snapshot's compaction removed meanwhile starts over.
- A follower's tail starts at the revision recovery read at, so it sees every record after
  the recovered ones exactly once, in order (a re-put of an index already seen is skipped).

Becoming leader. :meth:`EtcdLog.open` recovers everything; a hot follower that has applied
every record up to ``last_index`` through :func:`tail` constructs :class:`EtcdLog` directly
with that index and :func:`snapshot_index` (one small read). It must first tail up to
:func:`log_head` as read *after* winning the election (the old leader's last txns may still
be on their way through the watch); if it does not, its first append fails with
:class:`EtcdLogHeadMismatchError` and nothing is overwritten.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import os
import pickle
import struct
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import msgpack

from .compaction import receive_job
from .election import LeaderKey
from .error import (
    LogClosedError,
    LogFailedError,
    LogQueueFullError,
    RecordTooLargeError,
    SnapshotBuildError,
    StorageError,
)
from .etcd_client import (
    Compare,
    DeleteRange,
    EtcdClient,
    EtcdError,
    EtcdRequestError,
    EtcdUnavailableError,
    Get,
    KeyValue,
    Put,
    prefix_end,
)
from .log import DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_QUEUED_RECORDS, Recovered, ReplicaFactory

logger = logging.getLogger(__name__)

# etcd refuses a txn with more than 128 operations (--max-txn-ops); one is log-head.
MAX_RECORDS_PER_TXN = 127
# etcd refuses a request over 1.5 MiB (--max-request-bytes), and the JSON gateway carries
# values in base64 (4/3 larger), which aiohttp warns about past 1 MiB of request body:
# 512 KiB of records stays well under both. A single larger record still goes alone.
MAX_TXN_BYTES = 512 * 1024
# The largest record the log takes: etcd's default --max-request-bytes (1.5 MiB, counted on
# the txn as etcd decodes it, before any base64) less 64 KiB for what a txn of one record
# adds (the keys under the prefix, the fence and log-head compares, the log-head put and the
# reads of a failed compare: under 1 KiB measured with a short prefix). Larger records are
# refused by :meth:`EtcdLog.check` before they are applied: etcd would refuse their txn, and
# a refused txn fails the log (nothing after it can be acknowledged in order).
MAX_RECORD_BYTES = 1536 * 1024 - 64 * 1024
# One txn (every retry across etcd's members included) may take this long before the log
# fails, unless the leader gives another bound (its lease): the client's own retries
# (several passes over every member, 5 s each) could otherwise hold the single writer, and
# every record queued behind it, for most of a minute.
DEFAULT_APPEND_TIMEOUT_S = 5.0
# One snapshot part per txn, under the same limits as a batch of records; the time etcd
# takes per part grows with its size, so smaller parts cost next to nothing more.
SNAPSHOT_PART_BYTES = 512 * 1024
# Part txns in flight at once: etcd commits concurrent txns in shared raft batches (a 20 MB
# state took 1.4 s one part at a time, about 0.95 s with 2, 4 or 8 in flight, one member on
# loopback), and a record txn queued behind them waits for at most this many parts.
SNAPSHOT_WRITES_IN_FLIGHT = 2
# Recovery reads snapshot parts one per request (0.7 MB of JSON each): no single answer
# ties up the event loop for long, and none nears a gateway or gRPC message limit.
SNAPSHOT_READ_PAGE_PARTS = 1
# Recovery reads the log in pages of this many keys: bounded requests, few round trips.
RECOVERY_PAGE = 1000
# A read pinned at one revision is restarted when a leader's compaction removes that
# revision meanwhile; that takes two snapshots during one read, so a few tries suffice.
RECOVERY_ATTEMPTS = 3
# A follower's watch that breaks is reopened from where it stopped, at most this many times
# in a row (each open tries every endpoint), half a second apart: rides out a member's
# restart or an etcd election, and gives up on a cluster that stays down.
TAIL_RECONNECTS = 20
TAIL_RECONNECT_PAUSE_S = 0.5

# The gRPC code etcd answers a read of, or a compaction at, a revision already compacted.
GRPC_OUT_OF_RANGE = 11

_LENGTH = struct.Struct("<Q")
_BUILD_OK = 0
_BUILD_FAILED = 1


class NotLeaderError(LogFailedError):
    """The fence failed: this replica's election key is gone, so it may no longer write.

    A :class:`~.error.LogFailedError`, so code that stops acknowledging on a failed log
    does so here too; the service should step down (stop serving writes, campaign again,
    recover) rather than shut down.
    """


class EtcdLogHeadMismatchError(LogFailedError):
    """etcd's ``log-head`` is not where this leader's log continues from.

    The log was opened (or constructed) at a ``last_index`` other than the one in etcd: a
    follower became leader before tailing up to :func:`log_head`. Nothing was written;
    recover (or catch up) and open the log again.
    """


class EtcdLogGapError(StorageError):
    """The log in etcd is not contiguous (a missing index, or records not reaching log-head).

    Nothing this code writes can cause it (records and snapshots are written in single
    txns); it means someone else wrote or deleted keys under the prefix.
    """


class EtcdSnapshotCorruptError(StorageError):
    """The snapshot's parts do not match its meta (a part missing, extra, or altered).

    Nothing this code writes can cause it (the meta is written only after every part, and
    the parts a meta names are deleted only in the txn that replaces that meta): someone
    else wrote or deleted keys under the prefix, or etcd lost data. The state cannot be
    recovered from this prefix.
    """


@dataclass(frozen=True)
class EtcdLogKeys:
    """The keys of one log under ``prefix`` (see the module docstring)."""

    prefix: str

    @property
    def _root(self) -> bytes:
        return self.prefix.rstrip("/").encode()

    @property
    def log_dir(self) -> bytes:
        return self._root + b"/log/"

    @property
    def head(self) -> bytes:
        return self._root + b"/log-head"

    @property
    def snapshot_meta(self) -> bytes:
        return self._root + b"/snapshot-meta"

    @property
    def snapshot_dir(self) -> bytes:
        """The parent of every snapshot's parts, whatever its index."""
        return self._root + b"/snapshot/"

    def record(self, index: int) -> bytes:
        return self.log_dir + f"{index:020d}".encode()

    def index_of(self, key: bytes) -> int:
        return int(key[len(self.log_dir) :])

    def snapshot_parts(self, index: int) -> bytes:
        """The parent of the parts of the snapshot at ``index``."""
        return self.snapshot_dir + f"{index:020d}/".encode()

    def snapshot_part(self, index: int, part: int) -> bytes:
        return self.snapshot_parts(index) + f"{part:06d}".encode()


@dataclass(frozen=True)
class SnapshotMeta:
    """The value of ``snapshot-meta``: which snapshot is stored, in how many parts, and its digest."""

    index: int
    parts: int
    size: int
    sha256: bytes

    def encode(self) -> bytes:
        packed: bytes = msgpack.packb(
            {"index": self.index, "parts": self.parts, "bytes": self.size, "sha256": self.sha256}, use_bin_type=True
        )
        return packed

    @classmethod
    def decode(cls, value: bytes, prefix: str) -> SnapshotMeta:
        """Parse a stored meta; raises :class:`EtcdSnapshotCorruptError` for anything malformed."""
        try:
            data = msgpack.unpackb(value, raw=False)
            meta = cls(int(data["index"]), int(data["parts"]), int(data["bytes"]), bytes(data["sha256"]))
        except Exception as exc:  # any shape msgpack or the lookups reject
            raise EtcdSnapshotCorruptError(
                f"The snapshot meta under {prefix!r} does not parse ({exc!r}); something else wrote under this prefix."
            ) from exc
        if meta.index < 1 or meta.parts < 1 or meta.size < 1 or len(meta.sha256) != 32:
            raise EtcdSnapshotCorruptError(f"The snapshot meta under {prefix!r} is out of range: {meta}.")
        return meta


@dataclass(frozen=True)
class _Stored:
    """What etcd holds under a prefix at one revision, still encoded; the snapshot verified."""

    revision: int
    meta: SnapshotMeta | None
    meta_revision: int  # the meta's mod revision: the previous snapshot's commit (0: none)
    snapshot: bytes | None  # msgpack(state), the parts joined
    records: list[bytes]  # msgpack(record) of every record after the snapshot, in order

    @property
    def snapshot_index(self) -> int:
        return self.meta.index if self.meta is not None else 0

    @property
    def last_index(self) -> int:
        return self.snapshot_index + len(self.records)


@dataclass
class _Pending:
    index: int
    payload: bytes
    future: asyncio.Future[None]


def _is_compacted(exc: EtcdRequestError) -> bool:
    return exc.code == GRPC_OUT_OF_RANGE


async def snapshot_index(client: EtcdClient, prefix: str) -> int:
    """The index of the snapshot stored under ``prefix`` (``0`` when none); reads only its meta.

    Raises :class:`EtcdSnapshotCorruptError` for a malformed meta and
    :class:`~.etcd_client.EtcdError` when etcd cannot be read.
    """
    kv = await client.get(EtcdLogKeys(prefix).snapshot_meta)
    return SnapshotMeta.decode(kv.value, prefix).index if kv is not None else 0


async def log_head(client: EtcdClient, prefix: str) -> int:
    """The index of the last record written under ``prefix`` (``0`` when none); one small read.

    Raises :class:`~.etcd_client.EtcdError` when etcd cannot be read.
    """
    kv = await client.get(EtcdLogKeys(prefix).head)
    return int(kv.value) if kv is not None else 0


async def recover(client: EtcdClient, prefix: str) -> tuple[Recovered, int]:
    """The snapshot and the records after it, read at one revision; and that revision.

    Tail from ``revision + 1`` to see every later record. Raises
    :class:`EtcdSnapshotCorruptError` when the snapshot's parts do not match its meta,
    :class:`EtcdLogGapError` when the stored log is not contiguous and
    :class:`~.etcd_client.EtcdError` when etcd cannot be read.
    """
    stored = await _read_stored(client, prefix)
    state: dict[str, Any] | None = None
    if stored.snapshot is not None:
        state = msgpack.unpackb(stored.snapshot, raw=False)
    records = [msgpack.unpackb(value, raw=False) for value in stored.records]
    recovered = Recovered(snapshot=state, records=records, truncated_bytes=0, last_index=stored.last_index)
    return recovered, stored.revision


async def _read_stored(client: EtcdClient, prefix: str) -> _Stored:
    """:func:`_read_at_one_revision`, started over when a compaction overtakes it."""
    for attempt in range(1, RECOVERY_ATTEMPTS + 1):
        try:
            return await _read_at_one_revision(client, EtcdLogKeys(prefix))
        except EtcdRequestError as exc:
            if not _is_compacted(exc) or attempt == RECOVERY_ATTEMPTS:
                raise
            logger.info("Reading the etcd log under %r was overtaken by a compaction; reading it again.", prefix)
    raise AssertionError("unreachable: the last attempt returns or raises")


async def _read_at_one_revision(client: EtcdClient, keys: EtcdLogKeys) -> _Stored:
    prefix = keys.prefix
    first = await client.range(keys.snapshot_meta)
    revision = first.revision
    meta: SnapshotMeta | None = None
    meta_revision = 0
    snapshot: bytes | None = None
    if first.kvs:
        meta = SnapshotMeta.decode(first.kvs[0].value, prefix)
        meta_revision = first.kvs[0].mod_revision
        snapshot = await _read_snapshot_parts(client, keys, meta, revision)
    head_kv = await client.range(keys.head, revision=revision)
    head = int(head_kv.kvs[0].value) if head_kv.kvs else 0
    records: list[bytes] = []
    expected = (meta.index if meta is not None else 0) + 1
    async for kv in _read_range(client, keys.record(expected), prefix_end(keys.log_dir), revision, RECOVERY_PAGE):
        index = keys.index_of(kv.key)
        if index != expected:
            raise EtcdLogGapError(
                f"The etcd log under {prefix!r} jumps from record {expected - 1} to {index}; "
                "something else wrote under this prefix. Use a prefix of its own for every cluster."
            )
        records.append(kv.value)
        expected += 1
    if head > expected - 1:
        raise EtcdLogGapError(
            f"The etcd log under {prefix!r} ends at record {expected - 1}, but its log-head says {head}."
        )
    return _Stored(revision, meta, meta_revision, snapshot, records)


async def _read_range(
    client: EtcdClient, start: bytes, end: bytes, revision: int, page_size: int
) -> AsyncIterator[KeyValue]:
    # Bounded: every page moves ``start`` past at least one key, and the range is fixed at
    # ``revision``.
    while True:
        page = await client.range(start, end, limit=page_size, revision=revision)
        for kv in page.kvs:
            yield kv
        if not page.more or not page.kvs:
            return
        start = page.kvs[-1].key + b"\0"


async def _read_snapshot_parts(client: EtcdClient, keys: EtcdLogKeys, meta: SnapshotMeta, revision: int) -> bytes:
    """The parts of the snapshot ``meta`` names, read at ``revision``, joined and verified."""
    where = f"The snapshot at {meta.index} under {keys.prefix!r}"
    parts: list[bytes] = []
    directory = keys.snapshot_parts(meta.index)
    async for kv in _read_range(client, directory, prefix_end(directory), revision, SNAPSHOT_READ_PAGE_PARTS):
        if kv.key != keys.snapshot_part(meta.index, len(parts)):
            raise EtcdSnapshotCorruptError(
                f"{where} has {kv.key.decode(errors='replace')} where part {len(parts)} belongs."
            )
        parts.append(kv.value)
    if len(parts) != meta.parts:
        raise EtcdSnapshotCorruptError(f"{where} has {len(parts)} parts, but its meta says {meta.parts}.")
    blob = b"".join(parts)
    if len(blob) != meta.size:
        raise EtcdSnapshotCorruptError(f"{where} has {len(blob)} bytes, but its meta says {meta.size}.")
    # hashlib releases the GIL for large inputs: a thread keeps the loop free meanwhile.
    digest = await asyncio.to_thread(_sha256, blob)
    if digest != meta.sha256:
        raise EtcdSnapshotCorruptError(f"{where} does not match its SHA-256: a part was altered.")
    return blob


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


async def tail(
    client: EtcdClient, prefix: str, *, after_index: int, start_revision: int
) -> AsyncIterator[tuple[int, dict[str, Any]]]:
    """Yield ``(index, record)`` for every record after ``after_index``, in order, as it commits.

    ``start_revision`` is the revision after the one :func:`recover` read at. Runs until
    the caller stops iterating. Raises :class:`EtcdLogGapError` if an index is skipped,
    :class:`~.etcd_client.EtcdUnavailableError` after :data:`TAIL_RECONNECTS` failed
    reopenings in a row, and :class:`~.etcd_client.EtcdWatchCompactedError` when etcd
    compacted the history it needs: the leader compacts at the previous snapshot's commit
    after each snapshot, so a follower more than one snapshot interval behind (its watch
    broken that long, or started from an old recovery) must call :func:`recover` again
    and tail from the new revision.
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


# ---------------------------------------------------------------- snapshot builder


@dataclass(frozen=True)
class _BuildJob:
    """What the builder process needs, pickled to it: the inputs exactly as etcd holds them."""

    index: int
    base: bytes | None  # msgpack(state) of the stored snapshot
    records: list[bytes]  # msgpack(record) of records base + 1 .. index
    replica: ReplicaFactory


def _build(job: _BuildJob) -> bytes:
    """Replay ``job`` into a fresh replica; return msgpack(state). Runs in the builder process."""
    fresh = job.replica()
    if job.base is not None:
        fresh.restore(msgpack.unpackb(job.base, raw=False))
    for value in job.records:
        fresh.replay(msgpack.unpackb(value, raw=False))
    blob: bytes = msgpack.packb(fresh.to_snapshot(), use_bin_type=True)
    return blob


class _Builder:
    """One build in a child process (see the module docstring); :meth:`stop` kills it."""

    def __init__(self, job: _BuildJob) -> None:
        self.job = job
        self._proc: asyncio.subprocess.Process | None = None
        self._stopped = False

    async def run(self) -> tuple[bytes, bytes]:
        """``(msgpack(state), its SHA-256)``; raises :class:`~.error.SnapshotBuildError` if the build fails."""
        payload = pickle.dumps(self.job, protocol=pickle.HIGHEST_PROTOCOL)
        # The parent's sys.path, so the builder imports the replica's module as the server did.
        bootstrap = f"import sys; sys.path[:] = {sys.path!r}; from {__name__} import _builder_main; _builder_main()"
        if self._stopped:
            raise SnapshotBuildError(f"The build of the snapshot at {self.job.index} was stopped before it started.")
        # A session of its own: a Ctrl-C at the server's terminal is the server's to handle.
        proc = self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            bootstrap,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,
            limit=SNAPSHOT_PART_BYTES,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            try:
                proc.stdin.write(_LENGTH.pack(len(payload)) + payload)
                await proc.stdin.drain()
                header = await proc.stdout.readexactly(1 + _LENGTH.size)
                body = await proc.stdout.readexactly(_LENGTH.unpack(header[1:])[0])
                await proc.stdout.read()  # to the end, so the pipe is closed
            except (asyncio.IncompleteReadError, BrokenPipeError, ConnectionResetError):
                header, body = b"", b""
            # stdin stays open until the builder exits: its EOF means "your parent is gone".
            status = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            proc.stdin.close()
        if status == 0 and header[:1] == bytes([_BUILD_OK]):
            return body[32:], body[:32]
        if self._stopped:
            why = "it was stopped (the log is closing)"
        elif header[:1] == bytes([_BUILD_FAILED]):
            why = body.decode("utf-8", "replace")
        elif status < 0:
            why = f"the builder process was killed by signal {-status}"
        else:
            why = f"the builder process exited with status {status} (its stderr is in the server's log)"
        raise SnapshotBuildError(f"Building the snapshot at {self.job.index} failed: {why}")

    def stop(self) -> None:
        """Kill the builder if it runs, or keep it from starting; :meth:`run` then raises."""
        self._stopped = True
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()


def _builder_main() -> None:
    """The builder process: read one job from stdin, build, write the result to stdout, exit.

    The result is one status byte, a length, and either SHA-256 + msgpack(state) or an
    error message. Anything else printed (by the replica's module, say) goes to stderr.
    """
    gc.disable()  # short-lived, single-threaded, acyclic data: see compaction.py
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    job = receive_job()
    try:
        blob = _build(job)
        status, body = _BUILD_OK, hashlib.sha256(blob).digest() + blob
    except Exception as exc:  # noqa: BLE001 (every failure is reported the same way)
        status, body = _BUILD_FAILED, f"{type(exc).__name__}: {exc}".encode()
    out.write(bytes([status]) + _LENGTH.pack(len(body)))
    out.write(body)
    out.flush()


def _split(blob: bytes) -> Iterator[tuple[int, bytes]]:
    view = memoryview(blob)
    for part, start in enumerate(range(0, len(blob), SNAPSHOT_PART_BYTES)):
        yield part, bytes(view[start : start + SNAPSHOT_PART_BYTES])


# ----------------------------------------------------------------------- the log


class EtcdLog:
    """The replicated :class:`~.log.Log`, for the leader; see the module docstring.

    Create it with :meth:`open` once :class:`~.election.Election` has returned the fence,
    or, for a follower that has tailed the log, with the constructor (see below). The
    client stays the caller's to close.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        fence: LeaderKey,
        *,
        last_index: int,
        snapshot_index: int,
        append_timeout_s: float = DEFAULT_APPEND_TIMEOUT_S,
        max_queued_records: int = DEFAULT_MAX_QUEUED_RECORDS,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        max_record_bytes: int = MAX_RECORD_BYTES,
    ):
        """The log continuing after ``last_index``, for the leader holding ``fence``.

        Supported for a follower that becomes leader without reading everything again:
        ``last_index`` is the last record it applied through :func:`tail`, which must have
        reached :func:`log_head` read after winning the election; ``snapshot_index`` is
        :func:`snapshot_index` (it only sets :attr:`records_since_snapshot`; each snapshot
        reads what etcd holds). A stale ``last_index`` overwrites nothing: the first append
        fails with :class:`EtcdLogHeadMismatchError`.

        ``append_timeout_s`` bounds one txn of records, retries included (past it the log
        fails); ``max_queued_records`` and ``max_queued_bytes`` bound the records waiting
        for the writer and ``max_record_bytes`` one record (:meth:`check` refuses past them).
        """
        self._client = client
        self._append_timeout_s = append_timeout_s
        self._max_queued_records = max_queued_records
        self._max_queued_bytes = max_queued_bytes
        self.max_record_bytes = max_record_bytes
        self._queued_bytes = 0  # of self._pending
        self._inflight: list[_Pending] = []  # the batch whose txn is under way
        self._checked: tuple[dict[str, Any], bytes] | None = None  # the record check() encoded last
        self._prefix = prefix
        self._keys = EtcdLogKeys(prefix)
        self._fence = fence
        self._last_index = last_index
        self._cut_index = snapshot_index
        self._stored_index = snapshot_index  # the newest snapshot known to be in etcd
        self._pending: list[_Pending] = []
        self._latest: asyncio.Future[None] | None = None  # the last appended record's future
        self._wakeup = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        self._snapshot_task: asyncio.Future[None] | None = None
        self._builder: _Builder | None = None
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

    def check(self, record: dict[str, Any]) -> None:
        """Refuse a record etcd would not take and a queue at its bound; see :meth:`.log.Log.check`.

        Raises :class:`~.error.RecordTooLargeError` for a record over
        :attr:`max_record_bytes` encoded, :class:`~.error.LogQueueFullError` while the
        queue is at its bound, and what msgpack raises. The encoding is kept for the
        :meth:`append` of this very record that follows (encoded once, not twice).
        """
        if len(self._pending) >= self._max_queued_records or self._queued_bytes >= self._max_queued_bytes:
            raise LogQueueFullError(
                f"The etcd log under {self._prefix!r} has {len(self._pending)} records ({self._queued_bytes} bytes) "
                f"waiting for etcd, its bound ({self._max_queued_records} records, {self._max_queued_bytes} bytes)."
            )
        payload: bytes = msgpack.packb(record, use_bin_type=True)
        if len(payload) > self.max_record_bytes:
            raise RecordTooLargeError(
                f"The record is {len(payload)} bytes; the etcd log under {self._prefix!r} takes at most "
                f"{self.max_record_bytes} bytes per record (etcd refuses requests over its --max-request-bytes, "
                "1.5 MiB by default).",
                len(payload),
                self.max_record_bytes,
            )
        self._checked = (record, payload)

    def append(self, record: dict[str, Any]) -> asyncio.Future[None]:
        """Queue ``record`` as the next index; the future resolves once etcd committed it.

        Raises what msgpack raises for a record it cannot encode and
        :class:`~.error.LogClosedError` once closing; the future fails with
        :class:`NotLeaderError` when the fence fails, :class:`EtcdLogHeadMismatchError`
        when etcd's log does not end where this one continues, and
        :class:`~.error.LogFailedError` when etcd refuses or cannot be reached.
        """
        if self._closing:
            raise LogClosedError(f"The etcd log under {self._prefix!r} is closed; cannot append.")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._failure is not None:
            future.set_exception(self._failure)
            return future
        checked, self._checked = self._checked, None
        payload: bytes = checked[1] if checked is not None and checked[0] is record else msgpack.packb(
            record, use_bin_type=True
        )
        self._last_index += 1
        self._pending.append(_Pending(self._last_index, payload, future))
        self._queued_bytes += len(payload)
        self._latest = future
        self._wake_writer()
        return future

    def snapshot(self, replica: ReplicaFactory) -> asyncio.Future[None]:
        """Cut now at the last appended record; see :meth:`.log.Log.snapshot`.

        The returned task waits for that record's commit, rebuilds the state there from
        etcd with ``replica`` (in a child process), writes it in parts and commits it as
        the module docstring says, then compacts etcd's history. It fails with
        :class:`SnapshotBuildError` when rebuilding fails or etcd does not take a step
        (the log stays usable; a later snapshot tries again), :class:`NotLeaderError`
        when the fence fails, :class:`~.error.LogFailedError` when a record it covers was
        not committed, :class:`EtcdSnapshotCorruptError` when the stored snapshot does not
        verify, and :class:`~.error.LogClosedError` when the log closed during the build.
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
        if self._stored_index >= index:
            return
        started = time.monotonic()
        try:
            stored = await _read_stored(self._client, self._prefix)
        except EtcdError as exc:
            raise SnapshotBuildError(f"Reading the etcd log for the snapshot at {index} failed: {exc}") from exc
        base = stored.snapshot_index
        if base >= index:
            self._stored_index = base
            return
        covered = stored.records[: index - base]
        if len(covered) != index - base:
            raise SnapshotBuildError(
                f"The etcd log under {self._prefix!r} does not hold records {base + 1}..{index} for the snapshot."
            )
        await self._clear_snapshot_parts(keep=base)
        built = time.monotonic()
        blob, digest = await self._build(_BuildJob(index, stored.snapshot, covered, replica))
        written = time.monotonic()
        meta = SnapshotMeta(index=index, parts=-(-len(blob) // SNAPSHOT_PART_BYTES), size=len(blob), sha256=digest)
        await self.put_snapshot_parts(index, blob)
        await self._commit_snapshot(meta, stored.meta_revision)
        self._stored_index = index
        await self._compact(stored.meta_revision)
        logger.info(
            "Stored the snapshot at %d in etcd under %r: %d bytes in %d parts, %d records replayed onto the "
            "previous one (read %.2f s, build %.2f s off the event loop, write %.2f s); compacted etcd's history "
            "up to revision %d.",
            index,
            self._prefix,
            meta.size,
            meta.parts,
            len(covered),
            built - started,
            written - built,
            time.monotonic() - written,
            stored.meta_revision,
        )

    async def _build(self, job: _BuildJob) -> tuple[bytes, bytes]:
        if self._closing:
            raise LogClosedError(
                f"The etcd log under {self._prefix!r} is closing; the snapshot at {job.index} is not built."
            )
        builder = self._builder = _Builder(job)
        try:
            return await builder.run()
        except SnapshotBuildError as exc:
            if self._closing:
                raise LogClosedError(
                    f"The etcd log under {self._prefix!r} closed while the snapshot at {job.index} was built."
                ) from exc
            raise
        finally:
            self._builder = None

    async def _fenced(self, what: str, ops: list[Put | DeleteRange]) -> None:
        """Run ``ops`` in one txn if this leader still holds its fence; else fail the log."""
        try:
            result = await self._client.txn([self._fence.fence()], ops)
        except EtcdError as exc:
            raise SnapshotBuildError(f"etcd did not {what} under {self._prefix!r}: {exc}") from exc
        if not result.succeeded:
            raise self._lose_leadership()

    async def _clear_snapshot_parts(self, keep: int) -> None:
        """Delete every snapshot part but those of the snapshot at ``keep`` (what abandoned snapshots left)."""
        kept = self._keys.snapshot_parts(keep)
        await self._fenced(
            "delete abandoned snapshot parts",
            [
                DeleteRange(self._keys.snapshot_dir, kept),
                DeleteRange(prefix_end(kept), prefix_end(self._keys.snapshot_dir)),
            ],
        )

    async def put_snapshot_part(self, index: int, part: int, data: bytes) -> None:
        """Write part ``part`` of the snapshot at ``index`` in a fenced txn of its own.

        A step of :meth:`snapshot`, public so that tests can abandon a snapshot half-way.
        Raises :class:`NotLeaderError` (and fails the log) when the fence fails and
        :class:`~.error.SnapshotBuildError` when etcd does not take the write.
        """
        await self._fenced(
            f"store part {part} of the snapshot at {index}", [Put(self._keys.snapshot_part(index, part), data)]
        )

    async def put_snapshot_parts(self, index: int, blob: bytes) -> None:
        """Write ``blob`` as the parts of the snapshot at ``index``, a few txns in flight.

        Raises what :meth:`put_snapshot_part` raises, for the first part that fails; the
        parts in flight then finish, and none is started after it.
        """
        parts = _split(blob)
        failed = False

        async def worker() -> None:
            nonlocal failed
            for part, data in parts:  # shared: each part is taken by exactly one worker
                if failed:
                    return
                try:
                    await self.put_snapshot_part(index, part, data)
                except BaseException:
                    failed = True
                    raise

        outcomes = await asyncio.gather(*[worker() for _ in range(SNAPSHOT_WRITES_IN_FLIGHT)], return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _commit_snapshot(self, meta: SnapshotMeta, previous_revision: int) -> None:
        """Put the meta, delete the records and older parts it covers: one txn, fenced.

        Also compared on the meta's mod revision as read before the build, so nothing
        deletes parts a meta written meanwhile names.
        """
        keys, value = self._keys, meta.encode()
        try:
            result = await self._client.txn(
                [self._fence.fence(), Compare(keys.snapshot_meta, "MOD", previous_revision)],
                [
                    Put(keys.snapshot_meta, value),
                    DeleteRange(keys.record(0), keys.record(meta.index + 1)),
                    DeleteRange(keys.snapshot_dir, keys.snapshot_parts(meta.index)),
                ],
                [Get(self._fence.key), Get(keys.snapshot_meta)],
            )
        except EtcdError as exc:
            raise SnapshotBuildError(f"etcd did not store the snapshot at {meta.index}: {exc}") from exc
        if result.succeeded:
            return
        fence_kvs, meta_kvs = result.ranges
        if meta_kvs and meta_kvs[0].value == value:
            return  # this very txn, sent again after its answer was lost
        if not self._holds_fence(fence_kvs):
            raise self._lose_leadership()
        raise SnapshotBuildError(
            f"The snapshot meta under {self._prefix!r} changed while the snapshot at {meta.index} was built; "
            "something else writes under this prefix. Use a prefix of its own for every cluster."
        )

    async def _compact(self, revision: int) -> None:
        """Compact etcd's history before ``revision`` (the previous snapshot's commit).

        Not fenced (etcd cannot fence a compaction), and needs not be: a deposed leader
        compacts at most up to a snapshot commit the new leader's own compaction passes
        anyway. A failure costs only disk space until the next snapshot, so it is logged.
        """
        if revision <= 0:
            return
        try:
            await self._client.compact(revision)
        except EtcdRequestError as exc:
            if not _is_compacted(exc):  # else compacted further already, by etcd's own auto-compaction say
                logger.warning("Compacting etcd's history at revision %d failed: %s", revision, exc)
        except EtcdError as exc:
            logger.warning("Compacting etcd's history at revision %d failed: %s", revision, exc)

    async def close(self) -> None:
        """Commit everything pending, then stop (idempotent); the client stays open.

        A running snapshot build is stopped (the task fails with
        :class:`~.error.LogClosedError`); a snapshot being written is awaited.
        """
        if self._closing:
            return
        self._closing = True
        if self._builder is not None:
            self._builder.stop()
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
        self._queued_bytes -= size
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
            batch = self._inflight = self._take_batch()
            error = await self._write_batch(batch)
            self._inflight = []
            if error is not None:
                self._fail(error, batch)
                return
            for item in batch:
                if not item.future.done():  # a caller may have cancelled its wait
                    item.future.set_result(None)

    async def _write_batch(self, batch: list[_Pending]) -> LogFailedError | None:
        """Commit ``batch`` in one txn; the error that fails the log, or ``None``."""
        keys, first, last = self._keys, batch[0].index, batch[-1].index
        ops = [Put(keys.record(item.index), item.payload) for item in batch]
        ops.append(Put(keys.head, str(last).encode()))
        # log-head is the index before the batch (absent before record 1: create revision 0).
        head = Compare(keys.head, "VALUE", str(first - 1).encode()) if first > 1 else Compare(keys.head, "CREATE", 0)
        # On a failed compare, read what decides why: the fence, log-head, and the batch's keys.
        diagnose = [Get(self._fence.key), Get(keys.head), Get(keys.record(first), keys.record(last + 1))]
        try:
            result = await asyncio.wait_for(
                self._client.txn([self._fence.fence(), head], ops, diagnose), self._append_timeout_s
            )
        except (EtcdError, asyncio.TimeoutError) as exc:
            why = str(exc) if isinstance(exc, EtcdError) else f"no answer within {self._append_timeout_s:g} s"
            error = LogFailedError(
                f"etcd did not commit records {first}..{last} under {self._prefix!r} "
                f"({why}); nothing is acknowledged any more."
            )
            error.__cause__ = exc
            return error
        if result.succeeded:
            return None
        fence_kvs, head_kvs, record_kvs = result.ranges
        stored_head = int(head_kvs[0].value) if head_kvs else 0
        if stored_head == last and [kv.value for kv in record_kvs] == [item.payload for item in batch]:
            # This very txn, sent again after its answer was lost (or, just as good, the
            # same bytes at the same indices): etcd holds exactly what was asked.
            return None
        if not self._holds_fence(fence_kvs):
            return self._not_leader()
        return EtcdLogHeadMismatchError(
            f"etcd's log under {self._prefix!r} ends at record {stored_head}, but replica {self._fence.name} "
            f"continues after record {first - 1}; nothing was written. A follower must tail up to log-head "
            "(read after winning the election) before it leads, or open the log with EtcdLog.open."
        )

    def _holds_fence(self, fence_kvs: list[KeyValue]) -> bool:
        return bool(fence_kvs) and fence_kvs[0].create_revision == self._fence.create_revision

    def _not_leader(self) -> NotLeaderError:
        return NotLeaderError(
            f"Replica {self._fence.name} no longer leads under {self._prefix!r}: its election key "
            f"{self._fence.key.decode(errors='replace')} (created at revision {self._fence.create_revision}) "
            "is gone, so its lease expired or it resigned; it must not write."
        )

    def _lose_leadership(self) -> LogFailedError:
        """Fail the log for good as not leader (keeping an earlier failure); return the failure."""
        if self._failure is None:
            self._fail(self._not_leader(), [])
        assert self._failure is not None
        return self._failure

    def abandon(self, reason: str) -> None:
        """Stop at once; see :meth:`.log.ReplicatedLog.abandon`.

        The writer is cancelled mid-txn: a leader that steps down can no longer commit
        under its fence (or no longer knows whether it can), and its callers must hear so
        now, not when etcd or the client's retries give up. A txn already sent may still
        commit; the callers' retries at the next leader carry their request ids, so such a
        write applies once either way.
        """
        self._closing = True
        if self._failure is None:
            self._fail(
                NotLeaderError(
                    f"Replica {self._fence.name} stopped writing the etcd log under {self._prefix!r}: {reason}."
                ),
                self._inflight,
            )
        self._inflight = []
        for task in (self._writer, self._snapshot_task):
            if task is not None and not task.done():
                task.cancel()
        if self._builder is not None:
            self._builder.stop()

    def _fail(self, error: LogFailedError, batch: list[_Pending]) -> None:
        self._failure = error
        waiting = batch + self._pending
        self._pending = []
        self._queued_bytes = 0
        logger.error("%s %d pending records are not acknowledged.", error, len(waiting))
        for item in waiting:
            if not item.future.done():
                item.future.set_exception(error)
