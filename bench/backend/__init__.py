"""Backend adapters: one module per rendezvous backend the bench drives.

What it owns: the :class:`Backend` interface (start and stop the backend's service, make
the ``RendezvousParameters`` torchrun would make for it, open extra store clients), the
picklable specs that worker processes receive, and :func:`make_backends`.

Every handler is made through torch's public registry,
``registry.get_rendezvous_handler(RendezvousParameters(backend, endpoint, run_id, min_nodes,
max_nodes, local_addr="127.0.0.1", **conf))``, exactly as torchrun's agent makes it.
torch is imported lazily (inside the methods that need it) so that ``--help`` and the
report code stay light.
"""

from __future__ import annotations

import abc
import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import Store
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

#: Every simulated node says it lives here; nothing in the bench leaves loopback.
LOCAL_ADDR = "127.0.0.1"

#: The last_call_timeout of every job the bench forms (s): a round completes at max_nodes, so
#: only a re-rendezvous short of a node waits for it (``target.py`` judges those by it).
LAST_CALL_S = 1.0

#: Backend names as torch's registry knows them, in the order the bench runs them.
BACKEND_NAMES = ("rdzv-server", "c10d", "etcd-v2")


@dataclass(frozen=True)
class NodeSpec:
    """Everything a worker process needs to make the handlers of one job's nodes."""

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    conf: dict[str, Any] = field(default_factory=dict)
    #: Environment the handler reads (e.g. TORCH_DISABLE_SHARE_RDZV_TCP_STORE).
    env: dict[str, str] = field(default_factory=dict)

    def handler(self) -> RendezvousHandler:
        """One node's handler, made through torch's registry as torchrun makes it."""
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        os.environ.update(self.env)
        params = RendezvousParameters(
            self.backend, self.endpoint, self.run_id, self.min_nodes, self.max_nodes, local_addr=LOCAL_ADDR, **self.conf
        )
        return get_rendezvous_handler(params)


@dataclass(frozen=True)
class StoreSpec:
    """How another process opens a client of a job's store: ``module.open_store(self)``."""

    module: str  # the adapter module (``bench.backend.c10d``...) that knows how
    endpoint: str
    prefix: str = ""
    run_id: str = ""
    round: int | None = None

    def open(self) -> Store:
        opener = importlib.import_module(self.module).open_store
        return opener(self)  # type: ignore[no-any-return]


class Backend(abc.ABC):
    """One rendezvous backend: its service's lifetime and the parameters of its handlers.

    ``start`` raises :class:`bench.process.Unavailable` when the backend cannot run here
    (the report shows it as unavailable with that reason) and
    :class:`bench.process.Timeout` when its service does not come up in time.
    """

    #: The name torch's registry knows (``--rdzv-backend``).
    name: str
    #: What the report calls it (a backend may run in several variants).
    label: str
    #: Whether ``num_nodes_waiting()`` turns positive when a member dies.
    reports_dead_nodes: bool = False

    @abc.abstractmethod
    def start(self, work_dir: Path, log_dir: Path) -> None:
        """Start the backend's service (if it has one)."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the service; safe to call twice or without start."""

    @abc.abstractmethod
    def node_spec(self, run_id: str, min_nodes: int, max_nodes: int, conf: dict[str, Any]) -> NodeSpec:
        """The spec for a job's nodes; ``conf`` is ``--rdzv-conf`` on top of :meth:`base_conf`."""

    def base_conf(self) -> dict[str, Any]:
        """``--rdzv-conf`` for every job: a round completes at max_nodes, joins never time out."""
        return {"last_call_timeout": LAST_CALL_S, "join_timeout": 600}

    def failure_conf(self, *, silent: bool) -> dict[str, Any]:
        """``--rdzv-conf`` for the re-rendezvous measurement (``silent``: a SIGSTOPped node)."""
        return {"last_call_timeout": LAST_CALL_S, "keep_alive_interval": 1, "keep_alive_max_attempt": 3}

    def failure_env(self) -> dict[str, str]:
        """Environment of the re-rendezvous measurement's nodes."""
        return {}

    def service_pid(self) -> int | None:
        """The pid of the backend's service process, if it has one (for its CPU time)."""
        return None

    @abc.abstractmethod
    def store_spec(self, node: NodeSpec, info: RendezvousInfo) -> StoreSpec:
        """How another process reaches the store that ``info`` (a node of ``node``'s job) holds."""


def make_backends(names: list[str], *, durable: bool) -> list[Backend]:
    """Adapters for ``names`` in the order given; ``durable`` adds rdzv-server's durable mode."""
    from .c10d import C10dBackend
    from .etcd_v2 import EtcdV2Backend
    from .rdzv_server import RdzvServerBackend

    out: list[Backend] = []
    for name in names:
        if name == "rdzv-server":
            out.append(RdzvServerBackend(durable=False))
            if durable:
                out.append(RdzvServerBackend(durable=True))
        elif name == "c10d":
            out.append(C10dBackend())
        elif name == "etcd-v2":
            out.append(EtcdV2Backend())
        else:
            raise ValueError(f"unknown backend {name!r}: expected some of {', '.join(BACKEND_NAMES)}")
    return out
