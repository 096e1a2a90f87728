"""A torchrun node holds one connection to the server: its watch, its beats, its joins and
its store calls share one pipelined stream connection (rdzv_client.stream's
PipelinedSocketTransport), so the server spends one descriptor per node however many requests
a node has in flight."""

from __future__ import annotations

from typing import Any

import psutil
from conftest import Cluster
from integration.test_client_pipeline import stream_connections

# The workers run ~20 s: the connections are counted while the round runs.
LONG_STEPS = {"STEPS": "400", "STEP_SLEEP": "0.05"}


def agent_connections(pid: int, port: int) -> int:
    """TCP connections from the agent process ``pid`` to the server's ``port``."""
    return sum(
        1
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def test_each_torchrun_node_holds_one_connection_to_the_server(server: Any, cluster: Cluster) -> None:
    job = "one-connection"
    nodes = [cluster.start(f"n{i}", server, job, nnodes="2", nproc=2, env=LONG_STEPS) for i in range(2)]
    cluster.wait_started(world=4, count=4, timeout=90)

    # While the round runs: each agent's watch is parked, and its store and joins are done.
    seen = cluster.wait_for(
        lambda: (counts := [agent_connections(n.pid, server.port) for n in nodes]) == [1, 1] and counts or None,
        30,
        "each agent to hold exactly one connection to the server",
        details=lambda: f"connections per agent: {[agent_connections(n.pid, server.port) for n in nodes]}",
    )
    assert seen == [1, 1]
    assert stream_connections(server) == 2  # and the server holds one stream per node, no more
    cluster.kill_all()
