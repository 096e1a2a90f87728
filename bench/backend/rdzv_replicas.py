"""Replicated rdzv-server: a 3-member etcd 3.4 on loopback and replicas (``--etcd``) over it.

What it owns: :class:`EtcdCluster` (``size`` real etcd members on free 127.0.0.1 ports, data
in a temporary folder under the bench's work dir, so on the same disk as the durable
server's log; which member is etcd's leader, SIGKILL, SIGSTOP/SIGCONT and restart of one)
and :class:`ReplicatedBackend`, the ``rdzv-server`` backend whose endpoint
lists every replica (``127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3``, as torchrun's
``--rdzv-endpoint`` would), with what the take-over measurement needs: which replica leads
(each replica's ``/readyz``), SIGKILL of one, and its restart on the same port.

What it must not know: what is measured. It does not import from ``tests/`` (the tests'
``EtcdCluster`` and ``ReplicaCluster`` do the same job with pytest's skip): processes are
:class:`bench.process.Service`, so every one is stopped by :meth:`stop` even on Ctrl-C.

Replicas get fixed ports (free a moment before) rather than ``--port 0`` so that a
restarted replica comes back at the address the clients were given, and so that its
default ``--advertise-url`` (from ``--host``/``--port``) is one of those addresses.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from ..process import Service, Unavailable, free_port, wait_until
from .rdzv_server import READY_LINE, RdzvServerBackend, server_argv

#: A 3-member etcd on a loaded 2-core machine elects its leader in a few seconds.
ETCD_START_TIMEOUT = 60.0
#: A replica that has not printed its ready line by then is broken, not slow.
REPLICA_START_TIMEOUT = 60.0
#: The server's own default lease (``--etcd-lease-ttl``); the take-over runs also use 2.
DEFAULT_LEASE_TTL = 5


def _get_json(url: str, timeout: float = 1.0) -> dict[str, object] | None:
    """The JSON document at ``url`` (a 503's body too), or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as exc:
        try:
            return dict(json.loads(exc.read() or b"{}"))
        except ValueError:
            return None
    except (OSError, ValueError):
        return None


class EtcdCluster:
    """``size`` etcd members on 127.0.0.1; :attr:`client_urls` is what ``--etcd`` takes."""

    def __init__(self, size: int = 3, *, election_ms: int = 0) -> None:
        """``election_ms``: etcd's ``--election-timeout`` (its heartbeat a tenth of it); 0 for etcd's default."""
        self.size = size
        self.election_ms = election_ms
        self.client_urls: list[str] = []
        self._members: list[Service] = []
        self._paused: set[int] = set()
        self._log_dir = Path(".")
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def start(self, work_dir: Path, log_dir: Path, timeout: float = ETCD_START_TIMEOUT) -> None:
        """Start every member, then wait (bounded) until each says it is healthy.

        Raises :class:`Unavailable` without an ``etcd`` binary or when a member exits, and
        :class:`bench.process.Timeout` when the cluster has no leader in time; started members
        are stopped.
        """
        binary = shutil.which("etcd")
        if binary is None:
            raise Unavailable("etcd is not installed (run bench/setup.sh: apt-get install etcd-server)")
        work_dir.mkdir(parents=True, exist_ok=True)
        self._log_dir = log_dir
        self._tmp = tempfile.TemporaryDirectory(prefix="etcd3-bench-", dir=work_dir)
        client_ports = [free_port() for _ in range(self.size)]
        peer_ports = [free_port() for _ in range(self.size)]
        self.client_urls = [f"http://127.0.0.1:{port}" for port in client_ports]
        peers = [f"http://127.0.0.1:{port}" for port in peer_ports]
        cluster = ",".join(f"m{i}={peer}" for i, peer in enumerate(peers))
        token = f"rdzv-bench-{uuid.uuid4().hex[:12]}"
        try:
            for i in range(self.size):
                argv = [
                    binary,
                    "--name", f"m{i}",
                    "--data-dir", str(Path(self._tmp.name) / f"m{i}"),
                    "--listen-client-urls", self.client_urls[i],
                    "--advertise-client-urls", self.client_urls[i],
                    "--listen-peer-urls", peers[i],
                    "--initial-advertise-peer-urls", peers[i],
                    "--initial-cluster", cluster,
                    "--initial-cluster-state", "new",
                    "--initial-cluster-token", token,
                    "--log-level", "warn",
                ]  # fmt: skip
                if self.election_ms:
                    argv += ["--election-timeout", str(self.election_ms), "--heartbeat-interval", str(self.election_ms // 10)]
                member = Service(f"etcd-m{i}", argv, log_dir / f"etcd-m{i}.log")
                self._members.append(member)
                member.start()  # no wait here: no member is healthy before a quorum runs
            for i, member in enumerate(self._members):
                url = self.client_urls[i] + "/health"
                wait_until(functools.partial(_member_healthy, member, url), timeout, f"etcd member m{i} to be healthy")
        except BaseException:
            self.stop()
            raise

    def leader(self, timeout: float = ETCD_START_TIMEOUT) -> int:
        """The index of etcd's leader, once every running member names the same one (bounded)."""
        found: list[int] = []

        def agreed() -> bool:
            named: set[str] = set()
            ids: dict[str, int] = {}
            for i, url in enumerate(self.client_urls):
                member = self._members[i]
                if i in self._paused or member.proc is None or member.proc.poll() is not None:
                    continue
                status = _post_json(url + "/v3/maintenance/status")
                if status is None:
                    return False
                named.add(str(status.get("leader")))
                ids[str(dict(status.get("header") or {}).get("member_id"))] = i
            leader = next(iter(named)) if len(named) == 1 else None
            found[:] = [ids[leader]] if leader in ids else []
            return bool(found)

        wait_until(agreed, timeout, "the etcd members to agree on a leader")
        return found[0]

    def kill(self, i: int) -> float:
        """SIGKILL member ``i`` (a crash); return ``time.monotonic()`` right after the signal."""
        proc = self._members[i].proc
        assert proc is not None, f"etcd member m{i} was not started"
        proc.kill()
        killed = time.monotonic()
        self._members[i].kill()  # reaps it
        return killed

    def pause(self, i: int) -> float:
        """SIGSTOP member ``i`` (a hung host: its connections stay open); return when."""
        os.kill(self._members[i].pid, signal.SIGSTOP)
        self._paused.add(i)
        return time.monotonic()

    def resume(self, i: int) -> float:
        """SIGCONT member ``i`` after :meth:`pause` (nothing if it is not paused); return when."""
        if i in self._paused:
            os.kill(self._members[i].pid, signal.SIGCONT)
            self._paused.discard(i)
        return time.monotonic()

    def restart(self, i: int, timeout: float = ETCD_START_TIMEOUT) -> None:
        """Start member ``i`` again on its data (after :meth:`kill`) and wait until it is
        healthy and the members agree on a leader. Raises :class:`bench.process.Timeout`."""
        old = self._members[i]
        member = self._members[i] = Service(old.name, old.argv, old.log_path)
        member.start()
        url = self.client_urls[i] + "/health"
        wait_until(functools.partial(_member_healthy, member, url), timeout, f"etcd member m{i} to be healthy again")
        self.leader(timeout)

    def stop(self) -> None:
        """Stop every member and delete the data (idempotent)."""
        for i in list(self._paused):  # a stopped process cannot take SIGTERM
            self.resume(i)
        for member in self._members:
            member.stop()
        self._members = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _post_json(url: str, timeout: float = 1.0) -> dict[str, object] | None:
    """etcd's JSON answer to an empty POST at ``url``, or None when it does not answer."""
    request = urllib.request.Request(url, data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return dict(json.loads(answer.read()))
    except (OSError, ValueError):
        return None


def _member_healthy(member: Service, url: str) -> bool:
    if member.proc is not None and member.proc.poll() is not None:
        raise Unavailable(f"{member.name} exited with status {member.proc.returncode}; see {member.log_path}")
    doc = _get_json(url)
    return doc is not None and str(doc.get("health")) == "true"


class ReplicatedBackend(RdzvServerBackend):
    """``size`` replicas of one cluster over ``etcd_urls``, under a prefix of their own."""

    def __init__(self, etcd_urls: list[str], *, size: int = 3, lease_ttl: int = DEFAULT_LEASE_TTL) -> None:
        super().__init__(durable=False)
        self.label = f"rdzv-server (etcd x{size})"  # x3: three replicas (over three etcd members)
        self.etcd_urls = list(etcd_urls)
        self.size = size
        self.lease_ttl = lease_ttl
        self.prefix = f"/rdzv-bench-{uuid.uuid4().hex[:8]}"
        self.ports: list[int] = []
        self._replicas: list[Service] = []
        self._log_dir = Path(".")

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def _argv(self, i: int) -> list[str]:
        return server_argv(
            "--etcd", ",".join(self.etcd_urls),
            "--etcd-prefix", self.prefix,
            "--etcd-lease-ttl", str(self.lease_ttl),
            "--replica-id", f"r{i}",
            port=self.ports[i],
        )  # fmt: skip

    def _make_replica(self, i: int) -> Service:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RDZV_")}  # only the flags count
        return Service(f"replica-r{i}-ttl{self.lease_ttl}", self._argv(i), self._log_dir / f"replica-r{i}-ttl{self.lease_ttl}.log", env=env)

    def start(self, work_dir: Path, log_dir: Path) -> None:
        """Start the replicas one after another (the first may create the token file), then
        wait until one leads. Raises :class:`bench.process.Timeout` or :class:`Unavailable`;
        stops what it started."""
        self._log_dir = log_dir
        self.ports = [free_port() for _ in range(self.size)]
        try:
            for i in range(self.size):
                replica = self._make_replica(i)
                self._replicas.append(replica)
                replica.start(ready_line=READY_LINE, timeout=REPLICA_START_TIMEOUT)
            self.wait_for_leader(REPLICA_START_TIMEOUT)
        except BaseException:
            self.stop()
            raise
        self.endpoint = ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def stop(self) -> None:
        for replica in self._replicas:
            replica.stop()
        self._replicas = []

    def service_pid(self) -> int | None:
        """The leader's pid (formation reports its CPU time), or None while none leads."""
        leader = self.leader_index()
        return None if leader is None else self._replicas[leader].pid

    def roles(self) -> list[str | None]:
        """Each replica's role as its ``/readyz`` says (None: not answering)."""
        out: list[str | None] = []
        for replica, url in zip(self._replicas, self.urls):
            alive = replica.proc is not None and replica.proc.poll() is None
            doc = _get_json(url + "/readyz") if alive else None
            out.append(None if doc is None else str(doc.get("role")))
        return out

    def leader_index(self) -> int | None:
        roles = self.roles()
        return roles.index("leader") if "leader" in roles else None

    def wait_for_leader(self, timeout: float, *, other_than: int | None = None) -> int:
        """The index of the replica that leads, once one other than ``other_than`` does."""
        found: list[int] = []

        def leads() -> bool:
            found[:] = [i for i, role in enumerate(self.roles()) if role == "leader" and i != other_than]
            return bool(found)

        wait_until(leads, timeout, "a replica to lead")
        return found[0]

    def kill(self, i: int) -> float:
        """SIGKILL replica ``i`` (a crash: it cannot revoke its lease); return ``time.monotonic()``
        right after the signal was sent. The process is reaped by :meth:`restart` or :meth:`stop`."""
        proc = self._replicas[i].proc
        assert proc is not None, f"replica r{i} was not started"
        proc.kill()
        return time.monotonic()

    def restart(self, i: int, timeout: float = REPLICA_START_TIMEOUT) -> None:
        """Reap replica ``i`` and start it again on its port; wait until it answers ``/readyz``
        with a role (it recovered and follows, or leads). Raises :class:`bench.process.Timeout`."""
        self._replicas[i].kill()
        replica = self._replicas[i] = self._make_replica(i)
        replica.start(ready_line=READY_LINE, timeout=timeout)
        wait_until(lambda: self.roles()[i] in ("leader", "follower"), timeout, f"replica r{i} to follow after its restart")

