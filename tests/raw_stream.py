"""Reading what the server sends on a raw socket, for tests that speak the stream protocol by hand
(through the client package's one frame reader, :mod:`rdzv_client.frame`)."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from rdzv_client import frame, wire

# A raw test socket waits this long for the server before it gives up.
PATIENCE = 15.0
# What a test reads: anything the server could send (the server bounds itself; tests check that).
READ_LIMIT = 1 << 30


def read_until_eof(sock: socket.socket, timeout: float = PATIENCE) -> bytes:
    """Everything the server sends until it closes (bounded by ``timeout``)."""
    sock.settimeout(timeout)
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(1 << 16):
            out += chunk
    return out


def stream_frames(data: bytes) -> list[list[Any]]:
    """The whole frames in ``data``, decoded."""
    decoder = frame.FrameDecoder(READ_LIMIT)
    decoder.feed(data)
    frames = []
    while (message := decoder.next_frame()) is not None:
        frames.append(message)
    return frames


class FrameReader:
    """Reply frames off one socket, one at a time (a frame may arrive in pieces, or several at once)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._frames = frame.FrameDecoder(READ_LIMIT)

    def recv(self) -> list[Any]:
        """The next reply frame; ConnectionError once the server has closed (or reset) the socket."""
        try:
            payload = self._frames.receive(self.sock.recv)
        except (ConnectionResetError, EOFError) as exc:
            raise ConnectionError("the server closed the stream") from exc
        return wire.unpack(payload, READ_LIMIT, max_items=wire.MAX_REPLY_ITEMS)  # type: ignore[no-any-return]

    @property
    def buffered(self) -> int:
        """Bytes read off the socket that are not yet a whole frame handed out."""
        return self._frames.buffered
