"""Shared fixtures: the real server as a process on 127.0.0.1, a free port each."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_process import ServerProcess

# Auth is on by default: a server creates its token in $XDG_CONFIG_HOME/rdzv-server/token and
# every client on the host reads it there. The whole session (servers, clients, rdzvctl and
# torchrun agents inherit the environment) shares one fresh config folder, never the user's.
CONFIG_HOME = tempfile.mkdtemp(prefix="rdzv-tests-config-")
os.environ["XDG_CONFIG_HOME"] = CONFIG_HOME


@pytest.fixture(scope="session", autouse=True)
def _config_home() -> Iterator[None]:
    yield
    shutil.rmtree(CONFIG_HOME, ignore_errors=True)


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
