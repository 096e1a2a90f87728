"""Why every restart happened (issue 27, part 1), with real ``torchrun`` agents (gloo-free, CPU).

Two nodes, one worker each, ``--max-restarts=2``: the worker of global rank 1 raises
``RuntimeError("CUDA error: an illegal memory access was encountered")`` under torch's
``@record`` at its first start (tests/e2e/fate_worker.py). Its node's agent re-joins, and the
plug-in sends what failed with the re-join; the other node restarts for it; the re-formed
round succeeds and both agents exit 0. Then the job's events (the API), ``rdzvctl events``,
the job page in Chromium and ``/metrics`` all say: node rank 1 (its node_id), rank 1, exit
code 1 and the message; the next round's ``round_formed`` says it formed after
``workers_failed`` on that node.

Also here: the handler's final close carries its report (and a server older than reports
gets the close without one), in this process; and part 4 with real agents: a node whose
workers fail alone gets its host cordoned, while one error on every node cordons nobody.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from torch_feature import torchrun_command

from rdzv_client import Client

Cluster = Any  # conftest.py's class; annotations only

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

HERE = Path(__file__).parent
CUDA_ERROR = "RuntimeError: CUDA error: an illegal memory access was encountered"


def start_node(
    cluster: Cluster, server: Any, name: str, job: str, fate_dir: Path, *, addr: str = "127.0.0.1",
    env: dict[str, str] | None = None,
) -> Any:
    workdir = cluster.tmp_path / "nodes" / name
    cmd = [
        *torchrun_command(), "--rdzv-backend=rdzv-server", f"--rdzv-endpoint={server.endpoint}", f"--rdzv-id={job}",
        "--nnodes=2", "--nproc-per-node=1", f"--local-addr={addr}", "--monitor-interval=0.1", "--max-restarts=2",
        f"--log-dir={workdir / 'torchelastic'}",
        "--rdzv-conf=last_call_timeout=1,keep_alive_interval=0.5,keep_alive_max_attempt=4,join_timeout=60",
        str(HERE / "fate_worker.py"),
    ]  # fmt: skip
    return cluster.launch(name, server, cmd, {"LOGLEVEL": "INFO", "FATE_DIR": str(fate_dir), **(env or {"FAIL_RANK": "1"})})


def rdzvctl(endpoint: str, *args: str) -> str:
    """``rdzvctl --endpoint ENDPOINT ARGS``'s output (the token: the server's default file)."""
    done = subprocess.run(
        [sys.executable, "-m", "rdzv_client.ctl", "--endpoint", endpoint, *args],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_worker_failure_is_on_the_timeline_in_rdzvctl_on_the_page_and_in_the_metrics(
    server: Any, cluster: Cluster, tmp_path: Path
) -> None:
    job = "fate-cause"
    fate_dir = tmp_path / "fate"
    fate_dir.mkdir()
    nodes = [start_node(cluster, server, name, job, fate_dir) for name in ("a", "b")]
    codes = cluster.wait_all(150, nodes)
    assert codes == {"a": 0, "b": 0}, codes  # the re-formed round succeeded on both

    # (a) the events API: one workers_failed, of round 0, by the node of node rank 1.
    with Client(server.endpoint, token=server.token) as client:
        events = client.events(job)["events"]
    [failed] = [e for e in events if e["kind"] == "workers_failed"]
    assert (failed["round"], failed["cause"], failed["node_rank"], failed["failed_workers"]) == (0, "rejoined", 1, 1)
    [worker] = failed["failures"]
    assert (worker["global_rank"], worker["local_rank"], worker["exit_code"], worker["signal"]) == (1, 0, 1, "")
    assert worker["message"] == CUDA_ERROR
    failing_node = failed["node_id"]
    failing_agent = next(n for n in nodes if str(n.pid) in failing_node.split("-"))
    assert "its workers failed in round 0: rank 1 (local 0) exit code 1: " + CUDA_ERROR in failing_agent.log_text()
    # ... before the next round formed, which names it as its cause.
    reformed = next(e for e in events if e["kind"] == "round_formed" and e["round"] == 1)
    assert failed["seq"] < reformed["seq"]
    assert (reformed["opened_by"], reformed["opened_by_node"]) == ("workers_failed", failing_node)
    assert "opened_by" not in next(e for e in events if e["kind"] == "round_formed" and e["round"] == 0)
    # The other node restarted for it: no failure of its own.
    assert [e["node_id"] for e in events if e["kind"] == "workers_failed"] == [failing_node]

    # (b) rdzvctl events: the failure in words on its row.
    table = rdzvctl(server.endpoint, "events", job)
    [row] = [line for line in table.splitlines() if " workers_failed " in line]
    assert row.split()[2:7] == ["0", "workers_failed", "rejoined", failing_node, "127.0.0.1"], table
    assert "node_rank=1" in row and f"rank 1 (local 0) exit code 1: {CUDA_ERROR}" in row, table
    [formed_row] = [line for line in table.splitlines() if line.split()[2:4] == ["1", "round_formed"]]
    assert f"opened_by=workers_failed opened_by_node={failing_node}" in formed_row, table

    # (c) /metrics: the failed worker counted by its kind.
    request = urllib.request.Request(f"{server.url}/metrics", headers=server.auth)
    with urllib.request.urlopen(request, timeout=10) as answer:
        metrics = answer.read().decode()
    assert 'rdzv_worker_failures_total{kind="exit_1"} 1.0' in metrics

    # (d) the job page in Chromium: the failing node's lane is "failed" in round 0, the
    # message on hover; the timeline's row says it in words.
    from integration.test_dashboard_browser import job_page_in_chromium, lanes

    with job_page_in_chromium(
        server,
        job,
        tmp_path,
        "[...document.querySelectorAll('#lanes td')].some(td => td.dataset.state === 'failed')"
        " && [...document.querySelectorAll('#timeline tbody tr')].some(r => r.cells[2].textContent === 'workers_failed')",
        "the failure on the job page",
    ) as (browser, shot):
        drawn = lanes(shot)
        assert drawn[failing_node][0] == "failed", drawn
        assert "failed" not in [cells[0] for node_id, cells in drawn.items() if node_id != failing_node], drawn
        hover = browser.evaluate(
            "[...document.querySelectorAll('#lanes td')].find(td => td.dataset.state === 'failed').title"
        )
        assert hover == f"{failing_node}, round 0: workers failed (rank 1 (local 0) exit code 1: {CUDA_ERROR})", hover
        [shown] = [r for r in shot.timeline() if r[2] == "workers_failed"]
        assert shown[1:6] == ["0", "workers_failed", "rejoined", failing_node, "127.0.0.1"], shown
        assert shown[6] == f"node rank 1, 1 failed: rank 1 (local 0) exit code 1: {CUDA_ERROR}", shown
        round_title = browser.evaluate("document.querySelector('#lanes thead th:nth-child(3)').title")
        assert f"after workers_failed on {failing_node}" in round_title, round_title


# -- the handler's final close, in this process against the real server ----------------------------

HANDLER_CONF = {"join_timeout": 60, "last_call_timeout": 1, "keep_alive_interval": 0.5, "keep_alive_max_attempt": 4}


class OldServer:
    """A client as a server older than failure reports answers it: a join or a close that
    carries one is refused (``bad_request``, an unknown field), anything else goes through."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.closes: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def close_job(self, rdzv_id: str, **fields: Any) -> None:
        from rdzv_client.error import BadRequestError

        self.closes.append(fields)
        if fields.get("failure") is not None:
            raise BadRequestError("unknown field(s) ['failure', 'node_id'] for CloseRequest")
        self.client.close_job(rdzv_id, **fields)


