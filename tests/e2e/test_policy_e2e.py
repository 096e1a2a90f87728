"""Job policy lives on the server (issue 28), with real ``torchrun`` agents (CPU) and the real
``rdzvctl``: two jobs cover the issue's four scenarios.

1. ``rdzvctl policy set 'pol-*' min_nodes=2 max_nodes=2 max_restarts=1``, then two agents with
   ``--nnodes=1:8`` and no ``--rdzv-conf`` form a round of exactly 2, and the job document says
   where each setting came from. Their worker of global rank 0 fails on every attempt until the
   third; after the first failure an operator raises ``max_restarts`` for the job alone
   (``rdzvctl policy set pol-1 max_restarts=2``: a job id beats the glob), so the second failure,
   which the first budget would have ended the job for, is survived and the third attempt
   succeeds. The timeline has ``policy_changed`` between the two failures.
2. A ``--nnodes=3`` job whose two agents disagree on ``last_call_timeout`` (1 s and 20 s) under a
   policy that sets that key: both join (no ``settings_conflict``), wait for a third node that
   never comes, and form once ``rdzvctl policy set late-3 min_nodes=2`` runs; gloo all_reduce in
   a world of 2. The job page shows each setting with its source.

And in this process, the torchrun handler against the real server: a node-side key changed
while a round runs applies at the node's next join (its beats carry the new policy version).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch_feature import torchrun_command
from waiting import wait_until

from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters

from rdzv_client import Client
from rdzv_client.conf import NodeConf
from rdzv_client.error import NotFoundError
from rdzv_client.torchrun import RdzvServerHandler

Cluster = Any  # conftest.py's class; annotations only

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

HERE = Path(__file__).parent
WORKER = HERE / "policy_worker.py"
TRAIN = HERE / "train.py"


def rdzvctl(server: Any, *args: str) -> str:
    """``rdzvctl --endpoint ENDPOINT ARGS``'s output (its token: the server's default file)."""
    done = subprocess.run(
        [sys.executable, "-m", "rdzv_client.ctl", "--endpoint", server.endpoint, *args],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def agent(
    cluster: Cluster, server: Any, name: str, job: str, *, nnodes: str, conf: str = "", max_restarts: int = 0,
    script: Path = WORKER, env: dict[str, str] | None = None,
) -> Any:
    """A torchrun agent given what a scheduler gives (endpoint, id, --nnodes) and no
    ``--rdzv-conf`` unless ``conf``."""
    workdir = cluster.tmp_path / "nodes" / name
    cmd = [
        *torchrun_command(), "--rdzv-backend=rdzv-server", f"--rdzv-endpoint={server.endpoint}", f"--rdzv-id={job}",
        f"--nnodes={nnodes}", "--nproc-per-node=1", "--local-addr=127.0.0.1", "--monitor-interval=0.1",
        f"--max-restarts={max_restarts}", f"--log-dir={workdir / 'torchelastic'}",
        *([f"--rdzv-conf={conf}"] if conf else []), str(script),
    ]  # fmt: skip
    return cluster.launch(name, server, cmd, {"LOGLEVEL": "INFO", "RESULT_DIR": str(workdir / "results"), **(env or {})})


def timeline(server: Any, job: str) -> list[dict[str, Any]]:
    """The job's events (none while the job does not exist yet)."""
    with Client(server.endpoint, token=server.token) as client:
        try:
            return list(client.events(job)["events"])
        except NotFoundError:
            return []


def test_a_policy_decides_the_round_and_raising_max_restarts_live_keeps_a_failing_job_alive(
    server_factory: Any, cluster: Cluster, tmp_path: Path
) -> None:
    server = server_factory()
    job = "pol-1"
    said = rdzvctl(server, "policy", "set", "pol-*", "min_nodes=2", "max_nodes=2", "max_restarts=1")
    assert said == "policy pol-*: max_nodes=2 max_restarts=1 min_nodes=2\n"
    gate, state = tmp_path / "gate", tmp_path / "failures"
    state.mkdir()
    env = {"FAIL_RANK": "0", "FAILURES": "2", "GATE": str(gate), "STATE_DIR": str(state)}
    # torch's own --max-restarts is only a ceiling: the job's max_restarts decides.
    nodes = [agent(cluster, server, name, job, nnodes="1:8", max_restarts=5, env=env) for name in ("a", "b")]

    # A round of exactly 2 (max_nodes 2, not the agents' 8), the settings from the policy.
    formed = cluster.wait_for(
        lambda: next((e for e in timeline(server, job) if e["kind"] == "round_formed"), None), 90, "round 0 to form"
    )
    assert (formed["round"], formed["num_nodes"], formed["cause"]) == (0, 2, "max_nodes"), formed
    doc = cluster.job(server, job)
    assert doc is not None
    assert (doc["min_nodes"], doc["max_nodes"], doc["max_restarts"]) == (2, 2, 1), doc
    sources = doc["settings_source"]
    assert {k: sources[k] for k in ("min_nodes", "max_nodes", "max_restarts")} == dict.fromkeys(
        ("min_nodes", "max_nodes", "max_restarts"), "policy pol-*"
    ), sources
    assert not sources["last_call_timeout"].startswith("policy"), sources
    for node in nodes:  # each agent said which of its settings came from a policy
        assert "from policy pol-* (over its own --nnodes / --rdzv-conf)." in node.log_text(), node.name

    # The first failure spends the budget of 1; then an operator raises it for this job alone.
    cluster.wait_for(
        lambda: [e for e in timeline(server, job) if e["kind"] == "restart_counted"] or None, 90, "the first restart"
    )
    assert rdzvctl(server, "policy", "set", job, "max_restarts=2") == "policy pol-1: max_restarts=2\n"
    gate.touch()  # the second failure may come now
    codes = cluster.wait_all(120, nodes)
    assert codes == {"a": 0, "b": 0}, codes  # the third attempt succeeded: the job outlived its first budget

    events = timeline(server, job)
    counted = [e for e in events if e["kind"] == "restart_counted"]
    [changed] = [e for e in events if e["kind"] == "policy_changed"]
    assert [(e["restarts"], e["max_restarts"]) for e in counted] == [(1, 1), (2, 2)], counted
    assert counted[0]["seq"] < changed["seq"] < counted[1]["seq"], events
    assert (changed["cause"], changed["by"], changed["pattern"]) == ("operator", "operator", "pol-1"), changed
    assert changed["changes"] == {"max_restarts": {"old": 1, "new": 2, "source": "policy pol-1"}}, changed
    closed = [e["cause"] for e in events if e["kind"] == "job_closed"]
    assert closed == ["agent"], closed  # not restart_budget_exhausted
    shown = rdzvctl(server, "show", job)
    assert "  max_restarts       2      policy pol-1" in shown.splitlines(), shown
    assert "  min_nodes          2      policy pol-*" in shown.splitlines(), shown


