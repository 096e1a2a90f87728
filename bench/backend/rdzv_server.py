"""The ``rdzv-server`` backend: a server process the bench starts on 127.0.0.1.

Memory mode (``--memory``) is the default variant; the durable variant (``--data-dir``,
fsync ``always``: the server's defaults) shows what durability costs at formation.
Handlers come from torch's registry (our ``torchrun.handlers`` entry point); handlers in
one process share one client, as they would in any tool that simulates many nodes.
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..process import Service
from . import Backend, NodeSpec, StoreSpec

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.elastic.rendezvous import RendezvousInfo

    from rdzv_client import Client

#: What the server prints once it has recovered and accepts requests.
READY_LINE = "rdzv-server listening on http://"


def server_argv(*flags: str, port: int = 0) -> list[str]:
    """The command line of an rdzv-server on ``port`` of 127.0.0.1 (0: a free one).

    Without automatic quarantine: every simulated node is on 127.0.0.1, and the nodes that a
    measurement kills, or that end with their process, would otherwise cordon the host for
    the measurements after it (3 deaths an hour by default).
    """
    return [
        sys.executable, "-m", "rdzv_server", "--host", "127.0.0.1", "--port", str(port), "--log-level", "info",
        "--quarantine-after", "0", *flags,
    ]  # fmt: skip


def start_server(name: str, flags: list[str], log_dir: Path, timeout: float = 60.0) -> tuple[Service, str]:
    """Start a server with ``flags``; return it and its endpoint ``127.0.0.1:PORT``."""
    service = Service(name, server_argv(*flags), log_dir / f"{name}.log")
    service.start(ready_line=READY_LINE, timeout=timeout)
    return service, service.ready_text.removeprefix(READY_LINE)


class RdzvServerBackend(Backend):
    name = "rdzv-server"
    reports_dead_nodes = True

    def __init__(self, *, durable: bool) -> None:
        self.durable = durable
        self.label = "rdzv-server (durable)" if durable else "rdzv-server"
        self.endpoint = ""
        self.pid = 0
        self._service: Service | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    def start(self, work_dir: Path, log_dir: Path) -> None:
        if self.durable:
            work_dir.mkdir(parents=True, exist_ok=True)
            self._tmp = tempfile.TemporaryDirectory(prefix="rdzv-bench-", dir=work_dir)
            flags = ["--data-dir", self._tmp.name]
        else:
            flags = ["--memory"]
        name = "rdzv-server-durable" if self.durable else "rdzv-server"
        self._service, self.endpoint = start_server(name, flags, log_dir)
        self.pid = self._service.pid

    def stop(self) -> None:
        if self._service is not None:
            self._service.stop()
            self._service = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def base_conf(self) -> dict[str, Any]:
        return {**super().base_conf(), "nproc_per_node": 1}

    def failure_conf(self, *, silent: bool) -> dict[str, Any]:
        conf: dict[str, Any] = self.base_conf()  # (its last call: LAST_CALL_S)
        if silent:  # a heartbeat TTL of 2 s: the only signal a SIGSTOPped node leaves
            conf.update(keep_alive_interval=0.5, keep_alive_max_attempt=4)
        return conf

    def service_pid(self) -> int | None:
        return self._service.pid if self._service is not None else None

    def node_spec(self, run_id: str, min_nodes: int, max_nodes: int, conf: dict[str, Any]) -> NodeSpec:
        return NodeSpec(self.name, self.endpoint, run_id, min_nodes, max_nodes, conf)

    def store_spec(self, node: NodeSpec, info: RendezvousInfo) -> StoreSpec:
        return StoreSpec(__name__, self.endpoint, run_id=node.run_id, round=getattr(info.store, "round", None))


_clients: dict[str, Client] = {}
_clients_lock = threading.Lock()


def open_store(spec: StoreSpec) -> Store:
    """A store on the job's round over one client per process, shared as handlers share theirs."""
    from rdzv_client import Client
    from rdzv_client.torchrun import RdzvStore

    with _clients_lock:
        client = _clients.get(spec.endpoint)
        if client is None:
            client = _clients[spec.endpoint] = Client(spec.endpoint)
    return RdzvStore(client, spec.run_id, round=spec.round)
