"""Fleet control against a real server on loopback (issue 16): cordons over HTTP and
``rdzvctl``, a cordoned host refused with the cordon named and the refusal in the timeline,
a read-only token that cannot cordon, bad input refused changing nothing, cordons durable
across a restart, and a node's health-check refusal recorded."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from etcd_cluster import require_etcd, running_etcd
from replica_cluster import ReplicaCluster
from server_process import ServerProcess

from rdzv_client import Client, JobSettings
from rdzv_client.error import BadRequestError, HostCordonedError, JobClosedError


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One memory-only server for the module (a start costs ~0.5 s); every test uses its own
    job and lifts the cordons it makes. The tests' nodes share hosts: no quarantine of a host
    between tests."""
    srv = ServerProcess(tmp_path_factory.mktemp("fleet-server"), durable=False, args=("--quarantine-after", "0"))
    srv.start()
    yield srv
    srv.close()


def rdzvctl(*args: str, endpoint: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rdzv_client.ctl", "--endpoint", endpoint, *args],
        check=False, capture_output=True, text=True, timeout=60, env=dict(os.environ),
    )


def http_request(srv: ServerProcess, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def job_id() -> str:
    return f"fleet-{uuid.uuid4().hex[:8]}"


def join(client: Client, job: str, node: str, addr: str, **kw: Any) -> Any:
    return client.join(job, node_id=node, addr=addr, nproc_per_node=1,
        settings=JobSettings(min_nodes=1, max_nodes=2, last_call_timeout=0.0), timeout=10, **kw)


def test_a_cordoned_host_is_refused_naming_the_cordon_and_admitted_once_uncordoned(server: ServerProcess) -> None:
    job = job_id()
    with Client(server.endpoint) as client:
        join(client, job, "a", "10.0.0.1")
        cordon = client.cordon("node7", reason="bad DIMM", duration=600)
        assert (cordon["host"], cordon["reason"], cordon["by"]) == ("node7", "bad DIMM", "operator")
        assert cordon["until"] is not None and 0 < cordon["left_s"] <= 600
        with pytest.raises(HostCordonedError, match="host node7 is cordoned by an operator: bad DIMM") as info:
            join(client, job, "b", "10.0.0.2", host="node7")
        assert info.value.code is not None and info.value.code.value == "host_cordoned"
        events = client.events(job)["events"]
        refused = [e for e in events if e["kind"] == "node_refused"]
        assert [(e["cause"], e["node_id"]) for e in refused] == [("cordoned", "b")]
        assert "bad DIMM" in refused[0]["reason"]
        assert [c["host"] for c in client.cordons()["cordons"]] == ["node7"]
        assert client.uncordon("node7") is True
        assert client.uncordon("node7") is False
        assert client.cordons()["cordons"] == []
        assert join(client, job_id(), "b", "10.0.0.2", host="node7").node_rank == 0


def test_rdzvctl_cordons_lists_and_uncordons(server: ServerProcess) -> None:
    out = rdzvctl("cordon", "10.9.9.9", "--reason", "flaky NIC", "--for", "2h", endpoint=server.endpoint)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "cordoned 10.9.9.9 for 2h00m"
    out = rdzvctl("cordons", endpoint=server.endpoint)
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["HOST", "SINCE", "UNTIL", "REASON", "BY"]
    assert lines[1].startswith("10.9.9.9 ") and "flaky NIC" in lines[1] and lines[1].endswith("operator")
    doc = json.loads(rdzvctl("--json", "cordons", endpoint=server.endpoint).stdout)
    assert [c["host"] for c in doc["cordons"]] == ["10.9.9.9"]
    assert rdzvctl("uncordon", "10.9.9.9", endpoint=server.endpoint).stdout.strip() == "uncordoned 10.9.9.9"
    assert rdzvctl("cordons", endpoint=server.endpoint).stdout.strip() == "no cordons"
    bad = rdzvctl("cordon", "h", "--for", "soon", endpoint=server.endpoint)
    assert bad.returncode == 2 and "not a duration" in bad.stderr


def test_bad_cordons_are_refused_and_change_nothing(server: ServerProcess) -> None:
    token = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config"), "rdzv-server", "token")
    tok = token.read_text().strip() if token.exists() else None
    for body in ({"host": ""}, {"host": "a b"}, {"host": "h", "duration": -1}, {"host": "h", "by": "flapping"},
                 {"host": "h", "color": "red"}, ["h"]):
        status, answer = http_request(server, "POST", "/v1/cordons", body, tok)
        assert (status, answer["error"]) == (400, "bad_request"), body
    with Client(server.endpoint) as client:
        assert client.cordons()["cordons"] == []
        with pytest.raises(BadRequestError):
            client.cordon("bad host")


def test_a_read_only_token_lists_cordons_but_cannot_cordon_or_uncordon(read_server: Any) -> None:
    srv, read_token = read_server
    status, answer = http_request(srv, "POST", "/v1/cordons", {"host": "node7"}, read_token)
    assert (status, answer["error"]) == (403, "forbidden")
    assert "cordons need a write token" in answer["message"]
    status, answer = http_request(srv, "DELETE", "/v1/cordons/node7", None, read_token)
    assert status == 403
    status, answer = http_request(srv, "GET", "/v1/cordons", None, read_token)
    assert status == 200 and answer["cordons"] == []
    status, _ = http_request(srv, "GET", "/v1/cordons")
    assert status == 401


def test_cordons_survive_a_restart(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, durable=True)
    srv.start()
    try:
        with Client(srv.endpoint) as client:
            client.cordon("node7", reason="bad DIMM")
        srv.restart()
        with Client(srv.endpoint) as client:
            [cordon] = client.cordons()["cordons"]
            assert (cordon["host"], cordon["reason"], cordon["until"]) == ("node7", "bad DIMM", None)
            with pytest.raises(HostCordonedError):
                join(client, job_id(), "a", "node7")
    finally:
        srv.close()


def test_a_failed_health_check_is_recorded_as_node_refused(server: ServerProcess) -> None:
    job = job_id()
    with Client(server.endpoint) as client:
        for _ in range(3):  # an agent restarting in a loop is recorded once
            client.refuse(job, node_id="n1", addr="10.0.0.5", cause="health_check_failed",
                          detail="GPU 3: uncorrectable ECC\nerrors", settings=JobSettings(min_nodes=2, max_nodes=2))
        events = client.events(job)["events"]
        assert [(e["kind"], e["cause"]) for e in events] == [("job_created", "join"), ("node_refused", "health_check_failed")]
        assert events[1]["reason"] == "GPU 3: uncorrectable ECC errors"
        with pytest.raises(BadRequestError):
            client.refuse(job, node_id="n1", addr="10.0.0.5", cause="bored")


def metrics(srv: ServerProcess) -> dict[str, float]:
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_the_restart_budget_shows_in_the_document_rdzvctl_and_metrics_and_closes_the_job(server: ServerProcess) -> None:
    job = job_id()
    with Client(server.endpoint) as client:
        def rejoin() -> Any:
            return client.join(job, node_id="a", addr="node7", nproc_per_node=1,
                               settings=JobSettings(min_nodes=1, max_nodes=1, max_restarts=1),
                               timeout=10, topology="zone1/rack2")

        rejoin()
        before = metrics(server)
        assert rejoin().round == 1  # a member re-joins its formed round: its workers failed
        doc = client.job(job)
        assert (doc["restarts"], doc["max_restarts"], doc["nodes"][0]["topology"]) == (1, 1, "zone1/rack2")
        out = rdzvctl("show", job, endpoint=server.endpoint)
        assert out.stdout.splitlines()[1] == "restarts 1 of 1"
        assert out.stdout.splitlines()[3].split()[-1] == "TOPOLOGY" and "zone1/rack2" in out.stdout
        after = metrics(server)
        assert after['rdzv_restarts_total{cause="workers_failed"}'] - before.get('rdzv_restarts_total{cause="workers_failed"}', 0) == 1
        assert after["rdzv_jobs_budget_spent"] >= 1 and after["rdzv_restarts_used"] >= 1
        with pytest.raises(JobClosedError, match="restart_budget_exhausted"):
            rejoin()
        assert client.job(job)["closed_cause"] == "restart_budget_exhausted"
        final = metrics(server)
        assert final['rdzv_jobs_closed_total{cause="restart_budget_exhausted"}'] >= 1


def test_a_cordon_outlives_the_leader_over_replicas(tmp_path: Path) -> None:
    """Two replicas over a one-member etcd: the cordon is a logged command, so the replica that
    takes over holds it and refuses the host too."""
    require_etcd()
    with running_etcd(1) as etcd, ReplicaCluster(etcd, tmp_path, size=2).start() as replicas:
        with Client(replicas.endpoint, retry_budget=60) as client:
            client.cordon("node7", reason="bad DIMM")
        leader = replicas.wait_for_leader()
        replicas.replicas[leader].kill()
        replicas.wait_for_leader(other_than=leader)
        with Client(replicas.endpoint, retry_budget=60) as client:
            assert [(c["host"], c["reason"]) for c in client.cordons()["cordons"]] == [("node7", "bad DIMM")]
            with pytest.raises(HostCordonedError, match="node7"):
                join(client, job_id(), "a", "10.0.0.1", host="node7")
