"""The snapshot file format, and writing a snapshot so that it is either whole or absent.

What it owns: snapshot file names, their header, and the atomic write (temporary file,
fsync, rename, directory fsync).

Format. ``snapshot-<index:020d>.msgpack`` holds a 28-byte header and a payload::

    8 bytes            magic b"RDZVSNP1" (format version 1)
    u64 little-endian  index: the last record the snapshot covers (equals the file name's)
    u64 little-endian  payload length
    u32 little-endian  zlib.crc32(payload)
    payload            msgpack(state, use_bin_type=True)

Invariant: a file with the final name is complete and was fsynced before it got that name;
a crash mid-write leaves only a ``.tmp`` file, which recovery deletes. The two halves
(:func:`write_snapshot_temp`, :func:`install_snapshot`) may run in different processes: the
snapshot builder writes the temporary file, the server that holds the directory's lock
renames it. A final-named file
that fails verification is therefore damage after the fact, and recovery falls back to an
older snapshot rather than trusting it.

What it must not know: segments, or which snapshots to keep (that is :mod:`.file_log`).
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack

from .data_dir import fsync_directory
from .error import LogCorruptError

SNAPSHOT_MAGIC = b"RDZVSNP1"
SNAPSHOT_HEADER = struct.Struct("<8sQQI")
TEMP_SUFFIX = ".tmp"
_SNAPSHOT_NAME = re.compile(r"^snapshot-(\d{20})\.msgpack$")


def snapshot_name(index: int) -> str:
    """The file name of the snapshot that covers records up to ``index``."""
    return f"snapshot-{index:020d}.msgpack"


def parse_snapshot_name(name: str) -> int | None:
    """The index encoded in a snapshot file name, or ``None`` for any other file."""
    match = _SNAPSHOT_NAME.match(name)
    return int(match.group(1)) if match else None


def encode_snapshot(index: int, state: dict[str, Any]) -> bytes:
    """The whole snapshot file for ``state`` at ``index``; raises ``TypeError`` if unencodable."""
    payload: bytes = msgpack.packb(state, use_bin_type=True)
    header = SNAPSHOT_HEADER.pack(SNAPSHOT_MAGIC, index, len(payload), zlib.crc32(payload))
    return header + payload


def temp_path(data_dir: Path, index: int) -> Path:
    """Where the snapshot at ``index`` is written before it is renamed into place."""
    return data_dir / (snapshot_name(index) + TEMP_SUFFIX)


def write_snapshot_temp(temp: Path, blob: bytes, fsync: Callable[[int], None]) -> None:
    """Write ``blob`` to ``temp`` (replacing it) and fsync it; the first half of a snapshot.

    Raises ``OSError`` if any step fails, after removing ``temp``.
    """
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            view = memoryview(blob)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def install_snapshot(temp: Path, final: Path, fsync: Callable[[int], None]) -> None:
    """Rename the fsynced ``temp`` to ``final`` and make the rename durable; the second half.

    An existing snapshot named ``final`` is untouched until the rename replaces it whole.
    Raises ``OSError`` if the rename or the directory fsync fails (``temp`` is removed).
    """
    try:
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_directory(final.parent, fsync)


def write_snapshot(data_dir: Path, index: int, blob: bytes, fsync: Callable[[int], None]) -> Path:
    """Write ``blob`` as the snapshot at ``index`` atomically and durably; return its path.

    Raises ``OSError`` if any step fails; the temporary file is removed on the way out, and
    an existing snapshot with the same name is untouched until the rename replaces it.
    """
    final = data_dir / snapshot_name(index)
    temp = temp_path(data_dir, index)
    write_snapshot_temp(temp, blob, fsync)
    install_snapshot(temp, final, fsync)
    return final


def read_snapshot(path: Path, index: int) -> dict[str, Any]:
    """The state stored in ``path``; raise :class:`LogCorruptError` if it does not verify.

    Raises ``OSError`` if the file cannot be read at all.
    """
    data = path.read_bytes()
    header_size = SNAPSHOT_HEADER.size
    if len(data) < header_size:
        raise LogCorruptError("snapshot is shorter than its header", path, 0)
    magic, stored_index, length, crc = SNAPSHOT_HEADER.unpack_from(data, 0)
    if magic != SNAPSHOT_MAGIC:
        raise LogCorruptError(f"snapshot has an unknown magic {magic!r}", path, 0)
    if stored_index != index:
        raise LogCorruptError(
            f"snapshot header says index {stored_index} but its name says {index}", path, 8
        )
    payload = memoryview(data)[header_size:]
    if len(payload) != length:
        raise LogCorruptError(
            f"snapshot payload is {len(payload)} bytes, its header says {length}",
            path,
            header_size,
        )
    if zlib.crc32(payload) != crc:
        raise LogCorruptError("snapshot fails its CRC check", path, header_size)
    try:
        # The bytes are our own and CRC-verified, so msgpack's hash-flooding guard
        # (strict_map_key) does not apply, and a state may key a map by int.
        state = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise LogCorruptError(
            f"snapshot passes its CRC check but is not valid msgpack ({exc})", path, header_size
        ) from exc
    if not isinstance(state, dict):
        raise LogCorruptError(
            f"snapshot holds a {type(state).__name__}, not a map", path, header_size
        )
    return state
