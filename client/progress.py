"""A worker's training progress, told to its node's agent: :func:`progress`.

What it owns: the one channel from a worker to the agent that started it. The torchrun
handler gives each node a directory and puts its path in ``RDZV_PROGRESS_DIR`` in
``os.environ`` before ``next_rendezvous()`` returns, so every worker the agent starts inherits
it. A worker's :func:`progress` replaces ``<dir>/<LOCAL_RANK>`` with its step (a write to a
temporary file, then an atomic rename) at most once a second, and once more at its exit for
the last step it was given. The agent reads the highest step of the directory
(:func:`node_step`) for its beats (soft state: the job's steps over time) and, when it
re-joins, for the round it leaves (logged: the server's crash-loop rule reads it), then
empties it (:func:`clear`) for the next round.

Why a file and not a request of the worker's own: a worker then needs no token, no
connection and no server address (thousands of workers would be thousands of connections),
and the training loop never waits on the network; the step reaches the server with the
agent's requests, which go out anyway.

Rules it keeps: :func:`progress` never raises into the training loop (an error is logged
once and the step dropped), costs a clock read and a comparison when rate-limited, and does
nothing where ``RDZV_PROGRESS_DIR`` is not set (outside a torchrun job of rdzv-server).

What it must not know: torch, the client's transports, the server.
"""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
import threading
import time

log = logging.getLogger("rdzv_client")

#: The variable the torchrun handler sets for its workers: the node's progress directory.
PROGRESS_DIR_ENV = "RDZV_PROGRESS_DIR"
#: At most one write a second: a training loop may call :func:`progress` every step.
MIN_INTERVAL_S = 1.0


class _Reporter:
    """One worker's reports: the last step given, the last written, when, and where."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.given: int | None = None
        self.written: int | None = None
        self.at = -MIN_INTERVAL_S
        self.failed = False
        self.exit_hook = False

    def report(self, step: int) -> None:
        with self.lock:
            self.given = step
            now = time.monotonic()
            if now - self.at < MIN_INTERVAL_S:
                if not self.exit_hook:  # the last step given reaches the agent at the worker's exit
                    atexit.register(self.flush)
                    self.exit_hook = True
                return
            self.at = now
            self._write()

    def flush(self) -> None:
        with self.lock:
            if self.given is not None and self.given != self.written:
                self._write()

    def _write(self) -> None:
        directory = os.environ.get(PROGRESS_DIR_ENV)
        if not directory or self.given is None or self.failed:
            return
        path = os.path.join(directory, os.environ.get("LOCAL_RANK", "0"))
        try:
            fd, tmp = tempfile.mkstemp(dir=directory, prefix=".step-")
            with os.fdopen(fd, "w") as f:
                f.write(str(self.given))
            os.replace(tmp, path)
        except OSError as exc:
            self.failed = True  # once: a loop that calls every step must not log every step
            log.warning("rdzv_client.progress: cannot write %s (%s); progress is not reported.", path, exc)
            return
        self.written = self.given


_reporter = _Reporter()


def progress(step: int) -> None:
    """Tell the node's agent that this worker reached training step ``step``.

    Cheap enough to call every step (at most one write a second); never raises; a no-op
    outside a torchrun job of rdzv-server. A step that is not a non-negative integer is
    ignored."""
    try:
        if isinstance(step, bool) or not 0 <= int(step) < 2**63 or int(step) != step:
            return
        if os.environ.get(PROGRESS_DIR_ENV):
            _reporter.report(int(step))
    except Exception:  # never into the training loop
        log.debug("rdzv_client.progress(%r) failed", step, exc_info=True)


def node_step(directory: str) -> int | None:
    """The highest step the node's workers wrote in ``directory`` (None: none). Never raises."""
    best: int | None = None
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    for name in names:
        if name.startswith("."):
            continue
        try:
            with open(os.path.join(directory, name)) as f:
                step = int(f.read().strip())
        except (OSError, ValueError):
            continue  # being replaced, or not ours
        if 0 <= step < 2**63 and (best is None or step > best):
            best = step
    return best


def clear(directory: str) -> None:
    """Empty ``directory`` for the next round's workers. Never raises."""
    try:
        for name in os.listdir(directory):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
    except OSError:
        pass
