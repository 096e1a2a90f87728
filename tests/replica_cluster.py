"""A replicated rdzv-server for the tests: real etcd members and real replica processes on 127.0.0.1.

:class:`ReplicaCluster` starts ``size`` replicas of one cluster (``--etcd`` with every etcd
member's URL, a prefix of its own, a short lease) and knows which one leads by asking
each replica's ``/readyz``. Its :attr:`endpoint` lists every replica, as torchrun's
``--rdzv-endpoint=h1:p1,h2:p2,h3:p3`` would. Every wait is bounded.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from etcd_cluster import EtcdCluster
from server_process import ServerProcess

# The shortest lease a loaded 2-core runner keeps alive without false take-overs; the
# tests' take-over bound is this plus 1 s (issue: "within the lease TTL + 1 s").
LEASE_TTL_S = 2


def readyz(url: str, timeout: float = 1.0) -> dict[str, object] | None:
    """A replica's ``/readyz`` document (200 or 503), or None when it does not answer."""
    try:
        with urllib.request.urlopen(url + "/readyz", timeout=timeout) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as exc:
        with exc:  # it holds the connection
            return dict(json.loads(exc.read() or b"{}"))
    except (OSError, ValueError):
        return None


class ReplicaCluster:
    """``size`` replicas over ``etcd``, each in its own folder under ``workdir``."""

    def __init__(self, etcd: EtcdCluster, workdir: Path, size: int = 3, *, args: tuple[str, ...] = ()) -> None:
        self.etcd = etcd
        self.prefix = f"/rdzv-test-{uuid.uuid4().hex[:8]}"
        self.replicas = [
            ServerProcess(
                workdir / f"replica{i}",
                durable=False,
                etcd=etcd.client_urls,
                args=(
                    "--replica-id", f"r{i}", "--etcd-prefix", self.prefix,
                    "--etcd-lease-ttl", str(LEASE_TTL_S), *args,
                ),
            )
            for i in range(size)
        ]
        for replica in self.replicas:
            replica.workdir.mkdir(parents=True, exist_ok=True)

    def start(self) -> ReplicaCluster:
        for replica in self.replicas:
            replica.start()
        self.wait_until_settled()
        return self

    @property
    def endpoint(self) -> str:
        return ",".join(r.endpoint for r in self.replicas)

    def roles(self) -> list[str | None]:
        """Each replica's role as its /readyz says (None: not answering)."""
        out: list[str | None] = []
        for replica in self.replicas:
            doc = readyz(replica.url) if replica.proc is not None and replica.proc.poll() is None else None
            out.append(None if doc is None else str(doc.get("role")))
        return out

    def wait_for_leader(self, timeout: float = 30.0, *, other_than: int | None = None) -> int:
        """The index of the replica that leads, once one does (not ``other_than``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, role in enumerate(self.roles()):
                if role == "leader" and i != other_than:
                    return i
            time.sleep(0.05)
        logs = "\n".join(f"--- replica {i}:\n{r.log_text()[-3000:]}" for i, r in enumerate(self.replicas))
        raise AssertionError(f"no replica led within {timeout} s; roles {self.roles()}\n{logs}")

    def wait_until_settled(self, timeout: float = 30.0) -> int:
        """The leader's index once every replica is ready, one leads and each other one follows
        and names it (each one in the cluster view too: a replica is ready only once it is)."""
        deadline = time.monotonic() + timeout
        docs: list[dict[str, object] | None] = []
        while time.monotonic() < deadline:
            docs = [readyz(r.url) for r in self.replicas]
            leaders = [i for i, doc in enumerate(docs) if doc is not None and doc.get("role") == "leader"]
            if len(leaders) == 1:
                url = self.replicas[leaders[0]].url
                followers = [doc for i, doc in enumerate(docs) if i != leaders[0]]
                if all(d is not None and d.get("role") == "follower" and d.get("leader") == url for d in followers):
                    return leaders[0]
            time.sleep(0.05)
        logs = "\n".join(f"--- replica {i}:\n{r.log_text()[-3000:]}" for i, r in enumerate(self.replicas))
        raise AssertionError(f"the replicas did not settle within {timeout} s; /readyz {docs}\n{logs}")

    def close(self) -> None:
        for replica in self.replicas:
            replica.close()

    def __enter__(self) -> ReplicaCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
