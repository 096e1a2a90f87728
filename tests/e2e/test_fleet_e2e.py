"""Fleet control with real ``torchrun`` agents (gloo on CPU), as issue 16's "Done when" asks:
a node failing its health check is refused while the rest train; a cordoned host is refused
with the cordon named; a host whose nodes keep dying is quarantined; a job whose workers
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


def test_a_node_failing_its_health_check_is_refused_and_the_rest_train(
    server: Any, cluster: Cluster, tmp_path: Path
) -> None:
    job = "fleet-health"
    check = tmp_path / "check.sh"
    check.write_text('#!/bin/sh\necho "checking GPUs of $RDZV_NODE_ID in $RDZV_JOB_ID"\necho "GPU 3: uncorrectable ECC errors" >&2\nexit 3\n')
    check.chmod(0o755)
    sick = cluster.start("sick", server, job, nnodes="1:2", nproc=1, conf={"health_check": str(check)},
                         args=["--local-addr=127.0.0.2"])
    assert sick.wait(60) != 0
    assert f"failed health_check `{check}`" in sick.log_text()
    assert "GPU 3: uncorrectable ECC errors" in sick.log_text()
    healthy = cluster.start("healthy", server, job, nnodes="1:2", nproc=1, conf={"health_check": "true"})
    assert healthy.wait(90) == 0
    assert [r["WORLD_SIZE"] for r in healthy.results()] == ["1"]
    [refused] = kinds(server, job, "node_refused")
    assert (refused["cause"], refused["addr"]) == ("health_check_failed", "127.0.0.2")
    assert refused["reason"].endswith("GPU 3: uncorrectable ECC errors")


def test_a_cordoned_host_is_refused_with_the_cordon_named(server: Any, cluster: Cluster) -> None:
    job = "fleet-cordon"
    with Client(server.endpoint) as client:
        client.cordon("127.0.0.3", reason="bad DIMM in slot 4")
    try:
        cordoned = cluster.start("cordoned", server, job, nnodes="1:2", nproc=1, args=["--local-addr=127.0.0.3"])
        assert cordoned.wait(60) != 0
        assert "host 127.0.0.3 is cordoned by an operator: bad DIMM in slot 4" in cordoned.log_text()
        other = cluster.start("other", server, job, nnodes="1:2", nproc=1)
        assert other.wait(90) == 0
        [refused] = kinds(server, job, "node_refused")
        assert (refused["cause"], refused["addr"]) == ("cordoned", "127.0.0.3")
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
    cluster.start("steady", srv, job, nnodes="1:2", nproc=1, env=LONG, max_restarts=3)
    for attempt in range(2):  # the flapping host's node joins, runs, and dies: twice
        flaky = cluster.start(f"flaky{attempt}", srv, job, nnodes="1:2", nproc=1, env=LONG, max_restarts=3,
                              args=["--local-addr=127.0.0.2"])
        cluster.wait_job(srv, job, lambda d: d["state"] == "complete" and len(d["nodes"]) == 2
                         and all(n["alive"] for n in d["nodes"]), 90, f"flaky{attempt} in a round")
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
