"""The torchrun handler in this process, against the real server: how long a node waits in
line, how a closed job ends each node's wait, and the master port it offers.

Waiting and closing: a standby node (torch's redundancy list) waits past join_timeout for
as long as the job runs; when the job closes it gets torch's RendezvousGracefulExitError
(its agent exits cleanly), while a member of the closed run gets RendezvousClosedError.
(test_torchrun_e2e.py runs the same with real torchrun agents, exit codes included.)

The master port: picked at join time, the round may form minutes later, and node rank 0's
worker then binds it for the workers' TCPStore. The handler holds the port with a bound,
non-listening socket until just before ``next_rendezvous()`` returns. While it waits, no
other socket can bind the port, but a TCPStore can (it sets SO_REUSEADDR, as the
reservation does). After it returns the port is free. (That node rank 0's workers really
bind it in a torchrun job is what every job of test_torchrun_e2e.py checks: their gloo
process group meets at MASTER_PORT.)
"""

from __future__ import annotations

import errno
import os
import socket
import threading
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from rdzv_client import Client, JobSettings
from rdzv_client.error import NotFoundError
from rdzv_client.conf import NodeConf
from rdzv_client.torchrun import WORKER_IDENTICAL_ENV, RdzvServerHandler, RdzvStore, exchange_master_address

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CONF = {"join_timeout": 60, "last_call_timeout": 1, "keep_alive_interval": 0.5, "keep_alive_max_attempt": 4}


class Waiting:
    """A handler's next_rendezvous() running in a thread: the node waits in line."""

    def __init__(self, handler: RdzvServerHandler) -> None:
        self.handler = handler
        self.info: RendezvousInfo | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.info = self.handler.next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            self.error = exc

    def result(self, timeout: float = 30.0) -> RendezvousInfo:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "next_rendezvous() did not return"
        if self.error is not None:
            raise self.error
        assert self.info is not None
        return self.info


