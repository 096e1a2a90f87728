"""What happened to a job, as an operator reads it from the real server: the membership
document's pending reason while a round is open, and the metrics of joins, rounds formed
(by reason, with their formation time), departures by cause and how long a death took to
notice, after a node whose agent crashed (its watch connection reset) is marked dead."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
import urllib.error
import urllib.request
import uuid
from typing import Any

from raw_stream import FrameReader
from server_process import ServerProcess
from waiting import PATIENCE, wait_for_parked, wait_until_async

from rdzv_client import AsyncClient, Client, JobSettings, wire


def metrics(srv: ServerProcess) -> dict[str, float]:
    with urllib.request.urlopen(srv.url + "/metrics", timeout=10) as answer:
        text = answer.read().decode()
    return {
        name: float(value)
        for name, _, value in (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))
    }


def open_watch(srv: ServerProcess, job: str, node: str, round_: int) -> socket.socket:
    """A node's watch, parked on a raw stream connection (authenticated by the hello)."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    hello = wire.frame([1, wire.HELLO_OP, "", {"token": srv.token}])
    watch = wire.frame([2, "watch", job, {"node_id": node, "round": round_, "known": 0, "hold": 20.0}])
    sock.sendall(wire.STREAM_PREFACE + hello + watch)
    assert FrameReader(sock).recv()[:2] == [1, 200]  # the hello's answer; the watch's is not sent yet
    return sock


async def test_a_crashed_agent_shows_in_the_metrics_with_its_cause_and_how_fast_it_was_noticed(
    server: ServerProcess,
) -> None:
    job = f"events-{uuid.uuid4().hex[:8]}"
    async with AsyncClient(server.endpoint, retry_budget=10.0) as client:

        def join(node: str) -> asyncio.Task[wire.Assignment]:
            return asyncio.ensure_future(
                client.join(
                    job, node_id=node, addr=f"{node}.host", nproc_per_node=2,
                    settings=JobSettings(min_nodes=2, max_nodes=2, heartbeat_ttl=60.0), timeout=20,
                )
            )

        first = join("crashing")

        async def first_in_line() -> dict[str, Any] | None:
            job_doc = await client.job(job) if job in {j["rdzv_id"] for j in await client.jobs()} else None
            return job_doc if job_doc is not None and job_doc["joining"] else None

        job_doc = await wait_until_async(first_in_line, what="the server has the first node in line")
        assert job_doc["pending_reason"] == "waiting for min_nodes: 1 of 2 joined"
        assignments = await asyncio.gather(first, join("survivor"))
        assert (await client.job(job))["pending_reason"] is None

        watch = open_watch(server, job, "crashing", assignments[0].round)
        await asyncio.to_thread(wait_for_parked, server, 1)  # the watch is parked: the node is on it
        watch.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        watch.close()  # the agent's process died: its kernel resets the connection

        async def crashed_found_dead() -> dict[str, Any] | None:
            nodes = {n["node_id"]: n for n in (await client.job(job))["nodes"]}
            return None if nodes["crashing"]["alive"] else nodes

        nodes = await wait_until_async(crashed_found_dead, what="the crashed node marked dead")  # far inside its 60 s TTL
        assert nodes["survivor"]["alive"]

    seen = metrics(server)
    assert seen['rdzv_node_joins_total{role="candidate"}'] == 2
    assert seen['rdzv_rounds_formed_total{reason="max_nodes"}'] == 1
    assert seen['rdzv_round_formation_seconds_count{reason="max_nodes"}'] == 1
    assert seen['rdzv_node_departures_total{cause="connection_closed"}'] == 1
    assert seen['rdzv_death_detection_seconds_count{cause="connection_closed"}'] == 1
    assert 0.5 <= seen['rdzv_death_detection_seconds_sum{cause="connection_closed"}'] < 5.0  # the grace, not the TTL
    assert any(name.startswith("rdzv_build_info{version=") for name in seen)


def get_json(srv: ServerProcess, path: str, *, token: bool = True) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(srv.url + path, headers=srv.auth if token else {})
    try:
        with urllib.request.urlopen(request, timeout=20) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_events_api_pages_and_long_polls_a_jobs_timeline(server: ServerProcess) -> None:
    job = f"events-{uuid.uuid4().hex[:8]}"
    with Client(server.endpoint) as client:
        client.create_job(job, JobSettings(min_nodes=2, max_nodes=2))
        status, page = get_json(server, f"/v1/jobs/{job}/events")
        assert status == 200 and [e["kind"] for e in page["events"]] == ["job_created"]
        assert page["events"][0]["cause"] == "create" and page["next_seq"] == 2
        assert get_json(server, f"/v1/jobs/{job}/events", token=False)[0] == 401
        assert get_json(server, f"/v1/jobs/{job}/events?since=x")[1]["error"] == "bad_request"

        def join_later() -> None:
            wait_for_parked(server, 1)  # the events long-poll below
            with Client(server.endpoint) as other, contextlib.suppress(Exception):
                other.join(job, node_id="late", addr="late.host", nproc_per_node=1,
                           settings=JobSettings(min_nodes=2, max_nodes=2),
                           timeout=1)

        joiner = threading.Thread(target=join_later)
        joiner.start()
        # Parks until the join: held up to 60 s (the server's 30 s cap), only the join answers
        # it within get_json's 20 s socket timeout.
        status, page = get_json(server, f"/v1/jobs/{job}/events?since=1&wait=60")
        joiner.join(PATIENCE)
        assert status == 200
        assert [(e["kind"], e["cause"], e["node_id"], e["addr"]) for e in page["events"]][:1] == [
            ("node_joined", "candidate", "late", "late.host")
        ]


def test_a_refused_join_and_a_restart_are_on_the_jobs_timeline(durable_server: ServerProcess) -> None:
    job = f"events-{uuid.uuid4().hex[:8]}"
    with Client(durable_server.endpoint) as client:
        client.join(job, node_id="a", addr="a.host", nproc_per_node=1,
            settings=JobSettings(min_nodes=1, max_nodes=1), timeout=5)
        with contextlib.suppress(Exception):
            client.join(job, node_id="odd", addr="odd.host", nproc_per_node=1,
                settings=JobSettings(min_nodes=1, max_nodes=8), timeout=5)
        client.close_job(job, cause="operator")
    durable_server.restart()
    with Client(durable_server.endpoint) as client:
        events = client.events(job)["events"]
    kinds = [(e["kind"], e["cause"], e["node_id"]) for e in events]
    assert kinds[-3:] == [
        ("join_refused", "settings_conflict", "odd"),
        ("job_closed", "operator", None),
        ("server_restarted", "recovery", None),
    ]
    assert "max_nodes=8" in events[-3]["reason"]
