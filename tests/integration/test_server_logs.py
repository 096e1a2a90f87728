"""The server's log as a log pipeline reads it (``--log-format json``): every line one JSON
object, and the lines about a node's death and a job's collection carry the job, node and
cause as fields, so an operator filters by them instead of parsing sentences."""

from __future__ import annotations

import json
import socket
import struct
import uuid
from pathlib import Path
from typing import Any

from server_process import ServerProcess
from test_server_events import open_watch
from waiting import wait_for_parked, wait_until

from rdzv_client import Client, JobSettings, NotFoundError


def json_lines(srv: ServerProcess) -> list[dict[str, Any]]:
    lines = [line for line in srv.log_text().splitlines() if line.strip()]
    parsed = []
    for line in lines:
        doc = json.loads(line)  # every line, not only ours: no stray text, no multi-line record
        assert isinstance(doc, dict) and {"time", "level", "logger", "message"} <= doc.keys(), line
        parsed.append(doc)
    return parsed


def test_json_logs_name_the_job_node_and_cause_of_a_dropped_watch(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, durable=False, args=("--log-format", "json", "--job-ttl", "1"))
    srv.start()
    try:
        job = f"logs-{uuid.uuid4().hex[:8]}"
        with Client(srv.endpoint) as client:
            assignment = client.join(
                job, node_id="crashing", addr="crashing.host", nproc_per_node=1,
                settings=JobSettings(min_nodes=1, max_nodes=1, heartbeat_ttl=60.0), timeout=20,
            )
            watch = open_watch(srv, job, "crashing", assignment.round)
            wait_for_parked(srv, 1)  # the watch is parked: the node is on that connection
            watch.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            watch.close()  # the agent died: its kernel resets the watch connection
            def collected() -> bool:
                try:
                    client.job(job)
                except NotFoundError:
                    return True
                return False

            try:  # the disconnect grace, then the --job-ttl
                wait_until(collected, what=f"job {job} collected")
            except AssertionError as exc:
                raise AssertionError(f"{exc}; the log:\n{srv.log_text()}") from None
        # The collection's log line follows its apply.
        wait_until(lambda: any(r.get("job") == job and "collected" in r["message"] for r in json_lines(srv)),
                   what=f"the log line of job {job}'s collection")
        records = json_lines(srv)
    finally:
        srv.close()

    about_node = [r for r in records if r.get("job") == job and r.get("node") == "crashing"]
    assert {r["cause"] for r in about_node} == {"connection_closed"}
    assert any("dropped its connection" in r["message"] for r in about_node)
    assert any("departed" in r["message"] for r in about_node)
    assert all(r["logger"].startswith("rdzv_server") and r["level"] == "INFO" for r in about_node)
    assert any(r.get("job") == job and "collected" in r["message"] for r in records)
    assert all(r["time"].endswith("Z") for r in records)
