"""Recovery: rebuild the durable history from a data directory, or refuse to start.

What it owns: choosing the snapshot to start from, replaying the segments after it, the one
repair recovery makes on its own (truncating a torn tail of the last segment), and the
repair an operator may ask for (``--truncate-corrupt-log``: keep everything before damage).

Rules, in the order they are applied:
1. Leftover ``snapshot-*.tmp`` files are deleted: a snapshot only counts once renamed.
2. The newest snapshot that verifies is the base; a newer one that fails verification is
   skipped with a warning. Falling back is only accepted if replay then reaches at least
   the skipped snapshot's index; otherwise acknowledged writes would silently vanish, so
   :class:`LogCorruptError` is raised (``--truncate-corrupt-log`` does not change this).
3. Replay starts in the last segment whose first index is at or below ``base + 1`` (older
   segments are wholly covered by the snapshot and are not read), and continues through
   every later segment. Each segment must start exactly where the previous one ended; a
   gap or overlap is damage.
4. A torn tail is the only thing truncated silently (with a warning): a bad frame (short,
   zero length, CRC mismatch) in the last segment *with no whole, verified frame anywhere
   after it*. That is what a crash mid-write leaves: the write was cut short, so nothing
   it carried was acknowledged. The file is truncated there (and fsynced), the dropped
   bytes are reported, and appending continues at that point.
5. Anything else is damage: a bad frame followed by a verified one (in the last segment
   too: a torn write only ever loses the end of the file, so verified records after the
   bad spot were written, and fsynced, after it), a bad frame in a segment that is not
   the last, a frame that passes its CRC but is not a record, a gap between segments or
   between the snapshot and the log. Records after it may have been acknowledged, so
   recovery refuses with :class:`LogCorruptError` naming the file, the byte offset and
   what to do. The price of this rule: a power loss that persists a later page of the
   last write but not an earlier one (possible on some file systems) also reads as
   damage, and needs the operator's ``--truncate-corrupt-log`` although nothing
   acknowledged was lost. Refusing when unsure is the point.
6. With ``truncate_corrupt`` (``--truncate-corrupt-log``) damage is cut off instead: every
   record before it is kept, and nothing is deleted. Segments after the damaged one are
   renamed aside (``<name>.corrupt-<UTC time>``) first, newest first, so that a crash
   midway leaves a contiguous log; then the damaged segment is copied aside (fsynced) and
   only then truncated where its trustworthy prefix ends. Appends continue after the kept
   records (or after the snapshot, if it is newer). What was dropped is logged.
7. Appends continue in the last kept segment if it ends exactly at the last recovered
   index; otherwise (no segment yet, or a snapshot newer than the log's end) a new
   segment starting at ``last_index + 1`` is created by the caller.

No garbage-collector switch here: recovery runs in a thread beside the serving event loop,
and ``gc.disable()`` is process-wide, so a thread flipping it would race every other
thread (the caller that wants recovery faster decides, on its own thread).

What it must not know: what records mean, or anything about writing new ones.
"""

from __future__ import annotations

import bisect
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .data_dir import fsync_directory
from .error import LogCorruptError
from .log import Recovered
from .segment import SegmentScan, parse_segment_name, scan_segment
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


