"""The failure finder against a real ``torchrun`` (gloo-free, CPU, one node, two workers).

Worker LOCAL_RANK 1 raises a RuntimeError under torch's ``@record`` at every start (worker 0
waits, and the agent stops it with SIGTERM), with
``--max-restarts=1``: the agent re-enters ``next_rendezvous()`` once after the first failure
and calls ``shutdown()`` after the second. A probe handler (tests/e2e/failure_probe.py, torch's
c10d handler behind a delegating one) calls
:func:`rdzv_client.torchrun.find_failure_report` in both and records what it returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rdzv_client.failure import FailureReport, WorkerFailure

HERE = Path(__file__).parent
CUDA_ERROR = "RuntimeError: CUDA error: an illegal memory access was encountered"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_the_finder_reports_the_failed_worker_at_the_next_rendezvous_and_at_shutdown(tmp_path: Path) -> None:
    out = tmp_path / "probe.jsonl"
    cmd = [
        sys.executable, str(HERE / "failure_probe.py"), str(out),
        "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1",
        "--rdzv-backend=failure-probe", "--rdzv-endpoint=localhost:0", "--rdzv-id=failure-probe",
        str(HERE / "failing_worker.py"),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agent = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env, cwd=tmp_path)

    assert agent.returncode == 1, agent.stderr[-3000:]
    calls = [json.loads(line) for line in out.read_text().splitlines()]
    assert [c["call"] for c in calls] == ["next_rendezvous", "next_rendezvous", "shutdown"], agent.stderr[-3000:]
    assert calls[0]["report"] is None  # the first round: nothing failed yet
    for call in calls[1:]:
        report = FailureReport.from_wire(call["report"], now=0.0)
        assert report.failed_workers == 2
        assert [(f.global_rank, f.local_rank, f.exit_code, f.message) for f in report.failures] == [
            (1, 1, 1, CUDA_ERROR),
            (0, 0, -15, "SIGTERM"),
        ], call["call"] + (
            " (torch's SimpleElasticAgent._invoke_run run_result)"
            if call["call"] == "next_rendezvous"
            else " (torch's launch_agent result)"
        )
        assert isinstance(report.failures[0], WorkerFailure) and 0.0 <= -report.failures[0].failed_at < 120.0
