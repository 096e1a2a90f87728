"""Shared fixtures: the real server as a process on 127.0.0.1, a free port each.

Under pytest-xdist's ``--dist loadfile`` (README's test command) each test file goes to one
worker, so a file's tests never run at the same time as each other and share its
module-scoped fixtures, as in a serial run. The files in :data:`SPREAD_FILES` are long (real
torchrun jobs) and are cut into :data:`SPREAD_PARTS` parts, so that no one worker runs them
all; their parts are collected first. Files are handed out in collection order (the parts,
then e2e, integration, unit: the longest first), not by xdist's default reorder by test count.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_process import ServerProcess

# Auth is on by default: a server creates its token in $XDG_CONFIG_HOME/rdzv-server/token and
# every client on the host reads it there. The whole session (servers, clients, rdzvctl and
# torchrun agents inherit the environment) shares one fresh config folder, never the user's.
CONFIG_HOME = tempfile.mkdtemp(prefix="rdzv-tests-config-")
os.environ["XDG_CONFIG_HOME"] = CONFIG_HOME

# The suite starts some hundreds of Python processes (servers, rdzvctl, torchrun agents, the
# xdist workers), and each compiled our sources and the test files from scratch where the
# environment says PYTHONDONTWRITEBYTECODE (as on these machines): ~0.1 s of CPU per server
# start, ~4 s per worker to rewrite the test modules' asserts. The session writes bytecode
# caches (into the __pycache__ folders .gitignore names), and every process after the first reads them.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


@pytest.fixture(scope="session", autouse=True)
def _config_home() -> Iterator[None]:
    yield
    shutil.rmtree(CONFIG_HOME, ignore_errors=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Also in a pytest-xdist controller, which imports this file but runs no test (and so no
    session fixture): each process removes the config folder it made."""
    shutil.rmtree(CONFIG_HOME, ignore_errors=True)


# Test files too long for one worker (paths from the tests folder), and in how many parts.
SPREAD_FILES = frozenset({"e2e/test_torchrun_e2e.py", "e2e/test_job_fate.py"})
SPREAD_PARTS = 3
TESTS_DIR = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", default="no") == "loadfile":
        config.option.loadscopereorder = False  # hand files out in collection order: the longest first
        _warm_torch()


def _warm_torch() -> None:
    """In the xdist controller, before any worker starts: import torch's launcher once, so
    that its bytecode is written (README's command installs with ``--no-compile``, and pip's
    compiling of every package costs more than this) and read by every process after it,
    instead of compiled again by each of the workers and agents that start at once."""
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError:  # (no torch: the tests that need it say so)
        pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a pytest-xdist worker, :data:`SPREAD_FILES` first: their parts are the longest units
    of work, so they start first (every worker sorts alike, as xdist requires)."""
    if not hasattr(config, "workerinput"):
        return
    spread = {id(item) for item in items if _tests_path(item.path) in SPREAD_FILES}
    items.sort(key=lambda item: id(item) not in spread)  # stable: the order within each kept


def _tests_path(path: Path) -> str:
    """``path`` from the tests folder (as :data:`SPREAD_FILES` names files), else as given."""
    try:
        return path.resolve().relative_to(TESTS_DIR).as_posix()
    except ValueError:
        return path.as_posix()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with each of :data:`SPREAD_FILES` cut into :data:`SPREAD_PARTS` parts."""
    if config.getoption("dist", default="no") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SpreadLoadFile(LoadFileScheduling):  # type: ignore[misc]
        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            self._scopes: dict[str, str] = {}
            self._counts: dict[str, int] = {}

        def _split_scope(self, nodeid: str) -> str:
            scope: str = super()._split_scope(nodeid)
            name = _tests_path(Path(config.rootpath, scope))
            if name not in SPREAD_FILES:
                return scope
            if nodeid not in self._scopes:  # the first call sees the collection in order
                self._counts[name] = self._counts.get(name, -1) + 1
                self._scopes[nodeid] = f"{scope}#{self._counts[name] % SPREAD_PARTS}"
            return self._scopes[nodeid]

    return SpreadLoadFile(config, log)


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
def read_server(tmp_path: Path) -> Iterator[tuple[ServerProcess, str]]:
    """A memory-only server that also takes a read-only token: ``(server, read_token)``."""
    read_token = secrets.token_urlsafe(24)
    path = tmp_path / "read-token"
    path.write_text(read_token + "\n")
    path.chmod(0o600)
    srv = ServerProcess(tmp_path, durable=False, args=("--read-token-file", str(path)))
    srv.start()
    yield srv, read_token
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
