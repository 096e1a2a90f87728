"""The storage package: durability rules of FileLog and MemoryLog, driven on a real tmp dir.

Crashes are simulated by killing a child process (SIGKILL) or by damaging files the way a
torn write or bit rot would; fsyncs are observed through FileLog's ``fsync_fn`` seam.
Snapshots are built for real, in a builder process, from :class:`Seen` replicas: their
state is the list of records replayed into them, so a snapshot shows exactly what it covers.
"""

from __future__ import annotations

import asyncio
import gc
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from waiting import wait_until, wait_until_async

from rdzv_server import storage
from rdzv_server.storage import (
    DataDirLockedError,
    FileLog,
    FsyncPolicy,
    LogClosedError,
    LogCorruptError,
    LogFailedError,
    MemoryLog,
    Recovered,
    SnapshotBuildError,
    default_data_dir,
)

HEADER = struct.Struct("<II")


def rec(i: int) -> dict[str, Any]:
    return {"op": "set", "k": b"key-%d" % i, "v": b"x" * 16, "i": i}


def covering(*indices: int) -> dict[str, Any]:
    """The state of a :class:`Seen` snapshot that covers ``rec(i)`` for these ``i``."""
    return {"records": [rec(i) for i in indices]}


class Seen:
    """A replica whose state is every record replayed into it (pickled by reference)."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def restore(self, state: dict[str, Any]) -> None:
        self.records = list(state["records"])

    def replay(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def to_snapshot(self) -> dict[str, Any]:
        return {"records": self.records}


class Poisoned(Seen):
    """Fails on a record carrying ``"poison"``, as a replica whose code disagrees with the log."""

    def replay(self, record: dict[str, Any]) -> None:
        if "poison" in record:
            raise RuntimeError("log replay diverged")
        super().replay(record)


class Stuck(Seen):
    """Takes far longer than any test to replay anything (a build that is still running)."""

    def replay(self, record: dict[str, Any]) -> None:
        time.sleep(60)


def seg(data_dir: Path, first: int) -> Path:
    return data_dir / f"log-{first:020d}.bin"


def snap(data_dir: Path, index: int) -> Path:
    return data_dir / f"snapshot-{index:020d}.msgpack"


def frame_offsets(path: Path) -> list[int]:
    """Byte offset of every frame in a (clean) segment."""
    data = path.read_bytes()
    offsets, offset = [], 0
    while offset < len(data):
        offsets.append(offset)
        length, _ = HEADER.unpack_from(data, offset)
        offset += HEADER.size + length
    return offsets


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def append_bytes(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def data_files(data_dir: Path) -> set[str]:
    return {p.name for p in data_dir.iterdir() if p.name != "lock"}


class CountingFsync:
    """An ``fsync_fn`` that counts calls and can hold the next one until released."""

    def __init__(self) -> None:
        self.calls = 0
        self.hold_next = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, fd: int) -> None:
        self.calls += 1
        if self.hold_next:
            self.hold_next = False
            self.entered.set()
            self.release.wait(10)
        os.fsync(fd)


async def write_log(
    data_dir: Path,
    records: list[dict[str, Any]],
    *,
    snapshot_after: tuple[int, ...] = (),
) -> None:
    """Append ``records``, snapshotting after the record at each position in ``snapshot_after``."""
    log, _ = FileLog.open(data_dir, FsyncPolicy.ALWAYS)
    for position, record in enumerate(records, start=1):
        await log.append(record)
        if position in snapshot_after:
            await log.snapshot(Seen)
    await log.close()


async def recover(data_dir: Path) -> Recovered:
    log, recovered = FileLog.open(data_dir, FsyncPolicy.ALWAYS)
    await log.close()
    return recovered


# ------------------------------------------------------------------------- round trips


async def test_a_new_directory_recovers_empty(tmp_path: Path) -> None:
    data_dir = tmp_path / "nested" / "data"
    recovered = await recover(data_dir)
    assert recovered == Recovered(snapshot=None, records=[], truncated_bytes=0, last_index=0)
    assert data_dir.is_dir()


async def test_records_round_trip_with_every_value_type(tmp_path: Path) -> None:
    records: list[dict[str, Any]] = [
        {"b": b"\x00\xff", "s": "text", "i": -(2**63), "f": 1.5, "t": True, "n": None},
        {"list": [1, b"x", "y", [None]], "map": {"a": {"b": 2}}, "intkeys": {1: b"one"}},
        {},
    ]
    await write_log(tmp_path, records)
    recovered = await recover(tmp_path)
    assert recovered.records == records
    assert recovered.last_index == 3
    assert recovered.truncated_bytes == 0


async def test_reopened_log_continues_the_index_sequence(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(1), rec(2)])
    await write_log(tmp_path, [rec(3)])
    recovered = await recover(tmp_path)
    assert recovered.records == [rec(1), rec(2), rec(3)]
    assert recovered.last_index == 3
    assert data_files(tmp_path) == {seg(tmp_path, 1).name}


def test_every_acknowledged_record_survives_a_killed_process(tmp_path: Path) -> None:
    child = textwrap.dedent(
        """
        import asyncio, sys
        from pathlib import Path
        from rdzv_server.storage import FileLog, FsyncPolicy

        async def main() -> None:
            log, _ = FileLog.open(Path(sys.argv[1]), FsyncPolicy.ALWAYS)
            i = 0
            while True:
                # Several in flight at once, so the kill can land mid-write.
                futures = [log.append({"i": i + n}) for n in range(1, 9)]
                for future in futures:
                    await future
                    i += 1
                    print(i, flush=True)

        asyncio.run(main())
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", child, str(tmp_path)], stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None
        acked = 0
        while acked < 300:
            line = proc.stdout.readline()
            assert line, "the child exited early"
            acked = int(line)
        proc.kill()  # SIGKILL: no close, no flush of anything still queued
        proc.wait()
    recovered = asyncio.run(recover(tmp_path))
    assert recovered.last_index >= acked
    assert recovered.records == [{"i": i} for i in range(1, recovered.last_index + 1)]


