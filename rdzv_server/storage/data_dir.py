"""Where the durable state lives, and the lock that gives one process that directory alone.

What it owns: the default data directory (XDG state directory), the exclusive lock on a
data directory, and making changes to a directory's entries durable. The lock exists
because two servers started with the same default directory would otherwise append
interleaved frames to the same segment and destroy each other's logs.

What it must not know: the files inside the directory (segments and snapshots belong to
:mod:`.segment` and :mod:`.snapshot`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from .error import DataDirLockedError

LOCK_FILE_NAME = "lock"
APP_DIR_NAME = "rdzv-server"


def default_data_dir() -> Path:
    """``$XDG_STATE_HOME/rdzv-server``, or ``~/.local/state/rdzv-server`` when it is unset.

    A relative ``XDG_STATE_HOME`` is ignored, as the XDG base directory spec requires: the
    server would otherwise write its state wherever it happened to be started.
    """
    state_home = os.environ.get("XDG_STATE_HOME", "")
    if state_home and os.path.isabs(state_home):
        return Path(state_home) / APP_DIR_NAME
    return Path.home() / ".local" / "state" / APP_DIR_NAME


class DataDirLock:
    """An exclusive, non-blocking ``flock`` on ``<data_dir>/lock``, held until :meth:`release`.

    ``flock`` is released by the kernel when the process dies, so a crashed server never
    leaves a stale lock behind. On Windows there is no ``flock`` and the lock is a no-op.
    """

    def __init__(self, data_dir: Path) -> None:
        """Take the lock; raise :class:`DataDirLockedError` if another holder has it."""
        self._path = data_dir / LOCK_FILE_NAME
        self._fd: int | None = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        if sys.platform != "win32":
            import fcntl

            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                os.close(self._fd)
                self._fd = None
                raise DataDirLockedError(
                    f"The data directory {data_dir} is in use by another rdzv-server process; "
                    "give each server its own --data-dir."
                ) from exc

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd is not None:
            # Closing the descriptor releases the flock.
            os.close(self._fd)
            self._fd = None


def fsync_directory(directory: Path, fsync: Callable[[int], None]) -> None:
    """Make creations, renames and deletions inside ``directory`` durable.

    A new segment or a renamed snapshot is not durable until its directory entry is: after
    a power loss the file's data could be on disk with no name pointing at it. Windows
    cannot open a directory for fsync (and NTFS journals the entry), so it is skipped there.
    """
    if sys.platform == "win32":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fsync(fd)
    finally:
        os.close(fd)
