"""The real server as a process on 127.0.0.1: start, SIGKILL, SIGTERM, restart on the same port.

:class:`TLSFiles` makes a throwaway CA (``trustme``) with a server certificate for 127.0.0.1
and a client certificate, as PEM files: ``ServerProcess(..., tls=files)`` serves TLS with
them (``mutual_tls=True`` also requires client certificates signed by that CA).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The ready line: "rdzv-server listening on http://HOST:PORT" (https:// with TLS).
READY_PREFIXES = ("rdzv-server listening on http://", "rdzv-server listening on https://")
START_TIMEOUT = 30.0


@dataclass(frozen=True)
class TLSFiles:
    """A throwaway CA's certificate (what clients trust), a server certificate for 127.0.0.1
    (and localhost) with its key, and a client certificate with its key; all PEM files."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path

    @classmethod
    def make(cls, folder: Path, server_names: tuple[str, ...] = ("127.0.0.1", "localhost")) -> TLSFiles:
        import trustme

        folder.mkdir(parents=True, exist_ok=True)
        ca = trustme.CA()
        server = ca.issue_cert(*server_names)
        client = ca.issue_cert("rdzv-test-client@example.org")
        files = cls(
            ca=folder / "ca.pem",
            cert=folder / "server.pem",
            key=folder / "server.key",
            client_cert=folder / "client.pem",
            client_key=folder / "client.key",
        )
        ca.cert_pem.write_to_path(str(files.ca))
        server.private_key_pem.write_to_path(str(files.key))
        client.private_key_pem.write_to_path(str(files.client_key))
        for blob in server.cert_chain_pems:
            blob.write_to_path(str(files.cert), append=True)
        for blob in client.cert_chain_pems:
            blob.write_to_path(str(files.client_cert), append=True)
        return files


class ServerProcess:
    """`python -m rdzv_server` on 127.0.0.1 (or ``host``); restarts keep the port and the data dir."""

    def __init__(
        self,
        workdir: Path,
        *,
        durable: bool,
        args: tuple[str, ...] = (),
        tls: TLSFiles | None = None,
        mutual_tls: bool = False,
        etcd: list[str] | None = None,
        open_files: int | None = None,
        host: str = "127.0.0.1",
        source: Path | None = None,
    ) -> None:
        """``etcd``: run as a replica over these etcd client URLs (``durable`` is then ignored).
        ``open_files``: the server's open-files limit, soft and hard (RLIMIT_NOFILE), set before it starts.
        ``host``: the address it listens on (one of this host's). ``source``: a folder holding
        ``rdzv_server`` and ``rdzv_client`` (an older revision's): the server runs from it, in it."""
        self.workdir = workdir
        self.host = host
        self.source = source
        self.data_dir = workdir / "data" if durable else None
        self.etcd = etcd
        self.args = args
        if tls is not None:
            self.args += ("--tls-cert", str(tls.cert), "--tls-key", str(tls.key))
            if mutual_tls:
                self.args += ("--tls-client-ca", str(tls.ca))
        self.tls = tls
        self.open_files = open_files
        self.scheme = "https" if tls is not None else "http"  # as the ready line says
        self.port = 0
        self.proc: subprocess.Popen[str] | None = None
        self.log_path = workdir / "server.log"
        self.starts = 0

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``, or ``https://`` for a TLS server: also a client endpoint."""
        return f"{self.scheme}://{self.host}:{self.port}"

    def command(self) -> list[str]:
        """The server's command line (``self.port`` is 0 until the first start picked one)."""
        cmd = [sys.executable, "-m", "rdzv_server", "--host", self.host, "--port", str(self.port)]
        if self.etcd is not None:
            cmd += ["--etcd", ",".join(self.etcd)]
        else:
            cmd += ["--memory"] if self.data_dir is None else ["--data-dir", str(self.data_dir)]
        return cmd + list(self.args)

    def start(self) -> None:
        cmd = self.command()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RDZV_")}
        if self.source is not None:  # (``-m`` puts the working folder first on the path: run in it)
            env["PYTHONPATH"] = str(self.source)
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=self.source,
                preexec_fn=self._limits if self.open_files is not None else None,
            )
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
            if line.startswith(READY_PREFIXES):
                self.scheme = line.split("://", 1)[0].rsplit(" ", 1)[1]
                self.port = int(line.strip().rsplit(":", 1)[1])
                return
        self.close()  # its stdout pipe too: a test that expects the refusal leaks nothing
        raise RuntimeError(f"server did not start; its log:\n{self.log_text()}")

    def _limits(self) -> None:
        """In the child, before exec: the open-files limit asked for."""
        if self.open_files is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, self.open_files))

    @property
    def token(self) -> str:
        """The token this server created (or found) in its default file; clients send it."""
        from rdzv_client.wire import default_token_file

        return default_token_file().read_text().strip()

    @property
    def auth(self) -> dict[str, str]:
        """The header that authenticates a raw HTTP request to this server."""
        return {"Authorization": f"Bearer {self.token}"}

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def signal(self, sig: int) -> None:
        """Send ``sig`` (SIGSTOP, SIGCONT: a paused process) to the running server."""
        assert self.proc is not None and self.proc.poll() is None
        self.proc.send_signal(sig)

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