async def test_recovery_never_switches_the_garbage_collector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It runs in a thread beside the event loop; the collector's switch is process-wide.
    await write_log(tmp_path, [rec(i) for i in range(1, 6)], snapshot_after=(3,))

    def switched() -> None:
        raise AssertionError("recovery switched the garbage collector")

    monkeypatch.setattr(gc, "disable", switched)
    monkeypatch.setattr(gc, "enable", switched)
    recovered = await asyncio.to_thread(lambda: asyncio.run(recover(tmp_path)))
    assert recovered.records == [rec(4), rec(5)]


async def test_recovered_log_counts_records_since_its_snapshot(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 6)], snapshot_after=(3,))
    log, recovered = FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    assert log.records_since_snapshot == len(recovered.records) == 2
    await log.append(rec(6))
    assert log.records_since_snapshot == 3
    await log.close()


# ---------------------------------------------------------------------- torn tails


async def test_torn_last_record_is_truncated_and_appending_continues(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 11)])
    path = seg(tmp_path, 1)
    size = path.stat().st_size
    last_frame = frame_offsets(path)[-1]
    truncate(path, size - 3)
    append_bytes(path, b"\xde\xad\xbe\xef\x01")

    log, recovered = FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    assert recovered.records == [rec(i) for i in range(1, 10)]
    assert recovered.last_index == 9
    assert recovered.truncated_bytes == size - 3 + 5 - last_frame
    assert path.stat().st_size == last_frame
    await log.append(rec(100))
    await log.append(rec(101))
    await log.close()

    recovered = await recover(tmp_path)
    assert recovered.records == [rec(i) for i in range(1, 10)] + [rec(100), rec(101)]
    assert recovered.last_index == 11
    assert recovered.truncated_bytes == 0


async def test_crc_mismatch_in_the_last_record_is_a_torn_tail(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 11)])
    path = seg(tmp_path, 1)
    size = path.stat().st_size
    last = frame_offsets(path)[-1]
    flip_byte(path, last + HEADER.size + 2)  # inside record 10's payload: nothing valid after it

    recovered = await recover(tmp_path)
    assert recovered.records == [rec(i) for i in range(1, 10)]
    assert recovered.truncated_bytes == size - last
    assert path.stat().st_size == last


