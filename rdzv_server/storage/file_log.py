"""The durable log: segments and snapshots in a data directory, written off the event loop.

What it owns: the write path (one writer task on the event loop feeding one writer thread),
the fsync policies, segment rotation at snapshots, starting and installing snapshot builds
(:mod:`.compaction`), and which old files may be deleted.

What it must not know: HTTP, or what records and states mean.

How a record becomes durable. ``append`` encodes the record into a frame at once (so a bad
record fails its caller, not the log) and queues it with a future. The writer task takes
everything queued, hands it to the writer thread as one ``write()`` (plus an ``fsync()``
unless the policy is ``NEVER``), and resolves the futures when the thread returns. Records
that arrive while the thread is busy are queued for the next round, so under load every
fsync covers many records (group commit) without any policy waiting on purpose.

``ALWAYS`` versus ``BATCH``. Both acknowledge a record only after an fsync that includes
it, and both share one fsync among the records queued while the previous one ran.
``ALWAYS`` starts the next write as soon as the previous one finished, so it fsyncs as
often as the disk allows whenever anything is queued. ``BATCH`` caps the rate: it starts
a write no sooner than ``batch_window_s`` (2 ms by default) after the previous one
started, so there are at most 500 fsyncs a second however the load arrives, each
covering everything gathered meanwhile. A record arriving after a quiet spell is written
at once, as under ``ALWAYS``; under load each record waits up to one window longer in
exchange for a bounded fsync rate (less I/O competing with, say, training checkpoints on
the same disk). In a closed loop, where every client waits for its ack before writing
again, ``ALWAYS`` already groups all outstanding records and ``BATCH`` only adds latency.

Invariants:
- Records reach the disk in ``append`` order: one task hands them to one thread in order.
- A future resolves successfully only after its record's bytes were written (and, unless
  ``NEVER``, fsynced). After any write or fsync error the log is failed for good: every
  pending and later future fails with :class:`LogFailedError` and nothing is retried.
- A snapshot at index ``i`` first rotates the log (the writer fsyncs the segment holding
  ``i``, whatever the policy, and creates ``log-<i+1>``, fsyncing the directory). On the
  event loop that is all: O(1), whatever the state's size. Then a builder process rebuilds
  the state at ``i`` from the newest durable snapshot and the closed segments up to ``i``
  and writes ``snapshot-<i>.msgpack.tmp`` (fsynced); this log renames it into place and
  fsyncs the directory. So a snapshot on disk implies every record it covers was written
  and fsynced before it, and the log continues at ``i + 1``.
- Snapshots finish in cut order, one build at a time; a cut whose index the newest durable
  snapshot already covers builds nothing. A failed build changes nothing on disk (the
  records stay in the log, and the next cut builds from the same base). ``close`` stops a
  running build rather than wait for it: the records are durable without it.
- Retention keeps one generation back: after snapshot ``i`` is durable, the previous
  snapshot ``p`` and the segments after ``p`` are kept; older snapshots and segments
  wholly covered by ``p`` are deleted. If snapshot ``i`` is later found damaged, recovery
  falls back to ``p`` and replays to the same point instead of refusing to start.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .compaction import BuildJob, SnapshotBuilder
from .data_dir import DataDirLock, fsync_directory
from .error import LogClosedError, LogFailedError, LogQueueFullError, SnapshotBuildError
from .log import DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_QUEUED_RECORDS, FsyncPolicy, Recovered, ReplicaFactory
from .recovery import recover
from .segment import encode_frame, segment_name
from .snapshot import install_snapshot, parse_snapshot_name, snapshot_name, temp_path

logger = logging.getLogger(__name__)

# Caps BATCH at 500 fsyncs a second, a small load for any disk, while adding at most 2 ms
# to a write, about what one fsync costs on a commodity SSD anyway.
DEFAULT_BATCH_WINDOW_S = 0.002


@dataclass(frozen=True)
class _Rotation:
    """Start segment ``log-<first>`` after the ``position``-th queued frame of a batch."""

    position: int
    first: int
    done: asyncio.Future[None]


class _Segment:
    """The segment being appended to. Touched only by the writer thread after ``open``."""

    def __init__(self, path: Path, fsync: Callable[[int], None], *, create: bool) -> None:
        """Open ``path`` for appending; when ``create``, make it and fsync the directory.

        Raises ``OSError`` if the file cannot be opened or created.
        """
        self.path = path
        self._fsync = fsync
        flags = os.O_WRONLY | os.O_APPEND | getattr(os, "O_BINARY", 0)
        if create:
            flags |= os.O_CREAT | os.O_EXCL
        self._fd: int | None = os.open(path, flags, 0o600)
        if create:
            try:
                # Records acknowledged in this file are only durable once its name is.
                fsync_directory(path.parent, fsync)
            except BaseException:
                self.close()
                raise

    def write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            written = os.write(self._fd, view)
            view = view[written:]

    def sync(self) -> None:
        assert self._fd is not None
        self._fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


class FileLog:
    """The durable :class:`~.log.Log`: see the module docstring for the write path.

    Create it with :meth:`open`, which recovers the directory first. Use it from one event
    loop; call :meth:`close` before dropping it.
    """

    def __init__(
        self,
        *,
        data_dir: Path,
        policy: FsyncPolicy,
        fsync_fn: Callable[[int], None],
        batch_window_s: float,
        lock: DataDirLock,
        segment: _Segment,
        segment_first: int,
        segment_firsts: list[int],
        last_index: int,
        snapshot_index: int | None,
        max_queued_records: int,
        max_queued_bytes: int,
    ) -> None:
        """Use :meth:`open`; this only wires the pieces that ``open`` has prepared."""
        self._data_dir = data_dir
        self._max_queued_records = max_queued_records
        self._max_queued_bytes = max_queued_bytes
        self._queued_bytes = 0  # of self._frames
        self._policy = policy
        self._fsync = fsync_fn
        self._batch_window_s = batch_window_s
        self._lock = lock
        self._segment = segment  # owned by the writer thread once the log runs
        # Event-loop view of the segments, including rotations not yet done by the thread.
        self._segment_first = segment_first
        self._segment_firsts = segment_firsts
        self._last_index = last_index
        self._cut_index = snapshot_index or 0
        self._snapshot_index = snapshot_index  # the newest snapshot known to be durable
        self._frames: list[bytes] = []
        self._futures: list[asyncio.Future[None]] = []
        self._rotations: list[_Rotation] = []
        self._wakeup = asyncio.Event()
        self._writer: asyncio.Task[None] | None = None
        # One thread, so writes happen one after another in the order they were handed over.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rdzv-log-writer")
        self._snapshot_task: asyncio.Future[None] | None = None  # the latest cut's
        self._builder: SnapshotBuilder | None = None  # the build running now
        self._failure: BaseException | None = None
        self._closing = False

    @classmethod
    def open(
        cls,
        data_dir: Path,
        fsync: FsyncPolicy,
        *,
        fsync_fn: Callable[[int], None] = os.fsync,
        batch_window_s: float = DEFAULT_BATCH_WINDOW_S,
        truncate_corrupt: bool = False,
        max_queued_records: int = DEFAULT_MAX_QUEUED_RECORDS,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
    ) -> tuple[FileLog, Recovered]:
        """Lock and recover ``data_dir`` (creating it if needed); return the log and history.

        ``fsync_fn`` is called for every fsync of a file or directory by this process (a
        seam for tests; a snapshot builder process fsyncs its file with ``os.fsync``);
        ``batch_window_s`` is the least time between the starts of two writes under
        :attr:`FsyncPolicy.BATCH`; ``truncate_corrupt`` keeps the records before damage
        instead of refusing (``--truncate-corrupt-log``, see :mod:`.recovery`);
        ``max_queued_records`` and ``max_queued_bytes`` bound the records waiting for the
        writer (:meth:`check` refuses past them).

        Synchronous: it blocks until recovery is done, which is what the server must do
        before it reports ready. Raises :class:`~.error.DataDirLockedError` if another
        process holds the directory, :class:`~.error.LogCorruptError` for damage recovery
        must not repair, and ``OSError`` when the directory cannot be read or written.
        """
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = DataDirLock(data_dir)
        try:
            outcome = recover(data_dir, fsync_fn, truncate_corrupt=truncate_corrupt)
            segment_firsts = list(outcome.segment_firsts)
            path = data_dir / segment_name(outcome.append_first)
            segment = _Segment(path, fsync_fn, create=not outcome.append_exists)
            if not outcome.append_exists:
                segment_firsts.append(outcome.append_first)
        except BaseException:
            lock.release()
            raise
        log = cls(
            data_dir=data_dir,
            policy=fsync,
            fsync_fn=fsync_fn,
            batch_window_s=batch_window_s,
            lock=lock,
            segment=segment,
            segment_first=outcome.append_first,
            segment_firsts=segment_firsts,
            last_index=outcome.recovered.last_index,
            snapshot_index=outcome.snapshot_index,
            max_queued_records=max_queued_records,
            max_queued_bytes=max_queued_bytes,
        )
        return log, outcome.recovered

    @property
    def records_since_snapshot(self) -> int:
        """Records appended since the last snapshot's cut (or since the recovered snapshot)."""
        return self._last_index - self._cut_index

    def check(self, record: dict[str, Any]) -> None:
        """Refuse (:class:`~.error.LogQueueFullError`) while the queue is at its bound; see
        :meth:`.log.Log.check`. A local log takes a record of any size: no size check."""
        if len(self._frames) >= self._max_queued_records or self._queued_bytes >= self._max_queued_bytes:
            raise LogQueueFullError(
                f"The log in {self._data_dir} has {len(self._frames)} records ({self._queued_bytes} bytes) waiting "
                f"for the disk, its bound ({self._max_queued_records} records, {self._max_queued_bytes} bytes)."
            )

    def append(self, record: dict[str, Any]) -> asyncio.Future[None]:
        """Queue ``record`` as the next index; see :meth:`.log.Log.append` for what it raises."""
        if self._closing:
            raise LogClosedError(f"The log in {self._data_dir} is closed; cannot append.")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._failure is not None:
            future.set_exception(self._failed_error())
            return future
        # Encode now: the caller learns at once about a value msgpack cannot take, no index
        # is spent on it, and later mutation of the record cannot change what is written.
        frame = encode_frame(record)
        self._last_index += 1
        self._frames.append(frame)
        self._queued_bytes += len(frame)
        self._futures.append(future)
        self._wake_writer()
        return future

    def snapshot(self, replica: ReplicaFactory) -> asyncio.Future[None]:
        """Cut now at the last appended record; see :meth:`.log.Log.snapshot`.

        O(1) here: the index and the rotation queued behind exactly the records the cut
        includes. The returned task builds the snapshot in a builder process with
        ``replica``, installs it and deletes what it makes redundant; it finishes after
        every snapshot cut before it.
        """
        if self._closing:
            raise LogClosedError(f"The log in {self._data_dir} is closed; cannot snapshot.")
        loop = asyncio.get_running_loop()
        if self._failure is not None:
            failed: asyncio.Future[None] = loop.create_future()
            failed.set_exception(self._failed_error())
            return failed
        index = self._last_index
        self._cut_index = index
        rotated: asyncio.Future[None] | None = None
        if self._segment_first <= index:
            rotated = loop.create_future()
            self._rotations.append(_Rotation(len(self._frames), index + 1, rotated))
            self._segment_first = index + 1
            self._segment_firsts.append(index + 1)
            self._wake_writer()
        task = loop.create_task(
            self._finish_snapshot(index, replica, rotated, self._snapshot_task),
            name=f"rdzv-snapshot {index} {self._data_dir}",
        )
        self._snapshot_task = task
        return task

    async def _finish_snapshot(
        self,
        index: int,
        replica: ReplicaFactory,
        rotated: asyncio.Future[None] | None,
        before: asyncio.Future[None] | None,
    ) -> None:
        if before is not None:
            # Finish in cut order, so retention never deletes what a later cut still needs;
            # the earlier one's outcome is its own caller's to handle.
            await asyncio.wait([before])
        if rotated is not None:
            await rotated
        base = self._snapshot_index
        if base is not None and base >= index:
            return  # the newest durable snapshot covers this cut already
        if self._closing:
            raise LogClosedError(f"The log in {self._data_dir} is closing; the snapshot at {index} is not built.")
        builder = SnapshotBuilder(self._build_job(index, base, replica))
        self._builder = builder
        try:
            report = await asyncio.to_thread(builder.run)
        except SnapshotBuildError as exc:
            if self._closing:
                raise LogClosedError(f"The log in {self._data_dir} closed while snapshot {index} was built.") from exc
            raise
        finally:
            self._builder = None
        final = self._data_dir / snapshot_name(index)
        await asyncio.to_thread(install_snapshot, builder.job.temp, final, self._fsync)
        logger.info(
            "Wrote snapshot %s (%d bytes, %d records replayed onto the previous one in %.2f s, off the event loop).",
            final,
            report.size,
            report.records,
            report.seconds,
        )
        previous, self._snapshot_index = self._snapshot_index, index
        if previous is not None and previous != index:
            covered = self._release_covered(previous)
            await asyncio.to_thread(_delete_files, self._data_dir, covered, (previous, index))

    def _build_job(self, index: int, base: int | None, replica: ReplicaFactory) -> BuildJob:
        """The closed segments from the one holding ``base + 1`` through the one ending at ``index``."""
        firsts = sorted(self._segment_firsts)
        start = max(0, bisect.bisect_right(firsts, (base or 0) + 1) - 1)
        return BuildJob(
            index=index,
            base_index=base,
            base_path=None if base is None else self._data_dir / snapshot_name(base),
            segments=tuple((first, self._data_dir / segment_name(first)) for first in firsts[start:] if first <= index),
            temp=temp_path(self._data_dir, index),
            replica=replica,
        )

    async def close(self) -> None:
        """Write and fsync everything pending, close files, release the directory lock.

        Raises :class:`~.error.LogFailedError` if this final write or fsync fails. A log
        that had already failed closes quietly: its failure was reported to every append
        it affected. Closing twice is a no-op.
        """
        if self._closing:
            return
        self._closing = True
        try:
            if self._writer is not None:
                self._wake_writer()
                await self._writer
            if self._snapshot_task is not None:
                # A running build is stopped (and later ones never start): the records are
                # durable without it, and a shutdown should not wait for it. A snapshot
                # already built still gets installed. Errors belong to the callers.
                if self._builder is not None:
                    self._builder.stop()
                await asyncio.wait([self._snapshot_task])
            if self._failure is None:
                try:
                    # Even under NEVER: a clean shutdown leaves nothing for the OS to lose.
                    await asyncio.get_running_loop().run_in_executor(
                        self._executor, self._segment.sync
                    )
                except OSError as exc:
                    self._failure = exc
                    raise self._failed_error() from exc
        finally:
            self._segment.close()
            self._executor.shutdown(wait=True)
            self._lock.release()

    # ----------------------------------------------------------------------- writer

    def _wake_writer(self) -> None:
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(
                self._run_writer(), name=f"rdzv-log-writer {self._data_dir}"
            )
        self._wakeup.set()

    async def _run_writer(self) -> None:
        loop = asyncio.get_running_loop()
        sync = self._policy is not FsyncPolicy.NEVER
        window = self._batch_window_s if self._policy is FsyncPolicy.BATCH else 0.0
        next_start = loop.time()  # BATCH: when the next write may start
        while True:
            if not self._frames and not self._rotations:
                if self._closing:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            delay = next_start - loop.time()
            if delay > 0 and not self._closing:
                await asyncio.sleep(delay)  # gather: everything arriving now shares the fsync
            next_start = loop.time() + window
            frames, futures, rotations = self._frames, self._futures, self._rotations
            self._frames, self._futures, self._rotations = [], [], []
            self._queued_bytes = 0
            try:
                await loop.run_in_executor(self._executor, self._write, frames, rotations, sync)
            # OSError in practice; whatever it is, those records must not be acknowledged.
            except Exception as exc:  # noqa: BLE001
                self._fail(exc, futures, rotations)
                return
            for future in futures:
                if not future.done():  # a caller may have cancelled its wait
                    future.set_result(None)
            for rotation in rotations:
                if not rotation.done.done():
                    rotation.done.set_result(None)

    def _write(self, frames: list[bytes], rotations: list[_Rotation], sync: bool) -> None:
        """Runs on the writer thread: write ``frames`` in order, rotating where asked."""
        start = 0
        for rotation in rotations:
            if rotation.position > start:
                self._segment.write(b"".join(frames[start : rotation.position]))
                start = rotation.position
            # Fsync under every policy: the segment is about to become a non-last one, and
            # recovery refuses a damaged non-last segment rather than truncating it.
            self._segment.sync()
            self._segment.close()
            self._segment = _Segment(
                self._data_dir / segment_name(rotation.first), self._fsync, create=True
            )
        if start < len(frames):
            self._segment.write(b"".join(frames[start:]))
        if sync:
            self._segment.sync()

    def _fail(
        self, exc: BaseException, futures: list[asyncio.Future[None]], rotations: list[_Rotation]
    ) -> None:
        self._failure = exc
        logger.error(
            "The log in %s stopped accepting writes because a write or fsync failed (%r); "
            "%d pending records are not acknowledged and every later append fails.",
            self._data_dir,
            exc,
            len(futures) + len(self._futures),
        )
        waiting = futures + self._futures
        waiting += [rotation.done for rotation in rotations + self._rotations]
        self._frames, self._futures, self._rotations = [], [], []
        self._queued_bytes = 0
        for future in waiting:
            if not future.done():
                future.set_exception(self._failed_error())

    def _failed_error(self) -> LogFailedError:
        error = LogFailedError(
            f"The log in {self._data_dir} failed on an earlier write or fsync "
            f"({self._failure!r}); nothing is acknowledged any more."
        )
        error.__cause__ = self._failure
        return error

    # --------------------------------------------------------------------- retention

    def _release_covered(self, previous: int) -> list[int]:
        """Forget the segments wholly covered by snapshot ``previous``; return their firsts.

        A segment is wholly covered when the next one starts at or below ``previous + 1``;
        the last segment never is (the log continues in it).
        """
        firsts = sorted(self._segment_firsts)
        covered = [first for first, after in itertools.pairwise(firsts) if after <= previous + 1]
        self._segment_firsts = [first for first in firsts if first not in covered]
        return covered


def _delete_files(data_dir: Path, segment_firsts: list[int], keep: tuple[int, int]) -> None:
    """Runs in a thread: delete those segments, and snapshots older than ``keep`` but not in it.

    Deletions are not fsynced: a file that reappears after a crash is harmless (covered
    segments are never read; old snapshots are only read if every newer one is damaged)
    and is deleted again after the next snapshot.
    """
    newest = max(keep)
    for first in segment_firsts:
        (data_dir / segment_name(first)).unlink(missing_ok=True)
    for name in os.listdir(data_dir):
        index = parse_snapshot_name(name)
        if index is not None and index < newest and index not in keep:
            (data_dir / name).unlink(missing_ok=True)
