"""The stream protocol's framing, sans I/O: bytes in, frames out.

What it owns: how a byte stream splits into frames (``wire``, "stream protocol": a 4-byte
unsigned big-endian length, then that many bytes of msgpack), with an explicit size limit,
for every reader of the protocol: the server's connections, the client's socket
transports, the bench's and the tests' raw sockets. :func:`frame_end` scans a buffer its
caller owns (the server charges every byte it buffers, so it keeps its own buffer);
:class:`FrameDecoder` keeps the buffer itself. Frames are written by :func:`wire.frame`.

The one loop that reads a frame off a blocking stream is here too
(:meth:`FrameDecoder.receive`, :func:`receive_one`), written once for every blocking
reader; the caller hands it its stream's ``recv``, so it still opens, waits on and closes
nothing itself.

What it must not know: sockets, event loops, what a frame's message means. Nothing here
reads, writes, waits or logs but through the ``recv`` a caller hands it; tests drive it in
memory.

Rules:
- A header that announces more than the limit raises :class:`FrameTooLarge` as soon as
  the header is whole: the framing can no longer be trusted, and no byte of the body
  needs to arrive (or be buffered) to know it.
- A frame is handed out only once it is whole; a truncated frame is simply not there yet.
- A frame's payload may be empty (an empty payload is not valid msgpack: the caller's
  decoding says so, not the framing).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Union

from . import wire

HEADER = wire.FRAME_HEADER
HEADER_LEN = HEADER.size
_read_header = HEADER.unpack_from

Buffer = Union[bytes, bytearray, memoryview]
#: A blocking stream's read: up to ``n`` bytes, at least one; ``b""`` once the peer has closed.
Recv = Callable[[int], bytes]

# Replies are small: one read of this size takes a typical one whole, with the header.
READ_SIZE = 64 * 1024
# The rest of a large frame is read in pieces of at most this, never past the frame's end.
MAX_READ = 1 << 20


class FrameTooLarge(wire.WireError):
    """A frame header announced ``length`` bytes, more than the reader's ``limit``."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the limit of {limit}")
        self.length = length
        self.limit = limit


class TrailingBytes(wire.WireError):
    """Bytes arrived behind a frame that nothing may follow (:func:`receive_one`)."""

    def __init__(self, count: int) -> None:
        super().__init__(f"{count} bytes arrived after the frame, with nothing more expected")
        self.count = count


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

    def receive(self, recv: Recv) -> bytes:
        """The next frame's payload: a whole one buffered already, else read with ``recv``
        until one is (the header in one read if it can, then exactly the rest of the frame,
        so no byte past it is taken off the stream).

        Raises :class:`FrameTooLarge`, and ``EOFError`` when ``recv`` says the stream ended
        first; what ``recv`` raises passes through.
        """
        while True:
            payload = self.next_payload()
            if payload is not None:
                return payload
            want = READ_SIZE if len(self._buf) < HEADER_LEN else min(missing(self._buf), MAX_READ)
            chunk = recv(want)
            if not chunk:
                raise EOFError("the connection closed mid-frame" if self._buf else "the connection closed")
            self._buf += chunk

    def next_frame(self, max_items: int = wire.MAX_REPLY_ITEMS) -> Any:
        """The next whole frame's message (None while there is none); raises
        :class:`FrameTooLarge`, or :class:`wire.WireError` for a payload that is not msgpack.
        A frame that holds msgpack ``nil`` is indistinguishable from no frame: no frame of
        the protocol is one."""
        payload = self.next_payload()
        return None if payload is None else wire.unpack(payload, self.limit, max_items=max_items)


def receive_one(recv: Recv, limit: int) -> bytes:
    """The payload of the one frame a blocking stream sends next, where nothing may follow it
    (the answer to the one request in flight on a connection).

    A frame that arrives whole in one read, as a small one does, is handed out from that read:
    one ``recv``, no decoder, no copy into a buffer (the blocking client's fast path). Raises
    :class:`FrameTooLarge`, :class:`TrailingBytes` when more arrived behind it, ``EOFError``
    when the stream ended first; what ``recv`` raises passes through.
    """
    chunk = recv(READ_SIZE)
    if frame_end(chunk, 0, limit) == len(chunk):
        return chunk[HEADER_LEN:]
    if not chunk:
        raise EOFError("the connection closed")
    frames = FrameDecoder(limit)
    frames.feed(chunk)
    payload = frames.receive(recv)
    if frames.buffered:
        raise TrailingBytes(frames.buffered)
    return payload