async def test_crc_mismatch_mid_last_segment_with_valid_records_after_refuses_naming_file_and_offset(
    tmp_path: Path,
) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 11)])
    path = seg(tmp_path, 1)
    before = path.read_bytes()
    fifth = frame_offsets(path)[4]
    flip_byte(path, fifth + HEADER.size + 2)  # inside record 5's payload; records 6-10 are intact

    with pytest.raises(LogCorruptError) as caught:
        FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    assert caught.value.path == path
    assert caught.value.offset == fifth
    message = str(caught.value)
    assert f"file {path}, offset {fifth}" in message
    assert "5 whole, verified records follow it" in message
    assert "--truncate-corrupt-log" in message and "\n" not in message
    # Nothing was repaired behind the operator's back.
    assert len(path.read_bytes()) == len(before)
    assert data_files(tmp_path) == {path.name}


async def test_damaged_length_field_mid_segment_is_found_by_resynchronising(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 11)])
    path = seg(tmp_path, 1)
    third = frame_offsets(path)[2]
    flip_byte(path, third + 3)  # the length's top byte: the frame now "runs past the end"

    with pytest.raises(LogCorruptError, match="runs past the end .* 7 whole, verified records") as caught:
        FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    assert (caught.value.path, caught.value.offset) == (path, third)


async def test_truncate_corrupt_keeps_the_records_before_the_damage_and_sets_the_segment_aside(
    tmp_path: Path,
) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 11)])
    path = seg(tmp_path, 1)
    fifth = frame_offsets(path)[4]
    flip_byte(path, fifth + HEADER.size + 2)
    damaged = path.read_bytes()

    log, recovered = FileLog.open(tmp_path, FsyncPolicy.ALWAYS, truncate_corrupt=True)
    assert recovered.records == [rec(i) for i in range(1, 5)]
    assert recovered.last_index == 4
    assert path.stat().st_size == fifth
    (aside,) = [p for p in tmp_path.iterdir() if ".corrupt-" in p.name]
    assert aside.name.startswith(path.name + ".corrupt-")
    assert aside.read_bytes() == damaged  # kept whole, never deleted
    await log.append(rec(100))
    await log.close()

    # The repaired log is clean: a start without the flag recovers it, and keeps the copy.
    recovered = await recover(tmp_path)
    assert recovered.records == [rec(i) for i in range(1, 5)] + [rec(100)]
    assert aside.exists()


async def test_truncate_corrupt_sets_aside_every_segment_after_the_damaged_one(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 11)], snapshot_after=(5,))
    snap(tmp_path, 5).unlink()  # replay must read log-1, which is not the last segment
    third = frame_offsets(seg(tmp_path, 1))[2]
    flip_byte(seg(tmp_path, 1), third + HEADER.size)
    later = seg(tmp_path, 6).read_bytes()

    log, recovered = FileLog.open(tmp_path, FsyncPolicy.ALWAYS, truncate_corrupt=True)
    assert recovered.records == [rec(1), rec(2)]
    await log.append(rec(3))
    await log.close()
    assert not seg(tmp_path, 6).exists()
    names = {p.name for p in tmp_path.iterdir()}
    (moved,) = [n for n in names if n.startswith(seg(tmp_path, 6).name + ".corrupt-")]
    assert (tmp_path / moved).read_bytes() == later
    assert any(n.startswith(seg(tmp_path, 1).name + ".corrupt-") for n in names)
    assert (await recover(tmp_path)).records == [rec(1), rec(2), rec(3)]


async def test_truncate_corrupt_cuts_the_log_at_a_gap_between_segments(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 9)], snapshot_after=(5,))
    snap(tmp_path, 5).unlink()
    truncate(seg(tmp_path, 1), frame_offsets(seg(tmp_path, 1))[-1])  # record 5 is gone

    log, recovered = FileLog.open(tmp_path, FsyncPolicy.ALWAYS, truncate_corrupt=True)
    assert recovered.records == [rec(i) for i in range(1, 5)]
    await log.append(rec(5))
    await log.close()
    assert not seg(tmp_path, 6).exists()
    assert any(p.name.startswith(seg(tmp_path, 6).name + ".corrupt-") for p in tmp_path.iterdir())
    assert (await recover(tmp_path)).records == [rec(i) for i in range(1, 6)]


