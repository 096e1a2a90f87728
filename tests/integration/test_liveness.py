"""Liveness with beats that need no answer (issue 29), against the real server, with the real
client's node loop in processes of their own (``tests/node_agent.py``, no torch).

What a user relies on:
- an agent that hangs (SIGSTOP: its connection stays open, its kernel still acknowledges) and
  an agent whose host vanishes (its packets dropped: no FIN, no reset) are found dead by the
  heartbeat TTL, within it, while the job's other nodes live on their beats;
- a job whose nodes run an older client (before one-way beats: it beats with watches of no
  hold) beside new ones forms and heartbeats on a new server (the hung agent's job: one check
  of a few seconds' life, not two), and on an older server too (which announces nothing in
  its hello, so the new clients beat with watches of no hold there);
- a beat the server refuses is not lost in silence: the next beat goes answered and says why.

"Within its TTL" is read on the server's own timeline: the server's clock just before the
agent was stopped (or cut off), against the time of the death event it recorded, whose cause
must be the TTL's (``heartbeat_expired``), not a dropped connection's.

The older revision is taken from the repository's own history (``git archive``), so CI (a clean
clone of main, with its history) runs it too; the vanished host needs a network namespace
(root, iproute2): a runner that cannot make one fails these tests, naming why.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_process import ServerProcess
from waiting import served, wait_until

from rdzv_client import Client, NotFoundError, wire
from rdzv_client.node import node_client

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO = TESTS_DIR.parent
AGENT = TESTS_DIR / "node_agent.py"
#: main just before one-way beats: its client beats with watches of no hold, its server's hello
#: announces nothing (the node loop it has is node_agent.py's).
OLD_REVISION = "ecea856"
#: The jobs' heartbeat TTL: nodes beat every third of it. Short, so a death comes soon; long
#: enough that a loaded 2-core runner never lets a live node's beat come that late.
TTL = 3.0
#: How long past its round's formation a node must live on its beats alone before a test
#: judges it: more than a TTL, so only beats can have kept it alive.
LIVED = 1.5 * TTL
#: What "within its TTL" allows beyond the TTL, on the server's clock: the timer's wake-up, and
#: the gap between the test's reading of the clock and its signal to the agent.
TIMER_SLACK = TTL / 3
PATIENCE = 30.0
SHARED = ("--quarantine-after", "0")  # (every agent is on this host: deaths must not cordon it)


# --------------------------------------------------------------------------- the agents


class Agent:
    """One ``node_agent.py`` process: node ``node_id`` of a job of ``nodes`` on ``endpoint``."""

    def __init__(
        self, endpoint: str, job: str, node_id: str, nodes: int, *, prefix: tuple[str, ...] = (), source: Path | None = None
    ) -> None:
        self.node_id = node_id
        env = dict(os.environ)
        if source is not None:  # an older revision's rdzv_client, ahead of the installed one
            env["PYTHONPATH"] = str(source)
        cmd = [*prefix, sys.executable, str(AGENT), endpoint, job, node_id, str(nodes), str(TTL)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    def formed(self) -> tuple[int, int]:
        """The round and node rank it printed once its round formed (its output if it died first)."""
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            lines: list[str] = []
            while sel.select(PATIENCE):
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith("formed "):
                    _, round_, rank = line.split()
                    return int(round_), int(rank)
                lines.append(line)
        raise AssertionError(f"agent {self.node_id} printed no formed round; its output:\n{''.join(lines)}")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # (a stopped process takes its SIGKILL either way)
            self.proc.kill()
        self.proc.wait(PATIENCE)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    """Agents a test starts; each is killed after it."""
    started: list[Agent] = []
    yield started
    for agent in started:
        agent.close()


def start_job(endpoint: str, agents: list[Agent], *versions: dict[str, Any]) -> tuple[str, int]:
    """A job of one agent per entry of ``versions`` (``Agent``'s keyword arguments), each named
    ``node-I``; returns the job and its formed round, once every agent holds its place."""
    job = f"live-{uuid.uuid4().hex[:10]}"
    for i, kwargs in enumerate(versions):
        agents.append(Agent(endpoint, job, f"node-{i}", len(versions), **kwargs))
    rounds = {agent.formed()[0] for agent in agents}
    assert len(rounds) == 1, f"the agents hold places in different rounds: {rounds}"
    return job, rounds.pop()


def events(client: Client, job: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in client.events(job)["events"] if e["kind"] == kind]


def live_on_beats(client: Client, job: str) -> dict[str, Any]:
    """Wait until the server's clock is :data:`LIVED` past the round's formation; the job's
    document then, which must show every node alive, none departed: beats alone kept them."""
    formed_at = max(e["time"] for e in events(client, job, "round_formed"))
    wait_until(lambda: client.events(job)["now"] >= formed_at + LIVED, timeout=PATIENCE, interval=0.2,
               what=f"the server's clock {LIVED} s past the round's formation")  # fmt: skip
    document = client.job(job)
    assert [n["status"] for n in document["nodes"]] == ["alive"] * len(document["nodes"]), document["nodes"]
    assert events(client, job, "node_departed") == []
    return document


def death_of(client: Client, job: str, node_id: str) -> dict[str, Any]:
    """The event that recorded ``node_id``'s departure, once there is one."""
    def departed() -> dict[str, Any] | None:
        return next((e for e in events(client, job, "node_departed") if e["node_id"] == node_id), None)

    found = wait_until(departed, timeout=PATIENCE, interval=0.1, what=f"{node_id}'s departure on the timeline")
    assert found is not None
    return found


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("liveness"), durable=False, args=SHARED)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.endpoint, retry_budget=PATIENCE) as c:
        yield c


