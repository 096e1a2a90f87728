"""Reading what the server sends on a raw socket, for tests that speak the stream protocol by hand."""

from __future__ import annotations

import contextlib
import socket
import struct
from typing import Any

import msgpack

# A raw test socket waits this long for the server before it gives up.
PATIENCE = 15.0


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
    frames = []
    while len(data) >= 4:
        (n,) = struct.unpack(">I", data[:4])
        frames.append(msgpack.unpackb(data[4 : 4 + n], raw=False))
        data = data[4 + n :]
    return frames


class FrameReader:
    """Reply frames off one socket, one at a time (a frame may arrive in pieces, or several at once)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""

    def recv(self) -> list[Any]:
        """The next reply frame; ConnectionError once the server has closed (or reset) the socket."""
        while len(self._buf) < 4 or len(self._buf) < 4 + struct.unpack(">I", self._buf[:4])[0]:
            try:
                chunk = self.sock.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                raise ConnectionError("the server closed the stream")
            self._buf += chunk
        (n,) = struct.unpack(">I", self._buf[:4])
        reply: list[Any] = msgpack.unpackb(self._buf[4 : 4 + n], raw=False)
        self._buf = self._buf[4 + n :]
        return reply