def test_nodes_that_disagree_on_a_key_the_policy_sets_both_join_and_a_live_min_nodes_forms_their_round(
    server: Any, cluster: Cluster, tmp_path: Path
) -> None:
    job = "late-3"
    rdzvctl(server, "policy", "set", job, "last_call_timeout=1")
    nodes = [
        agent(cluster, server, name, job, nnodes="3", conf=f"last_call_timeout={last_call}", script=TRAIN)
        for name, last_call in (("a", 1), ("b", 20))
    ]
    # Both in line (their own last_call_timeout differs: no settings_conflict), waiting for a third.
    doc = cluster.wait_job(server, job, lambda d: len(d["joining"]) == 2, 90, "both nodes in line")
    assert doc["state"] == "open" and "min_nodes" in doc["pending_reason"], doc
    assert [e for e in timeline(server, job) if e["kind"] == "join_refused"] == []

    assert rdzvctl(server, "policy", "set", job, "min_nodes=2") == "policy late-3: last_call_timeout=1 min_nodes=2\n"
    codes = cluster.wait_all(120, nodes)
    assert codes == {"a": 0, "b": 0}, codes
    assert sorted((r["WORLD_SIZE"], r["RANK"]) for r in cluster.results()) == [("2", "0"), ("2", "1")]
    events = timeline(server, job)
    [changed] = [e for e in events if e["kind"] == "policy_changed"]  # the first policy came before the job
    assert changed["changes"] == {"min_nodes": {"old": 3, "new": 2, "source": "policy late-3"}}, changed
    [formed] = [e for e in events if e["kind"] == "round_formed"]
    assert changed["seq"] < formed["seq"] and (formed["num_nodes"], formed["cause"]) == (2, "last_call"), events
    doc = cluster.job(server, job)
    assert doc is not None
    assert (doc["min_nodes"], doc["max_nodes"], doc["last_call_timeout"]) == (2, 3, 1.0), doc
    assert {k: doc["settings_source"][k] for k in ("min_nodes", "max_nodes", "last_call_timeout")} == {
        "min_nodes": "policy late-3", "max_nodes": "node", "last_call_timeout": "policy late-3"
    }

    # The job page: each setting with its source.
    from integration.test_dashboard_browser import job_page_in_chromium

    with job_page_in_chromium(
        server, job, tmp_path, "document.querySelectorAll('#settings tbody tr').length >= 8", "the job's settings"
    ) as (browser, shot):
        rows = browser.evaluate(
            "[...document.querySelectorAll('#settings tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
        )
    assert ["min_nodes", "2", "policy late-3"] in rows and ["max_nodes", "3", "node"] in rows, rows
    assert ["last_call_timeout", "1", "policy late-3"] in rows, rows
    [shown] = [r for r in shot.timeline() if r[2] == "policy_changed"]
    assert shown[6] == "policy late-3 by operator: min_nodes 3 \u2192 2 (policy late-3)", shown


def test_a_health_check_a_policy_sets_while_the_round_runs_applies_at_the_nodes_next_join(server: Any) -> None:
    job = "hc-1"
    with Client(server.endpoint, token=server.token) as client:
        client.set_policy(job, {"gpu_check": False, "health_check": "true"})
        params = RendezvousParameters("rdzv-server", server.endpoint, job, 1, 1, local_addr="127.0.0.1",
                                      keep_alive_interval=0.5, keep_alive_max_attempt=4)  # fmt: skip
        handler = RdzvServerHandler(NodeConf.read(params), 1, client=client)
        try:
            assert handler.next_rendezvous().rank == 0  # its own conf has no health check: the policy's passes
            taken = handler.node.policy_version
            client.set_policy(job, {"health_check": "echo 'GPU 3: ECC errors'; exit 3"})
            # The node's beats (a third of its 2 s TTL) bring the new version while its round runs.
            wait_until(lambda: handler.node.policy_version > taken, timeout=30, what="a beat with the new policy version")
            with pytest.raises(RendezvousError, match="failed health_check `echo 'GPU 3: ECC errors'; exit 3`"):
                handler.next_rendezvous()  # as its agent re-joins after its workers failed
        finally:
            handler.shutdown()
        [refused] = [e for e in client.events(job)["events"] if e["kind"] == "node_refused"]
        assert refused["cause"] == "health_check_failed" and "GPU 3: ECC errors" in refused["reason"], refused
