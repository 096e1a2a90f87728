"""A re-formation as the plug-in's node loop lives it (``rdzv_client.node.NodeLoop``, the real
client on one pipelined connection per node, the real server): a survivor of a death sends
the fewest requests the protocol allows. Its parked watch is answered (nodes waiting), it
re-joins (one request, answered with its assignment once the round forms), and the server
parks its watch of the next round with that answer (the join's ``then_watch``, as the plug-in
joins), which the node loop's first watch waits on: no watch request for the new round, and no
second long-poll of the round that ended (issue 29)."""

from __future__ import annotations

import threading

import pytest
from server_process import ServerProcess
from waiting import parked_long_polls, served, wait_for_parked, wait_until

from rdzv_client import Client, JobSettings, RdzvTimeoutError
from rdzv_client.node import NodeLoop
from rdzv_client.stream import PipelinedSocketTransport

JOB = "reform"
# Beats are due a third of the TTL after the last contact: never within the test, so every
# watch the server answers is a long-poll's.
TTL = 600.0
SETTINGS = JobSettings(min_nodes=2, max_nodes=3, last_call_timeout=0.2, heartbeat_ttl=TTL)


def _node(server: ServerProcess) -> Client:
    return Client(server.endpoint, retry_budget=10.0, transport=PipelinedSocketTransport(token=server.token))


def _join_all(clients: dict[str, Client]) -> dict[str, object]:
    """Every node joins, as the plug-in does (``then_watch``)."""
    got: dict[str, object] = {}

    def join(name: str, client: Client) -> None:
        got[name] = client.join(
            JOB, node_id=name, addr="127.0.0.1", nproc_per_node=1, settings=SETTINGS, timeout=30, then_watch=True
        )

    threads = [threading.Thread(target=join, args=item) for item in clients.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert set(got) == set(clients), f"joins that did not return: {set(clients) - set(got)}"
    return got


def test_a_survivor_re_forms_with_one_watch_answered_one_join_and_no_watch_request(server: ServerProcess) -> None:
    clients = {name: _node(server) for name in ("node-a", "node-b", "node-c")}
    loops = {
        name: NodeLoop(client, JOB, name, keep_alive_interval=TTL / 5, heartbeat_ttl=TTL)
        for name, client in clients.items()
    }
    try:
        for client in clients.values():  # each connection open, its hello answered (it takes then_watch)
            client.create_job(JOB, SETTINGS)
        first = _join_all(clients)
        assert {a.round for a in first.values()} == {0}  # type: ignore[attr-defined]
        for name, loop in loops.items():
            loop.watch(first[name].round)  # type: ignore[attr-defined]
        wait_for_parked(server, 3)
        watches, joins = served(server, "watch"), served(server, "join")

        # node-c dies: its connection drops with its watch parked on it.
        loops["node-c"].stop(for_good=True)
        clients["node-c"].close()
        survivors = {name: loops[name] for name in ("node-a", "node-b")}
        wait_until(lambda: all(loop.num_waiting > 0 for loop in survivors.values()), what="the survivors to see it")
        # Each survivor's watch was answered once; neither parked another on the round that ended.
        assert served(server, "watch") == watches + 2
        assert parked_long_polls(server) == 0

        # The agents re-join (torch's agent does on num_nodes_waiting > 0): one join each,
        # answered with the assignment once the round of the two survivors forms.
        for loop in survivors.values():
            loop.stop()
        second = _join_all({name: clients[name] for name in survivors})
        assert {a.round for a in second.values()} == {1}  # type: ignore[attr-defined]
        assert sorted(a.node_rank for a in second.values()) == [0, 1]  # type: ignore[attr-defined]
        assert {a.num_nodes for a in second.values()} == {2}  # type: ignore[attr-defined]
        # The server parked the next round's two watches with the assignments, before the node
        # loops watch anything, and holds nothing of the round before.
        wait_for_parked(server, 2)
        assert parked_long_polls(server) == 2
        assert served(server, "join") == joins + 2
        assert served(server, "watch") == watches + 2
        for name, loop in survivors.items():
            loop.watch(second[name].round)  # type: ignore[attr-defined]

        timeline = clients["node-a"].events(JOB)["events"]
        story = [(e["kind"], e["cause"], e["round"], e["node_id"]) for e in timeline[5:]]
        assert [story[0], *sorted(story[1:3]), *story[3:]] == [
            ("node_departed", "connection_closed", 0, "node-c"),
            ("node_joined", "rejoined", 1, "node-a"),
            ("node_joined", "rejoined", 1, "node-b"),
            ("round_formed", "last_call", 1, None),
        ]
        assert timeline[-1]["opened_by"] == "member_died"

        # A node arrives: the loops see it through the watches the server parked, the only two
        # (a loop that sent its own watch would have had it answered too: two more).
        late = _node(server)
        with pytest.raises(RdzvTimeoutError):  # it waits for the next round
            late.join(JOB, node_id="node-d", addr="127.0.0.1", nproc_per_node=1, settings=SETTINGS, timeout=0)
        wait_until(lambda: all(loop.num_waiting > 0 for loop in survivors.values()), what="the survivors to see node-d")
        assert served(server, "watch") == watches + 4
        assert parked_long_polls(server) == 0
        late.close()

        # An older plug-in parks a second watch of the round that ended (known = the nodes it
        # saw waiting): the server still holds it to its hold and answers it with the job as
        # it is, the next round formed.
        seen = clients["node-a"].watch(JOB, "node-a", round=0, known=1, hold=0.5)
        assert (seen.round, seen.state, seen.num_nodes_waiting) == (1, "complete", 1)
    finally:
        for loop in loops.values():
            loop.stop(for_good=True)
        for client in clients.values():
            client.close()
