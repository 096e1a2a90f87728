"""rdzvctl as a user runs it: a subprocess against a real server on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rdzv_client import Client


def rdzvctl(*args: str, endpoint: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "rdzv_client.ctl"]
    if endpoint is not None:
        argv += ["--endpoint", endpoint]
    return subprocess.run(
        argv + list(args), capture_output=True, text=True, timeout=60, env={**os.environ, **(env or {})}
    )


@pytest.fixture
def client(server: Any) -> Iterator[Client]:
    with Client(server.endpoint) as c:
        yield c


@pytest.fixture
def joined_job(client: Client) -> str:
    job = f"ctl-{uuid.uuid4().hex[:10]}"
    client.join(job, node_id="node-a", addr="10.1.2.3", nproc_per_node=2, min_nodes=1, max_nodes=1, timeout=10)
    return job


def test_jobs_lists_the_job_in_a_table(server: Any, joined_job: str) -> None:
    out = rdzvctl("jobs", endpoint=server.endpoint)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["RDZV_ID", "STATE", "ROUND", "NODES", "WORLD_SIZE"]
    row = next(line.split() for line in lines if line.startswith(joined_job))
    assert row[1] == "complete" and row[3] == "1" and row[4] == "2"


def test_jobs_json_is_the_servers_document(server: Any, joined_job: str) -> None:
    out = rdzvctl("--json", "jobs", endpoint=server.endpoint)
    assert out.returncode == 0, out.stderr
    jobs = json.loads(out.stdout)["jobs"]
    assert any(j["rdzv_id"] == joined_job for j in jobs)


def test_show_prints_header_and_node_table(server: Any, joined_job: str) -> None:
    out = rdzvctl("show", joined_job, endpoint=server.endpoint)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"job {joined_job}  state complete  round ")
    assert lines[0].endswith("nodes 1 (1..1)  world_size 2")
    assert lines[2].split() == ["NODE_RANK", "NODE_ID", "ADDR", "NPROC", "RANKS", "ALIVE", "HEARTBEAT"]
    cells = lines[3].split()
    assert cells[:6] == ["0", "node-a", "10.1.2.3", "2", "0-1", "yes"]
    assert cells[6].endswith("s")


def test_show_json_has_the_membership_fields(server: Any, joined_job: str) -> None:
    out = rdzvctl("--json", "show", joined_job, endpoint=server.endpoint)
    doc = json.loads(out.stdout)
    assert doc["rdzv_id"] == joined_job and doc["nodes"][0]["global_ranks"] == [0, 1]


def test_kv_set_get_list_round_trip(server: Any, joined_job: str) -> None:
    assert rdzvctl("kv", "set", joined_job, "cfg/lr", "0.1", endpoint=server.endpoint).returncode == 0
    assert rdzvctl("kv", "set", joined_job, "cfg/bs", "64", endpoint=server.endpoint).returncode == 0
    got = rdzvctl("kv", "get", joined_job, "cfg/lr", endpoint=server.endpoint)
    assert (got.returncode, got.stdout) == (0, "0.1\n")
    listed = rdzvctl("kv", "list", joined_job, "cfg/", endpoint=server.endpoint)
    assert sorted(listed.stdout.splitlines()) == ["cfg/bs", "cfg/lr"]
    as_json = rdzvctl("--json", "kv", "get", joined_job, "cfg/bs", endpoint=server.endpoint)
    assert json.loads(as_json.stdout) == {"key": "cfg/bs", "value": "64"}


def test_the_endpoint_comes_from_the_environment(server: Any, joined_job: str) -> None:
    out = rdzvctl("jobs", env={"RDZV_ENDPOINT": server.endpoint})
    assert out.returncode == 0, out.stderr
    assert joined_job in out.stdout


def test_close_closes_the_job(server: Any, client: Client, joined_job: str) -> None:
    out = rdzvctl("close", joined_job, endpoint=server.endpoint)
    assert out.returncode == 0, out.stderr
    assert client.job(joined_job)["state"] == "closed"


def test_an_unknown_job_is_a_one_line_error_with_its_code(server: Any) -> None:
    out = rdzvctl("show", "no-such-job", endpoint=server.endpoint)
    assert out.returncode == 1
    first, *rest = out.stderr.splitlines()
    assert first.startswith("rdzvctl: error: ") and first.endswith("(job_not_found)")
    assert all(line.startswith("rdzvctl: hint: ") for line in rest)


def test_a_missing_key_exits_1(server: Any, joined_job: str) -> None:
    out = rdzvctl("kv", "get", joined_job, "absent", endpoint=server.endpoint)
    assert out.returncode == 1
    assert "absent" in out.stderr


def test_no_server_exits_3_with_a_hint() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    out = rdzvctl("jobs", endpoint=f"127.0.0.1:{port}")
    assert out.returncode == 3
    assert time.monotonic() - start < 15
    lines = out.stderr.splitlines()
    assert lines[0].startswith("rdzvctl: error: ")
    assert lines[1] == (
        f"rdzvctl: hint: is the server running at 127.0.0.1:{port}? start it with `rdzv-server`, "
        "or point rdzvctl at it with --endpoint HOST:PORT or $RDZV_ENDPOINT"
    )


def test_usage_errors_exit_2() -> None:
    assert rdzvctl("kv", "get", "only-a-job").returncode == 2
    assert rdzvctl("frobnicate").returncode == 2
