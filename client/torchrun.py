"""torch integration: the only module of rdzv_client that imports torch.

What it owns:
- :class:`RdzvStore`, a ``torch.distributed.Store`` over one job (and optionally one
  round's key space) of rdzv-server: what the elastic agent, ``elastic.utils.store``
  (barrier, synchronize) and ``init_process_group(store=...)`` call;
- :class:`RdzvServerHandler`, the torchrun ``RendezvousHandler`` of the backend
  ``rdzv-server``, made by :func:`create_handler` (the ``torchrun.handlers`` entry point
  is the torch-free ``plugin.register``, which calls it);
- :func:`register_backend` and :func:`run_torchrun`, for torch 2.4 and 2.5, which never read
  entry points: ``rdzv-torchrun`` (:mod:`rdzv_client.launcher`) registers the backend, then
  runs torchrun's own ``main``.

How a torchrun agent uses the handler (TORCH-NOTES.md): ``next_rendezvous()`` joins,
offering a free port, and long-polls for the round; the assignment names node rank 0's
addr and offered port, which become MASTER_ADDR/MASTER_PORT (no exchange through the
store). The offered port stays reserved while the node waits in line, which may be
minutes (see :class:`PortReservation`), and is released just before
``next_rendezvous()`` returns: node rank 0's worker binds it moments later, the same
window torch's own free-port pick leaves. The handler's watch thread keeps one long-poll
open per node while its round runs (held up to ``max_hold``): it is the fast death signal
(the server sees the connection drop when the process dies) and the source of
``num_nodes_waiting()``, which the agent calls every 0.1 s and which therefore costs
nothing. Its beat thread is the heartbeat: a watch of no hold, answered at once, whenever
no answer beat the node for a third of the TTL. The watch, the beats and every other
request of the node (join, leave, close, the store) travel pipelined on one stream
connection (:func:`node_client`): one descriptor per node on the server.

How long a node waits in line is the server's decision (it knows the node's role): a
candidate or waiting node gets ``join_timeout`` (torch's ``RendezvousTimeoutError``); a
standby node (torch's redundancy list) waits as long as the job runs, and when the job
closes it gets ``RendezvousGracefulExitError``, which the agent treats as a clean exit.

Credentials and TLS come from ``--rdzv-conf`` (:func:`client_options`): ``token_file=PATH``
(else the client's usual lookup: ``RDZV_TOKEN``, ``RDZV_TOKEN_FILE``, the default file),
``tls=1`` (or an ``https://`` endpoint), ``ca_file=PATH``, ``cert_file=PATH``,
``key_file=PATH``. The token itself never goes on the command line, where ``ps`` shows it.

Errors at the torch boundary are torch's: ``RendezvousTimeoutError``,
``RendezvousClosedError``, ``RendezvousGracefulExitError``, ``RendezvousConnectionError``
(chained ``from`` ours); store timeouts raise ``torch.distributed.DistStoreError`` like
TCPStore's.
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousError

from . import health, wire
from .client import Client
from .error import (
    ConflictError,
    HostCordonedError,
    JobClosedError,
    JobClosedInLineError,
    RdzvConnectionError,
    RdzvError,
    RdzvTimeoutError,
)
from .stream import PipelinedSocketTransport
from .policy import BEAT_JITTER

log = logging.getLogger("rdzv_client")

BACKEND = "rdzv-server"
# torch's own defaults for the same --rdzv-conf keys (dynamic_rendezvous.py).
DEFAULT_JOIN_TIMEOUT = 600.0
DEFAULT_LAST_CALL_TIMEOUT = 30.0
DEFAULT_CLOSE_TIMEOUT = 30.0
# Heartbeat every 2 s, dead after 5 missed: a host that vanishes silently is noticed in 10 s
# (a process that dies is noticed in about a second, by its dropped watch connection).
DEFAULT_KEEP_ALIVE_INTERVAL = 2.0
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 5
# TCPStore's default timeout for blocking store calls.
DEFAULT_STORE_TIMEOUT = 300.0
# Read by torch's agent right after next_rendezvous() (``_assign_worker_ranks``): "1" computes
# each node's worker ranks as node_rank * nproc_per_node + local_rank, with no exchange through
# the round's store. The handler sets it for rounds whose nodes all run the same number of
# workers (the server says so in the assignment), unless the user set it.
WORKER_IDENTICAL_ENV = "TORCH_ELASTIC_WORKER_IDENTICAL"
_worker_identical_ours = False  # the value in the environment is the handler's, not the user's
# The --rdzv-conf keys that are Client options, passed as they are (paths); ``tls`` is a bool.
CLIENT_PATH_KEYS = ("token_file", "ca_file", "cert_file", "key_file")


def _text(key: str | bytes) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


class RdzvStore(Store):
    """A torch ``Store`` over the keys of job ``rdzv_id`` (of ``round``'s key space if given).

    ``client`` is a :class:`Client` (shared, thread-safe) or an endpoint string. With
    ``create=True`` the job is created (1 node) if it does not exist yet, for standalone
    use as ``init_process_group(store=RdzvStore(endpoint, "job", create=True), ...)``.
    Blocking calls (get, multi_get, wait) honour ``timeout`` / ``set_timeout`` and raise
    ``torch.distributed.DistStoreError`` when it passes.
    """

    def __init__(
        self,
        client: Client | str,
        rdzv_id: str,
        *,
        round: int | None = None,
        timeout: timedelta = timedelta(seconds=DEFAULT_STORE_TIMEOUT),
        create: bool = False,
    ) -> None:
        super().__init__()
        wire.check_id("rdzv_id", rdzv_id)
        self._owns_client = isinstance(client, str)
        self._client = Client(client) if isinstance(client, str) else client
        self.rdzv_id = rdzv_id
        self.round = round
        self._clones: list[RdzvStore] = []
        self.set_timeout(timeout)
        if create:
            try:
                self._client.create_job(rdzv_id, min_nodes=1, max_nodes=1)
            except ConflictError:
                pass  # it exists (with nodes in it): use it as it is

    def _seconds(self, timeout: timedelta | None = None) -> float:
        # `timeout` is the native Store property; torch's stub only declares it on subclasses.
        current: timedelta = self.timeout  # type: ignore[attr-defined]
        return (timeout if timeout is not None else current).total_seconds()

    def _blocking(self, call: Callable[[], Any], what: str) -> Any:
        try:
            return call()
        except RdzvTimeoutError as exc:
            raise dist.DistStoreError(f"rdzv store {what} in job {self.rdzv_id}: timeout: {exc}") from exc

    def set(self, key: str, value: str | bytes) -> None:
        self._client.set(self.rdzv_id, _text(key), _text(value), round=self.round)

    def get(self, key: str) -> bytes:
        seconds = self._seconds()
        return self._blocking(  # type: ignore[no-any-return]
            lambda: self._client.get(self.rdzv_id, _text(key), timeout=seconds, round=self.round), f"get({key!r})"
        )

    def add(self, key: str, amount: int) -> int:
        return self._client.add(self.rdzv_id, _text(key), int(amount), round=self.round)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._client.compare_set(self.rdzv_id, _text(key), _text(expected), _text(desired), round=self.round)

    def append(self, key: str, value: str | bytes) -> None:
        self._client.append(self.rdzv_id, _text(key), _text(value), round=self.round)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        seconds = self._seconds()
        return self._blocking(  # type: ignore[no-any-return]
            lambda: self._client.multi_get(self.rdzv_id, [_text(k) for k in keys], timeout=seconds, round=self.round),
            f"multi_get of {len(keys)} keys",
        )

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self._client.multi_set(self.rdzv_id, [_text(k) for k in keys], [_text(v) for v in values], round=self.round)

    def check(self, keys: Sequence[str]) -> bool:
        return self._client.check(self.rdzv_id, [_text(k) for k in keys], round=self.round)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        seconds = self._seconds(timeout)
        self._blocking(
            lambda: self._client.wait(self.rdzv_id, [_text(k) for k in keys], timeout=seconds, round=self.round),
            f"wait for {len(keys)} keys",
        )

    def delete_key(self, key: str) -> bool:
        return self._client.delete_key(self.rdzv_id, _text(key), round=self.round)

    def num_keys(self) -> int:
        return self._client.num_keys(self.rdzv_id, round=self.round)

    def list_keys(self, prefix: str = "") -> list[str]:
        return [k.decode() for k in self._client.list_keys(self.rdzv_id, _text(prefix), round=self.round)]

    def has_extended_api(self) -> bool:
        return True

    # torch's C++ side (PrefixStore, gloo) calls the C++ names through the trampoline.
    deleteKey = delete_key
    getNumKeys = num_keys

    def clone(self) -> RdzvStore:
        """Another store over the same keys, client and timeout (torch's ``Store.clone``).

        Called from C++ (``PrefixStore.clone``, process-group splitting). The clone stays
        referenced by this store: C++ holds only the native half of a Python store, and
        torch's trampoline fails with "Not implemented" once the Python object is gone.
        """
        current: timedelta = self.timeout  # type: ignore[attr-defined]
        twin = RdzvStore(self._client, self.rdzv_id, round=self.round, timeout=current)
        self._clones.append(twin)
        return twin

    def close(self) -> None:
        """Close the client if this store created it."""
        if self._owns_client:
            self._client.close()


# Where a reservation binds: the wildcard of every family the workers' TCPStore may listen on.
_RESERVE_ON = ([(socket.AF_INET6, "::")] if socket.has_dualstack_ipv6() else []) + [(socket.AF_INET, "0.0.0.0")]


class PortReservation:
    """A free TCP port held by a bound, non-listening socket until :meth:`release`.

    The port is offered with the join (for node rank 0's workers' TCPStore) and the round
    may form minutes later. While the socket is bound, the kernel hands the port to no
    port-0 ``bind`` and no outgoing connection, and a plain ``bind`` of it fails with
    EADDRINUSE. The socket has SO_REUSEADDR and never listens, so a TCPStore (which sets
    SO_REUSEADDR too) can bind and listen on the port even before the release. Dual-stack
    where the host has IPv6, so the port is held for both address families. Raises
    ``OSError`` when no socket can be bound (no file descriptor or port left).
    """

    def __init__(self) -> None:
        self._socket: socket.socket | None = None
        error: OSError | None = None
        for family, host in _RESERVE_ON:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                sock.bind((host, 0))
            except OSError as exc:  # IPv6 present but unusable: the IPv4 wildcard will do
                sock.close()
                error = exc
                continue
            self._socket = sock
            break
        if self._socket is None:
            assert error is not None
            raise error
        self.port: int = self._socket.getsockname()[1]

    @property
    def held(self) -> bool:
        return self._socket is not None

    def release(self) -> None:
        """Free the port (idempotent)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class RdzvServerHandler(RendezvousHandler):
    """torchrun's rendezvous through rdzv-server. Built by :func:`create_handler`."""

    def __init__(self, params: RendezvousParameters, nproc_per_node: int, client: Client | None = None) -> None:
        endpoint = _endpoint(params)
        self._run_id = wire.check_id("rdzv_id", params.run_id)
        self._min_nodes = params.min_nodes
        self._max_nodes = params.max_nodes
        self._nproc = nproc_per_node
        self._join_timeout = float(params.get("join_timeout", DEFAULT_JOIN_TIMEOUT))
        self._last_call_timeout = float(params.get("last_call_timeout", DEFAULT_LAST_CALL_TIMEOUT))
        self._close_timeout = float(params.get("close_timeout", DEFAULT_CLOSE_TIMEOUT))
        self._keep_alive_interval = float(params.get("keep_alive_interval", DEFAULT_KEEP_ALIVE_INTERVAL))
        attempts = int(params.get("keep_alive_max_attempt", DEFAULT_KEEP_ALIVE_MAX_ATTEMPT))
        self._heartbeat_ttl = self._keep_alive_interval * attempts
        self._store_timeout = timedelta(seconds=float(params.get("store_timeout", DEFAULT_STORE_TIMEOUT)))
        self._addr = params.local_addr or socket.getfqdn()
        # Unique per agent, even for several agents on one host: host, pid and a random part.
        host = "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in socket.gethostname())[:100] or "node"
        self._node_id = params.get("node_id") or f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        wire.check_id("node_id", self._node_id)
        self._client = client or node_client(endpoint, self._close_timeout, client_options(params))
        # Fleet control (README "Fleet control"): decided on the server, fed from here.
        self._health_check = str(params.get("health_check") or "")
        self._health_check_timeout = float(params.get("health_check_timeout", health.DEFAULT_HEALTH_CHECK_TIMEOUT))
        self._gpu_check = params.get_as_bool("gpu_check", True)
        budget = params.get("max_restarts")
        self._max_restarts = None if budget in (None, "") else int(budget)
        self._topology = health.topology_path(params.get("topology_env"))
        hostname = socket.gethostname()
        self._host = hostname if hostname != self._addr else ""
        # This node was refused (its health check failed, its host is cordoned): it never got a
        # place, so its exit must not close the job the others run (see shutdown()).
        self._refused = False
        self._num_waiting = 0
        self._closed = False
        self._reservation: PortReservation | None = None  # the offered master port, while in line
        self._gracefully_exited = False
        # The watch thread lives as long as the handler and watches the round in _watching
        # (None: no round, it waits). Started here, not when a round forms: starting a thread
        # waits for it to run, and that wait lands on the critical path of every formation.
        self._watch_cv = threading.Condition()
        self._watching: tuple[int, int] | None = None  # (round, generation)
        self._generation = 0
        self._shut_down = False
        self._contact = 0.0  # time.monotonic() of the server's last answer that beat this node
        threading.Thread(target=self._watch, name=f"rdzv-watch-{self._node_id}", daemon=True).start()
        threading.Thread(target=self._beat, name=f"rdzv-beat-{self._node_id}", daemon=True).start()

    # -- RendezvousHandler -------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self._run_id

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def offered_port(self) -> int | None:
        """The master port this node offered with its join, while it waits in line holding it
        reserved (None otherwise)."""
        reservation = self._reservation
        return reservation.port if reservation is not None and reservation.held else None

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the job's next round and wait for it to form.

        Raises torch's ``RendezvousTimeoutError`` (join_timeout passed), ``RendezvousClosedError``
        (the job closed), ``RendezvousGracefulExitError`` (the job closed while this node was a
        standby or waiting node: it was no part of the run), ``RendezvousConnectionError``.
        """
        self._stop_watch()
        self._check_health()
        # Offered in case this node becomes node rank 0: the server hands node rank 0's addr
        # and port to every node in its assignment (no store exchange after the round forms).
        self._reservation = PortReservation()
        try:
            return self._rendezvous(self._reservation.port)
        finally:
            # Just before the agent starts the workers: node rank 0's worker binds the port next.
            self._reservation.release()

    def _check_health(self) -> None:
        """Before each join: the built-in GPU check, then ``health_check``. A failure is
        recorded on the server (``node_refused``, ``health_check_failed``) and raised as a
        ``RendezvousError`` naming the check: the agent exits non-zero without joining."""
        checks: list[tuple[str, Callable[[], health.CheckResult]]] = []
        if self._gpu_check:
            checks.append(("the built-in GPU check (gpu_check=0 turns it off)", lambda: health.gpu_check(self._nproc)))
        if self._health_check:
            env = {"RDZV_JOB_ID": self._run_id, "RDZV_NODE_ID": self._node_id, "RDZV_NPROC_PER_NODE": str(self._nproc)}
            checks.append((
                f"health_check `{self._health_check}`",
                lambda: health.run_check(self._health_check, self._health_check_timeout, env),
            ))
        for name, check in checks:
            result = check()
            if result.ok:
                continue
            log.error("Node %s failed %s: %s", self._node_id, name, result.detail)
            try:
                self._client.refuse(
                    self._run_id, node_id=self._node_id, addr=self._addr, host=self._host,
                    cause="health_check_failed", detail=f"{name}: {result.detail}",
                    min_nodes=self._min_nodes, max_nodes=self._max_nodes, max_restarts=self._max_restarts,
                )
            except RdzvError as exc:
                log.warning("Node %s could not report its failed health check to job %s: %s",
                            self._node_id, self._run_id, exc)
            self._refused = True
            raise RendezvousError(
                f"node {self._node_id} failed {name} and does not join job {self._run_id}: {result.detail}"
            )

    def _rendezvous(self, port: int) -> RendezvousInfo:
        log.info(
            "Node %s joins job %s at %s (nnodes %d:%d, nproc_per_node %d, master port %d offered).",
            self._node_id, self._run_id, ",".join(map(str, self._client.endpoints)),
            self._min_nodes, self._max_nodes, self._nproc, port,
        )
        try:
            # No deadline of our own: the server ends the wait of a node that can time out (its
            # join_timeout, as JoinTimeoutError), a standby waits as long as the job runs, and
            # the client's retry budget ends it when no server answers.
            a = self._client.join(
                self._run_id,
                node_id=self._node_id,
                addr=self._addr,
                nproc_per_node=self._nproc,
                min_nodes=self._min_nodes,
                max_nodes=self._max_nodes,
                last_call_timeout=self._last_call_timeout,
                join_timeout=self._join_timeout,
                heartbeat_ttl=self._heartbeat_ttl,
                master_port=port,
                timeout=math.inf,
                host=self._host,
                topology=self._topology,
                max_restarts=self._max_restarts,
            )
        except RdzvError as exc:
            if isinstance(exc, RdzvTimeoutError):
                self._leave_quietly()  # do not hold a place in a round we stopped waiting for
            if isinstance(exc, HostCordonedError):
                self._refused = True
            if isinstance(exc, JobClosedInLineError):
                self._gracefully_exited = True
                log.info("Node %s: job %s closed while this node was in line; it exits gracefully.",
                         self._node_id, self._run_id)
            raise _torch_error(exc, f"node {self._node_id} could not join job {self._run_id}") from exc
        self._num_waiting = 0
        self._start_watch(a.round)
        self._worker_ranks_without_exchange(a.uniform_nproc)
        store = RdzvStore(self._client, self._run_id, round=a.round, timeout=self._store_timeout)
        if a.master_port:
            bootstrap = RendezvousStoreInfo(a.master_addr, a.master_port)
        else:  # a server (or node rank 0) that does not hand out the port: exchange it through the store
            try:
                bootstrap = _exchange_master_address(a.node_rank, store, self._addr, port)
            except (RdzvError, dist.DistStoreError) as exc:
                raise _torch_error(exc, f"node {self._node_id} could not exchange the master address") from exc
        log.info(
            "Node %s is node_rank %d of %d in round %d of job %s (world_size %d, master %s:%d).",
            self._node_id, a.node_rank, a.num_nodes, a.round, self._run_id, a.world_size,
            bootstrap.master_addr, bootstrap.master_port,
        )
        return RendezvousInfo(store, a.node_rank, a.num_nodes, bootstrap)

    def _worker_ranks_without_exchange(self, uniform: bool) -> None:
        """In a round of uniform nodes, spare the agent torch's worker-rank exchange.

        That exchange (every agent ``set``s its role info, node rank 0 ``multi_get``s them all
        and ``multi_set``s the ranks, every agent ``get``s its own) costs a round trip per node
        and, worse, runs before the agent watches for restarts: a member that dies before
        writing its record leaves the others blocked until ``store_timeout``. In a uniform round
        torch's shortcut gives the same ranks as the exchange, and the agent goes straight to
        its workers and its watch, which reports the death at once. Any other round keeps the
        exchange (the shortcut's ranks would be wrong)."""
        global _worker_identical_ours
        if WORKER_IDENTICAL_ENV in os.environ and not _worker_identical_ours:
            return  # the user's
        if uniform:
            os.environ[WORKER_IDENTICAL_ENV] = "1"
        else:
            os.environ.pop(WORKER_IDENTICAL_ENV, None)
        _worker_identical_ours = uniform

    def is_closed(self) -> bool:
        if self._closed:
            return True
        try:
            job = self._client.job(self._run_id)
        except RdzvError as exc:
            raise _torch_error(exc, f"could not read the state of job {self._run_id}") from exc
        return bool(job.get("state") == "closed")

    def set_closed(self) -> None:
        try:
            self._client.close_job(self._run_id, cause="agent")
        except RdzvError as exc:
            raise _torch_error(exc, f"could not close job {self._run_id}") from exc
        self._closed = True

    def num_nodes_waiting(self) -> int:
        # Kept current by the watch thread's long-poll: the agent calls this every 0.1 s.
        return self._num_waiting

    def shutdown(self) -> bool:
        """The agent is done (its run succeeded or failed for good): close the job, then leave.

        Closing is what torch's own backends do: the other agents' next re-rendezvous fails
        with RendezvousClosedError instead of waiting for a round that cannot form. It comes
        before the leave: the leave of a job's last live member would otherwise open (and,
        with min_nodes standby nodes in line, form) a round for its spares, which would then
        start a run of their own instead of exiting gracefully.

        Raises ``SystemExit(0)`` in one case only, torch 2.13's: after this node exited
        gracefully, ``agent.run()`` returns None, ``launch_agent`` then fails on
        ``None.is_failed()`` and calls this method while that AttributeError propagates; it
        is replaced (chained) by a clean exit, which torchrun's ``@record`` turns into exit
        code 0. A torch that handles the graceful exit itself never gets here with it.
        """
        self._stop_watch(for_good=True)
        if self._refused:  # refused: the job is the others' (a refused node must not end it)
            log.info("Node %s was refused by job %s; it leaves the job to the others.", self._node_id, self._run_id)
            self._closed = True
            self._leave_quietly()  # a member cordoned mid-round leaves its place (a no-op for a new node)
            return True
        try:
            self._client.close_job(self._run_id, cause="agent")
            self._client.leave(self._run_id, self._node_id)
            return True
        except RdzvError as exc:
            log.warning("Node %s could not leave job %s cleanly: %s", self._node_id, self._run_id, exc)
            return False
        finally:
            self._closed = True
            in_flight = sys.exc_info()[1]
            if self._gracefully_exited and _is_torch_none_run_result(in_flight):
                log.info("Node %s left job %s gracefully; exiting with code 0.", self._node_id, self._run_id)
                raise SystemExit(0) from in_flight

    def _leave_quietly(self) -> None:
        try:
            self._client.leave(self._run_id, self._node_id)
        except RdzvError as exc:
            log.warning("Node %s could not leave job %s: %s", self._node_id, self._run_id, exc)

    @property
    def use_agent_store(self) -> bool:
        # Workers build their own TCPStore at MASTER_ADDR:MASTER_PORT (worker rank 0 hosts it).
        return False

    # -- the watch thread ----------------------------------------------------------------

    def _start_watch(self, round_: int) -> None:
        self._contact = time.monotonic()  # the assignment was just answered: a beat
        with self._watch_cv:
            self._generation += 1
            self._watching = (round_, self._generation)
            self._watch_cv.notify_all()

    def _stop_watch(self, *, for_good: bool = False) -> None:
        # The thread drops its current long-poll's answer; nothing waits for that poll to end
        # (it ends at once when this node's join opens the next round).
        with self._watch_cv:
            self._watching = None
            self._shut_down = self._shut_down or for_good
            self._watch_cv.notify_all()

    def _watch(self) -> None:
        while True:
            with self._watch_cv:
                while self._watching is None and not self._shut_down:
                    self._watch_cv.wait()
                if self._shut_down:
                    return
                assert self._watching is not None
                current = self._watching
            self._watch_round(current)

    def _watch_round(self, current: tuple[int, int]) -> None:
        """Heartbeat and long-poll ``current``'s round until the handler watches another (or none)."""
        round_ = current[0]
        known = 0  # as num_nodes_waiting() starts: the first poll parks unless nodes already wait
        while self._watching == current:
            try:
                # Held as long as the client and server allow (max_hold): the beat thread keeps
                # the node alive meanwhile, so the watch is re-sent only when it answers. (A
                # server older than the beats holds it a third of the TTL, which beats too.)
                seen = self._client.watch(self._run_id, self._node_id, round=round_, known=known, hold=math.inf)
            except Exception as exc:  # RdzvError, or a bug: never let it end the watch
                if self._watching != current:
                    return
                log.warning(
                    "Node %s: heartbeat to job %s failed (%s); retrying.", self._node_id, self._run_id, exc,
                    exc_info=not isinstance(exc, RdzvError),
                )  # fmt: skip
                with self._watch_cv:
                    self._watch_cv.wait_for(lambda: self._watching != current, self._keep_alive_interval)
                continue
            self._contact = time.monotonic()  # an answered watch beat the node (it was sent before now)
            if self._watching != current:
                return
            if seen.num_nodes_waiting != known and seen.num_nodes_waiting > 0:
                log.info(
                    "Node %s: job %s has %d node(s) waiting (round %d, state %s): the agent will re-rendezvous.",
                    self._node_id, self._run_id, seen.num_nodes_waiting, seen.round, seen.state,
                )
            known = seen.num_nodes_waiting
            if seen.closed:
                if seen.cause == "restart_budget_exhausted":
                    # The server stopped the job: the agent must stop its workers and fail, not
                    # train on until they finish. A re-rendezvous now fails with the closed error.
                    log.error("Node %s: job %s spent its restart budget (max_restarts); stopping.",
                              self._node_id, self._run_id)
                    known = 1
                self._num_waiting, self._closed = known, True
                # A closed job forms no other round and needs no heartbeat, and its watch answers
                # at once: watching on would spin. Its workers run to their end (or, budget
                # spent, are stopped); the next rendezvous fails with the closed error.
                with self._watch_cv:
                    self._watch_cv.wait_for(lambda: self._watching != current)
                return
            self._num_waiting = known
            self._closed = False

    def _beat(self) -> None:
        """The heartbeat: while a round is watched (and the job is not closed), a watch of no
        hold, which the server answers at once, whenever nothing else told the server for a
        third of the TTL that this node lives (a watch sent or answered, an assignment: the
        server beats the node when a request arrives and when it answers). A parked watch is
        not a heartbeat (a hung process keeps its connection open): these are what keep the
        node alive, as the watch's own beats did when it was held a third of the TTL. Against
        a server that still holds every watch a third of the TTL, the watches beat the node
        and a beat is sent when an answer comes late (2.17 requests a second per node against
        1.5 for the plug-in before the beats, two nodes at a TTL of 2 s)."""
        while True:
            with self._watch_cv:
                while (self._watching is None or self._closed) and not self._shut_down:
                    self._watch_cv.wait()
                if self._shut_down:
                    return
                current = self._watching
                assert current is not None
            self._beat_round(current, self._heartbeat_ttl / 3)

    def _beat_round(self, current: tuple[int, int], interval: float) -> None:
        rng = random.Random()
        # The first beat at a random point of the first interval, whatever the watch does: the
        # nodes of a round are placed in the same second, and would otherwise beat in the same
        # second for the whole round. The later ones are jittered too: they drift apart.
        first = True
        while True:
            seen = self._contact
            due = seen + interval * rng.uniform(0.0 if first else BEAT_JITTER, 1.0)
            with self._watch_cv:
                if self._watch_cv.wait_for(
                    lambda: self._watching != current or self._closed, max(0.0, due - time.monotonic())
                ):
                    return
            if self._contact != seen and not first:
                continue  # a watch was sent or answered meanwhile: the next beat counts from that
            first = False
            sent = time.monotonic()
            try:
                self._client.watch(self._run_id, self._node_id, round=current[0], hold=0.0)
            except Exception as exc:  # RdzvError, or a bug: never let it end the heartbeats
                log.warning(
                    "Node %s: heartbeat to job %s failed (%s).", self._node_id, self._run_id, exc,
                    exc_info=not isinstance(exc, RdzvError),
                )  # fmt: skip
            self._contact = sent


def _exchange_master_address(node_rank: int, store: Store, addr: str, port: int) -> RendezvousStoreInfo:
    """MASTER_ADDR / MASTER_PORT through the round's store: node rank 0 publishes its own addr
    and offered ``port``, every node reads them back.

    What torch's ``RendezvousStoreInfo.build`` does, under the same keys (so a node of an older
    client that calls it reads what this one writes, and the other way round), without calling
    it: its signature changed (torch 2.4's is ``build(rank, store)``, which publishes
    ``socket.getfqdn()`` whatever ``--local-addr`` says; 2.6's takes ``local_addr``), and its
    own port pick would leave unused the port this node already holds. Raises what the store's
    ``set`` / ``get`` raise (``RdzvError``, ``DistStoreError`` on a timeout).
    """
    if node_rank == 0:
        store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, addr)
        store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(port))
    master_addr = store.get(RendezvousStoreInfo.MASTER_ADDR_KEY).decode()
    master_port = int(store.get(RendezvousStoreInfo.MASTER_PORT_KEY).decode())
    return RendezvousStoreInfo(master_addr, master_port)


def _endpoint(params: RendezvousParameters) -> str:
    if not params.endpoint:
        raise ValueError("--rdzv-endpoint is required for --rdzv-backend=rdzv-server (HOST[:PORT] of rdzv-server)")
    return str(params.endpoint)


def client_options(params: RendezvousParameters) -> dict[str, Any]:
    """The :class:`Client` options ``--rdzv-conf`` gives: ``token_file``, ``tls``, ``ca_file``,
    ``cert_file``, ``key_file`` (absent keys are left out). Raises ValueError for a ``tls``
    that is not a boolean (``1``/``0``, ``true``/``false``, ``yes``/``no``)."""
    options: dict[str, Any] = {key: str(params.get(key)) for key in CLIENT_PATH_KEYS if params.get(key)}
    if params.get_as_bool("tls", False):
        options["tls"] = True
    return options


def _is_torch_none_run_result(exc: BaseException | None) -> bool:
    """``exc`` is what torch 2.13's ``launch_agent`` raises after a graceful exit: the
    AttributeError of ``result.is_failed()`` on the None that ``agent.run()`` returned."""
    return isinstance(exc, AttributeError) and exc.obj is None and exc.name == "is_failed"


def _torch_error(exc: BaseException, context: str) -> RendezvousError:
    message = f"{context}: {exc}"
    if isinstance(exc, JobClosedInLineError):
        return RendezvousGracefulExitError(message)
    if isinstance(exc, JobClosedError):
        return RendezvousClosedError(message)
    if isinstance(exc, (RdzvTimeoutError, dist.DistStoreError)):
        return RendezvousTimeoutError(message)
    if isinstance(exc, RdzvConnectionError):
        return RendezvousConnectionError(message)
    return RendezvousError(message)


def _launch_config_nproc() -> int | None:
    """nproc_per_node of the torchrun agent creating us.

    ``RendezvousParameters`` does not carry it, but torch creates the handler inside
    ``launch_agent(config, ...)`` (torchrun and ``elastic_launch`` alike); read it there.
    """
    frame = sys._getframe(1)
    while frame is not None:
        config = frame.f_locals.get("config")
        nproc = getattr(config, "nproc_per_node", None)
        if frame.f_code.co_name == "launch_agent" and nproc is not None:
            return int(nproc)
        frame = frame.f_back  # type: ignore[assignment]
    return None


def node_client(endpoint: str, retry_budget: float, options: Mapping[str, Any]) -> Client:
    """A :class:`Client` whose operations all travel on one pipelined stream connection per
    endpoint (:class:`PipelinedSocketTransport`): the watch thread's long-poll, the agent's
    calls and its store share it, so the server holds one descriptor per node.

    ``options`` are :func:`client_options`'s. Raises ValueError (``CredentialError``,
    ``TLSConfigError``) for a token or TLS file that cannot be used, or TLS files without TLS.
    """
    return Client(endpoint, retry_budget=retry_budget, transport_type=PipelinedSocketTransport, **options)


# torchrun makes one handler per process: one client, so one connection, per agent.
_shared_clients: dict[tuple[str, int, tuple[tuple[str, Any], ...]], Client] = {}
_shared_lock = threading.Lock()


def _shared_client(endpoint: str, retry_budget: float, options: Mapping[str, Any]) -> Client:
    """One client (one pipelined connection per endpoint) per endpoint and client options per process.

    torchrun makes one handler per process; tools that simulate many nodes in one process
    (the bench's thread-per-node path, tests) then share that connection too.
    """
    key = (endpoint, os.getpid(), tuple(sorted(options.items())))
    with _shared_lock:
        client = _shared_clients.get(key)
        if client is None:
            client = _shared_clients[key] = node_client(endpoint, retry_budget, options)
        return client


def create_handler(params: RendezvousParameters) -> RdzvServerHandler:
    """torch's creator for the ``rdzv-server`` backend.

    nproc_per_node comes from ``--rdzv-conf nproc_per_node=K`` if given, else from the
    agent's launch config, else 1 (it only feeds the membership view's global ranks).
    Token and TLS options come from ``--rdzv-conf`` (:func:`client_options`); a token or TLS
    file that cannot be used raises ValueError naming it.
    """
    nproc = params.get("nproc_per_node") or _launch_config_nproc() or 1
    retry_budget = float(params.get("close_timeout", DEFAULT_CLOSE_TIMEOUT))
    client = _shared_client(_endpoint(params), retry_budget, client_options(params))
    return RdzvServerHandler(params, int(nproc), client=client)


def register_backend() -> bool:
    """Register the ``rdzv-server`` backend in torch's rendezvous registry unless it is there.

    torch 2.6 and later register it by themselves from the ``torchrun.handlers`` entry point
    while they import ``torch.distributed.elastic.rendezvous``, which this module's import has
    done; torch 2.4 and 2.5 never read entry points, and their torchrun fails with "The
    rendezvous backend 'rdzv-server' is not registered". Returns True when the registered
    creator is :func:`create_handler` (this call's, or an earlier one's), False when torch
    registered the entry point's creator (it is kept: registering another one would raise).
    """
    try:
        rendezvous_handler_registry.register(BACKEND, create_handler)
    except ValueError:  # "already registered with" another creator: the entry point's
        return False
    return True


def run_torchrun(argv: Sequence[str] | None = None) -> None:
    """torchrun with the backend registered first: ``rdzv-torchrun ARGS`` is ``torchrun ARGS``
    on every torch (``argv`` None: the process's own arguments, as torchrun reads them).

    Raises what torchrun's ``main`` raises (``ChildFailedError`` when workers failed; its
    ``@record`` writes the error file first).
    """
    register_backend()
    from torch.distributed import run  # torchrun's own module; imported only to launch

    run.main(None if argv is None else list(argv))