def wait_until(check: Callable[[], Any], timeout: float, what: str) -> Any:
    event = threading.Event()
    for _ in range(int(timeout / 0.05)):
        value = check()
        if value:
            return value
        event.wait(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Nodes:
    """Handlers of torchrun nodes in this process over one client; all shut down and closed at the end."""

    def __init__(self, server: Any) -> None:
        self.endpoint = server.endpoint
        self.client = Client(server.endpoint)
        self.handlers: list[RdzvServerHandler] = []

    def handler(self, job: str, nnodes: int, **conf: Any) -> RdzvServerHandler:
        params = RendezvousParameters(
            "rdzv-server", self.endpoint, job, nnodes, nnodes, local_addr="127.0.0.1", **{**CONF, **conf}
        )
        self.handlers.append(RdzvServerHandler(NodeConf.read(params), 1, client=self.client))
        return self.handlers[-1]

    def close(self) -> None:
        for handler in self.handlers:
            handler.shutdown()
        self.client.close()


@pytest.fixture
def nodes(server: Any) -> Iterator[Nodes]:
    made = Nodes(server)
    try:
        yield made
    finally:
        made.close()


# -- waiting in line, and the end of the job --------------------------------------------------------


def watches_served(server: Any) -> int:
    """How many watches ``server`` answered so far (``rdzv_requests_total{op="watch"}``)."""
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    return sum(int(float(line.split()[-1])) for line in text.splitlines() if line.startswith('rdzv_requests_total{') and 'op="watch"' in line)


def test_a_member_whose_job_closes_stops_watching_while_its_workers_run_on(server: Any, nodes: Nodes) -> None:
    """The first agent to finish closes the job (torch's shutdown); the others' workers may run
    on for a while. Their watch threads must not spin on a closed job's instant answers."""
    job = f"closed-{uuid.uuid4().hex[:8]}"
    member = nodes.handler(job, 1)
    assert member.next_rendezvous().rank == 0
    nodes.client.close_job(job)
    wait_until(lambda: member.node.closed, 30, "the watch to see the job closed")
    before = watches_served(server)
    threading.Event().wait(1.0)  # a second in which nothing should be asked
    assert watches_served(server) - before <= 1
    assert member.is_closed() and member.num_nodes_waiting() == 0  # its agent trains on, then exits


def test_the_handlers_beats_keep_its_node_alive_while_its_watch_is_parked_past_the_ttl(nodes: Nodes) -> None:
    """The watch is held up to max_hold (30 s) and the TTL here is 2 s (0.5 s x 4): the beat
    thread's watches of no hold, every third of the TTL, are what keep the members alive."""
    job = f"beats-{uuid.uuid4().hex[:8]}"
    waiting = [Waiting(nodes.handler(job, 2)) for _ in range(2)]
    first = {w.result().rank for w in waiting}
    assert first == {0, 1}
    threading.Event().wait(2.5 * 2.0)  # two and a half TTLs, the watches still parked
    membership = nodes.client.job(job)
    assert [n["alive"] for n in membership["nodes"]] == [True, True], membership["nodes"]
    assert membership["round"] == 0 and all(w.handler.num_nodes_waiting() == 0 for w in waiting)


def test_torchs_worker_rank_shortcut_follows_the_round_unless_the_user_set_it(
    nodes: Nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's agent reads TORCH_ELASTIC_WORKER_IDENTICAL right after next_rendezvous(): on
    ("1") for a round whose nodes all run as many workers, off (unset) for any other round, and
    the user's own value, where they set one, untouched."""
    monkeypatch.delenv(WORKER_IDENTICAL_ENV, raising=False)
    uniform = nodes.handler(f"uniform-{uuid.uuid4().hex[:8]}", 1)
    uniform.next_rendezvous()
    assert os.environ.get(WORKER_IDENTICAL_ENV) == "1"

    job = f"mixed-{uuid.uuid4().hex[:8]}"
    mixed = Waiting(nodes.handler(job, 2))  # one worker; the other node brings two

    def joined() -> bool:
        try:
            return bool(nodes.client.job(job)["joining"])
        except NotFoundError:  # not even created yet
            return False

    wait_until(joined, 30, "the handler to join")
    settings = JobSettings(min_nodes=2, max_nodes=2, last_call_timeout=1, join_timeout=60, heartbeat_ttl=2)
    nodes.client.join(job, node_id="two-workers", addr="127.0.0.1", nproc_per_node=2, timeout=30, settings=settings)
    assert mixed.result().world_size == 2
    assert WORKER_IDENTICAL_ENV not in os.environ

    monkeypatch.setenv(WORKER_IDENTICAL_ENV, "0")
    theirs = nodes.handler(f"theirs-{uuid.uuid4().hex[:8]}", 1)
    theirs.next_rendezvous()
    assert os.environ.get(WORKER_IDENTICAL_ENV) == "0"


def test_a_standby_node_waits_past_join_timeout_and_exits_gracefully_when_the_job_closes(nodes: Nodes) -> None:
    job = f"standby-{uuid.uuid4().hex[:8]}"
    join_timeout = 1.0
    member = nodes.handler(job, 1, join_timeout=join_timeout)
    spare = nodes.handler(job, 1, join_timeout=join_timeout)
    assert member.next_rendezvous().rank == 0  # a round of one
    waiting = Waiting(spare)
    wait_until(lambda: [e["node_id"] for e in nodes.client.job(job)["standby"]] == [spare.node_id], 30, "a spare")
    threading.Event().wait(3 * join_timeout)
    assert waiting.thread.is_alive(), waiting.error  # no RendezvousTimeoutError for a spare
    doc = nodes.client.job(job)
    assert [e["node_id"] for e in doc["standby"]] == [spare.node_id] and doc["round"] == 0, doc

    # The run is done: the member closes the job and leaves. (Leaving first would hand the
    # spare a round of its own: min_nodes=1.)
    assert member.shutdown()
    with pytest.raises(RendezvousGracefulExitError, match="in line"):
        waiting.result()
    # A member of the closed run that asks for another round is told the job is closed.
    with pytest.raises(RendezvousClosedError):
        member.next_rendezvous()


def test_shutdown_after_a_graceful_exit_turns_torch_2_13s_none_run_result_into_exit_code_0(nodes: Nodes) -> None:
    """torch 2.13's agent.run() returns None after RendezvousGracefulExitError and launch_agent
    then fails on ``result.is_failed()``, calling shutdown() while that error propagates; the
    handler replaces that error (and only that one) with SystemExit(0)."""
    job = f"graceful-{uuid.uuid4().hex[:8]}"
    member, spare = nodes.handler(job, 1), nodes.handler(job, 1)
    member.next_rendezvous()
    waiting = Waiting(spare)
    # On the server's standby list, not merely a port picked: a join that reached the server
    # after the close would be refused as closed, not ended gracefully.
    wait_until(lambda: [e["node_id"] for e in nodes.client.job(job)["standby"]] == [spare.node_id], 30, "a spare")
    member.shutdown()
    with pytest.raises(RendezvousGracefulExitError):
        waiting.result()
    with pytest.raises(ValueError):  # any other error in flight goes on untouched
        try:
            raise ValueError("not torch's None run result")
        finally:
            spare.shutdown()
    result: Any = None  # what agent.run() returned
    with pytest.raises(SystemExit) as exited:
        try:
            result.is_failed()
        finally:
            spare.shutdown()
    assert exited.value.code == 0
    assert isinstance(exited.value.__cause__, AttributeError)
    assert spare.shutdown() is True  # nothing in flight: a plain shutdown


# -- the master port ----------------------------------------------------------------------------------


@pytest.fixture
def in_line(nodes: Nodes) -> tuple[Waiting, Client, str]:
    """Node rank 0-to-be waiting in line for a second node (nnodes=2), the offered port known."""
    job = f"port-{uuid.uuid4().hex[:8]}"
    handler = nodes.handler(job, 2)
    waiting = Waiting(handler)
    wait_until(lambda: handler.offered_port is not None and joining(nodes.client, job), 30, "the first join")
    return waiting, nodes.client, job


def joining(client: Client, job: str) -> list[Any]:
    """The nodes in line for ``job``'s next round; none while the first join has not reached the server
    (the handler picks its port before it sends the join)."""
    try:
        return list(client.job(job)["joining"])
    except NotFoundError:
        return []


def join_second_node(client: Client, job: str) -> None:
    client.join(
        job, node_id="second", addr="127.0.0.1", nproc_per_node=1,
        settings=JobSettings(min_nodes=2, max_nodes=2, last_call_timeout=1.0, join_timeout=60.0, heartbeat_ttl=2.0),
        timeout=30.0,
    )


def plain_listen(port: int, host: str = "0.0.0.0") -> None:
    """Bind and listen on ``port`` the way an unrelated program would (no SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, port))
        s.listen()


def test_no_other_socket_can_take_the_offered_port_while_the_node_waits_in_line(
    in_line: tuple[Waiting, Client, str],
) -> None:
    waiting, client, job = in_line
    port = waiting.handler.offered_port
    assert port is not None
    for host in ("0.0.0.0", "127.0.0.1"):
        with pytest.raises(OSError) as taken:
            plain_listen(port, host)
        assert taken.value.errno == errno.EADDRINUSE, taken.value
    assert waiting.thread.is_alive()  # still in line: the round needs a second node

    join_second_node(client, job)
    info = waiting.result()
    assert (info.rank, info.world_size) == (0, 2)
    assert info.bootstrap_store_info is not None
    assert info.bootstrap_store_info.master_port == port  # node rank 0's offer is the master port
    assert waiting.handler.offered_port is None
    plain_listen(port)  # released as next_rendezvous() returned: node rank 0's worker binds it next


def test_a_workers_tcpstore_binds_the_offered_port_even_while_it_is_reserved(
    in_line: tuple[Waiting, Client, str],
) -> None:
    waiting, client, job = in_line
    port = waiting.handler.offered_port
    assert port is not None
    # What worker rank 0 does with MASTER_PORT (init_process_group(init_method="env://")).
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=10))
    store.set("key", "value")
    assert store.get("key") == b"value"
    assert waiting.handler.offered_port == port  # the reservation still holds it
    join_second_node(client, job)
    info = waiting.result()
    assert info.bootstrap_store_info is not None and info.bootstrap_store_info.master_port == port
    assert store.get("key") == b"value"
    del store


def test_without_an_offered_port_the_master_address_goes_through_the_rounds_store_under_torchs_keys(
    nodes: Nodes,
) -> None:
    """Node rank 0 of an older client offers no port: the others read MASTER_ADDR / MASTER_PORT
    from the round's store, where torch's ``RendezvousStoreInfo.build`` writes them; a node rank 0
    of ours that must publish them (a server that hands out no port) writes its own addr and
    offered port under the same keys. No call of ``build``, whose signature differs on torch 2.4."""
    job = f"noport-{uuid.uuid4().hex[:8]}"
    joined: list[Any] = []
    older = threading.Thread(target=lambda: joined.append(nodes.client.join(
        job, node_id="older-node", addr="127.0.0.1", nproc_per_node=1,
        settings=JobSettings(min_nodes=2, max_nodes=2, last_call_timeout=1.0, join_timeout=60.0, heartbeat_ttl=2.0),
        timeout=30.0,
    )), daemon=True)
    older.start()
    wait_until(lambda: joining(nodes.client, job), 30, "the older node's join")
    waiting = Waiting(nodes.handler(job, 2))
    older.join(30)
    assert joined and (joined[0].node_rank, joined[0].master_port) == (0, 0)
    store = RdzvStore(nodes.client, job, round=joined[0].round)
    store.set("MASTER_ADDR", "127.0.0.1")  # what torch's build does on node rank 0
    store.set("MASTER_PORT", "29555")
    info = waiting.result()
    assert info.rank == 1
    assert info.bootstrap_store_info is not None
    assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == ("127.0.0.1", 29555)

    publishing = RdzvStore(nodes.client, job, round=joined[0].round + 1000)
    assert exchange_master_address(0, publishing, "127.0.0.1", 29556) == RendezvousStoreInfo("127.0.0.1", 29556)
    assert publishing.get("MASTER_ADDR") == b"127.0.0.1" and publishing.get("MASTER_PORT") == b"29556"
    assert exchange_master_address(1, publishing, "elsewhere", 1) == RendezvousStoreInfo("127.0.0.1", 29556)


class FailingOnce:
    """The node's client, except that its first watch raises what no client code expects."""

    def __init__(self, client: Client) -> None:
        self._client = client
        self.failed = threading.Event()

    def watch(self, *args: Any, **kwargs: Any) -> Any:
        if not self.failed.is_set():
            self.failed.set()
            raise RuntimeError("an unexpected failure inside the client")
        return self._client.watch(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def test_an_unexpected_failure_of_one_heartbeat_does_not_end_the_nodes_heartbeats(server: Any, nodes: Nodes) -> None:
    """A watch thread that died of one exception would leave its node to expire while its
    workers train on (a real run lost a node this way after a replica fail-over)."""
    job = f"beats-on-{uuid.uuid4().hex[:8]}"
    params = RendezvousParameters("rdzv-server", nodes.endpoint, job, 1, 1, local_addr="127.0.0.1", **CONF)
    client = FailingOnce(nodes.client)
    handler = RdzvServerHandler(NodeConf.read(params), 1, client=client)  # type: ignore[arg-type]  # duck-typed
    nodes.handlers.append(handler)
    assert handler.next_rendezvous().rank == 0
    assert client.failed.wait(30)
    ttl = CONF["keep_alive_interval"] * CONF["keep_alive_max_attempt"]
    threading.Event().wait(ttl * 1.5)  # past the TTL: alive only if it beat after the failure
    doc = nodes.client.job(job)
    (node,) = doc["nodes"]
    assert node["alive"], doc
    assert node["last_heartbeat_age_s"] is not None and node["last_heartbeat_age_s"] < ttl, doc
