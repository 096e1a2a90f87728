"""Child processes of the bench: services it starts and the simulated-node workers it spawns.

What it owns: free loopback ports, starting a service and waiting (bounded) for it to be
ready, stopping it (SIGTERM, then SIGKILL), and the ``spawn`` multiprocessing context.
Every wait here has a deadline; a deadline that passes raises :class:`Timeout`, which the
measurements report as a timeout, never as a crash.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

# A service that is not listening after this long is broken, not slow.
DEFAULT_START_TIMEOUT = 60.0
# SIGTERM gets this long before SIGKILL: rdzv-server drains and flushes in well under it.
DEFAULT_STOP_GRACE = 10.0

#: Every child is spawned, never forked: the parent holds threads (clients, TCPStore).
SPAWN: multiprocessing.context.SpawnContext = multiprocessing.get_context("spawn")


class Timeout(Exception):
    """A bounded wait ran out; the message says what was awaited and for how long."""


class Unavailable(Exception):
    """A backend cannot run on this machine (e.g. etcd is not installed); the message says why."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``condition`` until it holds; raise :class:`Timeout` naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise Timeout(f"{what}: not within {timeout:g} s")
        time.sleep(interval)


class Service:
    """A service process (rdzv-server, etcd) whose stderr goes to a log file.

    ``ready_line``: a prefix of the stdout line that says it is ready (then :attr:`ready_text`
    holds that line); without it, ``probe`` is polled instead.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, *, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.started_at = 0.0
        self.ready_at = 0.0
        self.ready_text = ""
        self._log: IO[str] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "the service was not started"
        return self.proc.pid

    def start(
        self,
        *,
        ready_line: str | None = None,
        probe: Callable[[], bool] | None = None,
        timeout: float = DEFAULT_START_TIMEOUT,
    ) -> None:
        """Start the process and wait until it is ready; raise :class:`Timeout` (after killing it) if not."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "a", encoding="utf-8")  # noqa: SIM115 (closed in stop())
        self._log.write(f"=== {self.name}: {' '.join(self.argv)}\n")
        self._log.flush()
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            text=True,
            env=self.env,
            start_new_session=True,  # a Ctrl-C of the bench reaches it only through stop()
        )
        try:
            if ready_line is not None:
                self.ready_text = self._read_ready_line(ready_line, timeout)
            elif probe is not None:
                wait_until(lambda: self._alive() and probe(), timeout, f"{self.name} to answer")
        except BaseException:
            self.kill()
            raise
        self.ready_at = time.monotonic()
        # Keep draining stdout so the child never blocks on a full pipe.
        threading.Thread(target=self._drain, name=f"{self.name}-stdout", daemon=True).start()

    def _alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise Unavailable(f"{self.name} exited with status {self.proc.returncode}; see {self.log_path}")
        return True

    def _read_ready_line(self, prefix: str, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        found: list[str] = []
        stdout = self.proc.stdout

        def read() -> None:
            for line in stdout:
                if line.startswith(prefix):
                    found.append(line.strip())
                    return

        reader = threading.Thread(target=read, name=f"{self.name}-ready", daemon=True)
        reader.start()
        reader.join(timeout)
        if not found:
            if self.proc.poll() is not None:
                raise Unavailable(f"{self.name} exited with status {self.proc.returncode}; see {self.log_path}")
            raise Timeout(f"{self.name} did not print {prefix!r} within {timeout:g} s; see {self.log_path}")
        return found[0]

    def _drain(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            for _ in self.proc.stdout:
                pass

    def kill(self) -> None:
        """SIGKILL, and reap (bounded)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(DEFAULT_STOP_GRACE)
            except subprocess.TimeoutExpired:
                pass
        self._close_log()

    def stop(self, grace: float = DEFAULT_STOP_GRACE) -> None:
        """SIGTERM, then SIGKILL after ``grace`` s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def end_processes(procs: Sequence[multiprocessing.process.BaseProcess], grace: float = 5.0) -> None:
    """Join spawned workers for ``grace`` s in all, then SIGKILL the ones still there."""
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(DEFAULT_STOP_GRACE)


def gather(pipes: Sequence[multiprocessing.connection.Connection], timeout: float, what: str) -> list[Any]:
    """One ``("ok", value)`` reply from each worker pipe, in order, all within ``timeout`` s.

    Raises :class:`Timeout` when a worker is late and ``RuntimeError`` when one reports an error.
    """
    deadline = time.monotonic() + timeout
    out = []
    for pipe in pipes:
        if not pipe.poll(max(0.0, deadline - time.monotonic())):
            raise Timeout(f"{what}: not within {timeout:g} s")
        kind, value = pipe.recv()
        if kind == "error":
            raise RuntimeError(value)
        out.append(value)
    return out


def server_cpu_ns(pid: int | None) -> int | None:
    """CPU time of process ``pid``, every thread, in ns (Linux' schedstat); None where unknown."""
    if pid is None:
        return None
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat", encoding="ascii") as f:
                total += int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # not Linux, or a thread ended between listing and reading: no figure
    return total
