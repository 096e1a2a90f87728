"""Real etcd processes for the tests: 1 or 3 members on free loopback ports, in a temp folder.

Tests that need etcd call :func:`require_etcd` (or use a fixture that does): it skips with
"etcd not installed: apt-get install etcd-server" only when the ``etcd`` binary is absent.
Anything else that goes wrong (a member that never becomes healthy) fails loudly, with the
member's log tail in the message.

Ports are chosen at run time (bound to port 0 by the kernel, all held open together until
the members are about to start), never fixed, so parallel runs do not collide. Every wait
is bounded. :meth:`EtcdCluster.close` kills every member it started and deletes the folder.

``EtcdCluster(size, tls=files)`` serves the client URLs over https with a throwaway CA's
certificate (:class:`server_process.TLSFiles`; ``client_cert_auth=True`` also requires a
client certificate signed by that CA); peers still talk plain http on loopback.
``extra_args`` go to every member (``("--auth-token-ttl", "1")``), and
:meth:`EtcdCluster.enable_auth` turns on etcd's user/password authentication.

Faults: :meth:`EtcdCluster.kill` (a crash), :meth:`EtcdCluster.pause` and
:meth:`EtcdCluster.resume` (a member gone silent: its connections stay open and nothing
answers); :meth:`EtcdCluster.leader` says which member is etcd's leader, to kill that one or
to spare it; :meth:`EtcdCluster.wait_for_watchers` waits until a member serves a client's watch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from server_process import TLSFiles

ETCD_MISSING = "etcd not installed: apt-get install etcd-server"

# Long enough for three members to elect a leader on a loaded 2-core runner; short enough
# that a broken etcd fails the test quickly.
DEFAULT_START_TIMEOUT_S = 20.0
# Starts on fresh ports after a member lost its port to another process (see EtcdCluster.start).
PORT_RACE_ATTEMPTS = 3


def require_etcd() -> str:
    """The path of the ``etcd`` binary; skip the calling test when it is not installed."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip(ETCD_MISSING)
    return binary


