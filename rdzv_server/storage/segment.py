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
frame. :func:`scan_segment` only reports (where the trustworthy prefix ends, why, and whether
any whole, verified frame follows the bad spot); :mod:`.recovery` decides between truncating
a torn tail and refusing to start.

Finding a verified frame after a bad one means trying every later byte offset as a frame
start (a damaged length field hides where the next frame begins). A candidate is cheap to
reject: a length of 0 or one that runs past the end of the file costs one header read, and
runs of zero bytes (what a crash leaves most often) are skipped at once. A false match needs
a plausible length and a matching CRC-32 (about 1 in 2**32 per plausible candidate).
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

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
    """The verified prefix of one segment, and what follows it.

    ``count`` whole frames end at byte ``valid_end``; ``records`` holds the decoded records
    whose index is above the ``decode_after`` the scan was asked for. ``problem`` says why
    the scan stopped before ``size`` (``None`` when every byte is a whole, verified frame).
    ``undecodable`` is true when the frame at ``valid_end`` passes its CRC check but is not
    a record: never a torn write. ``resumes_at`` is the offset of the first whole, verified
    frame after the bad spot (``None``: none, which is what a torn tail looks like), and
    ``verified_after`` counts the verified frames from there to the end of the file.
    """

    first_index: int
    count: int
    records: list[dict[str, Any]]
    valid_end: int
    size: int
    problem: str | None
    undecodable: bool = False
    resumes_at: int | None = None
    verified_after: int = 0


def scan_segment(path: Path, first_index: int, decode_after: int) -> SegmentScan:
    """Verify the frames of ``path`` from the start; decode those with index > ``decode_after``.

    Stops at the first frame that is short, has a zero length, fails its CRC, or passes its
    CRC but does not decode to a msgpack map, and reports it in ``problem``; the caller
    decides what that means. Raises ``OSError`` if the file cannot be read.
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
    undecodable = False
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
            except Exception as exc:  # noqa: BLE001 (msgpack raises several unrelated types on garbage)
                problem = f"record {first_index + count} passes its CRC check but is not valid msgpack ({exc})"
                undecodable = True
                break
            if not isinstance(record, dict):
                problem = f"record {first_index + count} is a {type(record).__name__}, not a map"
                undecodable = True
                break
            append(record)
        count += 1
        offset = end
    resumes_at: int | None = None
    verified_after = 0
    if problem is not None:
        resumes_at = next_verified_frame(data, offset + 1)
        position = resumes_at
        while position is not None:
            verified_after += 1
            length, _ = unpack_header(data, position)
            position = next_verified_frame(data, position + header_size + length)
    return SegmentScan(
        first_index=first_index,
        count=count,
        records=records,
        valid_end=offset,
        size=size,
        problem=problem,
        undecodable=undecodable,
        resumes_at=resumes_at,
        verified_after=verified_after,
    )


_NONZERO_BYTE = re.compile(rb"[^\x00]")


def next_verified_frame(data: bytes, start: int) -> int | None:
    """The first offset at or after ``start`` where a whole frame passes its CRC check.

    ``None`` when there is none. See the module docstring for the cost.
    """
    size = len(data)
    header_size = FRAME_HEADER.size
    unpack_header = FRAME_HEADER.unpack_from
    crc32 = zlib.crc32
    view = memoryview(data)
    offset = start
    # The smallest frame is a header and one payload byte.
    while offset + header_size < size:
        length, crc = unpack_header(data, offset)
        if length == 0:
            # The 4 bytes of this length field are 0; no frame starts until a length field
            # includes the next non-zero byte, so at most 3 bytes before it.
            found = _NONZERO_BYTE.search(data, offset + 4)
            if found is None:
                return None
            offset = max(offset + 1, found.start() - 3)
            continue
        end = offset + header_size + length
        if end <= size and crc32(view[offset + header_size : end]) == crc:
            return offset
        offset += 1
    return None