def failed_run_result() -> Any:
    """What torch's ``launch_agent`` holds when its last restart failed: worker 0 raised."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=3, error_file="/nonexistent/error.json")
    return RunResult(state=WorkerState.FAILED, failures={0: failure})


def one_node_handler(server: Any, job: str, client: Any) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_client.conf import NodeConf
    from rdzv_client.torchrun import RdzvServerHandler

    params = RendezvousParameters("rdzv-server", server.endpoint, job, 1, 1, local_addr="127.0.0.1", **HANDLER_CONF)
    handler = RdzvServerHandler(NodeConf.read(params), 1, client=client)
    assert handler.next_rendezvous().rank == 0
    return handler


def test_an_agent_with_no_restart_left_reports_its_failure_with_its_close(server: Any) -> None:
    job = "fate-close"
    with Client(server.endpoint, token=server.token) as client:
        handler = one_node_handler(server, job, client)
        result = failed_run_result()  # on this thread's stack, as launch_agent's is when it calls shutdown()
        assert handler.shutdown() and result.is_failed()
        events = client.events(job)["events"]
    failed, closed = [e for e in events if e["kind"] in ("workers_failed", "job_closed")]
    assert (failed["cause"], failed["node_id"], failed["round"]) == ("agent", handler.node_id, 0)
    assert [(f["global_rank"], f["exit_code"], f["message"]) for f in failed["failures"]] == [(0, 3, "exit code 3")]
    assert closed["cause"] == "agent" and failed["seq"] < closed["seq"]


def test_shutdown_called_again_as_torch_2_4_does_reports_the_failure_once(server: Any) -> None:
    """torch 2.4.1 calls the handler's shutdown() three times for one failed run (the agent's own
    _shutdown, then launch_agent's finally): one report, one close (bench/torch-compat.sh 2.4.1)."""
    job = "fate-close-again"
    with Client(server.endpoint, token=server.token) as client:
        handler = one_node_handler(server, job, client)
        result = failed_run_result()
        assert [handler.shutdown() for _ in range(3)] == [True, True, True] and result.is_failed()
        events = client.events(job)["events"]
    assert [e["kind"] for e in events if e["kind"] in ("workers_failed", "job_closed")] == [
        "workers_failed", "job_closed"
    ]


