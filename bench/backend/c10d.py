"""torch's ``c10d`` backend: no service; the TCPStore is hosted by the first node.

As torch decides it (``c10d_rendezvous_backend._create_tcp_store``): the endpoint is
``127.0.0.1:PORT``, a loopback address, so every node "matches the machine" and tries to
host; the first process to bind the port hosts the store (other nodes in that process
share it, ``multi_tenant``) and every other node falls back to a client. Each job gets a
fresh free port, and the bench starts the process holding the job's first nodes before the
others, so the host is always among them (never the node a failure test kills).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..process import free_port
from . import Backend, NodeSpec, StoreSpec

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.elastic.rendezvous import RendezvousInfo

#: Read timeout of extra store clients (torch's c10d default is 60 s too).
STORE_TIMEOUT = timedelta(seconds=60)


class C10dBackend(Backend):
    name = "c10d"
    label = "c10d"

    def start(self, work_dir: Path, log_dir: Path) -> None:
        """Nothing to start: the first node hosts the store."""

    def stop(self) -> None:
        """Nothing to stop: the store ends with the process of its host node."""

    def failure_env(self) -> dict[str, str]:
        return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def node_spec(self, run_id: str, min_nodes: int, max_nodes: int, conf: dict[str, Any]) -> NodeSpec:
        return NodeSpec(self.name, f"127.0.0.1:{free_port()}", run_id, min_nodes, max_nodes, conf)

    def store_spec(self, node: NodeSpec, info: RendezvousInfo) -> StoreSpec:
        """The job's store as its handlers wrap it: a PrefixStore over the host's TCPStore."""
        return StoreSpec(__name__, node.endpoint, prefix=torch_round_prefix(node.run_id))


def torch_round_prefix(run_id: str) -> str:
    """The key prefix torch's dynamic handler gives a job's first round (it numbers it 0)."""
    return f"torch.rendezvous.{run_id}.0"


def open_store(spec: StoreSpec) -> Store:
    """A TCPStore client of the job's host, under the round's prefix (as c10d's handler wraps it)."""
    import torch.distributed as dist

    host, _, port = spec.endpoint.rpartition(":")
    tcp = dist.TCPStore(host, int(port), is_master=False, timeout=STORE_TIMEOUT)
    return dist.PrefixStore(spec.prefix, tcp) if spec.prefix else tcp
