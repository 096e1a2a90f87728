"""A torchrun node's life on the wire without torch: the real client's node loop, in a process
of its own (the liveness and mixed-version tests stop it, cut its network, or run it from an
older revision of the client).

    python node_agent.py ENDPOINT JOB NODE_ID NODES TTL

Joins job JOB as NODE_ID (``min_nodes = max_nodes = NODES``, heartbeat TTL ``TTL`` s) through
:func:`rdzv_client.node.node_client` (one pipelined stream connection, as the plug-in), prints
``formed ROUND NODE_RANK`` once its round forms, then watches and beats that round with
:class:`rdzv_client.node.NodeLoop` until it is killed. It uses only what the client has had
since the node loop moved out of the torchrun handler (09e581b), so that the mixed-version
tests can run it against an older ``rdzv_client``.
"""

from __future__ import annotations

import sys
import threading

from rdzv_client import wire
from rdzv_client.node import NodeLoop, node_client

#: How long a node may wait for its round to form, and the client's retry budget: a bound on a
#: broken run only.
PATIENCE = 60.0


def main() -> None:
    endpoint, job, node_id, nodes, ttl = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
    client = node_client(endpoint, PATIENCE, {})
    settings = wire.JobSettings(min_nodes=nodes, max_nodes=nodes, last_call_timeout=0.5, heartbeat_ttl=ttl)
    assignment = client.join(
        job, node_id=node_id, addr="127.0.0.1", nproc_per_node=1, settings=settings, timeout=PATIENCE
    )
    loop = NodeLoop(client, job, node_id, keep_alive_interval=ttl / 5, heartbeat_ttl=ttl)
    loop.watch(assignment.round)
    print(f"formed {assignment.round} {assignment.node_rank}", flush=True)
    threading.Event().wait()  # until killed: the loop's threads beat meanwhile


if __name__ == "__main__":
    main()
