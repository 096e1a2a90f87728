"""Recovery: rebuild the durable history from a data directory, or refuse to start.

What it owns: choosing the snapshot to start from, replaying the segments after it, and the
one repair recovery is allowed to make (truncating a torn tail of the last segment).

Rules, in the order they are applied:
1. Leftover ``snapshot-*.tmp`` files are deleted: a snapshot only counts once renamed.
2. The newest snapshot that verifies is the base; a newer one that fails verification is
   skipped with a warning. Falling back is only accepted if replay then reaches at least
   the skipped snapshot's index; otherwise acknowledged writes would silently vanish, so
   :class:`LogCorruptError` is raised.
3. Replay starts in the last segment whose first index is at or below ``base + 1`` (older
   segments are wholly covered by the snapshot and are not read), and continues through
   every later segment. Each segment must start exactly where the previous one ended; a
   gap or overlap raises :class:`LogCorruptError`.
4. A bad frame (short, zero length, CRC mismatch) in the last segment on disk is what a
   crash mid-write leaves: the file is truncated there (and fsynced), the dropped bytes
   are reported, and appending continues at that point. The same in any other segment
   cannot be a torn write (later segments were written after it was complete), so it
   raises :class:`LogCorruptError`.
5. Appends continue in the last segment if it ends exactly at the last recovered index;
   otherwise (no segment yet, or a snapshot newer than the log's end) a new segment
   starting at ``last_index + 1`` is created by the caller.

What it must not know: what records mean, or anything about writing new ones.
"""

from __future__ import annotations

import bisect
import gc
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .error import LogCorruptError
from .log import Recovered
from .segment import parse_segment_name, scan_segment
from .snapshot import TEMP_SUFFIX, parse_snapshot_name, read_snapshot

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecoveryOutcome:
    """What :func:`recover` found, plus what the writer needs to carry on from there.

    ``snapshot_index`` is the snapshot the history was rebuilt from (``None``: none);
    ``segment_firsts`` are the first indices of the segments on disk, ascending;
    ``append_first`` is the first index of the segment new records go to (appended at its
    end), which exists when ``append_exists`` is true.
    """

    recovered: Recovered
    snapshot_index: int | None
    segment_firsts: tuple[int, ...]
    append_first: int
    append_exists: bool


def recover(data_dir: Path, fsync: Callable[[int], None]) -> RecoveryOutcome:
    """Recover the history stored in ``data_dir`` (which must exist).

    Raises :class:`LogCorruptError` when the directory holds damage that recovery must not
    repair silently, and ``OSError`` when a file cannot be read, deleted or truncated.
    """
    snapshots: dict[int, Path] = {}
    segments: dict[int, Path] = {}
    for name in os.listdir(data_dir):
        path = data_dir / name
        if name.endswith(TEMP_SUFFIX):
            if parse_snapshot_name(name[: -len(TEMP_SUFFIX)]) is not None:
                path.unlink()
            continue
        snapshot_index = parse_snapshot_name(name)
        if snapshot_index is not None:
            snapshots[snapshot_index] = path
            continue
        first = parse_segment_name(name)
        if first is not None:
            segments[first] = path

    # Decoding a million records allocates millions of containers; the cyclic collector
    # would rescan them over and over (a third more recovery time, measured), and
    # msgpack output cannot form a cycle, so there is nothing for it to find.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _recover(data_dir, snapshots, segments, fsync)
    finally:
        if gc_was_enabled:
            gc.enable()


def _recover(
    data_dir: Path,
    snapshots: dict[int, Path],
    segments: dict[int, Path],
    fsync: Callable[[int], None],
) -> RecoveryOutcome:
    state: dict[str, Any] | None = None
    base_index: int | None = None
    skipped: dict[int, LogCorruptError] = {}
    for index in sorted(snapshots, reverse=True):
        try:
            state = read_snapshot(snapshots[index], index)
        except LogCorruptError as exc:
            logger.warning(
                "Skipping snapshot %s in %s because it does not verify (%s); "
                "falling back to an older snapshot and a longer replay.",
                snapshots[index].name,
                data_dir,
                exc,
            )
            skipped[index] = exc
            continue
        base_index = index
        break
    base = base_index or 0

    firsts = sorted(segments)
    start = bisect.bisect_right(firsts, base + 1) - 1
    if firsts and start < 0:
        raise LogCorruptError(
            f"records {base + 1} to {firsts[0] - 1} are missing: the oldest segment starts "
            f"at record {firsts[0]} but "
            + (
                f"the snapshot used covers only up to {base}"
                if base_index is not None
                else "no usable snapshot covers the records before it"
            )
            + _skipped_note(skipped),
            segments[firsts[0]],
            0,
        )

    records: list[dict[str, Any]] = []
    truncated_bytes = 0
    end_index = base + 1  # one past the last record replay has seen
    replayed = firsts[max(start, 0) :]
    for position, first in enumerate(replayed):
        path = segments[first]
        if position > 0 and first != end_index:
            raise LogCorruptError(
                f"segment starts at record {first} but the segment before it ends at record "
                f"{end_index - 1}" + _skipped_note(skipped),
                path,
                0,
            )
        scan = scan_segment(path, first, decode_after=base)
        if scan.problem is not None:
            if position != len(replayed) - 1:
                raise LogCorruptError(
                    f"{scan.problem} in a segment that is not the last one, so it is not a "
                    "torn write and records after it would be lost",
                    path,
                    scan.valid_end,
                )
            truncated_bytes = scan.size - scan.valid_end
            logger.warning(
                "Truncating %d bytes from the end of %s at offset %d because %s "
                "(a write torn by a crash); the %d records before it are kept.",
                truncated_bytes,
                path,
                scan.valid_end,
                scan.problem,
                scan.count,
            )
            _truncate(path, scan.valid_end, fsync)
        records.extend(scan.records)
        end_index = first + scan.count

    last_index = base + len(records)
    if skipped:
        newest_skipped = max(skipped)
        if last_index < newest_skipped:
            raise LogCorruptError(
                f"snapshot {newest_skipped} does not verify and the older snapshot and log "
                f"only reach record {last_index}",
                snapshots[newest_skipped],
                0,
            )
    append_exists = bool(replayed) and end_index == last_index + 1
    return RecoveryOutcome(
        recovered=Recovered(
            snapshot=state,
            records=records,
            truncated_bytes=truncated_bytes,
            last_index=last_index,
        ),
        snapshot_index=base_index,
        segment_firsts=tuple(firsts),
        append_first=replayed[-1] if append_exists else last_index + 1,
        append_exists=append_exists,
    )


def _skipped_note(skipped: dict[int, LogCorruptError]) -> str:
    if not skipped:
        return ""
    return "; newer snapshots were skipped because they do not verify: " + "; ".join(
        str(exc) for exc in skipped.values()
    )


def _truncate(path: Path, size: int, fsync: Callable[[int], None]) -> None:
    # The truncation must be durable before new frames are appended after it; otherwise a
    # second crash could leave the old garbage in front of them.
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, size)
        fsync(fd)
    finally:
        os.close(fd)
