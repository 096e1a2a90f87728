"""What a torchrun node is told, read once into one frozen record: :class:`NodeConf`.

What it owns: every setting the torchrun handler takes from torch's ``RendezvousParameters``
(``--rdzv-id``, ``--rdzv-endpoint``, ``--nnodes``, ``--local-addr`` and the ``--rdzv-conf``
keys), read, converted and checked in one place, :meth:`NodeConf.read`, with the defaults
that are the handler's own (torch's for the same keys). The job's settings are one
:class:`~rdzv_client.record.JobSettings`, whose defaults are the wire's: the node proposes
them with its join, its refusal, and nowhere else.

The ``--rdzv-conf`` keys: ``join_timeout``, ``last_call_timeout`` (the job's, as
:class:`JobSettings` has them by default), ``close_timeout`` (the client's retry budget),
``keep_alive_interval`` x ``keep_alive_max_attempt`` (the heartbeat TTL), ``store_timeout``,
``node_id``, ``nproc_per_node``, ``max_restarts``, the crash-loop rule (``min_round_seconds``,
``max_fast_failures``), fleet control (``health_check``,
``health_check_timeout``, ``gpu_check``, ``topology_env``) and the client's credentials and
TLS (``token_file``, ``tls``, ``ca_file``, ``cert_file``, ``key_file``).

A job policy on the server wins over the job's settings and the node-side checks where it
names a key: the server applies the job's, the node runs the checks a policy gives it
(:meth:`NodeConf.with_policy`; when the node asks: :mod:`rdzv_client.nodepolicy`).

What it must not know: torch (``RendezvousParameters`` is read through the :class:`RdzvParams`
protocol, so this module imports no torch), the client's transports, the server.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

from . import health, wire

# torch's own default for the same --rdzv-conf key (dynamic_rendezvous.py): how long the
# node's client retries an unreachable server before the call fails.
DEFAULT_CLOSE_TIMEOUT = 30.0
# Heartbeat every 2 s, dead after 5 missed: a host that vanishes silently is noticed in 10 s
# (a process that dies is noticed in about a second, by its dropped watch connection).
DEFAULT_KEEP_ALIVE_INTERVAL = 2.0
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 5
# TCPStore's default timeout for blocking store calls.
DEFAULT_STORE_TIMEOUT = 300.0
# The --rdzv-conf keys that are Client options, passed as they are (paths); ``tls`` is a bool.
CLIENT_PATH_KEYS = ("token_file", "ca_file", "cert_file", "key_file")
# The job settings a node proposes unless --rdzv-conf says otherwise: the wire's defaults.
_DEFAULTS = wire.JobSettings()


class RdzvParams(Protocol):
    """What the handler reads of torch's ``RendezvousParameters``."""

    run_id: str
    min_nodes: int
    max_nodes: int
    endpoint: str
    local_addr: str | None

    def get(self, key: str, default: Any = None) -> Any: ...

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None: ...


