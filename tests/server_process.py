"""The real server as a process on 127.0.0.1: start, SIGKILL, SIGTERM, restart on the same port."""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

READY_PREFIX = "rdzv-server listening on http://"
START_TIMEOUT = 30.0


class ServerProcess:
    """`python -m rdzv_server` on 127.0.0.1; restarts keep the port and the data dir."""

    def __init__(self, workdir: Path, *, durable: bool, args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.data_dir = workdir / "data" if durable else None
        self.args = args
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None
        self.log_path = workdir / "server.log"
        self.starts = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "rdzv_server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--memory"] if self.data_dir is None else ["--data-dir", str(self.data_dir)]
        cmd += list(self.args)
        env = {k: v for k, v in os.environ.items() if not k.startswith("RDZV_")}
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.starts += 1
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if not sel.select(timeout=0.2):
                if self.proc.poll() is not None:
                    break
                continue
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(READY_PREFIX):
                self.port = int(line.strip().rsplit(":", 1)[1])
                return
        self.kill()
        raise RuntimeError(f"server did not start; its log:\n{self.log_text()}")

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: no flush, no goodbye (what a crash or OOM kill does)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait: returns the exit code."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self.close()
        return code

    def restart(self) -> None:
        self.close()
        self.start()

    def close(self) -> None:
        self.kill()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
            self.proc.stdout = None
