"""The storage errors: one class per cause, all under :class:`StorageError`.

What it owns: the exceptions the storage package raises, so the service can tell "the data
directory cannot be trusted" (refuse to start) from "the disk stopped taking writes" (stop
acknowledging and shut down) without parsing messages.

What it must not know: HTTP. The service maps these to wire codes; nothing here carries one.
"""

from __future__ import annotations

from pathlib import Path


class StorageError(Exception):
    """Base class of every error the storage package raises on purpose."""


class LogCorruptError(StorageError):
    """Data on disk that recovery will not paper over: acknowledged writes could be lost.

    Raised for a bad frame with verified records after it (in any segment), a bad frame in
    a segment that is not the last one, a gap or overlap between segments, a snapshot-to-log
    gap, or a frame whose CRC matches but whose payload does not decode. ``path`` and
    ``offset`` name the first byte that could not be trusted; ``remedy``, when given, tells
    the operator what to do, and ends the message (which stays one line).
    """

    def __init__(self, message: str, path: Path, offset: int, *, remedy: str = "") -> None:
        where = f"{message} (file {path}, offset {offset})"
        super().__init__(f"{where}. {remedy}" if remedy else where)
        self.path = path
        self.offset = offset


class LogFailedError(StorageError):
    """A write or fsync failed, so this log acknowledges nothing from then on.

    The original ``OSError`` is the ``__cause__``. The log is not retried: after a failed
    fsync the kernel may already have dropped the dirty pages, so a later fsync that
    succeeds would prove nothing about the records written before it.
    """


class SnapshotBuildError(StorageError):
    """Rebuilding a snapshot from the log failed; the log is unchanged and stays usable.

    The message says why (the builder process died or was stopped, a closed segment does
    not verify, a record did not replay). Every record is still durable in the log; a
    later snapshot tries again.
    """


class RecordTooLargeError(StorageError):
    """A record is larger than this log takes (etcd refuses a request over its
    ``--max-request-bytes``). Raised by :meth:`~.log.Log.check` before anything is queued,
    so that the service refuses the command before it applies it; the log stays usable.
    ``size`` and ``limit`` are the record's encoded size and the log's limit, in bytes."""

    def __init__(self, message: str, size: int, limit: int) -> None:
        super().__init__(message)
        self.size = size
        self.limit = limit


class LogQueueFullError(StorageError):
    """The log's queue of records waiting to be written is at its bound (a slow disk, an
    etcd that does not answer). Raised by :meth:`~.log.Log.check`; nothing was queued and
    the log stays usable: the caller answers "busy, retry" instead of growing the queue."""


class LogClosedError(StorageError):
    """An append or snapshot was asked of a log that is closing or closed (a caller bug)."""


class DataDirLockedError(StorageError):
    """Another process holds the data directory; two writers would interleave their logs."""