@contextlib.contextmanager
def running_etcd(size: int) -> Iterator[EtcdCluster]:
    """A started cluster of ``size`` members, closed on exit; skips the test without etcd."""
    require_etcd()
    cluster = EtcdCluster(size).start()
    try:
        yield cluster
    finally:
        cluster.close()


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1; :attr:`client_urls` is what ``--etcd`` would take."""

    def __init__(
        self,
        size: int = 1,
        *,
        base_dir: Path | None = None,
        tls: TLSFiles | None = None,
        client_cert_auth: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.binary = require_etcd()
        self.size = size
        self.tls = tls
        self.client_cert_auth = client_cert_auth
        self.extra_args = tuple(extra_args)
        self._own_dir = base_dir is None
        self.dir = Path(tempfile.mkdtemp(prefix="rdzv-etcd-")) if base_dir is None else base_dir
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * size
        self._pick_ports()

    def _pick_ports(self) -> None:
        ports = _free_ports(2 * self.size)
        self.client_ports = ports[: self.size]
        self.peer_ports = ports[self.size :]
        scheme = "https" if self.tls is not None else "http"
        self.client_urls = [f"{scheme}://127.0.0.1:{port}" for port in self.client_ports]

    def start(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> EtcdCluster:
        """Start every member and wait until each reports healthy (a leader elected).

        A port is free when picked but is bound only when the member starts; another process
        (a parallel test's server or connection) may take it in between. A member that exits
        because its port was taken makes the cluster start again on new ports (bounded)."""
        for attempt in range(PORT_RACE_ATTEMPTS):
            try:
                return self._start(timeout_s)
            except RuntimeError:
                taken = any("address already in use" in self.log_tail(i, 200) for i in range(self.size))
                if not taken or attempt == PORT_RACE_ATTEMPTS - 1:
                    raise
                for i in range(self.size):
                    self.kill(i)
                    shutil.rmtree(self.dir / f"m{i}", ignore_errors=True)
                    (self.dir / f"m{i}.log").unlink(missing_ok=True)
                self._pick_ports()
        raise AssertionError("unreachable")

    def _start(self, timeout_s: float) -> EtcdCluster:
        cluster = ",".join(f"m{i}=http://127.0.0.1:{port}" for i, port in enumerate(self.peer_ports))
        token = f"rdzv-test-{uuid.uuid4().hex[:12]}"
        for i in range(self.size):
            peer = f"http://127.0.0.1:{self.peer_ports[i]}"
            log = open(self.dir / f"m{i}.log", "wb")  # noqa: SIM115 - owned by the child
            with log:
                self.processes[i] = subprocess.Popen(
                    [
                        self.binary,
                        "--name", f"m{i}",
                        "--data-dir", str(self.dir / f"m{i}"),
                        "--listen-client-urls", self.client_urls[i],
                        "--advertise-client-urls", self.client_urls[i],
                        "--listen-peer-urls", peer,
                        "--initial-advertise-peer-urls", peer,
                        "--initial-cluster", cluster,
                        "--initial-cluster-state", "new",
                        "--initial-cluster-token", token,
                        *self._tls_args(),
                        *self.extra_args,
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
        deadline = time.monotonic() + timeout_s
        for i in range(self.size):
            self._wait_healthy(i, deadline)
        return self

    def _tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        args = ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key)]
        if self.client_cert_auth:
            args += ["--client-cert-auth", "--trusted-ca-file", str(self.tls.ca)]
        return args

    def _ssl_context(self) -> ssl.SSLContext | None:
        """What the harness itself connects with: trusts the CA, presents the client certificate."""
        if self.tls is None:
            return None
        context = ssl.create_default_context(cafile=str(self.tls.ca))
        context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        return context

    def _wait_healthy(self, i: int, deadline: float) -> None:
        url = f"{self.client_urls[i]}/health"
        context = self._ssl_context()
        while True:
            process = self.processes[i]
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"etcd member m{i} exited with {process.returncode}:\n{self.log_tail(i)}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(url, timeout=1, context=context) as answer,
            ):
                if b'"health":"true"' in answer.read():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd member m{i} did not become healthy in time:\n{self.log_tail(i)}")
            time.sleep(0.05)

    def call(self, path: str, body: dict[str, Any], *, token: str = "") -> dict[str, Any]:
        """POST ``body`` to etcd's JSON gateway on member 0 (with ``token`` as Authorization);
        raises RuntimeError with etcd's answer when it is not a success."""
        headers = {"Content-Type": "application/json"}
        if token:
            headers["Authorization"] = token
        request = urllib.request.Request(
            self.client_urls[0] + path, data=json.dumps(body).encode(), headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=5, context=self._ssl_context()) as answer:
                result: dict[str, Any] = json.loads(answer.read())
                return result
        except urllib.error.HTTPError as exc:
            raise RuntimeError(f"etcd refused {path}: HTTP {exc.code} {exc.read()[:200]!r}") from exc

    def enable_auth(self, root_password: str) -> str:
        """Create the ``root`` user with ``root_password`` and the root role, turn on etcd's
        authentication, and return a token of root's (for adding more users)."""
        self.call("/v3/auth/user/add", {"name": "root", "password": root_password})
        self.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        self.call("/v3/auth/enable", {})
        token: str = self.call("/v3/auth/authenticate", {"name": "root", "password": root_password})["token"]
        return token

    def log_tail(self, i: int, lines: int = 20) -> str:
        """The last lines of member ``i``'s log, for failure messages."""
        path = self.dir / f"m{i}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as exc:
            return f"(no log: {exc})"

    def leader(self, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> int:
        """The index of etcd's leader, once every running member names the same one (bounded)."""
        context = self._ssl_context()
        deadline = time.monotonic() + timeout_s
        while True:
            named: set[str] = set()
            ids: dict[str, int] = {}
            for i, url in enumerate(self.client_urls):
                process = self.processes[i]
                if process is None or process.poll() is not None:
                    continue
                request = urllib.request.Request(url + "/v3/maintenance/status", data=b"{}", method="POST")
                with (
                    contextlib.suppress(OSError, urllib.error.URLError, ValueError),
                    urllib.request.urlopen(request, timeout=1, context=context) as answer,
                ):
                    status = json.loads(answer.read())
                    named.add(str(status.get("leader")))
                    ids[str(status["header"]["member_id"])] = i
            if len(named) == 1 and next(iter(named)) in ids:
                return ids[next(iter(named))]
            if time.monotonic() > deadline:
                raise RuntimeError(f"the etcd members did not agree on a leader in time (they name {named})")
            time.sleep(0.05)

    def watchers(self, i: int) -> int:
        """How many watches member ``i`` serves now (its ``etcd_debugging_mvcc_watcher_total``)."""
        with urllib.request.urlopen(self.client_urls[i] + "/metrics", timeout=5, context=self._ssl_context()) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("etcd_debugging_mvcc_watcher_total "):
                    return int(float(line.split()[1]))
        raise RuntimeError(f"etcd member m{i} reports no etcd_debugging_mvcc_watcher_total")

    def wait_for_watchers(self, i: int, count: int, timeout_s: float = DEFAULT_START_TIMEOUT_S) -> None:
        """Until member ``i`` serves at least ``count`` watches (a client's watch is open on it); bounded."""
        deadline = time.monotonic() + timeout_s
        while (seen := self.watchers(i)) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"etcd member m{i} serves {seen} watches, not {count}, after {timeout_s} s")
            time.sleep(0.02)

    def pause(self, i: int) -> None:
        """SIGSTOP member ``i``: it goes silent, its connections stay open (a hung host)."""
        process = self.processes[i]
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGSTOP)

    def resume(self, i: int) -> None:
        """SIGCONT member ``i`` after :meth:`pause`."""
        process = self.processes[i]
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` and reap it (a crash, not a shutdown)."""
        process = self.processes[i]
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def close(self) -> None:
        """Kill every member this cluster started and delete its folder (idempotent)."""
        for i in range(self.size):
            self.kill(i)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