@dataclasses.dataclass(frozen=True)
class NodeConf:
    """One torchrun node's settings, as :meth:`read` made them from torch's parameters."""

    run_id: str
    endpoint: str
    #: The job's settings as this node proposes them (node counts, timeouts, TTL, restart budget,
    #: the crash-loop rule).
    settings: wire.JobSettings
    node_id: str
    addr: str  # what the other nodes reach this one at (--local-addr, else the FQDN)
    host: str  # this host's name when it is not ``addr`` (cordons match either), else ""
    nproc_per_node: int | None  # --rdzv-conf nproc_per_node; None: the agent's launch config says
    close_timeout: float
    keep_alive_interval: float
    store_timeout: float
    health_check: str  # a command run before each join ("": none)
    health_check_timeout: float
    gpu_check: bool
    topology: str
    #: The :class:`Client` options (``token_file``, ``tls``, ``ca_file``, ``cert_file``, ``key_file``).
    client_options: Mapping[str, Any]

    @classmethod
    def read(cls, params: RdzvParams) -> NodeConf:
        """The node's settings from ``params``.

        Raises ValueError for a missing endpoint, an invalid ``rdzv_id`` or ``node_id``
        (``WireError``), a value that is not a number where one is due, and a ``tls`` that
        is not a boolean.
        """
        if not params.endpoint:
            raise ValueError("--rdzv-endpoint is required for --rdzv-backend=rdzv-server (HOST[:PORT] of rdzv-server)")
        interval = float(params.get("keep_alive_interval", DEFAULT_KEEP_ALIVE_INTERVAL))
        attempts = int(params.get("keep_alive_max_attempt", DEFAULT_KEEP_ALIVE_MAX_ATTEMPT))
        budget = params.get("max_restarts")
        settings = wire.JobSettings(
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            last_call_timeout=float(params.get("last_call_timeout", _DEFAULTS.last_call_timeout)),
            join_timeout=float(params.get("join_timeout", _DEFAULTS.join_timeout)),
            heartbeat_ttl=interval * attempts,
            max_restarts=None if budget in (None, "") else int(budget),
            min_round_seconds=float(params.get("min_round_seconds", _DEFAULTS.min_round_seconds)),
            max_fast_failures=int(params.get("max_fast_failures", _DEFAULTS.max_fast_failures)),
        )
        addr = params.local_addr or socket.getfqdn()
        hostname = socket.gethostname()
        # Unique per agent, even for several agents on one host: host, pid and a random part.
        host = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in hostname)[:100] or "node"
        node_id = params.get("node_id") or f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        nproc = params.get("nproc_per_node")
        return cls(
            run_id=wire.check_id("rdzv_id", params.run_id),
            endpoint=str(params.endpoint),
            settings=settings,
            node_id=wire.check_id("node_id", node_id),
            addr=addr,
            host=hostname if hostname != addr else "",
            nproc_per_node=int(nproc) if nproc else None,
            close_timeout=float(params.get("close_timeout", DEFAULT_CLOSE_TIMEOUT)),
            keep_alive_interval=interval,
            store_timeout=float(params.get("store_timeout", DEFAULT_STORE_TIMEOUT)),
            health_check=str(params.get("health_check") or ""),
            health_check_timeout=float(params.get("health_check_timeout", health.DEFAULT_HEALTH_CHECK_TIMEOUT)),
            gpu_check=bool(params.get_as_bool("gpu_check", True)),
            topology=health.topology_path(params.get("topology_env")),
            client_options=client_options(params),
        )

    def with_policy(self, policy: Mapping[str, Any]) -> NodeConf:
        """These settings with the node-side keys of ``policy`` (the keys a job policy sets, as
        the server's effective policy names them: ``health_check``, ``health_check_timeout``,
        ``gpu_check``) in place of the node's own; the node runs them before its joins.

        The job-side keys are not laid over :attr:`settings`, which stay what the node's own
        ``--nnodes`` / ``--rdzv-conf`` propose: the server applies a policy's value itself
        whatever a node proposes, and keeps the node's own as the job's (the value a job falls
        back to when the policy is unset)."""
        node: dict[str, Any] = {}
        if "health_check" in policy:
            node["health_check"] = str(policy["health_check"] or "")
        if "health_check_timeout" in policy:
            node["health_check_timeout"] = float(policy["health_check_timeout"])
        if "gpu_check" in policy:
            node["gpu_check"] = bool(policy["gpu_check"])
        return dataclasses.replace(self, **node)


def client_options(params: RdzvParams) -> dict[str, Any]:
    """The :class:`Client` options ``--rdzv-conf`` gives: ``token_file``, ``tls``, ``ca_file``,
    ``cert_file``, ``key_file`` (absent keys are left out). Raises ValueError for a ``tls``
    that is not a boolean (``1``/``0``, ``true``/``false``, ``yes``/``no``)."""
    options: dict[str, Any] = {key: str(params.get(key)) for key in CLIENT_PATH_KEYS if params.get(key)}
    if params.get_as_bool("tls", False):
        options["tls"] = True
    return options
