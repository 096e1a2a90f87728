"""A crash loop stops itself (issue 27, part 3), with real ``torchrun`` agents: a worker that
fails a second after every start closes its job with ``restart_storm`` after
``max_fast_failures`` fast rounds, whatever torch's --max-restarts; a worker reporting its steps
with ``rdzv_client.progress`` gives the job document its last step per round, and a round that
got no further counts as a fast failure however long it ran."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rdzv_client import Client

Cluster = Any  # conftest.py's class; annotations only

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

CRASH_LOOP = Path(__file__).with_name("crash_loop.py")


def events(server: Any, job: str) -> list[dict[str, Any]]:
    with Client(server.endpoint) as client:
        return list(client.events(job)["events"])


def test_a_worker_failing_a_second_after_every_start_closes_the_job_with_restart_storm(
    server: Any, cluster: Cluster
) -> None:
    job = "storm"
    conf = {"min_round_seconds": "60", "max_fast_failures": "3"}
    for name in ("n0", "n1"):  # torch would restart 20 times: the crash-loop rule stops it first
        cluster.start(name, server, job, nnodes="2", nproc=1, conf=conf, env={"FAIL_AFTER_S": "1"}, max_restarts=20,
                      script=CRASH_LOOP)
    codes = cluster.wait_all(180)
    assert codes["n0"] != 0 and codes["n1"] != 0, codes
    for node in cluster.nodes:
        assert "restart_storm" in node.log_text(), node.name
    timeline = events(server, job)
    fast = [e for e in timeline if e["kind"] == "fast_failure"]
    assert [(e["cause"], e["fast_failures"], e["round"]) for e in fast] == [
        ("short_round", 1, 0), ("short_round", 2, 1), ("short_round", 3, 2)
    ]
    [closed] = [e for e in timeline if e["kind"] == "job_closed"]
    assert (closed["cause"], closed["fast_failures"], closed["max_fast_failures"]) == ("restart_storm", 3, 3)
    doc = cluster.job(server, job)
    assert doc is not None and (doc["state"], doc["closed_cause"], doc["round"]) == ("closed", "restart_storm", 2)


def test_progress_reaches_the_job_document_per_round_and_a_round_without_progress_is_a_fast_failure(
    server: Any, cluster: Cluster
) -> None:
    job = "progress"
    # The time rule off (min_round_seconds=0): only progress can make a round fast.
    conf = {"min_round_seconds": "0", "max_fast_failures": "2"}
    node = cluster.start("n0", server, job, nnodes="1", nproc=2, conf=conf, env={"PROGRESS_TO": "5"}, max_restarts=20,
                         script=CRASH_LOOP)
    assert node.wait(180) != 0
    assert "restart_storm" in node.log_text()
    doc = cluster.job(server, job)
    assert doc is not None and doc["closed_cause"] == "restart_storm"
    # Round 0 reached step 5 (progress), rounds 1 and 2 resumed at 5 and got no further.
    assert [(r["round"], r["step"], r["fast_failure"]) for r in doc["progress"]] == [
        (0, 5, ""), (1, 5, "no_progress"), (2, 5, "no_progress")
    ]
    assert 0 < doc["goodput"] < 1  # round 0's time over the whole run's
    fast = [e for e in events(server, job) if e["kind"] == "fast_failure"]
    assert [(e["cause"], e["step"], e["best_step"]) for e in fast] == [("no_progress", 5, 5), ("no_progress", 5, 5)]
