"""The segment file format: how records become bytes on disk and how those bytes are read back.

What it owns: segment file names, the frame encoding, and the scan that splits a segment
into whole, verified frames and reports where (and why) the trustworthy prefix ends.

Format. A segment is a file named ``log-<first_index:020d>.bin`` holding frames back to
back, with no file header. A frame is::

    u32 little-endian  payload length (never 0: every record packs to at least one byte)
    u32 little-endian  zlib.crc32(payload)
    payload            msgpack(record, use_bin_type=True)

Indices are implicit: the k-th frame (from 0) of ``log-<f>.bin`` is record ``f + k``. That
keeps frames minimal and makes a gap between segments visible from the names and frame
counts alone.

What it must not know: which segment is the last one, snapshots, or what to do about a bad
frame. :func:`scan_segment` only reports; :mod:`.recovery` decides between truncating a torn
tail and refusing to start.
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from .error import LogCorruptError

FRAME_HEADER = struct.Struct("<II")
_SEGMENT_NAME = re.compile(r"^log-(\d{20})\.bin$")


def segment_name(first_index: int) -> str:
    """The file name of the segment whose first record has index ``first_index``."""
    return f"log-{first_index:020d}.bin"


def parse_segment_name(name: str) -> int | None:
    """The first index encoded in a segment file name, or ``None`` for any other file."""
    match = _SEGMENT_NAME.match(name)
    return int(match.group(1)) if match else None


def encode_frame(record: dict[str, Any]) -> bytes:
    """One frame holding ``record``; raises ``TypeError`` for a value msgpack cannot encode."""
    payload: bytes = msgpack.packb(record, use_bin_type=True)
    return FRAME_HEADER.pack(len(payload), zlib.crc32(payload)) + payload


@dataclass(frozen=True)
class SegmentScan:
    """The verified prefix of one segment.

    ``count`` whole frames end at byte ``valid_end``; ``records`` holds the decoded records
    whose index is above the ``decode_after`` the scan was asked for. ``problem`` says why
    the scan stopped before ``size`` (``None`` when every byte is a whole, verified frame).
    """

    first_index: int
    count: int
    records: list[dict[str, Any]]
    valid_end: int
    size: int
    problem: str | None


def scan_segment(path: Path, first_index: int, decode_after: int) -> SegmentScan:
    """Verify the frames of ``path`` from the start; decode those with index > ``decode_after``.

    Stops at the first frame that is short, has a zero length, or fails its CRC, and
    reports it in ``problem``; the caller decides what that means. A frame whose CRC
    matches but whose payload is not a msgpack map raises :class:`LogCorruptError` at once:
    that is not a torn write but a bug or tampering, and must never be truncated away.
    """
    data = path.read_bytes()
    size = len(data)
    view = memoryview(data)
    records: list[dict[str, Any]] = []
    # Locals: this loop runs once per record on every start, so attribute lookups matter.
    unpack_header = FRAME_HEADER.unpack_from
    header_size = FRAME_HEADER.size
    crc32 = zlib.crc32
    unpackb = msgpack.unpackb
    append = records.append
    skip = max(0, decode_after - first_index + 1)
    # strict_map_key=False below: these bytes are our own and CRC-verified, so msgpack's
    # hash-flooding guard does not apply, and a record may key a map by int.
    offset = 0
    count = 0
    problem: str | None = None
    while offset < size:
        if size - offset < header_size:
            problem = f"a frame header is cut short ({size - offset} of {header_size} bytes)"
            break
        length, crc = unpack_header(data, offset)
        start = offset + header_size
        end = start + length
        if length == 0:
            # Zero-filled blocks (a common result of a crash mid-write) would otherwise read
            # as endless valid empty frames, since crc32(b"") == 0.
            problem = "a frame has length 0"
            break
        if end > size:
            problem = f"a frame of {length} bytes runs past the end of the file"
            break
        payload = view[start:end]
        if crc32(payload) != crc:
            problem = "a frame fails its CRC check"
            break
        if count >= skip:
            try:
                record = unpackb(payload, raw=False, strict_map_key=False)
            except Exception as exc:  # msgpack raises several unrelated types on garbage
                raise LogCorruptError(
                    f"record {first_index + count} passes its CRC check but is not valid "
                    f"msgpack ({exc})",
                    path,
                    offset,
                ) from exc
            if not isinstance(record, dict):
                raise LogCorruptError(
                    f"record {first_index + count} is a {type(record).__name__}, not a map",
                    path,
                    offset,
                )
            append(record)
        count += 1
        offset = end
    return SegmentScan(
        first_index=first_index,
        count=count,
        records=records,
        valid_end=offset,
        size=size,
        problem=problem,
    )