async def test_truncate_corrupt_leaves_a_clean_log_and_a_torn_tail_as_they_were(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 6)])
    append_bytes(seg(tmp_path, 1), b"\x10\x00\x00\x00torn")
    log, recovered = FileLog.open(tmp_path, FsyncPolicy.ALWAYS, truncate_corrupt=True)
    await log.close()
    assert recovered.records == [rec(i) for i in range(1, 6)]
    assert recovered.truncated_bytes == 8
    assert data_files(tmp_path) == {seg(tmp_path, 1).name}


async def test_zero_filled_tail_is_truncated_not_read_as_empty_frames(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(1), rec(2)])
    path = seg(tmp_path, 1)
    append_bytes(path, bytes(4096))

    recovered = await recover(tmp_path)
    assert recovered.records == [rec(1), rec(2)]
    assert recovered.truncated_bytes == 4096


async def test_bad_frame_in_an_older_segment_refuses_to_start(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 11)], snapshot_after=(5,))
    # Without the snapshot, replay must read log-1, which is no longer the last segment.
    snap(tmp_path, 5).unlink()
    third = frame_offsets(seg(tmp_path, 1))[2]
    flip_byte(seg(tmp_path, 1), third + HEADER.size)

    with pytest.raises(LogCorruptError) as caught:
        FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    assert caught.value.path == seg(tmp_path, 1)
    assert caught.value.offset == third
    assert "not the last" in str(caught.value)


async def test_failed_open_releases_the_directory_lock(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 11)], snapshot_after=(5,))
    snap(tmp_path, 5).unlink()
    flip_byte(seg(tmp_path, 1), HEADER.size)
    with pytest.raises(LogCorruptError):
        FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    seg(tmp_path, 1).unlink()
    # A second open gets as far as recovery (a gap now), so the first one let go of the lock.
    with pytest.raises(LogCorruptError, match="missing"):
        FileLog.open(tmp_path, FsyncPolicy.ALWAYS)


async def test_gap_between_segments_refuses_to_start(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 9)], snapshot_after=(5,))
    snap(tmp_path, 5).unlink()  # replay from record 1, through log-1 and into log-6
    path = seg(tmp_path, 1)
    truncate(path, frame_offsets(path)[-1])  # a whole frame gone: record 5 is missing

    with pytest.raises(LogCorruptError, match="starts at record 6 .* ends at record 4") as caught:
        FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    assert caught.value.path == seg(tmp_path, 6)


async def test_log_starting_after_the_snapshot_refuses_to_start(tmp_path: Path) -> None:
    await write_log(
        tmp_path,
        [rec(i) for i in range(1, 13)],
        snapshot_after=(5, 10),
    )
    assert data_files(tmp_path) == {
        seg(tmp_path, 11).name,
        seg(tmp_path, 6).name,
        snap(tmp_path, 5).name,
        snap(tmp_path, 10).name,
    }
    seg(tmp_path, 6).unlink()
    snap(tmp_path, 10).unlink()

    with pytest.raises(LogCorruptError, match="records 6 to 10 are missing") as caught:
        FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    assert caught.value.path == seg(tmp_path, 11)


async def test_crc_valid_garbage_is_corruption_not_a_torn_tail(tmp_path: Path) -> None:
    import zlib

    payload = b"\xc1"  # reserved msgpack byte: never valid
    seg(tmp_path, 1).write_bytes(HEADER.pack(len(payload), zlib.crc32(payload)) + payload)
    with pytest.raises(LogCorruptError, match="not valid msgpack"):
        FileLog.open(tmp_path, FsyncPolicy.ALWAYS)


# ------------------------------------------------------------------------- snapshots


async def test_snapshot_then_more_records_recovers_snapshot_and_later_records(
    tmp_path: Path,
) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 8)], snapshot_after=(4,))
    recovered = await recover(tmp_path)
    assert recovered.snapshot == covering(1, 2, 3, 4)
    assert recovered.records == [rec(5), rec(6), rec(7)]
    assert recovered.last_index == 7


async def test_snapshot_with_no_later_records_reports_its_index(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(1), rec(2)], snapshot_after=(2,))
    recovered = await recover(tmp_path)
    assert recovered.snapshot == covering(1, 2)
    assert recovered.records == []
    assert recovered.last_index == 2


