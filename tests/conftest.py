"""Shared fixtures: the real server as a process on 127.0.0.1, a free port each."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import ServerProcess


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A memory-only server."""
    srv = ServerProcess(tmp_path, durable=False)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def durable_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server with a data dir under tmp_path (fsync=always); restart() recovers it."""
    srv = ServerProcess(tmp_path, durable=True)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[object]:
    """Start servers with extra flags: ``server_factory(durable=True, args=("--max-hold", "1"))``."""
    started: list[ServerProcess] = []

    def make(*, durable: bool = False, args: tuple[str, ...] = ()) -> ServerProcess:
        d = tmp_path / f"srv{len(started)}"
        d.mkdir()
        srv = ServerProcess(d, durable=durable, args=args)
        srv.start()
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.close()
