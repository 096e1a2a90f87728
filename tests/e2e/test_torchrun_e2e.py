"""Real torchrun agents (``--rdzv-backend=rdzv-server``) and gloo workers against the real
server on 127.0.0.1: formation (one connection per node, rdzvctl on the running job, and
torch's own exit barrier at the end), node failure (and the events, rdzvctl and the job page
that tell it), heterogeneous nodes, a node that dies as its round forms, a server restart
mid-job and a scale-up after it, a spare node that outlives join_timeout, and a job over TLS
whose tokens come from a file or the environment. A worker's failure and the re-formed round
after it are tests/e2e/test_job_fate.py's.

Each "node" is a torchrun process group of its own (see conftest.py). Every wait is
bounded. Workers run train.py: long rounds are made long with STEPS/STEP_SLEEP, and the
final round is made short with STEPS_WHEN_WORLD_SIZE (membership-change restarts keep
TORCHELASTIC_RESTART_COUNT at 0, so the world size is what identifies a round).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil
import pytest
from rdzv_client import Client, JobSettings
from integration.test_client_pipeline import stream_connections
from torch_feature import NO_WORKER_RANK_SHORTCUT, WORKER_RANK_SHORTCUT
from waiting import wait_until

# The fixtures' classes (conftest.py); annotations only.
Cluster = Any
Node = Any

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

# A long round: ~20 s of steps unless the agents restart the workers.
LONG = {"STEPS": "400", "STEP_SLEEP": "0.05"}
# Elastic tests allow restarts: when one agent stops its workers for a membership change,
# the other nodes' workers can see their all_reduce fail before their agent sees the
# change (a race in torch's monitor loop, whatever the backend); with --max-restarts=0
# that agent would give up and close the job.
ELASTIC_RESTARTS = 3


def complete_with(n: int, after_round: int | None = None) -> Any:
    def pred(doc: dict[str, Any]) -> bool:
        return (
            doc["state"] == "complete"
            and doc["num_nodes"] == n
            and (after_round is None or doc["round"] > after_round)
        )

    return pred


def node_of(cluster: Cluster, entry: dict[str, Any]) -> Node:
    """The test's Node behind a membership entry (its node_id holds the agent's pid)."""
    return cluster.node_of(entry)


def worker_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def check_records(records: list[dict[str, Any]], world: int, run_id: str) -> None:
    """Every final record of one round: right sum, one record per rank 0..world-1, same master."""
    assert sorted(int(r["RANK"]) for r in records) == list(range(world)), records
    for r in records:
        assert int(r["WORLD_SIZE"]) == world, r
        assert r["all_reduce"] == r["expected"] == world * (world + 1) / 2, r
        assert r["TORCHELASTIC_RUN_ID"] == run_id, r
        assert r["TORCHELASTIC_USE_AGENT_STORE"] == "False", r
        assert r["MASTER_ADDR"] == "127.0.0.1", r
    assert len({r["MASTER_PORT"] for r in records}) == 1, records


def check_membership_matches(cluster: Cluster, doc: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """The server's node_rank / global_ranks per node equal what that node's workers saw."""
    by_node: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_node[r["node"]].append(r)
    assert [e["node_rank"] for e in doc["nodes"]] == list(range(doc["num_nodes"])), doc
    assert sum(e["nproc_per_node"] for e in doc["nodes"]) == doc["world_size"], doc
    assert len(doc["nodes"]) == len(by_node), (doc, sorted(by_node))
    expected_start = 0
    for entry in doc["nodes"]:
        node = node_of(cluster, entry)
        mine = by_node[node.name]
        assert {int(r["GROUP_RANK"]) for r in mine} == {entry["node_rank"]}, (entry, mine)
        ranks = sorted(int(r["RANK"]) for r in mine)
        assert ranks == entry["global_ranks"], (entry, mine)
        # prefix sums in node_rank order, contiguous per node
        assert ranks == list(range(expected_start, expected_start + entry["nproc_per_node"])), (entry, ranks)
        expected_start += entry["nproc_per_node"]
        for r in mine:
            assert int(r["LOCAL_WORLD_SIZE"]) == entry["nproc_per_node"], r
            assert int(r["RANK"]) == entry["global_ranks"][0] + int(r["LOCAL_RANK"]), r
            assert int(r["GROUP_WORLD_SIZE"]) == doc["num_nodes"], r
        assert entry["addr"] == "127.0.0.1", entry


def test_three_nodes(server: Any, cluster: Cluster, tmp_path: Path) -> None:
    job = "three-nodes"
    seen = tmp_path / "seen-running"  # the workers step (at most 60 s) until the test has looked
    env = {"STEPS": "600", "STEP_SLEEP": "0.1", "RUN_UNTIL": str(seen)}
    for i in range(3):
        cluster.start(f"n{i}", server, job, nnodes="3", nproc=2, env=env)

    formed = cluster.wait_job(server, job, complete_with(3), 90, "the round of 3 nodes")
    cluster.wait_started(world=6, count=6)
    # Each node holds one connection to the server: its watch, beats, joins and store calls share
    # one pipelined stream, so the server spends one descriptor per node.
    check_one_connection_per_node(server, cluster)
    running = cluster.job(server, job)  # while the workers run
    assert running is not None
    assert running["state"] == "complete" and running["round"] == formed["round"], running
    assert running["num_nodes"] == 3 and running["world_size"] == 6, running
    assert running["min_nodes"] == running["max_nodes"] == 3, running
    assert [e["node_id"] for e in running["nodes"]] == [e["node_id"] for e in formed["nodes"]]
    assert not running["waiting"] and not running["standby"], running
    for entry in running["nodes"]:
        assert entry["alive"] is True, entry
        assert entry["nproc_per_node"] == 2, entry
        assert entry["last_heartbeat_age_s"] is not None and entry["last_heartbeat_age_s"] < 2.0, entry
    assert {node_of(cluster, e).name for e in running["nodes"]} == {"n0", "n1", "n2"}
    check_rdzvctl_on_a_running_job(server, job, running)
    seen.touch()

    codes = cluster.wait_all(90)
    assert codes == {"n0": 0, "n1": 0, "n2": 0}

    records = cluster.results()
    check_records(records, 6, job)
    for r in records:
        assert int(r["RANK"]) == int(r["GROUP_RANK"]) * 2 + int(r["LOCAL_RANK"]), r
        assert int(r["LOCAL_WORLD_SIZE"]) == 2 and int(r["GROUP_WORLD_SIZE"]) == 3, r
        assert r["TORCHELASTIC_RESTART_COUNT"] == "0", r
    check_membership_matches(cluster, running, records)
    after = cluster.job(server, job)
    assert after is not None and after["state"] == "closed", after  # the agents close the job when done
    # Every node finished normally: torch's own exit barrier (through our store) let them go, and
    # the server released no barrier early (issue 27's mixed finish is for failures only).
    with Client(server.endpoint, token=server.token) as client:
        timeline = client.events(job)["events"]
    assert not [e for e in timeline if e["kind"] == "exit_barrier_released"], timeline
    assert [e["cause"] for e in timeline if e["kind"] == "job_closed"] == ["agent"], timeline
    # Uniform nodes: the agents took torch's shortcut to their worker ranks, with no exchange.
    traded = [f"torchelastic/role_info/{i}".encode() for i in range(3)]
    assert role_infos(server, job, formed["round"]) == ([] if WORKER_RANK_SHORTCUT else traded)


def agent_connections(pid: int, port: int) -> int:
    """TCP connections from the agent process ``pid`` to the server's ``port``."""
    return sum(
        1
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def check_one_connection_per_node(server: Any, cluster: Cluster) -> None:
    """While the round runs (each agent's watch parked, its joins and store calls done), each
    agent holds exactly one connection to the server, and the server one stream per node."""
    nodes = cluster.nodes
    seen = cluster.wait_for(
        lambda: (counts := [agent_connections(n.pid, server.port) for n in nodes]) == [1] * len(nodes) and counts or None,
        30,
        "each agent to hold exactly one connection to the server",
        details=lambda: f"connections per agent: {[agent_connections(n.pid, server.port) for n in nodes]}",
    )
    assert seen == [1] * len(nodes)
    assert stream_connections(server) == len(nodes)


def role_infos(server: Any, job: str, round_: int) -> list[bytes]:
    """The records of torch's worker-rank exchange in a round's key space."""
    with Client(server.endpoint) as client:
        return sorted(client.list_keys(job, b"torchelastic/role_info/", round=round_))


def test_node_failure(server: Any, cluster: Cluster, tmp_path: Path) -> None:
    job = "node-failure"
    nproc = 1
    env = {**LONG, "STEPS_WHEN_WORLD_SIZE": f"{2 * nproc}:3"}
    start = {"nnodes": "2:3", "nproc": nproc, "env": env, "max_restarts": ELASTIC_RESTARTS,
                 "conf": {"last_call_timeout": "0.5"}}
    for name in ("a", "b", "c"):
        cluster.start(name, server, job, **start)
    formed = cluster.wait_job(server, job, complete_with(3), 90, "the round of 3 nodes")
    cluster.wait_started(world=3 * nproc, count=3 * nproc)

    rank0 = formed["nodes"][0]
    assert rank0["node_rank"] == 0
    victim = node_of(cluster, rank0)
    survivors = [n for n in cluster.nodes if n is not victim]

    victim.kill()
    killed = victim.killed_at
    assert killed is not None and victim.returncode == -9
    # The whole node is gone, workers included (torch gives each worker a session of its own).
    # SIGKILL is delivered asynchronously: allow the kernel a moment.
    worker_pids = [int(r["pid"]) for r in victim.started()]
    cluster.wait_for(
        lambda: True if not any(worker_alive(p) for p in worker_pids) else None, 5,
        f"the killed node's workers {worker_pids} to die",
    )
    # Watch the server every 50 ms: when does it notice, when is the job whole again?
    marked_dead = round_advanced = reformed = None
    last = None
    deadline = killed + 60
    while time.monotonic() < deadline:
        doc = cluster.job(server, job)
        now = time.monotonic()
        if doc is not None:
            last = doc
            entry = next((e for e in doc["nodes"] + doc["joining"] if e["node_id"] == rank0["node_id"]), None)
            if marked_dead is None and entry is not None and entry["alive"] is False:
                marked_dead = now - killed
            if round_advanced is None and doc["round"] > formed["round"]:
                round_advanced = now - killed
            if complete_with(2, formed["round"])(doc):
                reformed = now - killed
                break
        assert all(n.running() for n in survivors), f"a survivor exited: {survivors}"
        time.sleep(0.05)
    assert reformed is not None, f"no round of 2 within 60 s of the kill; last document: {last}"
    detected = min(t for t in (marked_dead, round_advanced) if t is not None)
    assert last is not None and last["world_size"] == 2 * nproc, last
    assert {node_of(cluster, e).name for e in last["nodes"]} == {n.name for n in survivors}, last
    assert rank0["node_id"] not in [e["node_id"] for e in last["nodes"]], last

    # What made the survivors restart: a worker failure (gloo saw its peer die) or the server's
    # num_nodes_waiting (dead member) — torch logs one or the other.
    causes = {
        n.name: ("membership" if "new nodes from group_rank" in n.log_text() else "worker failure")
        for n in survivors
    }
    timings = {
        "detection_s": round(detected, 3),
        "marked_dead_s": None if marked_dead is None else round(marked_dead, 3),
        "round_advanced_s": None if round_advanced is None else round(round_advanced, 3),
        "reformation_s": round(reformed, 3),
        "restart_cause": causes,
        "last_call_timeout_s": 0.5,
    }
    out = tmp_path / "failure_timings.json"
    out.write_text(json.dumps(timings, indent=2))
    print(f"\n[node failure] kill->detection {detected:.3f} s (marked dead {marked_dead}, round advanced "
          f"{round_advanced}), kill->re-formation {reformed:.3f} s; restart cause {causes}; written to {out}")
    assert reformed < 30, timings
    assert_the_death_story(server, cluster, job, formed, rank0, tmp_path)

    codes = cluster.wait_all(90, survivors)
    assert all(rc == 0 for rc in codes.values()), codes
    finals = [r for r in cluster.results() if int(r["WORLD_SIZE"]) == 2 * nproc]
    check_records(finals, 2 * nproc, job)
    check_membership_matches(cluster, last, finals)
    assert not victim.results()


def test_heterogeneous_nproc(server: Any, cluster: Cluster) -> None:
    job = "hetero"
    env = {"STEPS": "20", "STEP_SLEEP": "0.1"}
    cluster.start("two", server, job, nnodes="2", nproc=2, env=env)
    cluster.start("one", server, job, nnodes="2", nproc=1, env=env)
    formed = cluster.wait_job(server, job, complete_with(2), 90, "the round of 2 nodes")
    assert formed["world_size"] == 3, formed
    assert sorted(e["nproc_per_node"] for e in formed["nodes"]) == [1, 2], formed

    codes = cluster.wait_all(90)
    assert codes == {"two": 0, "one": 0}, codes
    records = cluster.results()
    check_records(records, 3, job)
    check_membership_matches(cluster, formed, records)
    for entry in formed["nodes"]:
        assert len(entry["global_ranks"]) == entry["nproc_per_node"], entry
        assert node_of(cluster, entry).name == ("two" if entry["nproc_per_node"] == 2 else "one")
    # Nodes of different sizes: torch's own exchange placed the workers (its shortcut would not).
    assert role_infos(server, job, formed["round"]) == [b"torchelastic/role_info/0", b"torchelastic/role_info/1"]


def test_a_node_that_dies_as_its_round_forms_holds_up_no_one(server: Any, cluster: Cluster) -> None:
    """A member that dies between its round forming and its workers starting never takes part
    in torch's worker-rank exchange. Here it is a client that joins, gets its place and goes
    silent. In a round of uniform nodes the survivor's agent does no exchange: it goes straight to
    its workers and its watch, and re-forms without the dead node in seconds, instead of waiting
    for the dead node's record until store_timeout (300 s)."""
    if not WORKER_RANK_SHORTCUT:
        pytest.skip(NO_WORKER_RANK_SHORTCUT)
    job = "dies-as-it-forms"
    # The ghost joins within the steady node's last call, so they form a round of two (should it
    # miss it, the steady node restarts for it, and the round of two is the next one).
    steady = cluster.start("steady", server, job, nnodes="1:2", nproc=1, max_restarts=ELASTIC_RESTARTS,
                           conf={"last_call_timeout": "3"}, env={**LONG, "STEPS_WHEN_WORLD_SIZE": "1:3"})
    cluster.wait_job(server, job, lambda d: len(d["joining"]) == 1, 60, "the steady node to join")
    with Client(server.endpoint) as ghost:
        place = ghost.join(
            job, node_id="ghost", addr="127.0.0.2", nproc_per_node=1,
            settings=JobSettings(min_nodes=1, max_nodes=2, last_call_timeout=3, join_timeout=60, heartbeat_ttl=2),
            master_port=1, timeout=30,
        )
    assert (place.num_nodes, place.uniform_nproc) == (2, True), place

    assert cluster.wait_all(60) == {"steady": 0}
    # Its agent started the workers of the round of two and restarted them for the dead member
    # (what torch logs when the handler reports it), then finished in a round of its own.
    assert "new nodes from group_rank" in steady.log_text(), steady.log_tail()
    check_records(steady.results(), 1, job)


def test_server_restart_mid_job_and_a_scale_up_after_it(durable_server: Any, cluster: Cluster) -> None:
    server = durable_server
    job = "server-restart"
    env = {**LONG, "STEPS": "600", "STEPS_WHEN_WORLD_SIZE": "3:3"}  # ~30 s: room for the restart and a late node
    start = {"nnodes": "2:3", "nproc": 1, "env": env, "max_restarts": ELASTIC_RESTARTS}
    a = cluster.start("a", server, job, **start)
    b = cluster.start("b", server, job, **start)
    formed = cluster.wait_job(server, job, complete_with(2), 90, "the round of 2 nodes")
    cluster.wait_started(world=2, count=2)

    def steps() -> int:
        return sum(hb["step"] for n in (a, b) for hb in n.heartbeats().values() if hb["world"] == 2)

    before = steps()
    server.kill()
    # The server is down; training is not affected: the workers make progress meanwhile.
    wait_until(lambda: steps() > before, timeout=30, what="the workers' progress while the server is down")
    assert a.running() and b.running()
    t0 = time.monotonic()
    server.restart()
    restart_s = time.monotonic() - t0
    during = steps()

    # Recovery resets every heartbeat to "now" (one TTL of grace). Past that TTL (0.5 s x 4),
    # a node is still alive only if its agent's watch reconnected and beat since: same round,
    # both alive, fresh heartbeats, and nobody restarted its workers.
    time.sleep(3.0)
    steady = cluster.job(server, job)
    assert steady is not None, "the restarted server does not know the job"
    assert steady["round"] == formed["round"] and steady["state"] == "complete", steady
    assert steady["num_nodes"] == 2 and [e["node_id"] for e in steady["nodes"]] == [
        e["node_id"] for e in formed["nodes"]
    ], steady
    for entry in steady["nodes"]:
        assert entry["alive"] is True, steady
        assert entry["last_heartbeat_age_s"] is not None and entry["last_heartbeat_age_s"] < 1.5, steady
    assert a.running() and b.running()
    assert steps() > during, "training stopped making progress after the server restart"
    assert len(cluster.started()) == 2, "workers were restarted after the server restart"

    # Scale-up through the restarted server: a third node joins. It waits for the next round; the
    # running agents are told so and restart their workers for it.
    cluster.start("c", server, job, **start)
    cluster.wait_job(
        server, job, lambda d: d["round"] > formed["round"] or d["num_nodes_waiting"] > 0, 60,
        "the third node to be waiting",
    )
    bigger = cluster.wait_job(server, job, complete_with(3, formed["round"]), 60, "the round of 3 nodes")
    assert bigger["world_size"] == 3, bigger
    # Rank stability: a and b keep their relative order, the newcomer comes last.
    old_order = [node_of(cluster, e).name for e in formed["nodes"]]
    assert [node_of(cluster, e).name for e in bigger["nodes"]] == old_order + ["c"], (formed, bigger)
    codes = cluster.wait_all(90)
    assert codes == {"a": 0, "b": 0, "c": 0}, codes
    # The running agents restarted for the newcomer (torch logs it at INFO).
    assert any("new nodes from group_rank" in n.log_text() for n in (a, b)), "no agent saw the waiting node"
    finals = [r for r in cluster.results() if int(r["WORLD_SIZE"]) == 3]
    check_records(finals, 3, job)
    check_membership_matches(cluster, bigger, finals)
    # Nobody finished in the round of 2: those workers were restarted, not completed.
    assert all(int(r["WORLD_SIZE"]) == 3 for r in cluster.results()), cluster.results()
    assert len([r for r in cluster.started() if int(r["WORLD_SIZE"]) == 2]) == 2
    print(f"\n[server restart] server back in {restart_s:.2f} s; round {formed['round']} kept; "
          f"round {bigger['round']} formed with 3 nodes")


def rdzvctl(endpoint: str, *args: str) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("rdzvctl")
    argv = [exe] if exe else [sys.executable, "-m", "rdzv_client.ctl"]
    return subprocess.run(
        [*argv, "--endpoint", endpoint, *args], capture_output=True, text=True, timeout=30, check=False
    )


def check_rdzvctl_on_a_running_job(server: Any, job: str, formed: dict[str, Any]) -> None:
    """``rdzvctl show``, ``jobs`` and their ``--json`` on a formed job of nodes of 2 workers each."""
    n = formed["num_nodes"]
    show = rdzvctl(server.endpoint, "show", job)
    assert show.returncode == 0, show.stderr
    lines = show.stdout.splitlines()
    world = f"world_size {2 * n}"
    assert lines[0].startswith(f"job {job}") and "state complete" in lines[0] and world in lines[0], lines
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["NODE_RANK"])
    assert lines[head].split() == ["NODE_RANK", "NODE_ID", "ADDR", "NPROC", "RANKS", "ALIVE", "HEARTBEAT"], lines
    rows = [line.split() for line in lines[head + 1 : head + 1 + n]]
    assert [r[0] for r in rows] == [str(i) for i in range(n)], lines
    assert [r[1] for r in rows] == [e["node_id"] for e in formed["nodes"]], lines
    assert [r[2] for r in rows] == ["127.0.0.1"] * n, lines
    assert [r[3] for r in rows] == ["2"] * n, lines
    assert [r[4] for r in rows] == [f"{2 * i}-{2 * i + 1}" for i in range(n)], lines
    assert [r[5] for r in rows] == ["yes"] * n, lines

    jobs = rdzvctl(server.endpoint, "jobs")
    assert jobs.returncode == 0, jobs.stderr
    row = next(line.split() for line in jobs.stdout.splitlines() if line.split()[:1] == [job])
    assert row[1:] == ["complete", str(formed["round"]), str(n), str(2 * n)], jobs.stdout

    as_json = rdzvctl(server.endpoint, "--json", "show", job)
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["rdzv_id"] == job and doc["num_nodes"] == n and doc["world_size"] == 2 * n, doc
    assert [e["global_ranks"] for e in doc["nodes"]] == [[2 * i, 2 * i + 1] for i in range(n)], doc
    listed = json.loads(rdzvctl(server.endpoint, "--json", "jobs").stdout)
    assert any(j["rdzv_id"] == job and j["num_nodes"] == n for j in listed["jobs"]), listed


