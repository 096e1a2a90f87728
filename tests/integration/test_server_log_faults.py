"""The one server when its log cannot keep up or fails, against the real server process:

- A local append that fails (here: the file-size limit, EFBIG, a full disk's cousin) is
  answered ``503 log_failed``, never a 500 with a traceback, and the server stops.
- Past ``--max-log-queue`` records waiting for the disk, new writes are refused with
  ``503 log_queue_full`` before they are applied.
- A node whose join is refused again and again for the same reason is on the job's timeline
  once, not once per attempt (the log does not grow under an agent retrying in a loop).
"""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import struct
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import msgpack
import pytest
from raw_stream import FrameReader
from server_process import ServerProcess

from rdzv_client import Client, JobSettings, wire
from rdzv_client.error import ConflictError


def post_json(srv: ServerProcess, job: str, op: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{srv.url}/v1/jobs/{job}/{op}",
        data=json.dumps(body).encode(),
        headers={**srv.auth, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=15) as answer:
            return answer.status, dict(json.loads(answer.read()))
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, dict(json.loads(exc.read()))


def segments(data_dir: Path) -> list[Path]:
    return sorted(data_dir.glob("log-*.bin"))


@pytest.mark.skipif(not hasattr(resource, "prlimit"), reason="needs Linux prlimit")
def test_a_failed_local_append_is_a_503_log_failed_and_the_server_stops(durable_server: ServerProcess) -> None:
    job = f"faults-{uuid.uuid4().hex[:8]}"
    with Client(durable_server.endpoint) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        # Make the segment larger than the server's own log file will grow during this test:
        # the size limit set below applies to every file the server writes, its stderr too.
        client.set(job, "padding", b"p" * 256 * 1024)
    assert durable_server.data_dir is not None and durable_server.proc is not None
    size = sum(path.stat().st_size for path in segments(durable_server.data_dir)[-1:])
    # From now on the server cannot grow the segment: its next write fails with EFBIG
    # (Python ignores SIGXFSZ, so the write fails instead of the process dying).
    resource.prlimit(durable_server.proc.pid, resource.RLIMIT_FSIZE, (size, size))
    status, body = post_json(durable_server, job, "set", {"key": "k", "value": "v"})
    assert (status, body["error"]) == (503, "log_failed"), body
    assert "restart" in body["message"]
    code = durable_server.proc.wait(30)
    assert code != 0
    log = durable_server.log_text()
    assert "Traceback" not in log, log[-3000:]
    assert "stopped because the log failed" in log, log[-3000:]


def stream_frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def test_writes_past_the_log_queue_bound_are_refused_503_before_they_apply(
    server_factory: Any, tmp_path: Path
) -> None:
    srv: ServerProcess = server_factory(durable=True, args=("--max-log-queue", "1"))
    job = f"faults-{uuid.uuid4().hex[:8]}"
    with Client(srv.endpoint) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    count = 20
    frames = b"".join(
        stream_frame([tag, "set", job, {"key": f"k{tag}".encode(), "value": b"v", "rid": ["pipelined", tag]}])
        for tag in range(2, 2 + count)
    )
    with socket.create_connection(("127.0.0.1", srv.port), timeout=15) as sock:
        # One send: the frames arrive together, so every set after the first one finds the
        # first still queued for the disk (the bound is one record).
        sock.sendall(wire.STREAM_PREFACE + stream_frame([1, wire.HELLO_OP, "", {"token": srv.token}]) + frames)
        reader = FrameReader(sock)
        replies = [reader.recv() for _ in range(count + 1)]
    by_tag = {tag: (status, body) for tag, status, body in replies}
    assert by_tag[1][0] == 200
    ok = [tag for tag in range(2, 2 + count) if by_tag[tag][0] == 200]
    refused = [tag for tag in range(2, 2 + count) if by_tag[tag][0] != 200]
    assert ok and refused, by_tag
    for tag in refused:
        status, body = by_tag[tag]
        assert (status, body["error"]) == (503, "log_queue_full"), body
    with Client(srv.endpoint) as client:
        for tag in ok:
            assert client.get(job, f"k{tag}", timeout=5) == b"v"
        for tag in refused:  # refused before they were applied
            assert not client.check(job, [f"k{tag}"])
        # The refusal is "busy, retry": the client's own retry gets through.
        client.set(job, "after", "1")


def test_a_node_refused_again_and_again_is_on_the_timeline_once(server: ServerProcess) -> None:
    job = f"faults-{uuid.uuid4().hex[:8]}"
    with Client(server.endpoint) as client:
        client.join(job, node_id="a", addr="a.host", nproc_per_node=1,
            settings=JobSettings(min_nodes=1, max_nodes=1), timeout=5)
        before = client.events(job)["next_seq"]
        for _ in range(5):  # an agent with the wrong --nnodes, restarting in a loop
            with pytest.raises(ConflictError):
                client.join(job, node_id="odd", addr="odd.host", nproc_per_node=1,
                    settings=JobSettings(min_nodes=1, max_nodes=8), timeout=5)
        # The same request again, with the same request id (a client retrying it).
        odd = {"node_id": "odd", "addr": "odd.host", "nproc_per_node": 1, "min_nodes": 1, "max_nodes": 8}
        for _ in range(3):
            status, body = post_json(server, job, "join", {**odd, "rid": ["retrying", 7]})
            assert (status, body["error"]) == (409, "settings_conflict"), body
        events = client.events(job, since=before - 1)["events"]
        refusals = [e for e in events if e["kind"] == "join_refused"]
        assert len(refusals) == 1, events
        assert refusals[0]["node_id"] == "odd" and "max_nodes=8" in refusals[0]["reason"]
        # Another node's refusal, or the same node's after other events, is news again.
        with contextlib.suppress(ConflictError):
            client.join(job, node_id="odd2", addr="odd2.host", nproc_per_node=1,
                settings=JobSettings(min_nodes=1, max_nodes=8), timeout=5)
        client.close_job(job, cause="operator")
        events = client.events(job, since=before - 1)["events"]
        assert [e["node_id"] for e in events if e["kind"] == "join_refused"] == ["odd", "odd2"]
