"""A torchrun node's life on the wire, torch-free: its watch and beat threads, the port it
offers, the client it speaks through.

What it owns:
- :class:`NodeLoop`: the node's two threads while a round runs. The watch thread keeps one
  long-poll open (held up to ``max_hold``): it is the fast death signal (the server sees the
  connection drop when the process dies) and the source of ``num_nodes_waiting``, which
  torch's agent reads every 0.1 s and which therefore costs nothing. The beat thread is the
  heartbeat (:meth:`Client.beat`: one-way where the server takes it, else a watch of no
  hold, answered at once), whenever nothing beat the node for a third of the TTL; it carries the workers' current step (``rdzv_client.progress``: the
  highest in the node's progress directory) as soft state for the job's steps over time.
  Both live as long as the node and idle between rounds: starting a thread waits for it to
  run, and that wait would land on the critical path of every formation.
- :class:`PortReservation`: the master port the node offers with its join, held until the
  round forms.
- :func:`node_client` and :func:`shared_client`: the node's :class:`Client`, whose watch,
  beats, joins and store calls travel pipelined on one stream connection per endpoint (one
  descriptor per node on the server), one per process.

Rules it keeps:
- Nothing ends a thread but the node's shutdown: a failed watch (an ``RdzvError``, or a
  bug) is logged and retried after ``keep_alive_interval``; a failed beat is logged and the
  next one comes when due. (A watch thread killed by one exception left its node to expire
  while its workers trained on.)
- A watch's answer counts only for the round it watched: a node that re-joins meanwhile
  drops it.
- A closed job needs no heartbeat and its watch answers at once: the loop stops watching
  it (watching on would spin) and stops beating.
- A round with nodes waiting is over for the node (its agent re-joins): the loop stops
  watching it, and beats on until the node joins (one long-poll per node and round). The
  handler joins with ``then_watch``: the server parks the node's watch of the new round as it
  answers with the assignment, and the watch thread's first watch of the round waits on that
  one (:meth:`Client.watch` adopts it) instead of sending a request. So a re-formation costs
  the server, per surviving node, the watch's answer, the join (and its await_round re-polls
  while the round forms) and the assignment: no request for the next round's watch.

What it must not know: torch (the handler in :mod:`rdzv_client.torchrun` drives this loop
and translates errors into torch's), the server's internals.
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from .client import Client
from .error import RdzvError
from .policy import BEAT_JITTER
from .progress import node_step
from .stream import PipelinedSocketTransport

log = logging.getLogger("rdzv_client")

#: The causes of a close that stop a job's workers at once (the server's decisions), and what
#: the node's log says of each.
SERVER_STOPS = {
    "restart_budget_exhausted": "spent its restart budget (max_restarts)",
    "restart_storm": "is in a crash loop (restart_storm: max_fast_failures fast failures in a row)",
}


class NodeLoop:
    """The watch and beat threads of node ``node_id`` of job ``run_id`` (see the module rules).

    :meth:`watch` starts watching a round, :meth:`stop` stops (``for_good``: the threads
    end). ``num_waiting`` and ``closed`` say what the last watch saw (``closed`` is also
    set by the node itself when it closes the job or leaves it: no beats for a closed job).
    When a beat is due is read on ``clock`` (default ``time.monotonic``; the client's seam).
    """

    def __init__(
        self,
        client: Client,
        run_id: str,
        node_id: str,
        *,
        keep_alive_interval: float,
        heartbeat_ttl: float,
        progress_dir: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._clock = clock
        self._run_id = run_id
        self._node_id = node_id
        self._keep_alive_interval = keep_alive_interval
        self._heartbeat_ttl = heartbeat_ttl
        self._progress_dir = progress_dir  # the workers' steps (rdzv_client.progress), sent with the beats
        self.num_waiting = 0
        self.closed = False
        self.policy_version = 0  # the job-policy version the last watch answer carried
        self._cv = threading.Condition()
        self._watching: tuple[int, int] | None = None  # (round, generation); None: no round, the threads wait
        self._generation = 0
        self._shut_down = False
        self._contact = 0.0  # on ``clock``: the server's last answer that beat this node
        threading.Thread(target=self._watch, name=f"rdzv-watch-{node_id}", daemon=True).start()
        threading.Thread(target=self._beat, name=f"rdzv-beat-{node_id}", daemon=True).start()

    def watch(self, round_: int) -> None:
        """Watch ``round_`` (its assignment was just answered: that was a beat)."""
        self.num_waiting = 0
        self._contact = self._clock()
        with self._cv:
            self._generation += 1
            self._watching = (round_, self._generation)
            self._cv.notify_all()

    def use_heartbeat_ttl(self, ttl: float) -> None:
        """Beat for a TTL of ``ttl`` from the next watched round on (a job policy's heartbeat_ttl)."""
        self._heartbeat_ttl = ttl

    def stop(self, *, for_good: bool = False) -> None:
        """Stop watching; ``for_good``: the threads end. The watch thread drops its current
        long-poll's answer; nothing waits for that poll to end (it ends at once when this
        node's join opens the next round)."""
        with self._cv:
            self._watching = None
            self._shut_down = self._shut_down or for_good
            self._cv.notify_all()

    # -- the watch thread ----------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            with self._cv:
                while self._watching is None and not self._shut_down:
                    self._cv.wait()
                if self._shut_down:
                    return
                assert self._watching is not None
                current = self._watching
            self._watch_round(current)

    def _watch_round(self, current: tuple[int, int]) -> None:
        """Heartbeat and long-poll ``current``'s round until the node watches another (or none)."""
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
                with self._cv:
                    self._cv.wait_for(lambda: self._watching != current, self._keep_alive_interval)
                continue
            self._contact = self._clock()  # an answered watch beat the node (it was sent before now)
            self.policy_version = max(self.policy_version, seen.policy_version)
            if self._watching != current:
                return
            if seen.num_nodes_waiting != known and seen.num_nodes_waiting > 0:
                log.info(
                    "Node %s: job %s has %d node(s) waiting (round %d, state %s): the agent will re-rendezvous.",
                    self._node_id, self._run_id, seen.num_nodes_waiting, seen.round, seen.state,
                )  # fmt: skip
            known = seen.num_nodes_waiting
            if seen.closed:
                stopped = SERVER_STOPS.get(seen.cause or "")
                if stopped is not None:
                    # The server stopped the job: the agent must stop its workers and fail, not
                    # train on until they finish. A re-rendezvous now fails with the closed error.
                    log.error("Node %s: job %s %s; stopping.", self._node_id, self._run_id, stopped)
                    known = 1
                self.num_waiting, self.closed = known, True
                # A closed job forms no other round and needs no heartbeat, and its watch answers
                # at once: watching on would spin. Its workers run to their end (or, budget
                # spent, are stopped); the next rendezvous fails with the closed error.
                with self._cv:
                    self._cv.wait_for(lambda: self._watching != current)
                return
            self.num_waiting = known
            self.closed = False
            if known > 0:
                # The round is over for this node: torch's agent re-joins on num_nodes_waiting > 0.
                # Another long-poll of it could only answer once the next round forms, which the
                # join hears first: one request more per node and re-formation, for nothing. The
                # beats keep the node alive until it joins.
                with self._cv:
                    self._cv.wait_for(lambda: self._watching != current)
                return

    # -- the beat thread -----------------------------------------------------------------

    def _beat(self) -> None:
        """The heartbeat: while a round is watched (and the job is not closed), a beat (one-way,
        or a watch of no hold where the server takes none) whenever nothing else told the
        server for a third of the TTL that this node lives (a watch sent or answered, an assignment: the
        server beats the node when a request arrives and when it answers). A parked watch is
        not a heartbeat (a hung process keeps its connection open): these are what keep the
        node alive, as the watch's own beats did when it was held a third of the TTL. Against
        a server that still holds every watch a third of the TTL, the watches beat the node
        and a beat is sent when an answer comes late (2.17 requests a second per node against
        1.5 for the plug-in before the beats, two nodes at a TTL of 2 s)."""
        while True:
            with self._cv:
                while (self._watching is None or self.closed) and not self._shut_down:
                    self._cv.wait()
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
            with self._cv:
                if self._cv.wait_for(lambda: self._watching != current or self.closed, max(0.0, due - self._clock())):
                    return
            if self._contact != seen and not first:
                continue  # a watch was sent or answered meanwhile: the next beat counts from that
            first = False
            sent = self._clock()
            try:
                step = None if self._progress_dir is None else node_step(self._progress_dir)
                answer = self._client.beat(self._run_id, self._node_id, round=current[0], step=step)
                if answer is not None:  # it went answered (a watch of no hold): its policy version counts
                    self.policy_version = max(self.policy_version, answer.policy_version)
            except Exception as exc:  # RdzvError, or a bug: never let it end the heartbeats
                log.warning(
                    "Node %s: heartbeat to job %s failed (%s).", self._node_id, self._run_id, exc,
                    exc_info=not isinstance(exc, RdzvError),
                )  # fmt: skip
            self._contact = sent


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


def node_client(endpoint: str, retry_budget: float, options: Mapping[str, Any]) -> Client:
    """A :class:`Client` whose operations all travel on one pipelined stream connection per
    endpoint (:class:`PipelinedSocketTransport`): the watch thread's long-poll, the agent's
    calls and its store share it, so the server holds one descriptor per node.

    ``options`` are :func:`rdzv_client.conf.client_options`'s. Raises ValueError
    (``CredentialError``, ``TLSConfigError``) for a token or TLS file that cannot be used,
    or TLS files without TLS.
    """
    return Client(endpoint, retry_budget=retry_budget, transport_type=PipelinedSocketTransport, **options)


# torchrun makes one handler per process: one client, so one connection, per agent.
_shared_clients: dict[tuple[str, int, tuple[tuple[str, Any], ...]], Client] = {}
_shared_lock = threading.Lock()


def shared_client(endpoint: str, retry_budget: float, options: Mapping[str, Any]) -> Client:
    """One :func:`node_client` (one pipelined connection per endpoint) per endpoint and
    client options per process.

    torchrun makes one handler per process; tools that simulate many nodes in one process
    (the bench's thread-per-node path, tests) then share that connection too.
    """
    key = (endpoint, os.getpid(), tuple(sorted(options.items())))
    with _shared_lock:
        client = _shared_clients.get(key)
        if client is None:
            client = _shared_clients[key] = node_client(endpoint, retry_budget, options)
        return client