def test_a_spare_node_waits_past_join_timeout_and_exits_cleanly_when_the_job_ends(
    server: Any, cluster: Cluster
) -> None:
    """Three agents of ``--nnodes=2``: the third is standby (torch's redundancy list). It waits
    as long as the job runs, well past join_timeout, and when the other two finish and close
    the job it leaves with RendezvousGracefulExitError: all three exit 0."""
    job = "spare"
    join_timeout = 6.0
    env = {"STEPS": "150", "STEP_SLEEP": "0.1"}  # a ~15 s run
    start = {"nnodes": "2", "nproc": 1, "env": env, "conf": {"join_timeout": f"{join_timeout:g}"}}
    for name in ("a", "b", "s"):  # the same command three times; whoever comes third is the spare
        cluster.start(name, server, job, **start)

    doc = cluster.wait_job(
        server, job, lambda d: complete_with(2)(d) and len(d["standby"]) == 1, 90, "a round of 2 and a spare"
    )
    spare_id = doc["standby"][0]["node_id"]
    spare = node_of(cluster, doc["standby"][0])
    seen = time.monotonic()
    members = [n for n in cluster.nodes if n is not spare]
    cluster.wait_started(world=2, count=2)

    # Past join_timeout (counted from when the spare was first seen in line, so at least that
    # long after its join) the spare still waits while the round runs.
    cluster.wait_for(
        lambda: True if time.monotonic() >= seen + join_timeout + 2 else None, 30, "join_timeout to pass"
    )
    doc = cluster.job(server, job)
    assert doc is not None and doc["round"] == 0 and doc["state"] == "complete", doc
    assert [e["node_id"] for e in doc["standby"]] == [spare_id], doc
    assert spare.running() and all(n.running() for n in members), cluster.nodes
    assert len(cluster.results()) == 0, "the run ended before join_timeout passed: make it longer"

    codes = cluster.wait_all(90)
    assert codes == {"a": 0, "b": 0, "s": 0}, codes
    records = cluster.results()
    check_records(records, 2, job)
    assert {r["node"] for r in records} == {n.name for n in members}
    assert not spare.started(), "the spare never ran workers"
    log = spare.log_text()
    assert "Rendezvous gracefully exited" in log, log[-3000:]  # torch's agent followed the graceful path
    assert "RendezvousTimeoutError" not in log and "Traceback" not in log, log[-3000:]
    after = cluster.job(server, job)
    assert after is not None and after["state"] == "closed" and not after["standby"], after


