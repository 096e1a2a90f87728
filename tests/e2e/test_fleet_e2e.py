"""Fleet control with real ``torchrun`` agents (gloo on CPU), as issue 16's "Done when" asks:
a node failing its health check and a cordoned host's node (the cordon named) are refused
while the rest train; a host whose nodes keep dying is quarantined; a job whose workers
always fail is stopped once its restart budget is spent; node ranks follow topology paths; a
survivor keeps its rank across a re-formation and a spare takes the dead node's rank.

Nodes tell hosts apart by ``--local-addr`` (127.0.0.2, 127.0.0.3: loopback addresses of
this one machine), which is the address a cordon names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from server_process import ServerProcess

from rdzv_client import Client

Cluster = Any  # conftest.py's class; annotations only

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

# A round that runs until the test is done with it (~40 s of steps), unless its agents restart it.
LONG = {"STEPS": "800", "STEP_SLEEP": "0.05"}


def events(server: Any, job: str) -> list[dict[str, Any]]:
    with Client(server.endpoint) as client:
        return list(client.events(job)["events"])


def kinds(server: Any, job: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in events(server, job) if e["kind"] == kind]


def test_a_node_failing_its_health_check_and_a_cordoned_hosts_node_are_refused_and_the_rest_train(
    server: Any, cluster: Cluster, tmp_path: Path
) -> None:
    job = "fleet-refused"
    check = tmp_path / "check.sh"
    check.write_text('#!/bin/sh\necho "checking GPUs of $RDZV_NODE_ID in $RDZV_JOB_ID"\necho "GPU 3: uncorrectable ECC errors" >&2\nexit 3\n')
    check.chmod(0o755)
    with Client(server.endpoint) as client:
        client.cordon("127.0.0.3", reason="bad DIMM in slot 4")
    refused_both = tmp_path / "refused-both"
    # The healthy node trains (up to ~30 s) until both others were refused.
    env = {"STEPS": "600", "STEP_SLEEP": "0.05", "RUN_UNTIL": str(refused_both)}
    try:
        healthy = cluster.start("healthy", server, job, nnodes="1:2", nproc=1, conf={"health_check": "true"}, env=env)
        cluster.wait_started(world=1, count=1)
        sick = cluster.start("sick", server, job, nnodes="1:2", nproc=1, conf={"health_check": str(check)},
                             args=["--local-addr=127.0.0.2"])  # fmt: skip
        cordoned = cluster.start("cordoned", server, job, nnodes="1:2", nproc=1, args=["--local-addr=127.0.0.3"])
        assert sick.wait(60) != 0
        assert cordoned.wait(60) != 0
        refused_both.touch()
        assert f"failed health_check `{check}`" in sick.log_text()
        assert "GPU 3: uncorrectable ECC errors" in sick.log_text()
        assert "host 127.0.0.3 is cordoned by an operator: bad DIMM in slot 4" in cordoned.log_text()
        assert healthy.wait(90) == 0  # undisturbed: the refused nodes' exits did not end the job
        assert [r["WORLD_SIZE"] for r in healthy.results()] == ["1"]
        refused = {e["cause"]: e for e in kinds(server, job, "node_refused")}
        assert sorted(refused) == ["cordoned", "health_check_failed"], refused
        assert refused["health_check_failed"]["addr"] == "127.0.0.2"
        assert refused["health_check_failed"]["reason"].endswith("GPU 3: uncorrectable ECC errors")
        assert refused["cordoned"]["addr"] == "127.0.0.3"
        assert [e["cause"] for e in kinds(server, job, "job_closed")] == ["agent"]  # closed by the healthy node's end
    finally:
        with Client(server.endpoint) as client:
            client.uncordon("127.0.0.3")


@pytest.fixture
def quarantine_server(tmp_path: Path) -> Any:
    srv = ServerProcess(tmp_path / "srv", durable=False,
                        args=("--quarantine-after", "2", "--quarantine-window", "600", "--quarantine-for", "600"))
    (tmp_path / "srv").mkdir()
    srv.start()
    yield srv
    srv.close()


def test_a_host_whose_nodes_keep_dying_is_quarantined(quarantine_server: Any, cluster: Cluster) -> None:
    srv, job = quarantine_server, "fleet-flapping"
    # Each death of the flaky node fails the steady node's collectives (a torch restart each, with
    # the membership changes around them): torch's own budget must outlast the scenario.
    cluster.start("steady", srv, job, nnodes="1:2", nproc=1, env=LONG, max_restarts=10)
    for attempt in range(2):  # the flapping host's node joins, runs, and dies: twice
        flaky = cluster.start(f"flaky{attempt}", srv, job, nnodes="1:2", nproc=1, env=LONG, max_restarts=10,
                              args=["--local-addr=127.0.0.2"])
        cluster.wait_job(srv, job, lambda d: d["state"] == "complete" and len(d["nodes"]) == 2
                         and all(n["alive"] for n in d["nodes"]), 90, f"flaky{attempt} in a round")
        # It runs: its worker is up. (Killed the moment the round formed, it could die before its
        # agent wrote torch's worker-rank record to the round's store, and the steady agent would
        # wait for that record (store_timeout) instead of re-forming: see README, "Failures".)
        cluster.wait_for(lambda: flaky.started() or None, 60, f"flaky{attempt}'s worker to start")
        flaky.kill()
        cluster.wait_job(srv, job, lambda d: not any(n["addr"] == "127.0.0.2" and n["alive"] for n in d["nodes"]),
                         30, f"flaky{attempt}'s death")
    with Client(srv.endpoint) as client:
        [cordon] = client.cordons()["cordons"]
    assert (cordon["host"], cordon["by"]) == ("127.0.0.2", "flapping")
    assert cordon["reason"].startswith("2 deaths of its nodes within 600 s")
    [event] = kinds(srv, job, "host_cordoned")
    assert (event["cause"], event["host"]) == ("flapping", "127.0.0.2")
    again = cluster.start("flaky2", srv, job, nnodes="1:2", nproc=1, args=["--local-addr=127.0.0.2"])
    assert again.wait(60) != 0
    assert "host 127.0.0.2 is cordoned by the server (automatic quarantine" in again.log_text()


def test_a_job_whose_workers_always_fail_stops_when_its_restart_budget_is_spent(server: Any, cluster: Cluster) -> None:
    job = "fleet-budget"
    env = {"FAIL_ALWAYS": "1"}
    for name in ("n0", "n1"):  # torch's own per-agent budget is larger: the job-wide one decides
        cluster.start(name, server, job, nnodes="2", nproc=1, conf={"max_restarts": "2"}, env=env, max_restarts=10)
    codes = cluster.wait_all(120)
    assert codes["n0"] != 0 and codes["n1"] != 0, codes
    for node in cluster.nodes:
        assert "restart_budget_exhausted" in node.log_text(), node.name
    timeline = events(server, job)
    assert [e["restarts"] for e in timeline if e["kind"] == "restart_counted"] == [1, 2]
    [closed] = [e for e in timeline if e["kind"] == "job_closed"]
    assert (closed["cause"], closed["max_restarts"], closed["restarts"]) == ("restart_budget_exhausted", 2, 2)
    doc = cluster.job(server, job)
    assert doc is not None and (doc["restarts"], doc["max_restarts"], doc["state"]) == (2, 2, "closed")


def test_ranks_follow_topology_a_survivor_keeps_its_rank_and_a_spare_takes_the_dead_nodes(
    server: Any, cluster: Cluster
) -> None:
    job = "fleet-topology"
    paths = {"c": "zone1/rack3", "a": "zone1/rack1", "b": "zone1/rack2"}  # started in this order
    nodes = {name: cluster.start(name, server, job, nnodes="3", nproc=1, env={**LONG, "RDZV_TOPOLOGY": path},
                                 max_restarts=3) for name, path in paths.items()}

    def formed_with(names: set[str]) -> Any:
        return lambda d: (d["state"] == "complete" and all(n["alive"] for n in d["nodes"])
                          and {cluster.node_of(n).name for n in d["nodes"]} == names)

    doc = cluster.wait_job(server, job, formed_with({"a", "b", "c"}), 90, "the round of a, b, c")
    assert [(cluster.node_of(n).name, n["node_rank"], n["topology"]) for n in doc["nodes"]] == [
        ("a", 0, "zone1/rack1"), ("b", 1, "zone1/rack2"), ("c", 2, "zone1/rack3")
    ]
    # a spare whose path sorts first: as a new node it would take rank 0, as a spare it takes b's
    cluster.start("s", server, job, nnodes="3", nproc=1, env={**LONG, "RDZV_TOPOLOGY": "zone1/rack0"}, max_restarts=3)
    cluster.wait_job(server, job, lambda d: len(d["standby"]) == 1, 60, "the spare on standby")
    cluster.wait_started(world=3, count=3)  # b's agent is past torch's worker-rank exchange
    nodes["b"].kill()
    doc = cluster.wait_job(server, job, formed_with({"a", "s", "c"}), 90, "the round of a, s, c")
    assert [(cluster.node_of(n).name, n["node_rank"]) for n in doc["nodes"]] == [("a", 0), ("s", 1), ("c", 2)]
