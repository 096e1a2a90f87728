"""A real torchrun job against a replicated rdzv-server: three replicas over a three-member
etcd, every replica in ``--rdzv-endpoint``.

Three agents (``--nnodes=2:3``, one gloo worker each) form a round. While their workers
run, the leader replica is SIGKILLed. Another replica takes over; it gives every node a
full heartbeat TTL of grace, and the agents' watches fail over to it with no help. For
well past the lease TTL plus the heartbeat TTL the round is not disturbed: the same round,
every node alive and beating against the new leader, no node_departed in the job's events,
no worker restarted, training still making progress. Then one node is SIGKILLed (its
agent's process group and its workers): the new leader sees it die (node_departed with its
cause), the two survivors re-form and finish, and their agents exit 0.

The job is read through the replicated client (``rdzv_client.Client`` over every replica),
so the reads fail over as the agents do. Skipped only where etcd is not installed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from etcd_cluster import EtcdCluster, require_etcd
from replica_cluster import LEASE_TTL_S, ReplicaCluster
from test_torchrun_e2e import DEATH_CAUSES, ELASTIC_RESTARTS, check_records, complete_with

from rdzv_client import Client
from rdzv_client.error import NotFoundError

# The fixtures' classes (conftest.py); annotations only.
Cluster = Any

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

# The e2e's fast liveness (conftest.DEFAULT_CONF), spelled out: the test's bounds are made of it.
KEEP_ALIVE_INTERVAL_S = 0.5
KEEP_ALIVE_MAX_ATTEMPT = 4
HEARTBEAT_TTL_S = KEEP_ALIVE_INTERVAL_S * KEEP_ALIVE_MAX_ATTEMPT
# How long the round must stay undisturbed after the take-over: past one lease TTL (a leader
# that took over late) and one heartbeat TTL (the grace the new leader gives every node),
# with room for a loaded 2-core runner.
UNDISTURBED_S = LEASE_TTL_S + HEARTBEAT_TTL_S + 2.0
# Reads ride out an election (a lease TTL and a second or two) well within this.
READ_RETRY_BUDGET_S = 20.0


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[ReplicaCluster]:
    require_etcd()
    (tmp_path / "etcd").mkdir()
    etcd = EtcdCluster(3, base_dir=tmp_path / "etcd").start()
    try:
        cluster = ReplicaCluster(etcd, tmp_path / "replicas").start()
        try:
            yield cluster
        finally:
            cluster.close()
    finally:
        etcd.close()


def job_doc(client: Client, job: str) -> dict[str, Any] | None:
    try:
        doc: dict[str, Any] = client.job(job)
    except NotFoundError:
        return None
    return doc


def test_killing_the_leader_replica_leaves_the_round_alone_and_a_later_node_death_is_detected(
    replicas: ReplicaCluster, cluster: Cluster
) -> None:
    job = "replicated"
    cluster.servers.extend(replicas.replicas)  # every replica's log tail in a failure's report
    # A long round of 3 (interrupted by the node kill), a short one of 2 to finish.
    env = {"STEPS": "2000", "STEP_SLEEP": "0.05", "STEPS_WHEN_WORLD_SIZE": "2:3"}
    start = {
        "nnodes": "2:3", "nproc": 1, "env": env, "max_restarts": ELASTIC_RESTARTS,
        "conf": {
            "last_call_timeout": "0.5",
            "keep_alive_interval": f"{KEEP_ALIVE_INTERVAL_S:g}",
            "keep_alive_max_attempt": str(KEEP_ALIVE_MAX_ATTEMPT),
        },
        "endpoint": replicas.endpoint,
    }  # fmt: skip
    client = Client(replicas.endpoint, retry_budget=READ_RETRY_BUDGET_S)
    try:
        for name in ("a", "b", "c"):
            cluster.start(name, replicas.replicas[0], job, **start)

        def wait_doc(pred: Any, timeout: float, what: str) -> dict[str, Any]:
            last: list[dict[str, Any] | None] = [None]

            def check() -> dict[str, Any] | None:
                doc = last[0] = job_doc(client, job) or last[0]
                return doc if doc is not None and pred(doc) else None

            doc: dict[str, Any] = cluster.wait_for(
                check, timeout, what, 0.1, details=lambda: f"last document: {last[0]}"
            )
            return doc

        formed = wait_doc(complete_with(3), 90, "the round of 3 nodes")
        cluster.wait_started(world=3, count=3)
        # Every worker record so far: the round of 3, and any earlier round (two nodes may form
        # a round at its last call before the third joins) whose workers are gone by now.
        started = cluster.started()
        node_ids = [e["node_id"] for e in formed["nodes"]]

        def steps() -> int:
            return sum(hb["step"] for n in cluster.nodes for hb in n.heartbeats().values() if hb["world"] == 3)

        def restarted() -> list[dict[str, Any]]:
            return [r for r in cluster.started() if r not in started]

        # -- the leader replica dies mid-run --------------------------------------------------
        cluster.wait_for(lambda: True if steps() >= 3 * 5 else None, 30, "the workers to take 5 steps")
        leader = replicas.wait_for_leader()
        before = steps()
        killed_at = time.monotonic()
        replicas.replicas[leader].kill()
        successor = replicas.wait_for_leader(timeout=LEASE_TTL_S + 10, other_than=leader)
        took_over_s = time.monotonic() - killed_at

        # Past the new leader's grace (one heartbeat TTL), a node is alive only because its
        # agent's watch found the new leader and beat there: watch the whole window.
        until = time.monotonic() + UNDISTURBED_S
        checked = 0
        while time.monotonic() < until:
            doc = job_doc(client, job)
            assert doc is not None, "the new leader does not know the job"
            assert doc["round"] == formed["round"] and doc["state"] == "complete", doc
            assert [e["node_id"] for e in doc["nodes"]] == node_ids, doc
            assert all(e["alive"] for e in doc["nodes"]), doc
            assert not doc["waiting"] and doc["num_nodes_waiting"] == 0, doc
            assert all(n.running() for n in cluster.nodes), cluster.nodes
            assert not restarted(), f"workers restarted after the take-over: {restarted()}"
            checked += 1
            time.sleep(0.2)
        doc = job_doc(client, job)
        assert doc is not None
        for entry in doc["nodes"]:  # beating against the new leader, not living on its grace
            assert entry["last_heartbeat_age_s"] is not None, doc
            assert entry["last_heartbeat_age_s"] < HEARTBEAT_TTL_S, doc
        assert steps() > before, "training stopped making progress after the take-over"
        assert not restarted(), restarted()
        assert all(r["TORCHELASTIC_RESTART_COUNT"] == "0" for r in cluster.started()), cluster.started()
        events = client.events(job)["events"]
        assert not [e for e in events if e["kind"] == "node_departed"], events
        assert not [e for e in events if e["kind"] == "round_formed" and e["round"] > formed["round"]], events
        takeover = [e for e in events if e["kind"] == "server_restarted" and e["cause"] == "leader_changed"]
        assert takeover, f"no leader_changed in the job's events: {events}"
        assert all(e["round"] == formed["round"] for e in takeover), takeover
        cluster_view = client.cluster()
        assert cluster_view["leader"] is not None and cluster_view["leader"]["id"] == f"r{successor}", cluster_view

        # -- then a node dies: the new leader sees it, the survivors re-form -----------------
        victim_entry = formed["nodes"][1]
        victim = cluster.node_of(victim_entry)
        survivors = [n for n in cluster.nodes if n is not victim]
        victim.kill()
        node_killed_at = time.monotonic()

        def reformed_in_events() -> dict[str, Any] | None:
            events = client.events(job)["events"]
            return next(
                (e for e in events if e["kind"] == "round_formed" and e["round"] > formed["round"]),
                None,
            )

        reformed = cluster.wait_for(reformed_in_events, 30, "the survivors' round in the events", 0.1)
        reformed_s = time.monotonic() - node_killed_at
        assert reformed["num_nodes"] == 2 and reformed["world_size"] == 2, reformed
        # The victim's death is recorded before that round formed (while the old round ran, or
        # while the survivors' round was open) or never: a round that forms without a member
        # drops it from the job.
        events = client.events(job)["events"]
        death = next(
            (e for e in events if e["kind"] == "node_departed" and e["node_id"] == victim_entry["node_id"]), None
        )
        assert death is not None, (
            f"round {reformed['round']} formed with the 2 survivors {reformed_s:.2f} s after node {victim.name} "
            f"({victim_entry['node_id']}) was SIGKILLed, but the job's events have no node_departed for it: "
            f"its death is not recorded. Events: {events}"
        )
        assert death["cause"] in DEATH_CAUSES, death
        assert death["addr"] == "127.0.0.1" and death["role"] == "member", death
        assert formed["round"] <= death["round"] <= reformed["round"], death
        joined = {e["node_id"] for e in events if e["kind"] == "node_joined" and e["round"] == reformed["round"]}
        assert joined == set(node_ids) - {victim_entry["node_id"]}, events

        codes = cluster.wait_all(60, survivors)
        assert codes == {n.name: 0 for n in survivors}, codes
        finals = [r for r in cluster.results() if int(r["WORLD_SIZE"]) == 2]
        check_records(finals, 2, job)
        assert {r["node"] for r in finals} == {n.name for n in survivors}, finals
        assert not victim.results()
        events = client.events(job)["events"]
        deaths = [e for e in events if e["kind"] == "node_departed" and e["cause"] != "left"]
        assert [e["node_id"] for e in deaths] == [victim_entry["node_id"]], events
        closed = job_doc(client, job)
        assert closed is not None and closed["state"] == "closed", closed
        print(
            f"\n[replicas] leader r{leader} killed; r{successor} led after {took_over_s:.2f} s; round "
            f"{formed['round']} undisturbed for {UNDISTURBED_S:g} s ({checked} reads); node {victim.name} "
            f"killed: {death['cause']}, round {reformed['round']} of 2 formed after {reformed_s:.2f} s"
        )
    finally:
        client.close()