async def test_snapshot_covers_exactly_the_records_appended_before_the_call(
    tmp_path: Path,
) -> None:
    log, _ = FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    first = [log.append(rec(i)) for i in range(1, 6)]
    # The cut is made by the call itself, though the loop has not run the task yet (and the
    # records it covers are not even written yet).
    snapshotting = asyncio.ensure_future(log.snapshot(Seen))
    later = [log.append(rec(i)) for i in range(6, 9)]
    assert log.records_since_snapshot == 3
    await asyncio.gather(*first, snapshotting, *later)
    await log.close()
    assert len(frame_offsets(seg(tmp_path, 1))) == 5  # rotated right after the cut
    assert len(frame_offsets(seg(tmp_path, 6))) == 3

    recovered = await recover(tmp_path)
    assert recovered.snapshot == covering(1, 2, 3, 4, 5)
    assert recovered.records == [rec(6), rec(7), rec(8)]
    assert recovered.last_index == 8


async def test_snapshot_keeps_one_generation_back_and_deletes_older_files(
    tmp_path: Path,
) -> None:
    log, _ = FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    for i in range(1, 4):
        await log.append(rec(i))
    await log.snapshot(Seen)
    assert data_files(tmp_path) == {
        seg(tmp_path, 1).name,
        seg(tmp_path, 4).name,
        snap(tmp_path, 3).name,
    }
    for i in range(4, 7):
        await log.append(rec(i))
    await log.snapshot(Seen)  # built from snapshot 3 and log-4
    assert data_files(tmp_path) == {
        seg(tmp_path, 4).name,
        seg(tmp_path, 7).name,
        snap(tmp_path, 3).name,
        snap(tmp_path, 6).name,
    }
    for i in range(7, 10):
        await log.append(rec(i))
    await log.snapshot(Seen)  # built from snapshot 6 and log-7
    await log.close()
    assert data_files(tmp_path) == {
        seg(tmp_path, 10).name,
        seg(tmp_path, 7).name,
        snap(tmp_path, 6).name,
        snap(tmp_path, 9).name,
    }

    recovered = await recover(tmp_path)
    assert recovered.snapshot == covering(*range(1, 10))
    assert recovered.records == []
    assert recovered.last_index == 9


async def test_repeated_snapshot_without_new_records_builds_nothing(tmp_path: Path) -> None:
    log, _ = FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    await log.append(rec(1))
    await log.snapshot(Seen)
    written = snap(tmp_path, 1).stat().st_mtime_ns
    await log.snapshot(Poisoned)  # would fail if it built anything
    assert log.records_since_snapshot == 0
    await log.close()
    assert data_files(tmp_path) == {
        seg(tmp_path, 1).name,
        seg(tmp_path, 2).name,
        snap(tmp_path, 1).name,
    }
    assert snap(tmp_path, 1).stat().st_mtime_ns == written
    assert (await recover(tmp_path)).snapshot == covering(1)


async def test_snapshot_newer_than_the_log_end_continues_in_a_new_segment(
    tmp_path: Path,
) -> None:
    await write_log(tmp_path, [rec(1), rec(2), rec(3)], snapshot_after=(3,))
    # What NEVER plus a power loss could leave: the snapshot, but not the log's tail.
    seg(tmp_path, 4).unlink()
    truncate(seg(tmp_path, 1), frame_offsets(seg(tmp_path, 1))[2])

    log, recovered = FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    assert recovered.snapshot == covering(1, 2, 3)
    assert recovered.records == []
    assert recovered.last_index == 3
    await log.append(rec(4))
    await log.close()
    assert len(frame_offsets(seg(tmp_path, 4))) == 1
    recovered = await recover(tmp_path)
    assert recovered.records == [rec(4)]
    assert recovered.last_index == 4


async def test_damaged_newest_snapshot_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    await write_log(
        tmp_path,
        [rec(i) for i in range(1, 9)],
        snapshot_after=(3, 6),
    )
    flip_byte(snap(tmp_path, 6), snap(tmp_path, 6).stat().st_size - 1)

    recovered = await recover(tmp_path)
    assert recovered.snapshot == covering(1, 2, 3)
    assert recovered.records == [rec(i) for i in range(4, 9)]
    assert recovered.last_index == 8


