"""Snapshot building off the event loop: the previous snapshot and the closed segments after
it, replayed into a fresh replica in a separate process.

What it owns: turning (the snapshot at ``base``, the closed segments holding records
``base + 1`` to ``index``) into the temporary half of the snapshot at ``index``, in a child
process, and the small protocol between the log and that process.

Why a separate process, and not the event loop, a thread, or a fork:
- On the event loop, building and encoding the state costs time proportional to its size
  (about 0.25 s per 1M small keys, ``python -m bench.lab.snapshot``), and every client waits
  that long: nothing proportional to the state's size may run there.
- In a thread, the GIL still serialises the work with the loop, and msgpack's ``packb``
  holds the GIL for a whole call: encoding a 1M-key state in a thread stalls the loop
  about as long as encoding it on the loop does.
- A forked copy-on-write child of the server would see the live state without any replay,
  but ``fork()`` in a process with threads (the log writer, executors) copies locks other
  threads may hold, and the child can deadlock on them; Python warns against it.
- A fresh interpreter shares nothing and has its own GIL. It rebuilds the state by the same
  deterministic apply path recovery uses (``restore`` then ``replay``), so the snapshot
  it writes is the state a recovery at that index rebuilds; every snapshot is thereby also
  a check that the log replays.

Rules:
- The builder reads closed segments only, up to exactly the cut: the log rotated away from
  (and fsynced) the segment holding the cut before the build starts, and a closed segment
  never changes. It writes one file, ``snapshot-<index>.msgpack.tmp``, and fsyncs it; it
  never renames or deletes anything.
- The parent, which holds the directory's lock, renames the file into place (and fsyncs
  the directory) only after the builder exited successfully. A builder that outlives its
  server therefore leaves at most a ``.tmp`` file, which recovery deletes; and it exits
  as soon as it notices: it watches its stdin, which the parent holds open until the
  build is over and the kernel closes when the parent dies.
- What a build reads is verified as recovery verifies it (the snapshot's CRC, every
  frame's CRC, contiguous indices, reaching exactly the cut). Any problem fails the build
  with :class:`~.error.SnapshotBuildError` and changes nothing on disk.
- The builder's garbage collector is off: a single-threaded, short-lived process that builds
  acyclic data would only have the collector rescan millions of new containers. (The
  server's own process never switches its collector: see :mod:`.recovery`.)

Cost: the builder holds a second copy of the state while it runs (a fork would too, once
its pages were touched) and keeps a second core busy for about the time the loop used to
stall plus the replay of the records since the previous snapshot.

What it must not know: what records and states mean (the replica does), or the event loop.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .error import SnapshotBuildError
from .log import ReplicaFactory
from .segment import scan_segment
from .snapshot import encode_snapshot, read_snapshot, write_snapshot_temp

_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class BuildJob:
    """What one build needs; pickled to the builder process.

    ``segments`` are ``(first_index, path)`` in order, the first one holding record
    ``base_index + 1`` (or 1), the last one ending at ``index``.
    """

    index: int
    base_index: int | None
    base_path: Path | None
    segments: tuple[tuple[int, Path], ...]
    temp: Path
    replica: ReplicaFactory


@dataclass(frozen=True)
class BuildReport:
    """A finished build: records replayed on top of the base, the file's size, the time taken."""

    records: int
    size: int
    seconds: float