# --------------------------------------------------------------------------- a vanished host


class Namespace:
    """A network namespace joined to this host by a veth pair: this side ``HOST_IP``, the
    namespace's side ``PEER_IP``. Made with iproute2; needs root (CAP_NET_ADMIN)."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.name = f"rdzv-live-{tag}"
        self.here, self.there = f"rlh{tag}", f"rlp{tag}"
        subnet = f"10.{213 + os.getpid() % 40}.{os.getpid() % 250}"
        self.host_ip, self.peer_ip = f"{subnet}.1", f"{subnet}.2"
        self._made: list[list[str]] = []
        try:
            self._run(["ip", "netns", "add", self.name], undo=["ip", "netns", "del", self.name])
            self._run(["ip", "link", "add", self.here, "type", "veth", "peer", "name", self.there],
                      undo=["ip", "link", "del", self.here])  # fmt: skip
            self._run(["ip", "link", "set", self.there, "netns", self.name])
            self._run(["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.here])
            self._run(["ip", "link", "set", self.here, "up"])
            self.inside(["ip", "addr", "add", f"{self.peer_ip}/30", "dev", self.there])
            self.inside(["ip", "link", "set", self.there, "up"])
            self.inside(["ip", "link", "set", "lo", "up"])
        except BaseException:
            self.close()
            raise

    def _run(self, cmd: list[str], undo: list[str] | None = None) -> None:
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=PATIENCE)
        except FileNotFoundError as exc:
            raise AssertionError(f"this test needs iproute2's `ip` to make a network namespace: {exc}") from exc
        if done.returncode != 0:
            raise AssertionError(
                f"this test makes a network namespace (root, iproute2) and could not: `{' '.join(cmd)}` "
                f"exited {done.returncode}: {done.stderr.strip()}"
            )
        if undo is not None:
            self._made.append(undo)

    def inside(self, cmd: list[str]) -> None:
        self._run(["ip", "netns", "exec", self.name, *cmd])

    @property
    def prefix(self) -> tuple[str, ...]:
        """What runs a command inside the namespace."""
        return ("ip", "netns", "exec", self.name)

    def close(self) -> None:
        for undo in reversed(self._made):
            subprocess.run(undo, capture_output=True, timeout=PATIENCE)
        self._made.clear()


@pytest.fixture
def namespace() -> Iterator[Namespace]:
    ns = Namespace()
    yield ns
    ns.close()


def test_an_agent_whose_packets_are_dropped_is_found_dead_by_its_ttl_within_it(
    tmp_path: Path, namespace: Namespace, agents: list[Agent]
) -> None:
    srv = ServerProcess(tmp_path, durable=False, args=SHARED, host=namespace.host_ip)
    srv.start()
    try:
        with Client(srv.endpoint, retry_budget=PATIENCE) as client:
            # node-0 on the far side of the veth pair, node-1 on this host.
            job, _ = start_job(srv.endpoint, agents, {"prefix": namespace.prefix}, {})
            live_on_beats(client, job)

            before = client.events(job)["now"]
            namespace.inside(["ip", "link", "set", namespace.there, "down"])  # its host is gone: no FIN, no reset
            death = death_of(client, job, "node-0")
            assert death["cause"] == "heartbeat_expired", death
            assert death["time"] - before <= TTL + TIMER_SLACK, (death, before)
            assert events(client, job, "node_departed") == [death]
    finally:
        srv.close()


# --------------------------------------------------------------------------- old and new mixed; a hung agent


@pytest.fixture(scope="module")
def old_tree() -> Iterator[Path]:
    """:data:`OLD_REVISION`'s server and client, from the repository's history, importable as
    ``rdzv_server`` and ``rdzv_client`` from the folder returned."""
    with tempfile.TemporaryDirectory(prefix="rdzv-old-") as folder:
        tree = Path(folder)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", OLD_REVISION, "client", "rdzv_server"], capture_output=True, timeout=PATIENCE
        )
        assert archive.returncode == 0, (
            f"the mixed-version tests take revision {OLD_REVISION} from the repository's history and could not: "
            f"{archive.stderr.decode(errors='replace').strip()} (a shallow clone lacks it: fetch the history)"
        )
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True, timeout=PATIENCE)
        (tree / "rdzv_client").symlink_to("client")
        yield tree


def test_old_and_new_clients_live_on_their_beats_on_a_new_server_and_a_hung_one_is_found_dead_within_its_ttl(
    server: ServerProcess, client: Client, agents: list[Agent], old_tree: Path
) -> None:
    beats = served(server, "beat")
    job, _ = start_job(server.endpoint, agents, {}, {}, {"source": old_tree})  # node-2 runs the old client
    live_on_beats(client, job)
    assert served(server, "beat") - beats >= 2 * 2, "the new nodes' beats did not go one-way"

    before = client.events(job)["now"]
    agents[0].proc.send_signal(signal.SIGSTOP)  # hung: its connection stays open, its watch parked
    death = death_of(client, job, "node-0")
    assert death["cause"] == "heartbeat_expired", death  # by the TTL: nothing closed
    assert death["time"] - before <= TTL + TIMER_SLACK, (death, before)
    assert events(client, job, "node_departed") == [death]  # the new and the old peer beat on


def test_an_old_and_a_new_client_form_and_heartbeat_on_an_old_server(
    tmp_path: Path, agents: list[Agent], old_tree: Path
) -> None:
    srv = ServerProcess(tmp_path, durable=False, args=SHARED, source=old_tree)
    srv.start()
    try:
        with Client(srv.endpoint, retry_budget=PATIENCE) as client:
            job, _ = start_job(srv.endpoint, agents, {"source": old_tree}, {})
            document = live_on_beats(client, job)  # the new node beat with watches: nothing else keeps it
            assert sorted(n["node_id"] for n in document["nodes"]) == ["node-0", "node-1"]
            assert served(srv, "beat") == 0  # (an old server has no such operation)
    finally:
        srv.close()


# --------------------------------------------------------------------------- a refused beat


def test_a_refused_one_way_beat_makes_the_next_beat_answered_which_says_why(server: ServerProcess) -> None:
    node = node_client(server.endpoint, PATIENCE, {})
    try:
        node.create_job("refused-beats", wire.JobSettings(min_nodes=1, max_nodes=1))  # the connection, greeted
        node.beat("no-such-job", "n", round=0)  # one-way: nothing raised, nothing waited for
        node.num_keys("refused-beats")  # answered after the beat's refusal, on the same connection
        with pytest.raises(NotFoundError, match="no-such-job"):
            node.beat("no-such-job", "n", round=0)  # answered this time
    finally:
        node.close()