async def test_damaged_first_snapshot_falls_back_to_replaying_everything(
    tmp_path: Path,
) -> None:
    await write_log(tmp_path, [rec(i) for i in range(1, 6)], snapshot_after=(3,))
    snap(tmp_path, 3).write_bytes(b"RDZVSNP1")  # cut short

    recovered = await recover(tmp_path)
    assert recovered.snapshot is None
    assert recovered.records == [rec(i) for i in range(1, 6)]


async def test_damaged_snapshot_with_no_log_to_replace_it_refuses_to_start(
    tmp_path: Path,
) -> None:
    await write_log(
        tmp_path,
        [rec(i) for i in range(1, 9)],
        snapshot_after=(3, 6),
    )
    snap(tmp_path, 3).unlink()
    flip_byte(snap(tmp_path, 6), 30)

    with pytest.raises(LogCorruptError, match="missing.*do not verify"):
        FileLog.open(tmp_path, FsyncPolicy.ALWAYS)


async def test_leftover_temporary_snapshot_is_deleted_and_ignored(tmp_path: Path) -> None:
    await write_log(tmp_path, [rec(1), rec(2)])
    leftover = tmp_path / (snap(tmp_path, 2).name + ".tmp")
    leftover.write_bytes(b"half a snapshot")

    recovered = await recover(tmp_path)
    assert recovered.snapshot is None
    assert recovered.records == [rec(1), rec(2)]
    assert not leftover.exists()


async def test_a_failed_build_changes_nothing_and_the_next_snapshot_builds_from_the_same_base(
    tmp_path: Path,
) -> None:
    log, _ = FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    await log.append(rec(1))
    await log.snapshot(Seen)
    await log.append({"poison": True})
    with pytest.raises(SnapshotBuildError, match="RuntimeError: log replay diverged"):
        await log.snapshot(Poisoned)
    assert data_files(tmp_path) == {seg(tmp_path, 1).name, seg(tmp_path, 2).name, seg(tmp_path, 3).name,
                                    snap(tmp_path, 1).name}  # fmt: skip
    await log.append(rec(3))  # the log goes on
    await log.snapshot(Seen)  # from snapshot 1 again, through log-2 and log-3
    await log.close()
    recovered = await recover(tmp_path)
    assert recovered.snapshot == {"records": [rec(1), {"poison": True}, rec(3)]}
    assert recovered.records == []


async def test_close_stops_a_running_build_instead_of_waiting_for_it(tmp_path: Path) -> None:
    log, _ = FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    await log.append(rec(1))
    before = {child.pid for child in psutil.Process().children()}
    building = log.snapshot(Stuck)

    async def builder_running() -> bool:  # (either way works; this is the harder one)
        return any(child.pid not in before for child in psutil.Process().children())

    await wait_until_async(builder_running, what="the snapshot's builder process running")
    await log.close()
    with pytest.raises(LogClosedError):
        await building
    assert data_files(tmp_path) == {seg(tmp_path, 1).name, seg(tmp_path, 2).name}  # no snapshot, no .tmp
    assert (await recover(tmp_path)).records == [rec(1)]


