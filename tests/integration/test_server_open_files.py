"""The open-files budget: the server lifts its soft limit to the hard one, says at start how
many nodes that leaves room for, and refuses connections past it with the documented
``too_many_connections`` instead of failing (EMFILE) or dropping them."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from raw_stream import PATIENCE, FrameReader, read_until_eof, stream_frames
from server_process import ServerProcess

from rdzv_client import Client, RdzvConnectionError, wire

# Soft and hard: 64 descriptors, of which the server keeps a quarter in reserve (FD_RESERVE is
# larger), so it serves 48 connections.
OPEN_FILES = 64
ROOM = OPEN_FILES - OPEN_FILES // 4


@pytest.fixture
def small_server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path, durable=False, open_files=OPEN_FILES)
    srv.start()
    yield srv
    srv.close()


def stream(srv: ServerProcess) -> tuple[socket.socket, FrameReader]:
    """A stream connection with its hello answered."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
    frames = FrameReader(sock)
    sock.sendall(wire.STREAM_PREFACE + wire.frame([1, wire.HELLO_OP, "", {"token": srv.token}]))
    assert frames.recv()[:2] == [1, 200]
    return sock, frames


def test_the_server_says_how_many_nodes_its_open_files_limit_leaves_room_for(small_server: ServerProcess) -> None:
    line = next(l for l in small_server.log_text().splitlines() if "Serving at most" in l)
    assert f"Serving at most {ROOM} connections" in line, line
    assert f"open-files limit of {OPEN_FILES} (hard {OPEN_FILES})" in line, line
    assert re.search(rf"room for about {ROOM} torchrun nodes", line), line


def test_past_the_open_files_budget_connections_are_refused_with_too_many_connections(
    small_server: ServerProcess,
) -> None:
    srv = small_server
    job = "fd-budget"
    held: list[Any] = []
    try:
        for i in range(ROOM):  # every slot holds a parked long-poll: nothing may be shed
            sock, frames = stream(srv)
            held.append(sock)
            if i == 0:
                sock.sendall(wire.frame([2, "create", job, {"min_nodes": 1, "max_nodes": 1}]))
                assert frames.recv()[:2] == [2, 200]
            sock.sendall(wire.frame([3, "get", job, {"key": b"never", "timeout": PATIENCE}]))

        # One more, stream or HTTP: refused at the door with the documented error, not dropped.
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
        held.append(sock)
        sock.sendall(wire.STREAM_PREFACE + wire.frame([1, wire.HELLO_OP, "", {"token": srv.token}]))
        frames_seen = stream_frames(read_until_eof(sock))
        assert [(f[0], f[1], f[2]["error"]) for f in frames_seen] == [(0, 429, "too_many_connections")]

        with Client(srv.endpoint, retry_budget=0.5) as client, pytest.raises(RdzvConnectionError) as err:
            client.num_keys(job)
        assert err.value.code == wire.ErrorCode.TOO_MANY_CONNECTIONS
    finally:
        for sock in held:
            sock.close()

    # The server is fine: once the parked connections are gone, a client is served again.
    with Client(srv.endpoint, retry_budget=10.0) as client:
        assert client.num_keys(job) == 0
    log = srv.log_text()
    assert "Traceback" not in log and "Too many open files" not in log
