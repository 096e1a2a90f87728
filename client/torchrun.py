"""torch integration: the only module of rdzv_client that imports torch.

What it owns: the torch boundary, and only that.
- :class:`RdzvStore`, a ``torch.distributed.Store`` over one job (and optionally one
  round's key space) of rdzv-server: what the elastic agent, ``elastic.utils.store``
  (barrier, synchronize) and ``init_process_group(store=...)`` call;
- :class:`RdzvServerHandler`, the torchrun ``RendezvousHandler`` of the backend
  ``rdzv-server``, made by :func:`create_handler` (the ``torchrun.handlers`` entry point
  is the torch-free ``plugin.register``, which calls it) from the node's settings, read
  once from torch's parameters (:class:`rdzv_client.conf.NodeConf`);
- translating the client's errors into torch's (:func:`_torch_error`);
- finding what failed in torch's agent (:func:`find_failure_report`), the one place where the
  plug-in leans on how the agent keeps its failures (see "What the failure report relies on"
  in docs/torch-compat.md), and sending it with the node's re-join and its agent's close;
- :func:`register_backend` and :func:`run_torchrun`, for torch 2.4 and 2.5, which never read
  entry points: ``rdzv-torchrun`` (:mod:`rdzv_client.launcher`) registers the backend, then
  runs torchrun's own ``main``.

How a torchrun agent uses the handler (TORCH-NOTES.md): ``next_rendezvous()`` joins,
offering a free port, and long-polls for the round; the assignment names node rank 0's
addr and offered port, which become MASTER_ADDR/MASTER_PORT (no exchange through the
store). The offered port stays reserved while the node waits in line, which may be
minutes (:class:`rdzv_client.node.PortReservation`), and is released just before
``next_rendezvous()`` returns: node rank 0's worker binds it moments later, the same
window torch's own free-port pick leaves. While its round runs the node's watch and beat
threads (:class:`rdzv_client.node.NodeLoop`) keep it alive and keep
``num_nodes_waiting()`` current; every request of the node travels pipelined on one
stream connection (:func:`rdzv_client.node.node_client`).

How long a node waits in line is the server's decision (it knows the node's role): a
candidate or waiting node gets ``join_timeout`` (torch's ``RendezvousTimeoutError``); a
standby node (torch's redundancy list) waits as long as the job runs, and when the job
closes it gets ``RendezvousGracefulExitError``, which the agent treats as a clean exit.

Credentials and TLS come from ``--rdzv-conf`` (:func:`rdzv_client.conf.client_options`):
``token_file=PATH`` (else the client's usual lookup: ``RDZV_TOKEN``, ``RDZV_TOKEN_FILE``, the
default file), ``tls=1`` (or an ``https://`` endpoint), ``ca_file=PATH``, ``cert_file=PATH``,
``key_file=PATH``. The token itself never goes on the command line, where ``ps`` shows it.

Errors at the torch boundary are torch's: ``RendezvousTimeoutError``,
``RendezvousClosedError``, ``RendezvousGracefulExitError``, ``RendezvousConnectionError``
(chained ``from`` ours); store timeouts raise ``torch.distributed.DistStoreError`` like
TCPStore's.

Why a node re-joins: torch hands a handler nothing about a failure. After a worker failure
with restarts left, ``SimpleElasticAgent._invoke_run`` calls ``_restart_workers`` ->
``_initialize_workers`` -> ``_rendezvous`` -> ``next_rendezvous()`` with no argument, and
after the last failure ``launch_agent`` calls ``shutdown()`` from its ``finally``. In both
places the agent's latest ``RunResult`` (``state``, ``failures``: global rank ->
``ProcessFailure``) is a local variable of a frame below the handler's (``run_result`` in
``_invoke_run``, ``result`` in ``launch_agent``; read in torch 2.4.1, 2.13, 2.14.1 and 2.15.0).
The rules of :func:`find_failure_report`:
- The nearest ``RunResult`` on the calling thread's stack (at most :data:`MAX_FRAMES` frames
  up) is the agent's latest. Its type is what is looked for, not a variable's name or a
  method's, so a renamed local or an agent subclass with its own run loop is still found.
- A result whose state is FAILED or UNHEALTHY gives a report (with no failures in it:
  :data:`~rdzv_client.failure.NO_DETAIL`); any other state, or no result (the agent's first
  rendezvous), gives None. Nothing found is None too: the handler decides with
  :class:`~rdzv_client.failure.RendezvousEntries` whether that entry follows a failure, and
  then reports "workers failed (no detail)".
- Never raises, never writes to torch's objects, never patches torch: reading frames is all
  it does. It runs on the thread torch called the handler on.

What it must not know: the node loop's threads, the port reservation, how ``--rdzv-conf``
is read, how a report is built and bounded (:mod:`rdzv_client.node`, :mod:`rdzv_client.conf`,
:mod:`rdzv_client.failure`, all torch-free).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from datetime import timedelta
from types import FrameType
from typing import Any, TypeVar

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
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.rendezvous.api import RendezvousError

from . import health, wire
from .client import Client
from .conf import DEFAULT_STORE_TIMEOUT, NodeConf
from .conf import client_options as client_options  # (the handler's options, for tools that build a client alike)
from .credential import CredentialError, find_token
from .error import (
    BadRequestError,
    ConflictError,
    HostCordonedError,
    JobClosedError,
    JobClosedInLineError,
    RdzvConnectionError,
    RdzvError,
    RdzvTimeoutError,
)
from .failure import FailureReport, RendezvousEntries, build_report, report_for
from .node import NodeLoop, PortReservation, node_client, shared_client
from .nodepolicy import NodePolicy
from .progress import PROGRESS_DIR_ENV, clear, node_step

log = logging.getLogger("rdzv_client")

T = TypeVar("T")

BACKEND = "rdzv-server"
# Read by torch's agent right after next_rendezvous() (``_assign_worker_ranks``): "1" computes
# each node's worker ranks as node_rank * nproc_per_node + local_rank, with no exchange through
# the round's store. The handler sets it for rounds whose nodes all run the same number of
# workers (the server says so in the assignment), unless the user set it.
WORKER_IDENTICAL_ENV = "TORCH_ELASTIC_WORKER_IDENTICAL"
_worker_identical_ours = False  # the value in the environment is the handler's, not the user's


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
                self._client.create_job(rdzv_id, wire.JobSettings(min_nodes=1, max_nodes=1))
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


class RdzvServerHandler(RendezvousHandler):
    """torchrun's rendezvous through rdzv-server, for the node ``conf`` describes. Built by
    :func:`create_handler`; ``client``: the node's (default: a :func:`node_client`)."""

    def __init__(self, conf: NodeConf, nproc_per_node: int, client: Client | None = None) -> None:
        self._conf = conf  # the node's own settings, then with the job policy's node-side keys (_take_policy)
        self._policy = NodePolicy(conf)
        self._run_id = conf.run_id
        self._node_id = conf.node_id
        self._nproc = nproc_per_node
        self._client = client or node_client(conf.endpoint, conf.close_timeout, conf.client_options)
        # This node was refused (its health check failed, its host is cordoned): it never got a
        # place, so its exit must not close the job the others run (see shutdown()).
        self._refused = False
        self._reservation: PortReservation | None = None  # the offered master port, while in line
        self._gracefully_exited = False
        self._shut_down: bool | None = None  # what shutdown() answered (None: not yet called)
        # Where this node's workers write their steps (rdzv_client.progress): the workers find
        # it in RDZV_PROGRESS_DIR, which next_rendezvous() sets before the agent starts them.
        self._progress_dir = tempfile.mkdtemp(prefix="rdzv-progress-")
        # Why the agent enters next_rendezvous(): a failure, when nothing asked it to restart.
        self._entries = RendezvousEntries()
        self._round = -1  # the last round this node was placed in (-1: none yet)
        # Masked wherever a failure's message quotes them (a worker that printed its environment).
        self._secrets = _token_of(conf)
        #: The node's watch and beat threads, and what they saw (``closed``, ``num_waiting``).
        self.node = NodeLoop(
            self._client, conf.run_id, conf.node_id,
            keep_alive_interval=conf.keep_alive_interval, heartbeat_ttl=conf.settings.heartbeat_ttl,
            progress_dir=self._progress_dir,
        )  # fmt: skip

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
        failure = report_for(self._entries.entered(), find_failure_report(self._secrets))
        if failure is not None:
            log.warning("Node %s of job %s: its workers failed in round %d: %s; it joins again, reporting it.",
                        self._node_id, self._run_id, self._round, failure.summary())
        self.node.stop()
        self._take_policy()
        self._check_health()
        # Offered in case this node becomes node rank 0: the server hands node rank 0's addr
        # and port to every node in its assignment (no store exchange after the round forms).
        self._reservation = PortReservation()
        try:
            return self._rendezvous(self._reservation.port, failure)
        finally:
            # Just before the agent starts the workers: node rank 0's worker binds the port next.
            self._reservation.release()

    def _take_policy(self) -> None:
        """Before each join: the job's policy over the node's own settings, fetched before the
        first join and again only when the server reported a new ``policy_version``
        (:class:`~rdzv_client.nodepolicy.NodePolicy`); the beats follow its ``heartbeat_ttl``."""
        self._policy.seen(self.node.policy_version)  # a change while the round ran
        self._conf = self._policy.before_join(self._client)
        self.node.use_heartbeat_ttl(self._policy.heartbeat_ttl)

    def _check_health(self) -> None:
        """Before each join: the built-in GPU check, then ``health_check``. A failure is
        recorded on the server (``node_refused``, ``health_check_failed``) and raised as a
        ``RendezvousError`` naming the check: the agent exits non-zero without joining."""
        conf = self._conf
        checks: list[tuple[str, Callable[[], health.CheckResult]]] = []
        if conf.gpu_check:
            checks.append(("the built-in GPU check (gpu_check=0 turns it off)", lambda: health.gpu_check(self._nproc)))
        if conf.health_check:
            env = {"RDZV_JOB_ID": self._run_id, "RDZV_NODE_ID": self._node_id, "RDZV_NPROC_PER_NODE": str(self._nproc)}
            checks.append((
                f"health_check `{conf.health_check}`",
                lambda: health.run_check(conf.health_check, conf.health_check_timeout, env),
            ))
        for name, check in checks:
            result = check()
            if result.ok:
                continue
            log.error("Node %s failed %s: %s", self._node_id, name, result.detail)
            try:
                self._client.refuse(
                    self._run_id, node_id=self._node_id, addr=conf.addr, host=conf.host,
                    cause="health_check_failed", detail=f"{name}: {result.detail}", settings=conf.settings,
                )
            except RdzvError as exc:
                log.warning("Node %s could not report its failed health check to job %s: %s",
                            self._node_id, self._run_id, exc)
            self._refused = True
            raise RendezvousError(
                f"node {self._node_id} failed {name} and does not join job {self._run_id}: {result.detail}"
            )

    def _rendezvous(self, port: int, failure: FailureReport | None) -> RendezvousInfo:
        conf = self._conf
        log.info(
            "Node %s joins job %s at %s (nnodes %d:%d, nproc_per_node %d, master port %d offered).",
            self._node_id, self._run_id, ",".join(map(str, self._client.endpoints)),
            conf.settings.min_nodes, conf.settings.max_nodes, self._nproc, port,
        )
        # The highest step the workers of the round this node leaves reported (their agent
        # stopped them before this call): the server's crash-loop rule reads it. Then the next
        # round's workers start from an empty directory.
        step = node_step(self._progress_dir)
        clear(self._progress_dir)
        os.environ[PROGRESS_DIR_ENV] = self._progress_dir  # inherited by the workers the agent starts next
        try:
            # No deadline of our own: the server ends the wait of a node that can time out (its
            # join_timeout, as JoinTimeoutError), a standby waits as long as the job runs, and
            # the client's retry budget ends it when no server answers.
            a = self._sent_with_failure(
                failure,
                lambda sent: self._client.join(
                    self._run_id,
                    node_id=self._node_id,
                    addr=conf.addr,
                    nproc_per_node=self._nproc,
                    settings=conf.settings,
                    master_port=port,
                    timeout=math.inf,
                    host=conf.host,
                    topology=conf.topology,
                    step=step,
                    failure=sent,
                    # The server parks the node's watch of the new round with the assignment:
                    # the watch thread's first watch (NodeLoop) waits on it, no request sent.
                    then_watch=True,
                ),
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
        self._policy.seen(a.policy_version)
        self.node.watch(a.round)
        self._round = a.round
        self._worker_ranks_without_exchange(a.uniform_nproc)
        store = RdzvStore(self._client, self._run_id, round=a.round, timeout=timedelta(seconds=conf.store_timeout))
        if a.master_port:
            bootstrap = RendezvousStoreInfo(a.master_addr, a.master_port)
        else:  # a server (or node rank 0) that does not hand out the port: exchange it through the store
            try:
                bootstrap = exchange_master_address(a.node_rank, store, conf.addr, port)
            except (RdzvError, dist.DistStoreError) as exc:
                raise _torch_error(exc, f"node {self._node_id} could not exchange the master address") from exc
        log.info(
            "Node %s is node_rank %d of %d in round %d of job %s (world_size %d, master %s:%d).",
            self._node_id, a.node_rank, a.num_nodes, a.round, self._run_id, a.world_size,
            bootstrap.master_addr, bootstrap.master_port,
        )
        return RendezvousInfo(store, a.node_rank, a.num_nodes, bootstrap)

    def _sent_with_failure(self, failure: FailureReport | None, send: Callable[[wire.FailureWire | None], T]) -> T:
        """``send(report)`` with ``failure`` as the wire carries it (ages on the node's wall
        clock, which torch's failure times are on); a server older than failure reports refuses
        the unknown field (``bad_request``, nothing applied): then once more without it, so a
        new plug-in still re-joins an old server."""
        if failure is None:
            return send(None)
        try:
            return send(failure.to_wire(time.time()))
        except BadRequestError as exc:
            log.warning("Node %s: the server of job %s did not take its failure report (%s); sending without it.",
                        self._node_id, self._run_id, exc)
            return send(None)

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
        if self.node.closed:
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
        self.node.closed = True

    def num_nodes_waiting(self) -> int:
        # Kept current by the watch thread's long-poll: the agent calls this every 0.1 s.
        waiting = self.node.num_waiting
        self._entries.answered_waiting(waiting)  # the agent's next entry is a restart for them, not a failure
        return waiting

    def shutdown(self) -> bool:
        """The agent is done (its run succeeded or failed for good): close the job, then leave.

        Closing is what torch's own backends do: the other agents' next re-rendezvous fails
        with RendezvousClosedError instead of waiting for a round that cannot form. It comes
        before the leave: the leave of a job's last live member would otherwise open (and,
        with min_nodes standby nodes in line, form) a round for its spares, which would then
        start a run of their own instead of exiting gracefully.

        torch may call it more than once for one end (2.4.1: the agent's own ``_shutdown`` and
        ``launch_agent``'s ``finally``, three calls for a failed run): the job is closed, and
        the failure reported, by the first; a later call answers what the first did.

        Raises ``SystemExit(0)`` in one case only, torch 2.13's: after this node exited
        gracefully, ``agent.run()`` returns None, ``launch_agent`` then fails on
        ``None.is_failed()`` and calls this method while that AttributeError propagates; it
        is replaced (chained) by a clean exit, which torchrun's ``@record`` turns into exit
        code 0. A torch that handles the graceful exit itself never gets here with it.
        """
        try:
            if self._shut_down is None:
                self._shut_down = self._close_and_leave()
            return self._shut_down
        finally:
            in_flight = sys.exc_info()[1]
            if self._gracefully_exited and _is_torch_none_run_result(in_flight):
                log.info("Node %s left job %s gracefully; exiting with code 0.", self._node_id, self._run_id)
                raise SystemExit(0) from in_flight

    def _close_and_leave(self) -> bool:
        """:meth:`shutdown`'s one pass: the close (with the failure report, if the workers
        failed), then the leave; False when the server could not be told."""
        self.node.stop(for_good=True)
        shutil.rmtree(self._progress_dir, ignore_errors=True)
        if self._refused:  # refused: the job is the others' (a refused node must not end it)
            log.info("Node %s was refused by job %s; it leaves the job to the others.", self._node_id, self._run_id)
            self.node.closed = True
            self._leave_quietly()  # a member cordoned mid-round leaves its place (a no-op for a new node)
            return True
        failure = find_failure_report(self._secrets)  # the run ended by its workers' failure, or None
        if failure is not None:
            log.warning("Node %s of job %s: its workers failed in round %d and it has no restart left: %s.",
                        self._node_id, self._run_id, self._round, failure.summary())
        try:
            self._sent_with_failure(
                failure,
                lambda sent: self._client.close_job(
                    self._run_id, cause="agent", node_id=self._node_id if sent is not None else "", failure=sent
                ),
            )
            self._client.leave(self._run_id, self._node_id)
            return True
        except RdzvError as exc:
            log.warning("Node %s could not leave job %s cleanly: %s", self._node_id, self._run_id, exc)
            return False
        finally:
            self.node.closed = True

    def _leave_quietly(self) -> None:
        try:
            self._client.leave(self._run_id, self._node_id)
        except RdzvError as exc:
            log.warning("Node %s could not leave job %s: %s", self._node_id, self._run_id, exc)

    @property
    def use_agent_store(self) -> bool:
        # Workers build their own TCPStore at MASTER_ADDR:MASTER_PORT (worker rank 0 hosts it).
        return False

def _token_of(conf: NodeConf) -> tuple[str, ...]:
    """The node's token (as its client found it), to mask in failure messages; none if unreadable."""
    token_file = conf.client_options.get("token_file")
    try:
        token = find_token(None, token_file)
    except CredentialError:
        return ()
    return (token,) if token else ()


# The handler's call sits a handful of frames above the agent's loop (torch's @prof wrappers
# add one per method); 64 covers that with room for a launcher of our own, and bounds the cost.
MAX_FRAMES = 64
FAILED_STATES = frozenset({WorkerState.FAILED, WorkerState.UNHEALTHY})


def find_failure_report(secrets: Collection[str] = ()) -> FailureReport | None:
    """The report of the failure that brought the agent into this call, or None when the
    agent holds no failed result (its first rendezvous, a membership change, a clean end) or
    none can be found. ``secrets`` are masked in messages (see :func:`build_report`).
    Never raises (the module's rules)."""
    try:
        result = latest_run_result(inspect.currentframe())
        if result is None or result.state not in FAILED_STATES:
            return None
        return build_report(result.failures, secrets)
    except Exception:  # a torch we have not read: the caller reports no detail
        log.debug("The agent's failures could not be read.", exc_info=True)
        return None


def latest_run_result(frame: FrameType | None) -> RunResult | None:
    """The nearest ``RunResult`` held in a local variable of ``frame`` or a frame below it
    (its callers), looking at most :data:`MAX_FRAMES` frames."""
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        for value in list(frame.f_locals.values()):
            if isinstance(value, RunResult):
                return value
        frame = frame.f_back
    return None


def exchange_master_address(node_rank: int, store: Store, addr: str, port: int) -> RendezvousStoreInfo:
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


def create_handler(params: RendezvousParameters) -> RdzvServerHandler:
    """torch's creator for the ``rdzv-server`` backend.

    nproc_per_node comes from ``--rdzv-conf nproc_per_node=K`` if given, else from the
    agent's launch config, else 1 (it only feeds the membership view's global ranks).
    Token and TLS options come from ``--rdzv-conf`` (:func:`client_options`); a token or TLS
    file that cannot be used raises ValueError naming it.
    """
    conf = NodeConf.read(params)
    nproc = conf.nproc_per_node if conf.nproc_per_node is not None else (_launch_config_nproc() or 1)
    client = shared_client(conf.endpoint, conf.close_timeout, conf.client_options)
    return RdzvServerHandler(conf, nproc, client=client)


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