def test_a_builder_whose_server_died_exits_and_installs_nothing(tmp_path: Path) -> None:
    child = textwrap.dedent(
        """
        import asyncio, sys
        from pathlib import Path
        from rdzv_server.storage import FileLog, FsyncPolicy
        from test_storage import Stuck

        async def main() -> None:
            log, _ = FileLog.open(Path(sys.argv[1]), FsyncPolicy.ALWAYS)
            await log.append({"i": 1})
            log.snapshot(Stuck)
            print("building", flush=True)
            await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    with subprocess.Popen(
        [sys.executable, "-c", child, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    ) as proc:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "building\n"
        server = psutil.Process(proc.pid)
        builders = wait_until(server.children, timeout=10, what="a builder process started")
        proc.kill()  # SIGKILL: the server never stops its builder
        proc.wait()
    _, alive = psutil.wait_procs(builders, timeout=10)
    assert not alive, "the builder outlived its server"
    assert not list(tmp_path.glob("snapshot-*.msgpack"))


# ---------------------------------------------------------------------- fsync policies


async def test_always_fsyncs_before_every_acknowledgement(tmp_path: Path) -> None:
    fsync = CountingFsync()
    log, _ = FileLog.open(tmp_path, FsyncPolicy.ALWAYS, fsync_fn=fsync)
    before = fsync.calls
    for i in range(5):
        await log.append(rec(i))
    assert fsync.calls - before == 5
    await log.close()


@pytest.mark.parametrize("policy", [FsyncPolicy.ALWAYS, FsyncPolicy.BATCH])
async def test_records_arriving_during_an_fsync_share_the_next_one(
    tmp_path: Path, policy: FsyncPolicy
) -> None:
    fsync = CountingFsync()
    log, _ = FileLog.open(tmp_path, policy, fsync_fn=fsync)
    before = fsync.calls
    fsync.hold_next = True
    first = log.append(rec(0))
    await asyncio.to_thread(fsync.entered.wait, 10)
    rest = [log.append(rec(i)) for i in range(1, 50)]
    assert not first.done()
    fsync.release.set()
    await asyncio.gather(first, *rest)
    assert fsync.calls - before == 2
    await log.close()
    assert (await recover(tmp_path)).records == [rec(i) for i in range(50)]


async def test_batch_writes_at_most_once_per_window(tmp_path: Path) -> None:
    fsync = CountingFsync()
    log, _ = FileLog.open(tmp_path, FsyncPolicy.BATCH, fsync_fn=fsync, batch_window_s=0.5)
    before = fsync.calls
    await log.append(rec(0))  # after a quiet spell: written at once
    assert fsync.calls - before == 1
    spread = []
    for i in range(1, 11):
        spread.append(log.append(rec(i)))
        await asyncio.sleep(0)  # separate loop iterations, all inside one window
    await asyncio.gather(*spread)
    assert fsync.calls - before == 2
    await log.close()


async def test_never_acknowledges_after_write_without_fsync(tmp_path: Path) -> None:
    fsync = CountingFsync()
    log, _ = FileLog.open(tmp_path, FsyncPolicy.NEVER, fsync_fn=fsync)
    before = fsync.calls
    for i in range(20):
        await log.append(rec(i))
    assert fsync.calls == before
    assert len(frame_offsets(seg(tmp_path, 1))) == 20  # handed to the OS before the ack
    await log.close()
    assert fsync.calls == before + 1  # close leaves nothing for the OS to lose
    assert (await recover(tmp_path)).records == [rec(i) for i in range(20)]


async def test_never_still_fsyncs_a_segment_before_rotating_away_from_it(
    tmp_path: Path,
) -> None:
    fsync = CountingFsync()
    log, _ = FileLog.open(tmp_path, FsyncPolicy.NEVER, fsync_fn=fsync)
    before = fsync.calls
    await log.append(rec(1))
    await log.snapshot(Seen)
    # Old segment, new segment's directory entry, snapshot's directory entry. (The builder
    # process fsyncs the snapshot file itself, before it exits, with os.fsync.)
    assert fsync.calls - before == 3
    await log.close()


async def test_order_is_preserved_under_many_concurrent_appends(tmp_path: Path) -> None:
    log, _ = FileLog.open(tmp_path, FsyncPolicy.BATCH, batch_window_s=0.001)
    order: list[dict[str, Any]] = []

    async def client(c: int) -> None:
        for n in range(40):
            record = {"c": c, "n": n}
            order.append(record)
            await log.append(record)
            if n % 7 == c % 7:
                await asyncio.sleep(0)

    await asyncio.gather(*(client(c) for c in range(50)))
    await log.close()
    recovered = await recover(tmp_path)
    assert recovered.records == order
    assert recovered.last_index == 2000


# -------------------------------------------------------------------------- failures


class FailingFsync:
    """An ``fsync_fn`` that starts failing with EIO once armed."""

    def __init__(self) -> None:
        self.armed = False

    def __call__(self, fd: int) -> None:
        if self.armed:
            raise OSError(5, "Input/output error")
        os.fsync(fd)


async def test_failed_fsync_fails_pending_and_every_later_append(tmp_path: Path) -> None:
    fsync = FailingFsync()
    log, _ = FileLog.open(tmp_path, FsyncPolicy.ALWAYS, fsync_fn=fsync)
    await log.append(rec(1))
    fsync.armed = True
    pending = [log.append(rec(i)) for i in range(2, 6)]
    results = await asyncio.gather(*pending, return_exceptions=True)
    for result in results:
        assert isinstance(result, LogFailedError)
        assert isinstance(result.__cause__, OSError)
    with pytest.raises(LogFailedError):
        await log.append(rec(6))
    with pytest.raises(LogFailedError):
        await log.snapshot(Seen)
    await log.close()  # already reported: closes quietly and releases the directory


async def test_failed_final_fsync_on_close_is_raised(tmp_path: Path) -> None:
    fsync = FailingFsync()
    log, _ = FileLog.open(tmp_path, FsyncPolicy.NEVER, fsync_fn=fsync)
    await log.append(rec(1))
    fsync.armed = True
    with pytest.raises(LogFailedError):
        await log.close()
    fsync.armed = False
    assert (await recover(tmp_path)).records == [rec(1)]


async def test_unencodable_record_raises_and_spends_no_index(tmp_path: Path) -> None:
    log, _ = FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    await log.append(rec(1))
    with pytest.raises(TypeError):
        log.append({"bad": object()})
    await log.append(rec(2))
    assert log.records_since_snapshot == 2
    await log.close()
    assert (await recover(tmp_path)).records == [rec(1), rec(2)]


async def test_append_and_snapshot_after_close_raise(tmp_path: Path) -> None:
    log, _ = FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    await log.close()
    await log.close()  # idempotent
    with pytest.raises(LogClosedError):
        log.append(rec(1))
    with pytest.raises(LogClosedError):
        await log.snapshot(Seen)


async def test_a_second_open_of_the_same_directory_is_refused(tmp_path: Path) -> None:
    log, _ = FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    with pytest.raises(DataDirLockedError):
        FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    await log.close()
    await recover(tmp_path)  # free again once closed


# ------------------------------------------------------------------------- MemoryLog


async def test_memory_log_acknowledges_at_once_and_keeps_nothing() -> None:
    log = MemoryLog()
    future = log.append(rec(1))
    assert future.done() and future.result() is None
    log.append(rec(2))
    assert log.records_since_snapshot == 2
    await log.snapshot(Seen)
    assert log.records_since_snapshot == 0
    with pytest.raises(TypeError):
        log.append({"bad": {1, 2}})
    await log.close()
    with pytest.raises(LogClosedError):
        log.append(rec(3))


# -------------------------------------------------------------------------- the seam


def test_default_data_dir_follows_xdg_state_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert default_data_dir() == tmp_path / "state" / "rdzv-server"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_STATE_HOME", "relative/is/ignored")
    assert default_data_dir() == tmp_path / "home" / ".local" / "state" / "rdzv-server"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert default_data_dir() == tmp_path / "home" / ".local" / "state" / "rdzv-server"


async def test_both_logs_fit_the_log_seam(tmp_path: Path) -> None:
    file_log, _ = FileLog.open(tmp_path, FsyncPolicy.ALWAYS)
    logs: list[storage.Log] = [file_log, MemoryLog()]  # mypy checks the structural match
    for log in logs:
        await log.append(rec(1))
        assert log.records_since_snapshot == 1
        await log.snapshot(Seen)
        assert log.records_since_snapshot == 0
        await log.close()


def test_public_names_are_exactly_the_storage_api() -> None:
    assert sorted(storage.__all__) == sorted(
        [
            "DEFAULT_BATCH_WINDOW_S",
            "DEFAULT_MAX_QUEUED_BYTES",
            "DEFAULT_MAX_QUEUED_RECORDS",
            "DEFAULT_SNAPSHOT_EVERY",
            "DataDirLockedError",
            "FileLog",
            "FsyncPolicy",
            "Log",
            "LogClosedError",
            "LogCorruptError",
            "LogFailedError",
            "LogQueueFullError",
            "MemoryLog",
            "RecordTooLargeError",
            "Recovered",
            "ReplicatedLog",
            "Replica",
            "ReplicaFactory",
            "SnapshotBuildError",
            "StorageError",
            "default_data_dir",
        ]
    )
    assert storage.DEFAULT_SNAPSHOT_EVERY == 100_000
    assert [p.value for p in FsyncPolicy] == ["always", "batch", "never"]