class SnapshotBuilder:
    """One build in a child process. :meth:`run` blocks (call it in a thread); :meth:`stop` may
    be called from any thread, before or during :meth:`run`."""

    def __init__(self, job: BuildJob) -> None:
        self.job = job
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = False

    def run(self) -> BuildReport:
        """Build the snapshot's temporary file; raise :class:`SnapshotBuildError` if it fails."""
        payload = pickle.dumps(self.job)
        # The parent's sys.path, so the builder imports the replica's module as the server
        # did (an editable install, a source checkout, a test directory).
        bootstrap = f"import sys; sys.path[:] = {sys.path!r}; from {__name__} import main; main()"
        with self._lock:
            if self._stopped:
                raise SnapshotBuildError(f"the build of snapshot {self.job.index} was stopped before it started")
            # A session of its own: a Ctrl-C at the server's terminal is the server's to
            # handle; it stops the builder through stop().
            proc = self._proc = subprocess.Popen(
                [sys.executable, "-c", bootstrap],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,
            )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            try:
                proc.stdin.write(_LENGTH.pack(len(payload)) + payload)
                proc.stdin.flush()
            except BrokenPipeError:
                pass  # it died already; its exit status says why
            # stdin stays open until the builder exits: its EOF means "your parent is gone".
            output = proc.stdout.read()
            status = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdin.close()
            proc.stdout.close()
        lines = output.decode("utf-8", "replace").strip().splitlines()
        try:
            result: dict[str, Any] = json.loads(lines[-1]) if lines else {}
        except ValueError:
            result = {}
        if status == 0 and "size" in result:
            return BuildReport(records=int(result["records"]), size=int(result["size"]), seconds=float(result["seconds"]))
        self.job.temp.unlink(missing_ok=True)
        if self._stopped:
            why = "it was stopped (the log is closing)"
        elif "error" in result:
            why = str(result["error"])
        elif status < 0:
            why = f"the builder process was killed by signal {-status}"
        else:
            why = f"the builder process exited with status {status} (its stderr is in the server's log)"
        raise SnapshotBuildError(f"building snapshot {self.job.index} failed: {why}")

    def stop(self) -> None:
        """Kill the builder if it runs, or keep it from starting; :meth:`run` then raises."""
        with self._lock:
            self._stopped = True
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()


def build(job: BuildJob) -> BuildReport:
    """Replay ``job`` into a fresh replica and write the snapshot's temporary file (in the builder).

    Raises :class:`SnapshotBuildError` when the inputs do not verify or do not reach the
    cut, :class:`~.error.LogCorruptError` for a damaged base snapshot, ``OSError`` for I/O,
    and whatever the replica raises for a record that does not replay.
    """
    started = time.monotonic()
    replica = job.replica()
    after = job.base_index or 0
    if job.base_path is not None and job.base_index is not None:
        replica.restore(read_snapshot(job.base_path, job.base_index))
    expected = after + 1  # the next record to replay
    for first, path in job.segments:
        if first > expected:
            raise SnapshotBuildError(f"{path} starts at record {first}, but the next record to replay is {expected}")
        scan = scan_segment(path, first, decode_after=after)
        if scan.problem is not None:
            raise SnapshotBuildError(
                f"{scan.problem} at offset {scan.valid_end} of {path}, a closed segment: the log is damaged, "
                "and the next restart will refuse to start until it is repaired"
            )
        # scan.records are the records from max(first, after + 1) on.
        skip = expected - max(first, after + 1)
        wanted = job.index - expected + 1
        for record in scan.records[skip : skip + wanted]:
            replica.replay(record)
        expected = max(expected, first + scan.count)
        if expected > job.index:
            break
    if expected <= job.index:
        raise SnapshotBuildError(f"the closed segments end at record {expected - 1}, before the cut at {job.index}")
    blob = encode_snapshot(job.index, replica.to_snapshot())
    write_snapshot_temp(job.temp, blob, os.fsync)
    return BuildReport(records=job.index - after, size=len(blob), seconds=time.monotonic() - started)


def main() -> None:
    """The builder process: read one job from stdin, build, print one JSON line, exit."""
    gc.disable()  # see the module docstring
    job = receive_job()
    try:
        report = build(job)
    except Exception as exc:  # noqa: BLE001 (every failure is reported the same way)
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        sys.exit(1)
    print(json.dumps({"records": report.records, "size": report.size, "seconds": report.seconds}), flush=True)


def receive_job() -> Any:
    """In a builder process: the job its parent sent on stdin (a length, then a pickle); from
    then on the process exits as soon as its parent goes away (stdin closes)."""
    (length,) = _LENGTH.unpack(_read_exactly(0, _LENGTH.size))
    job = pickle.loads(_read_exactly(0, length))  # from our own parent, over a private pipe
    threading.Thread(target=_exit_with_parent, name="rdzv-snapshot-parent-watch", daemon=True).start()
    return job


def _read_exactly(fd: int, size: int) -> bytes:
    chunks: list[bytes] = []
    while size > 0:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise SystemExit(2)  # the parent went away before sending the job
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _exit_with_parent() -> None:
    # Raw reads, not sys.stdin: a daemon thread blocked inside a buffered reader's lock
    # makes interpreter shutdown abort.
    while os.read(0, 4096):
        pass
    os._exit(3)
