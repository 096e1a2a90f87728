"""The log for ``--memory``: the :class:`~.log.Log` interface with nothing kept.

What it owns: standing in for :class:`~.file_log.FileLog` in tests and throwaway runs.
Appends are acknowledged at once (their futures are already done) and a restart starts
empty.

It still encodes every record with msgpack and drops the bytes, so a record the file log
would reject fails the same way here: tests that run in memory catch a state machine
emitting something unencodable (a set, an object) before a durable server does. A snapshot
keeps nothing either: it only restarts the count of records since the last one.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack

from .error import LogClosedError
from .log import ReplicaFactory


class MemoryLog:
    """A :class:`~.log.Log` that keeps nothing; see the module docstring."""

    def __init__(self) -> None:
        self._last_index = 0
        self._cut_index = 0
        self._closed = False
        # One Packer: msgpack.packb builds one (with its buffer) per call, which costs more
        # than encoding a record. The loop's thread only, as every append.
        self._pack = msgpack.Packer(use_bin_type=True).pack
        # What every append returns: one future, resolved once (asking for the running loop
        # costs a getpid() system call per append).
        self._appended: asyncio.Future[None] | None = None

    @property
    def records_since_snapshot(self) -> int:
        """Records appended since the last :meth:`snapshot` call."""
        return self._last_index - self._cut_index

    def check(self, record: dict[str, Any]) -> None:
        """Nothing to refuse: there is no queue, and no size limit but memory's."""

    def append(self, record: dict[str, Any]) -> asyncio.Future[None]:
        """Return an already-resolved future (the same one every time).

        Raises ``TypeError`` for a record msgpack cannot encode and
        :class:`~.error.LogClosedError` after :meth:`close`.
        """
        if self._closed:
            raise LogClosedError("The in-memory log is closed; cannot append.")
        self._pack(record)
        self._last_index += 1
        future = self._appended
        if future is None:
            future = self._appended = asyncio.get_running_loop().create_future()
            future.set_result(None)
        return future

    def snapshot(self, replica: ReplicaFactory) -> asyncio.Future[None]:
        """Reset :attr:`records_since_snapshot`; return an already-resolved future.

        Nothing is built (there is nothing to build from). Raises
        :class:`~.error.LogClosedError` after :meth:`close`.
        """
        if self._closed:
            raise LogClosedError("The in-memory log is closed; cannot snapshot.")
        self._cut_index = self._last_index
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def close(self) -> None:
        """Refuse further appends (idempotent)."""
        self._closed = True
