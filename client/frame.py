"""The stream protocol's framing, sans I/O: bytes in, frames out.

What it owns: how a byte stream splits into frames (``wire``, "stream protocol": a 4-byte
unsigned big-endian length, then that many bytes of msgpack), with an explicit size limit,
for every reader of the protocol: the server's connections, the blocking client's
transport and the tests' raw sockets. :func:`frame_end` scans a buffer its caller owns
(the server charges every byte it buffers, so it keeps its own buffer);
:class:`FrameDecoder` keeps the buffer itself. Frames are written by :func:`wire.frame`.

What it must not know: sockets, event loops, what a frame's message means. Nothing here
reads, writes, waits or logs; tests drive it in memory.

Rules:
- A header that announces more than the limit raises :class:`FrameTooLarge` as soon as
  the header is whole: the framing can no longer be trusted, and no byte of the body
  needs to arrive (or be buffered) to know it.
- A frame is handed out only once it is whole; a truncated frame is simply not there yet.
- A frame's payload may be empty (an empty payload is not valid msgpack: the caller's
  decoding says so, not the framing).
"""

from __future__ import annotations

from typing import Any, Union

from . import wire

HEADER = wire.FRAME_HEADER
HEADER_LEN = HEADER.size
_read_header = HEADER.unpack_from

Buffer = Union[bytes, bytearray, memoryview]


class FrameTooLarge(wire.WireError):
    """A frame header announced ``length`` bytes, more than the reader's ``limit``."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the limit of {limit}")
        self.length = length
        self.limit = limit


def frame_end(buf: Buffer, pos: int, limit: int) -> int | None:
    """Where the frame that starts at ``pos`` of ``buf`` ends (its payload is
    ``buf[pos + HEADER_LEN : end]``); None while ``buf`` does not hold it whole.

    Raises :class:`FrameTooLarge` when its header announces more than ``limit`` bytes.
    """
    if len(buf) - pos < HEADER_LEN:
        return None
    (length,) = _read_header(buf, pos)
    if length > limit:
        raise FrameTooLarge(length, limit)
    end = pos + HEADER_LEN + length
    return end if end <= len(buf) else None


def missing(buf: Buffer, pos: int = 0) -> int:
    """Bytes still to come before ``buf[pos:]`` holds its header, then its whole frame (0: it does)."""
    held = len(buf) - pos
    if held < HEADER_LEN:
        return HEADER_LEN - held
    length: int = _read_header(buf, pos)[0]
    return max(0, HEADER_LEN + length - held)


class FrameDecoder:
    """Frames out of the bytes fed in, one at a time; frames over ``limit`` bytes raise.

    ``feed`` what arrived, then take frames until :meth:`next_payload` (or
    :meth:`next_frame`) returns None: the rest of a frame has not arrived yet.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buf = bytearray()

    def feed(self, data: Buffer) -> None:
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes fed and not yet handed out as a frame."""
        return len(self._buf)

    def missing(self) -> int:
        """Bytes that complete the next frame's header, then the frame (0: it is whole)."""
        return missing(self._buf)

    def next_payload(self) -> bytes | None:
        """The next whole frame's payload, or None; raises :class:`FrameTooLarge`."""
        end = frame_end(self._buf, 0, self.limit)
        if end is None:
            return None
        payload = bytes(self._buf[HEADER_LEN:end])
        del self._buf[:end]
        return payload

    def next_frame(self, max_items: int = wire.MAX_REPLY_ITEMS) -> Any:
        """The next whole frame's message (None while there is none); raises
        :class:`FrameTooLarge`, or :class:`wire.WireError` for a payload that is not msgpack.
        A frame that holds msgpack ``nil`` is indistinguishable from no frame: no frame of
        the protocol is one."""
        payload = self.next_payload()
        return None if payload is None else wire.unpack(payload, self.limit, max_items=max_items)
