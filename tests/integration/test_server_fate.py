"""Failures that follow a host (issue 27, part 4), against a real server on loopback: nodes
join and re-join with the failure reports the torchrun plug-in sends. A node whose workers
fail while the other node's do not counts against its host, and after
``--quarantine-failures`` (2 here) such rounds the host is cordoned (``by: workers_failed``,
the message in the reason), which its next join names; a failure on every node with the same
error cordons nobody."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_process import ServerProcess

from rdzv_client import Client, JobSettings
from rdzv_client.error import HostCordonedError, NotFoundError

CUDA_ERROR = "RuntimeError: CUDA error: an illegal memory access was encountered"
BUG = "KeyError: 'lr'"
JOIN_TIMEOUT = 30.0
EVENTS_WAIT = 20.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path, durable=False, args=("--quarantine-failures", "2"))
    srv.start()
    yield srv
    srv.close()


def report(rank: int, message: str, age_s: float = 0.0) -> dict[str, Any]:
    """A failure report as the plug-in sends it: one worker, exit code 1."""
    failure = {"global_rank": rank, "local_rank": 0, "exit_code": 1, "age_s": age_s, "message": message}
    return {"failed_workers": 1, "failures": [failure]}


def round_of(client: Client, job: str, nodes: dict[str, tuple[str, dict[str, Any] | None]]) -> None:
    """The nodes (node_id -> (addr, failure report or None)) join in this order, each once the
    one before is in line (as agents do: a healthy node restarts only once the failing one
    re-joined), and the round forms."""
    errors: list[BaseException] = []

    def join(node_id: str, addr: str, failure: dict[str, Any] | None) -> None:
        try:
            client.join(job, node_id=node_id, addr=addr, nproc_per_node=1, settings=JobSettings(2, 2, 0.0),
                        timeout=JOIN_TIMEOUT, failure=failure)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 (raised by the test thread below)
            errors.append(exc)

    threads = []
    for node_id, (addr, failure) in nodes.items():
        since = client.events(job)["next_seq"] - 1 if threads else 0
        threads.append(threading.Thread(target=join, args=(node_id, addr, failure)))
        threads[-1].start()
        wait_for_event(client, job, since, lambda e, n=node_id: e["kind"] == "node_joined" and e["node_id"] == n)
    for t in threads:
        t.join(JOIN_TIMEOUT + 5)
    assert not errors, errors


def wait_for_event(client: Client, job: str, since: int, match: Any) -> dict[str, Any]:
    """The first event after ``since`` that ``match``es, waiting on the job's timeline."""
    while True:
        try:
            page = client.events(job, since=since, wait=EVENTS_WAIT)
        except NotFoundError:  # the first join has not made the job yet
            page = {"events": [{"kind": "-"}], "next_seq": 1}
        assert page["events"], f"no such event on job {job}'s timeline"
        found = [e for e in page["events"] if match(e)]
        if found:
            return found[0]
        since = page["next_seq"] - 1


def test_host_local_failures_cordon_the_host_and_failures_on_every_node_cordon_none(server: ServerProcess) -> None:
    with Client(server.endpoint, token=server.token) as client:
        # Every node fails with the same error, three rounds running: the script, not a host.
        script = f"fate-script-{uuid.uuid4().hex[:6]}"
        round_of(client, script, {"a": ("127.0.0.4", None), "b": ("127.0.0.5", None)})
        for _ in range(3):
            round_of(client, script, {"a": ("127.0.0.4", report(0, BUG)), "b": ("127.0.0.5", report(1, BUG, 2.0))})
        # Node b fails alone, twice: its host is cordoned.
        job = f"fate-host-{uuid.uuid4().hex[:6]}"
        round_of(client, job, {"a": ("127.0.0.2", None), "b": ("127.0.0.3", None)})
        for _ in range(2):
            round_of(client, job, {"b": ("127.0.0.3", report(1, CUDA_ERROR)), "a": ("127.0.0.2", None)})
        # The cordon follows the round's formation: wait for it on the job's timeline.
        event = wait_for_event(client, job, 0, lambda e: e["kind"] == "host_cordoned")
        assert (event["cause"], event["node_id"], event["host"]) == ("workers_failed", "b", "127.0.0.3"), event
        assert CUDA_ERROR in event["reason"], event
        # Applied after the script job's rounds: a cordon of theirs would be listed by now.
        [cordon] = client.cordons()["cordons"]
        assert (cordon["host"], cordon["by"]) == ("127.0.0.3", "workers_failed"), cordon
        assert cordon["reason"].startswith("workers failed on it first 2 times within 3600 s"), cordon
        with pytest.raises(HostCordonedError, match="workers failed on it while the other nodes' did not"):
            client.join(job, node_id="b", addr="127.0.0.3", nproc_per_node=1, settings=JobSettings(2, 2, 0.0),
                        timeout=JOIN_TIMEOUT)  # fmt: skip