def recover(data_dir: Path, fsync: Callable[[int], None], *, truncate_corrupt: bool = False) -> RecoveryOutcome:
    """Recover the history stored in ``data_dir`` (which must exist).

    ``truncate_corrupt``: cut damage off instead of refusing (rule 6 of the module).
    Raises :class:`LogCorruptError` when the directory holds damage that recovery must not
    repair silently, and ``OSError`` when a file cannot be read, copied, renamed, deleted
    or truncated.
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
    return _recover(data_dir, snapshots, segments, fsync, truncate_corrupt)


@dataclass(frozen=True)
class _Damage:
    """Where the trustworthy log ends: in ``replayed[position]``, at byte ``offset``.

    ``whole``: that segment is dropped whole (it starts after a gap); otherwise it keeps
    its bytes before ``offset``. ``verified_after`` counts verified frames after the damage
    in that segment.
    """

    message: str
    position: int
    offset: int
    whole: bool
    verified_after: int


@dataclass(frozen=True)
class _Base:
    """The snapshot replay starts from (rule 2): ``index`` None when none verifies;
    ``skipped`` holds the newer snapshots that do not verify, by index."""

    state: dict[str, Any] | None
    index: int | None
    skipped: dict[int, LogCorruptError]

    @property
    def last(self) -> int:
        """The last record the base covers (0: none)."""
        return self.index or 0


@dataclass
class _Replay:
    """What replaying the segments after the base found (rules 3 to 5).

    ``replayed`` are the first indices of the segments read, ascending; ``end_index`` is one
    past the last record seen; ``damage`` is where the trustworthy log ends (None: nowhere).
    """

    replayed: list[int]
    end_index: int
    records: list[dict[str, Any]] = field(default_factory=list)
    truncated_bytes: int = 0
    damage: _Damage | None = None

    def kept(self) -> list[int]:
        """The segments that stay in the log: all of them, or those before the damage (and the
        damaged one, unless it is dropped whole)."""
        damage = self.damage
        return self.replayed if damage is None else self.replayed[: damage.position + (0 if damage.whole else 1)]


def _recover(
    data_dir: Path,
    snapshots: dict[int, Path],
    segments: dict[int, Path],
    fsync: Callable[[int], None],
    truncate_corrupt: bool,
) -> RecoveryOutcome:
    """The module's rules 2 to 7, in order, over the files :func:`recover` found."""
    base = _choose_snapshot(data_dir, snapshots)
    replay = _replay_segments(segments, base, fsync)
    last_index = base.last + len(replay.records)
    if replay.damage is not None and not truncate_corrupt:
        raise _refusal(data_dir, segments[replay.replayed[replay.damage.position]], replay.damage, last_index)
    _check_skipped_snapshots(data_dir, snapshots, base, last_index)
    firsts = sorted(segments)
    kept = replay.kept()
    if replay.damage is not None:
        damaged = replay.replayed[replay.damage.position :]
        _set_aside_damage(data_dir, [segments[first] for first in damaged], replay.damage, last_index, fsync)
        firsts = [first for first in firsts if first not in replay.replayed[len(kept) :]]
    append_exists = bool(kept) and replay.end_index == last_index + 1  # rule 7
    return RecoveryOutcome(
        recovered=Recovered(
            snapshot=base.state,
            records=replay.records,
            truncated_bytes=replay.truncated_bytes,
            last_index=last_index,
        ),
        snapshot_index=base.index,
        segment_firsts=tuple(firsts),
        append_first=kept[-1] if append_exists else last_index + 1,
        append_exists=append_exists,
    )


def _choose_snapshot(data_dir: Path, snapshots: dict[int, Path]) -> _Base:
    """Rule 2: the newest snapshot that verifies; newer ones that do not are skipped, with a warning."""
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
        return _Base(state, index, skipped)
    return _Base(None, None, skipped)


def _replay_segments(segments: dict[int, Path], base: _Base, fsync: Callable[[int], None]) -> _Replay:
    """Rules 3 to 5: read the segments after the base in order, truncating a torn tail, up to
    the first damage (recorded, not raised: rule 6 may cut it off)."""
    firsts = sorted(segments)
    start = bisect.bisect_right(firsts, base.last + 1) - 1
    replay = _Replay(firsts[max(start, 0) :], end_index=base.last + 1)
    for position, first in enumerate(replay.replayed):
        replay.damage = _gap(base, position, first, replay.end_index)
        if replay.damage is not None:
            break
        path = segments[first]
        scan = scan_segment(path, first, decode_after=base.last)
        replay.records.extend(scan.records)
        replay.end_index = first + scan.count
        if scan.problem is None:
            continue
        last = position == len(replay.replayed) - 1
        if last and not scan.undecodable and scan.resumes_at is None:
            replay.truncated_bytes = _truncate_torn_tail(path, scan, fsync)
            continue
        message = _damage_message(scan, replay.end_index, last)
        replay.damage = _Damage(message, position, scan.valid_end, whole=False, verified_after=scan.verified_after)
        break
    return replay


def _gap(base: _Base, position: int, first: int, end_index: int) -> _Damage | None:
    """Rule 3: the segment at ``position`` must start right after what came before it (the
    base, or the previous segment, which ended at ``end_index - 1``); else it is dropped whole."""
    if position == 0 and first > end_index:
        covered = (
            f"the snapshot used covers only up to {base.last}"
            if base.index is not None
            else "no usable snapshot covers the records before it"
        )
        message = (
            f"records {base.last + 1} to {first - 1} are missing: the oldest segment starts "
            f"at record {first} but " + covered + _skipped_note(base.skipped)
        )
        return _Damage(message, position, 0, whole=True, verified_after=0)
    if position > 0 and first != end_index:
        message = (
            f"segment starts at record {first} but the segment before it ends at record "
            f"{end_index - 1}" + _skipped_note(base.skipped)
        )
        return _Damage(message, position, 0, whole=True, verified_after=0)
    return None