def test_a_job_over_tls_with_the_token_from_a_file_or_the_environment(
    tls_server: Any, cluster: Cluster, tmp_path: Path
) -> None:
    """Two agents reach a TLS server, one by an ``https://`` endpoint and one by
    ``--rdzv-conf tls=1``, trusting the test's CA (``ca_file``). Neither finds the default token
    file (their XDG_CONFIG_HOME is elsewhere): the first reads ``--rdzv-conf token_file``, the
    second ``RDZV_TOKEN`` from its environment."""
    job = "over-tls"
    token_file = tmp_path / "token"
    token_file.write_text(tls_server.token)
    hidden = {"XDG_CONFIG_HOME": str(tmp_path / "no-config")}
    ca = {"ca_file": str(tls_server.tls.ca)}
    start = {"nnodes": "2", "nproc": 1}
    cluster.start("a", tls_server, job, conf={**ca, "token_file": str(token_file)}, endpoint=tls_server.url,
                  env={"STEPS": "3", **hidden}, **start)  # fmt: skip
    cluster.start("b", tls_server, job, conf={**ca, "tls": "1"},
                  env={"STEPS": "3", **hidden, "RDZV_TOKEN": tls_server.token}, **start)  # fmt: skip
    codes = cluster.wait_all(90)
    assert codes == {"a": 0, "b": 0}, codes
    check_records(cluster.results(), 2, job)
    doc = cluster.job(tls_server, job)
    assert doc is not None and doc["state"] == "closed", doc