def test_a_server_older_than_failure_reports_still_gets_the_close_without_one(server: Any) -> None:
    job = "fate-old-server"
    with Client(server.endpoint, token=server.token) as client:
        old = OldServer(client)
        handler = one_node_handler(server, job, old)
        result = failed_run_result()
        assert handler.shutdown() and result.is_failed()
        assert [c.get("failure") is not None for c in old.closes] == [True, False]
        assert client.job(job)["state"] == "closed"


# -- failures that follow a host (part 4) ----------------------------------------------------------


@pytest.fixture
def quarantining_server(tmp_path: Path) -> Any:
    """A server of its own that cordons a host at its first host-local failure (3 by default): the
    strictest setting, so that a failure on every node, counted by mistake, would cordon too."""
    from server_process import ServerProcess

    (tmp_path / "server").mkdir()
    srv = ServerProcess(tmp_path / "server", durable=False, args=("--quarantine-failures", "1"))
    srv.start()
    yield srv
    srv.close()


@pytest.mark.timeout(400)  # two jobs of two rounds each, four agents at once on a shared machine
def test_host_local_failures_cordon_the_host_and_failures_on_every_node_cordon_none(
    quarantining_server: Any, cluster: Cluster, tmp_path: Path
) -> None:
    """Nodes tell hosts apart by ``--local-addr`` (loopback addresses of this one machine). Two
    jobs at once, each failing once, then succeeding in its second round (``--max-restarts=2``):
    in one, every node's workers fail at the same moment with the same error (the script, not a
    host); in the other, node h2's fail alone."""
    server = quarantining_server
    script_dir, local_dir = tmp_path / "script", tmp_path / "local"
    script_dir.mkdir()
    local_dir.mkdir()
    together = {"FAIL_HERE": "1", "FAIL_TOGETHER": "1"}
    nodes = {
        "s1": ("fate-script", script_dir, "127.0.0.4", together),
        "s2": ("fate-script", script_dir, "127.0.0.5", together),
        "h1": ("fate-host", local_dir, "127.0.0.2", {"FAIL_STARTS": "1"}),  # fails not (no FAIL_HERE)
        "h2": ("fate-host", local_dir, "127.0.0.3", {"FAIL_HERE": "1"}),
    }
    started = [start_node(cluster, server, n, job, d, addr=a, env=e) for n, (job, d, a, e) in nodes.items()]
    # A cordon does not stop a running member: every agent ends with its second round.
    assert cluster.wait_all(300, started) == {"s1": 0, "s2": 0, "h1": 0, "h2": 0}
    with Client(server.endpoint, token=server.token) as client:
        failed = [e for e in client.events("fate-script")["events"] if e["kind"] == "workers_failed"]
        assert sorted(e["addr"] for e in failed) == ["127.0.0.4", "127.0.0.5"], failed
        since = 0
        while True:  # the cordon follows the second round's formation: wait for it on the timeline
            page = client.events("fate-host", since=since, wait=20.0)
            assert page["events"], "no host_cordoned on job fate-host's timeline"
            cordoned = [e for e in page["events"] if e["kind"] == "host_cordoned"]
            if cordoned:
                break
            since = page["next_seq"] - 1
        assert (cordoned[0]["cause"], cordoned[0]["host"]) == ("workers_failed", "127.0.0.3"), cordoned
        # A round's quarantine is applied as its record becomes durable, seconds before its agents
        # end: once they all exited, a cordon for the script job's hosts would be listed.
        [cordon] = client.cordons()["cordons"]
    assert (cordon["host"], cordon["by"]) == ("127.0.0.3", "workers_failed"), cordon
    assert cordon["reason"].endswith(CUDA_ERROR), cordon
