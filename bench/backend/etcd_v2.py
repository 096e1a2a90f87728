"""torch's ``etcd-v2`` backend against a real etcd (3.4, ``--enable-v2``) on loopback.

The bench starts etcd with a temporary data directory on two free 127.0.0.1 ports (client
and peer) and stops it afterwards. ``bench/setup.sh`` installs etcd (Debian's
``etcd-server``) and ``python-etcd``; without them the backend is reported unavailable.
"""

from __future__ import annotations

import shutil
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..process import Service, Unavailable, free_port
from . import Backend, NodeSpec, StoreSpec
from .c10d import torch_round_prefix

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.elastic.rendezvous import RendezvousInfo

#: The EtcdStore prefix torch's etcd-v2 backend uses (etcd_rendezvous_backend.create_backend).
STORE_PREFIX = "/torch/elastic/store"


class EtcdV2Backend(Backend):
    name = "etcd-v2"
    label = "etcd-v2"

    def __init__(self) -> None:
        self.endpoint = ""
        self._service: Service | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def start(self, work_dir: Path, log_dir: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise Unavailable("etcd is not installed (run bench/setup.sh: apt-get install etcd-server)")
        try:
            import etcd  # noqa: F401  (torch's etcd-v2 backend imports it)
        except ImportError as exc:
            raise Unavailable(f"python-etcd is not installed (run bench/setup.sh): {exc}") from exc
        work_dir.mkdir(parents=True, exist_ok=True)
        self._tmp = tempfile.TemporaryDirectory(prefix="etcd-bench-", dir=work_dir)
        client, peer = free_port(), free_port()
        client_url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
        argv = [
            binary,
            "--name", "bench",
            "--data-dir", self._tmp.name,
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"bench={peer_url}",
            "--enable-v2=true",
            "--log-level", "warn",
        ]  # fmt: skip
        self._service = Service("etcd", argv, log_dir / "etcd.log")
        self._service.start(probe=lambda: _answers(client_url + "/v2/keys"), timeout=30.0)
        self.endpoint = f"127.0.0.1:{client}"

    def stop(self) -> None:
        if self._service is not None:
            self._service.stop()
            self._service = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def service_pid(self) -> int | None:
        return self._service.pid if self._service is not None else None

    def node_spec(self, run_id: str, min_nodes: int, max_nodes: int, conf: dict[str, Any]) -> NodeSpec:
        return NodeSpec(self.name, self.endpoint, run_id, min_nodes, max_nodes, conf)

    def store_spec(self, node: NodeSpec, info: RendezvousInfo) -> StoreSpec:
        return StoreSpec(__name__, self.endpoint, prefix=torch_round_prefix(node.run_id))


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def open_store(spec: StoreSpec) -> Store:
    """An EtcdStore client under the round's prefix, as the etcd-v2 handler wraps it."""
    from datetime import timedelta

    import etcd
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    host, _, port = spec.endpoint.rpartition(":")
    store = EtcdStore(etcd.Client(host, int(port), read_timeout=60), STORE_PREFIX, timeout=timedelta(seconds=60))
    # A PrefixStore holds only the C++ side of a Python store: keep the Python object alive.
    _keep_alive.append(store)
    return dist.PrefixStore(spec.prefix, store) if spec.prefix else store


_keep_alive: list[Store] = []