DOCS = Path(__file__).resolve().parents[2] / "docs"
# How a killed node's death shows: its dropped watch, its silent heartbeat, or (when the
# survivors re-form before either) the next round forming without it.
DEATH_CAUSES = ("connection_closed", "heartbeat_expired", "not_rejoined")


def assert_the_death_story(
    server: Any, cluster: Cluster, job: str, formed: dict[str, Any], victim_entry: dict[str, Any], tmp_path: Path
) -> None:
    """After one of three nodes (``--nnodes=2:3``) was SIGKILLed and the two survivors re-formed,
    the job's events name the death with its cause and the next round with its reason and
    formation time, through the API, ``rdzvctl events`` and the job page.
    ``UPDATE_DOCS_SCREENSHOT=1`` also keeps the page's screenshot as docs/job-page.png."""
    # (a) the API: the death, then the survivors' round.
    def story(events: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]] | None:
        death = next(
            (e for e in events if e["kind"] == "node_departed" and e["node_id"] == victim_entry["node_id"]), None
        )
        reformed = next(
            (e for e in events if e["kind"] == "round_formed" and e["round"] > formed["round"] and e["num_nodes"] == 2),
            None,
        )
        return None if death is None or reformed is None else (death, reformed)

    with Client(server.endpoint, token=server.token) as client:
        found = cluster.wait_for(
            lambda: story(client.events(job)["events"]), 30, "the death and the next round in the events"
        )
        page = client.events(job)
    death, reformed = found
    assert death["cause"] in DEATH_CAUSES, death
    assert death["addr"] == "127.0.0.1" and death["role"] == "member", death
    # While the old round ran, or while the survivors' next round was open (they re-joined first).
    assert formed["round"] <= death["round"] <= reformed["round"], death
    assert reformed["cause"] in ("members_back", "last_call", "max_nodes"), reformed
    assert isinstance(reformed["formation_s"], float) and 0 <= reformed["formation_s"] < 60, reformed
    assert reformed["world_size"] == 2, reformed
    first = next(e for e in page["events"] if e["kind"] == "round_formed" and e["round"] == formed["round"])
    assert first["num_nodes"] == 3 and first["formation_s"] >= 0, first
    assert death["seq"] > first["seq"] and reformed["seq"] > first["seq"], page["events"]
    rejoined = {e["node_id"] for e in page["events"] if e["kind"] == "node_joined" and e["round"] == reformed["round"]}
    assert victim_entry["node_id"] not in rejoined and len(rejoined) == 2, page["events"]

    # (b) rdzvctl events JOB: the same story as a table.
    shown = rdzvctl(server.endpoint, "events", job)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].split() == ["SEQ", "TIME", "ROUND", "EVENT", "CAUSE", "NODE", "ADDR", "DETAIL"], lines
    rows = {line.split()[0]: line.split() for line in lines[1:] if line.split()}
    assert rows[str(death["seq"])][2:7] == [
        str(death["round"]), "node_departed", death["cause"], victim_entry["node_id"], "127.0.0.1"
    ], lines  # fmt: skip
    formed_row = rows[str(reformed["seq"])]
    assert formed_row[2:5] == [str(reformed["round"]), "round_formed", reformed["cause"]], lines
    assert f"formation_s={reformed['formation_s']}" in formed_row[5:], lines

    # (c) the job page in a browser.
    from integration.test_dashboard_browser import job_page_in_chromium, lanes

    with job_page_in_chromium(
        server,
        job,
        tmp_path,
        "document.querySelectorAll('#rounds tbody tr').length >= 2"
        " && [...document.querySelectorAll('#timeline tbody tr')].some(r => r.cells[2].textContent === 'node_departed')"
        " && document.querySelectorAll('#members-nodes tr.node').length === 2"
        " && [...document.querySelectorAll('#lanes td')].some(td => td.dataset.state === 'dead')",
        "the death and the next round on the job page",
    ) as (browser, shot):
        # The lanes: the victim's ends red; the survivors' are members of the re-formed round.
        drawn = lanes(shot)
        assert "dead" in drawn[victim_entry["node_id"]], drawn
        assert len(drawn) == 3, drawn
        survivor_lanes = [cells for node_id, cells in drawn.items() if node_id != victim_entry["node_id"]]
        # Members of the re-formed round; its 3 steps may be over by the time the page draws,
        # and a survivor that finished and left shows its graceful leave in that round.
        assert len(survivor_lanes) == 2 and all(cells[-1] in ("member", "left") for cells in survivor_lanes), drawn
        assert all("dead" not in cells for cells in survivor_lanes), drawn
        timeline = shot.timeline()
        died = [r[1:6] for r in timeline if r[2] == "node_departed" and r[4] == victim_entry["node_id"]]
        assert died == [[str(death["round"]), "node_departed", death["cause"], victim_entry["node_id"], "127.0.0.1"]], (
            timeline
        )
        assert next(r[2:4] for r in timeline if r[2] == "round_formed") == ["round_formed", reformed["cause"]], timeline
        rounds = shot.rounds()
        assert [row[0] for row in rounds][:1] == [str(reformed["round"])], rounds  # newest first
        assert rounds[0][2:5] == [reformed["cause"], "2", "2"], rounds
        # The round of 3 is listed below the survivors' (a loaded runner may have formed a round
        # of 2 before the third node arrived: then that one is listed below it).
        assert rounds[0][6].endswith(" s") and str(formed["round"]) in [row[0] for row in rounds[1:]], rounds
        assert sorted(row[1] for row in shot.node_rows()) == sorted(
            e["node_id"]
            for e in cluster.job(server, job)["nodes"]  # type: ignore[index]
        )
        image = tmp_path / "job-page.png"
        browser.screenshot(image)
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        if os.environ.get("UPDATE_DOCS_SCREENSHOT") == "1":
            shutil.copyfile(image, DOCS / "job-page.png")