def _damage_message(scan: SegmentScan, end_index: int, last: bool) -> str:
    """Rule 5: why a bad frame of a segment (the ``last`` one or not) is damage, not a torn write."""
    bad = f"{scan.problem} (record {end_index})" if not scan.undecodable else scan.problem
    if not last:
        return (
            f"{bad} in a segment that is not the last one, so it is not a torn write and "
            "records after it would be lost"
        )
    if scan.undecodable:
        return f"{bad}: damage or a bug, never a torn write"
    return (
        f"{bad}, and {scan.verified_after} whole, verified records follow it from offset "
        f"{scan.resumes_at}, so this is damage to written records, not a write torn by a crash"
    )


def _truncate_torn_tail(path: Path, scan: SegmentScan, fsync: Callable[[int], None]) -> int:
    """Rule 4: cut the last segment's torn tail off (durably); returns the bytes dropped."""
    dropped = scan.size - scan.valid_end
    logger.warning(
        "Truncating %d bytes from the end of %s at offset %d because %s "
        "(a write torn by a crash); the %d records before it are kept.",
        dropped,
        path,
        scan.valid_end,
        scan.problem,
        scan.count,
    )
    _truncate(path, scan.valid_end, fsync)
    return dropped


def _refusal(data_dir: Path, path: Path, damage: _Damage, last_index: int) -> LogCorruptError:
    """Rule 5: the error that refuses to start on damage, naming the way out."""
    return LogCorruptError(
        damage.message,
        path,
        damage.offset,
        remedy=(
            f"Refusing to start, so that no acknowledged write is dropped silently: restore "
            f"{data_dir} from a backup, or start once with --truncate-corrupt-log to keep the "
            f"records before this point (through record {last_index}) and set the damaged files "
            "aside (renamed *.corrupt-<time>, never deleted)."
        ),
    )


def _check_skipped_snapshots(data_dir: Path, snapshots: dict[int, Path], base: _Base, last_index: int) -> None:
    """Rule 2: falling back past a snapshot that does not verify is only accepted if replay
    reached its index. Raises :class:`LogCorruptError` otherwise."""
    if not base.skipped:
        return
    newest_skipped = max(base.skipped)
    if last_index < newest_skipped:
        raise LogCorruptError(
            f"snapshot {newest_skipped} does not verify and the older snapshot and log "
            f"only reach record {last_index}",
            snapshots[newest_skipped],
            0,
            remedy=f"Refusing to start: restore {data_dir} from a backup.",
        )


def _set_aside_damage(
    data_dir: Path, paths: list[Path], damage: _Damage, last_index: int, fsync: Callable[[int], None]
) -> None:
    """Rule 6: ``paths[0]`` is the damaged segment, the rest come after it; nothing is deleted."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    damaged, later = paths[0], paths[1:]
    dropped = damage.verified_after
    moved: list[str] = []

    def set_aside(path: Path) -> int:
        """Rename ``path`` aside; the records it held that verify (now dropped from the log)."""
        first = parse_segment_name(path.name)
        assert first is not None
        scan = scan_segment(path, first, decode_after=2**63)
        aside = _aside_name(path, stamp)
        os.rename(path, aside)
        moved.append(aside.name)
        return scan.count + scan.verified_after

    for path in reversed(later):  # newest first: a crash midway leaves a contiguous log
        dropped += set_aside(path)
    if damage.whole:
        dropped += set_aside(damaged)
        fsync_directory(data_dir, fsync)
    else:
        fsync_directory(data_dir, fsync)  # the renames are durable before the truncation
        aside = _aside_name(damaged, stamp)
        shutil.copyfile(damaged, aside)
        fd = os.open(aside, os.O_RDONLY)
        try:
            fsync(fd)
        finally:
            os.close(fd)
        fsync_directory(data_dir, fsync)
        _truncate(damaged, damage.offset, fsync)
        moved.append(f"{aside.name} (a copy of {damaged.name} before it was truncated at offset {damage.offset})")
    logger.error(
        "--truncate-corrupt-log: dropped every record after record %d from the log in %s because %s "
        "(file %s, offset %d); the damaged frame and at least %d verified records after it are dropped. "
        "Kept everything before it; set aside, not deleted: %s.",
        last_index,
        data_dir,
        damage.message,
        damaged,
        damage.offset,
        dropped,
        ", ".join(reversed(moved)),
    )


def _aside_name(path: Path, stamp: str) -> Path:
    """``<name>.corrupt-<stamp>``, numbered if that exists (a second repair in one second)."""
    aside = path.with_name(f"{path.name}.corrupt-{stamp}")
    number = 1
    while aside.exists():
        aside = path.with_name(f"{path.name}.corrupt-{stamp}-{number}")
        number += 1
    return aside


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
