"""Durable storage: an append-only log of records plus snapshots, and recovery at start.

What it owns: making the state machine's records durable under an fsync policy before the
service acknowledges them, and giving back, on start, the newest snapshot and the records
after it (see DESIGN.md, "Durability").

What it must not know: HTTP, or what a record or a state means. Records and states are
plain msgpack-able dicts, stored opaquely. It may use ``core/``; ``core/`` never uses it.

Layout: :mod:`.log` is the seam (the :class:`Log` protocol and its values);
:mod:`.file_log` and :mod:`.memory_log` implement it; :mod:`.segment` and :mod:`.snapshot`
are the two file formats; :mod:`.recovery` reads a directory back; :mod:`.compaction`
builds snapshots in a separate process; :mod:`.data_dir` is where it lives and who may use it.
"""

from __future__ import annotations

from .data_dir import default_data_dir
from .error import (
    DataDirLockedError,
    LogClosedError,
    LogCorruptError,
    LogFailedError,
    LogQueueFullError,
    RecordTooLargeError,
    SnapshotBuildError,
    StorageError,
)
from .file_log import DEFAULT_BATCH_WINDOW_S, FileLog
from .log import (
    DEFAULT_MAX_QUEUED_BYTES,
    DEFAULT_MAX_QUEUED_RECORDS,
    DEFAULT_SNAPSHOT_EVERY,
    FsyncPolicy,
    Log,
    Recovered,
    ReplicatedLog,
    Replica,
    ReplicaFactory,
)
from .memory_log import MemoryLog

__all__ = [
    "DEFAULT_BATCH_WINDOW_S",
    "DEFAULT_MAX_QUEUED_BYTES",
    "DEFAULT_MAX_QUEUED_RECORDS",
    "DEFAULT_SNAPSHOT_EVERY",
    "DataDirLockedError",
    "FileLog",
    "FsyncPolicy",
    "Log",
    "LogClosedError",
    "LogCorruptError",
    "LogFailedError",
    "LogQueueFullError",
    "MemoryLog",
    "RecordTooLargeError",
    "Recovered",
    "ReplicatedLog",
    "Replica",
    "ReplicaFactory",
    "SnapshotBuildError",
    "StorageError",
    "default_data_dir",
]
