"""End-to-end fixtures: real ``torchrun`` agents ("nodes") against the real server.

A :class:`Node` is one ``torchrun`` process (``rdzv-torchrun`` on a torch that reads no
entry points: tests/torch_feature.py) started with ``start_new_session=True`` on 127.0.0.1,
with its own RESULT_DIR / NODE_NAME, its output in a file under the test's tmp dir, and a
bounded :meth:`Node.wait`. :meth:`Node.kill` SIGKILLs the whole node:
the agent's process group AND its workers. (torch 2.13 starts every worker of a script
entrypoint in a session of its own — ``SubprocessHandler`` passes
``start_new_session=True`` — so killing the agent's group alone would leave the workers
running, still talking gloo to the other nodes: not what a dead host looks like. The
node is frozen with SIGSTOP first, its descendants are listed, then everything gets
SIGKILL.)

The :class:`Cluster` fixture starts nodes, reads what their workers wrote, polls the
server's membership document ``GET /v1/jobs/{rdzv_id}`` (with the server's token, over TLS
for a TLS server), and at teardown kills every process that carries its token (nothing
outlives a test). ``tls_server`` is a memory-only server with TLS from a throwaway CA. When a test fails, the tail
of every node's log and of the server's log is added to the report.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import ssl
import subprocess
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import pytest
from server_process import ServerProcess, TLSFiles
from torch_feature import torchrun_command

TRAIN = Path(__file__).with_name("train.py")
TOKEN_ENV = "E2E_NODE_TOKEN"
# Small timeouts so that every scenario fits in seconds (see the e2e brief).
DEFAULT_CONF: dict[str, str] = {
    "last_call_timeout": "1",
    "keep_alive_interval": "0.5",
    "keep_alive_max_attempt": "4",
    "join_timeout": "60",
}
LOG_TAIL_LINES = 120

_CLUSTER_KEY = pytest.StashKey["Cluster"]()


class Node:
    """One torchrun agent (and its workers) as a process group of its own."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], workdir: Path) -> None:
        self.name = name
        self.cmd = cmd
        self.env = env
        self.workdir = workdir
        self.result_dir = workdir / "results"
        self.log_path = workdir / "torchrun.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.killed_at: float | None = None

    def start(self) -> Node:
        self.result_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env,
                cwd=self.workdir, start_new_session=True,
            )
        self.started_at = time.monotonic()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return int(self.proc.pid)

    @property
    def returncode(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def running(self) -> bool:
        return self.returncode is None

    def wait(self, timeout: float) -> int:
        """The agent's exit code; on timeout the node is killed and the test fails."""
        assert self.proc is not None
        try:
            return int(self.proc.wait(timeout))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"node {self.name} (pid {self.pid}) did not exit within {timeout:.0f} s; killed it.\n"
                f"--- its log (tail) ---\n{self.log_tail()}"
            ) from None

    def kill(self) -> None:
        """SIGKILL the agent's process group and every descendant (workers have own sessions)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            return  # the agent is gone (and reaped); Cluster's sweep catches any orphan worker
        pgid = self.pid  # session leader: its pid is its process group id
        own_group = os.getpgid(0)
        try:
            os.killpg(pgid, signal.SIGSTOP)  # freeze: no new workers while we list them
        except ProcessLookupError:
            pass
        try:
            descendants = psutil.Process(pgid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        for child in descendants:
            try:
                group = os.getpgid(child.pid)
                if group != own_group:
                    os.killpg(group, signal.SIGKILL)
                child.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.killed_at = time.monotonic()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _records(self, pattern: str) -> list[dict[str, Any]]:
        out = []
        for path in sorted(self.result_dir.glob(pattern)):
            record = json.loads(path.read_text())
            record["node"] = self.name
            out.append(record)
        return out

    def results(self) -> list[dict[str, Any]]:
        """Final records of workers that finished (``<restart>-<run_id>-<rank>.json``)."""
        return [r for r in self._records("*.json") if "finished" in r]

    def started(self) -> list[dict[str, Any]]:
        """One record per worker per round it got its process group up in."""
        return self._records("started-*.json")

    def heartbeats(self) -> dict[int, dict[str, Any]]:
        """local_rank -> the latest step record of that worker."""
        out = {}
        for path in self.result_dir.glob("hb-*.json"):
            try:
                out[int(path.stem.split("-", 1)[1])] = json.loads(path.read_text())
            except (ValueError, OSError):
                continue  # replaced while we read it
        return out

    def __repr__(self) -> str:
        return f"Node({self.name}, pid={self.proc.pid if self.proc else None}, rc={self.returncode if self.proc else None})"


def agent_pid(node_id: str) -> int:
    """The agent pid inside a node_id ``<hostname>-<pid>-<random>``."""
    return int(node_id.rsplit("-", 2)[1])


class Cluster:
    """The nodes of one test, the server they talk to, and helpers to watch them."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.token = uuid.uuid4().hex
        self.nodes: list[Node] = []
        self.servers: list[Any] = []

    # -- nodes -----------------------------------------------------------------------

    def start(
        self,
        name: str,
        server: Any,
        rdzv_id: str,
        *,
        nnodes: str,
        nproc: int,
        conf: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        max_restarts: int = 0,
        args: Iterable[str] = (),
        endpoint: str | None = None,
        script: Path = TRAIN,
    ) -> Node:
        """Start one torchrun node running ``script`` (train.py) against ``server`` (at
        ``endpoint``, by default ``server.endpoint``)."""
        workdir = self.tmp_path / "nodes" / name
        rdzv_conf = {**DEFAULT_CONF, **(conf or {})}
        cmd = [
            *torchrun_command(),  # plain torchrun, or rdzv-torchrun where torch reads no entry points
            "--rdzv-backend=rdzv-server",
            f"--rdzv-endpoint={endpoint or server.endpoint}",
            f"--rdzv-id={rdzv_id}",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            "--local-addr=127.0.0.1",
            "--monitor-interval=0.1",
            f"--max-restarts={max_restarts}",
            f"--log-dir={workdir / 'torchelastic'}",
            "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in rdzv_conf.items()),
            *args,
            str(script),
        ]
        node_env = {
            "LOGLEVEL": "INFO",  # torch's agent logs (rendezvous results, restarts) with timestamps
            "RESULT_DIR": str(workdir / "results"),
            "NODE_NAME": name,
            **(env or {}),
        }
        return self.launch(name, server, cmd, node_env)

    def launch(self, name: str, server: Any, cmd: list[str], env: Mapping[str, str] | None = None) -> Node:
        """Start one node running ``cmd`` (a whole torchrun command line) against ``server``:
        this process's environment without RDZV_* / TORCHELASTIC_* / TORCH_ELASTIC_*, plus
        ``env``. (The handler tests run the plug-in in this process, and it sets
        TORCH_ELASTIC_WORKER_IDENTICAL=1 for their uniform rounds: an agent that inherited it
        would take it for its user's and apply torch's shortcut to a round of unequal nodes.)"""
        if server not in self.servers:
            self.servers.append(server)
        node_env = {
            k: v for k, v in os.environ.items() if not k.startswith(("RDZV_", "TORCHELASTIC_", "TORCH_ELASTIC_"))
        }
        node_env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{TOKEN_ENV: self.token})
        node_env.update(env or {})
        node = Node(name, cmd, node_env, self.tmp_path / "nodes" / name)
        self.nodes.append(node)
        return node.start()

    def by_pid(self, pid: int) -> Node:
        return next(n for n in self.nodes if n.pid == pid)

    def node_of(self, entry: Mapping[str, Any]) -> Node:
        """The Node behind a membership entry (its node_id holds the agent's pid)."""
        return self.by_pid(agent_pid(str(entry["node_id"])))

    def wait_all(self, timeout: float, nodes: Iterable[Node] | None = None) -> dict[str, int]:
        """Exit codes by node name; fails (after killing everything) if one is still running at the end."""
        deadline = time.monotonic() + timeout
        codes = {}
        for node in list(nodes if nodes is not None else self.nodes):
            remaining = max(0.1, deadline - time.monotonic())
            try:
                codes[node.name] = node.wait(remaining)
            except AssertionError:
                self.kill_all()
                raise
        return codes

    def kill_all(self) -> None:
        for node in self.nodes:
            if node.proc is not None:
                node.kill()
        self._sweep()

    def _sweep(self) -> list[int]:
        """Kill any process that still carries this cluster's token (orphaned workers)."""
        me = os.getpid()
        killed = []
        for proc in psutil.process_iter(["pid"]):
            if proc.pid == me:
                continue
            try:
                if proc.environ().get(TOKEN_ENV) == self.token:
                    proc.kill()
                    killed.append(proc.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
                continue
        return killed

    # -- what the workers wrote ------------------------------------------------------

    def results(self) -> list[dict[str, Any]]:
        return [r for n in self.nodes for r in n.results()]

    def started(self) -> list[dict[str, Any]]:
        return [r for n in self.nodes for r in n.started()]

    def wait_started(self, world: int, count: int, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Wait until ``count`` workers of a round with WORLD_SIZE ``world`` are up."""

        def check() -> list[dict[str, Any]] | None:
            seen = [r for r in self.started() if int(r["WORLD_SIZE"]) == world]
            return seen if len(seen) >= count else None

        return self.wait_for(check, timeout, f"{count} workers of world size {world} to start")

    # -- the server's view -----------------------------------------------------------

    def job(self, server: Any, rdzv_id: str, timeout: float = 2.0) -> dict[str, Any] | None:
        """``GET /v1/jobs/{rdzv_id}``; None when the job is unknown or the server does not answer.

        One connection per call, always closed (a server killed mid-answer must not leave a
        socket for the garbage collector to warn about in some later test).
        """
        url = urllib.parse.urlsplit(server.url)
        conn: http.client.HTTPConnection
        files: TLSFiles | None = getattr(server, "tls", None)
        if files is not None:
            context = ssl.create_default_context(cafile=str(files.ca))
            context.load_cert_chain(str(files.client_cert), str(files.client_key))  # for mutual TLS
            conn = http.client.HTTPSConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout, context=context)
        else:
            conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=timeout)
        try:
            conn.request("GET", f"/v1/jobs/{rdzv_id}", headers={"Accept": "application/json", **server.auth})
            resp = conn.getresponse()
            status, body = resp.status, resp.read()
        except (OSError, http.client.HTTPException):
            return None
        finally:
            conn.close()
        if status == 404:
            return None
        if status != 200:
            raise AssertionError(f"GET /v1/jobs/{rdzv_id}: HTTP {status}: {body[:500]!r}")
        doc: dict[str, Any] = json.loads(body)
        return doc

    def wait_job(
        self,
        server: Any,
        rdzv_id: str,
        pred: Callable[[dict[str, Any]], bool],
        timeout: float,
        what: str,
        interval: float = 0.05,
    ) -> dict[str, Any]:
        """Poll the membership document until ``pred(doc)``; fail fast if a node dies unexpectedly."""
        last: list[dict[str, Any] | None] = [None]

        def check() -> dict[str, Any] | None:
            doc = self.job(server, rdzv_id)
            if doc is not None:
                last[0] = doc
                if pred(doc):
                    return doc
            return None

        return self.wait_for(check, timeout, what, interval, details=lambda: f"last document: {last[0]}")

    def wait_for(
        self,
        check: Callable[[], Any],
        timeout: float,
        what: str,
        interval: float = 0.05,
        details: Callable[[], str] = lambda: "",
    ) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value is not None:
                return value
            failed = [n for n in self.nodes if n.killed_at is None and n.returncode not in (None, 0)]
            if failed:
                raise AssertionError(
                    f"while waiting for {what}: node(s) exited with an error: {failed}\n{details()}"
                )
            if time.monotonic() >= deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f} s waiting for {what}; nodes: {self.nodes}\n{details()}"
                )
            time.sleep(interval)

    # -- diagnostics -------------------------------------------------------------------

    def report_sections(self) -> list[tuple[str, str]]:
        sections = []
        for node in self.nodes:
            sections.append((f"node {node.name} (pid {node.proc.pid if node.proc else '-'}, rc {node.returncode if node.proc else '-'}) log tail", node.log_tail()))
        for i, server in enumerate(self.servers):
            text = server.log_text() if hasattr(server, "log_text") else ""
            sections.append((f"server {i} log tail", "\n".join(text.splitlines()[-LOG_TAIL_LINES:])))
        return sections


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A memory-only server with TLS; ``tls_server.tls.ca`` is the CA its clients trust."""
    srv = ServerProcess(tmp_path, durable=False, tls=TLSFiles.make(tmp_path / "tls"))
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    request.node.stash[_CLUSTER_KEY] = c
    try:
        yield c
    finally:
        c.kill_all()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    c = item.stash.get(_CLUSTER_KEY, None)
    if c is not None and report.failed and report.when in ("call", "teardown"):
        for title, text in c.report_sections():
            report.sections.append((title, text))
