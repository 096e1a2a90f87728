"""A mixed finish with real ``torchrun`` agents (gloo on CPU), as issue 27 part 2 asks: node 1's
worker exits 3 at its very end while node 0's succeeds. Node 0's agent enters torch's exit
barrier (300 s by default) and node 1's agent re-joins (restarts left) or ends its run (none):
the server releases the barrier and ends the job, so both agents exit within seconds, node 0
with 0 and node 1 non-zero, and the timeline says why (docs/job-fate.md, "A mixed finish").

Node 1's worker exits only once node 0's worker has exited (train.py's EXIT_AT_END), so node
0's agent always reaches the barrier; whether node 1's re-join or node 0's barrier reaches the
server first is left to scheduling, and both orders must end the same way.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from rdzv_client import Client

Cluster = Any  # conftest.py's class; annotations only
Node = Any

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

# The feature's bound (the issue's "within 15 s"): without it node 0's agent waits out torch's
# 300 s exit barrier. Held on torch's own measure of the wait, node 0's agent's "Done waiting for
# other agents. Elapsed: S seconds" (from the barrier's start: the end of its workers), which
# does not count what the agents' teardown costs a loaded machine. Their exits are bounded
# further off, still far inside the 300 s the barrier would take: the full suite on 2 cores
# has seen an agent take over 10 s to exit after its barrier ended in 1 s.
BARRIER_WITHIN_S = 15.0
EXIT_WITHIN_S = 60.0
BARRIER_DONE = re.compile(r"Done waiting for other agents\. Elapsed: ([0-9.]+) seconds")
SHORT = {"STEPS": "3"}


def events(server: Any, job: str) -> list[dict[str, Any]]:
    with Client(server.endpoint) as client:
        return list(client.events(job)["events"])


def finish_mixed(server: Any, cluster: Cluster, job: str, max_restarts: int) -> tuple[Node, Node, dict[str, int]]:
    """Start node 0 (its worker succeeds) and node 1 (its worker exits 3 at its end); wait for
    node 0's worker to finish, then for both agents to exit. Returns the nodes and exit codes."""
    n0 = cluster.start("n0", server, job, nnodes="2", nproc=1, max_restarts=max_restarts, env=SHORT)
    fail = {**SHORT, "EXIT_AT_END": "3", "EXIT_AFTER_RESULTS": str(n0.result_dir)}
    n1 = cluster.start("n1", server, job, nnodes="2", nproc=1, max_restarts=max_restarts, env=fail)
    cluster.wait_for(lambda: n0.results() or None, 120, "node 0's worker to finish")
    codes = cluster.wait_all(EXIT_WITHIN_S)
    waited = [float(s) for s in BARRIER_DONE.findall(n0.log_text())]
    assert waited and waited[0] < BARRIER_WITHIN_S, f"node 0 waited {waited} s in torch's exit barrier"
    return n0, n1, codes


def node_id_of(server: Any, job: str, node: Node) -> str:
    """The node_id the server knows ``node``'s agent by (it holds the agent's pid)."""
    joined = [e["node_id"] for e in events(server, job) if e["kind"] == "node_joined"]
    return next(n for n in joined if int(n.rsplit("-", 2)[1]) == node.pid)


def test_a_worker_failing_at_the_end_with_no_restarts_left_ends_both_agents_at_once(
    server: Any, cluster: Cluster
) -> None:
    job = "mixed-no-restarts"
    n0, n1, codes = finish_mixed(server, cluster, job, max_restarts=0)
    assert codes["n0"] == 0, n0.log_tail()  # its workers succeeded: released from the barrier
    assert codes["n1"] != 0
    assert "exits 3 at its end on purpose" in n1.log_text()
    timeline = events(server, job)
    released = [e for e in timeline if e["kind"] == "exit_barrier_released"]
    # node 1's agent closed the job (its shutdown) and left: the barrier could never complete
    failing = node_id_of(server, job, n1)
    assert [(e["cause"], e["node_id"], e["finished"], e["num_nodes"]) for e in released] == [
        ("member_departed_after_finish", failing, 1, 2)
    ]
    # Its close carried what failed: the report found in torch's launch_agent (its RunResult on
    # the stack when it calls shutdown(): docs/torch-compat.md), with the worker's exit code.
    [failed] = [e for e in timeline if e["kind"] == "workers_failed"]
    assert (failed["cause"], failed["node_id"]) == ("agent", failing), failed
    assert [(f["local_rank"], f["exit_code"], f["message"]) for f in failed["failures"]] == [(0, 3, "exit code 3")]


def test_a_worker_failing_at_the_end_with_restarts_left_ends_both_agents_and_the_timeline_says_why(
    server: Any, cluster: Cluster
) -> None:
    job = "mixed-restarts-left"
    n0, n1, codes = finish_mixed(server, cluster, job, max_restarts=2)
    assert codes["n0"] == 0, n0.log_tail()
    assert codes["n1"] != 0
    # node 1's agent re-joined; the server refused it, naming the cause, and its agent says so
    assert "workers_failed_after_finish" in n1.log_text()
    assert "RendezvousClosedError" in n1.log_text()
    failing = node_id_of(server, job, n1)
    timeline = events(server, job)
    released = [(e["cause"], e["node_id"], e["finished"], e["num_nodes"]) for e in timeline
                if e["kind"] == "exit_barrier_released"]  # fmt: skip
    assert released == [("workers_failed_after_finish", failing, 1, 2)]
    closed = [(e["cause"], e.get("node_id")) for e in timeline if e["kind"] == "job_closed"]
    assert closed == [("workers_failed_after_finish", failing)]
    assert not [e for e in timeline if e["kind"] == "round_formed" and e["round"] > 0]  # no round re-formed
