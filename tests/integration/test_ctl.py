"""rdzvctl as a user runs it: a subprocess against a real server on loopback."""

from __future__ import annotations

import json
import os
import pty
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from server_process import ServerProcess
from waiting import PATIENCE, wait_for_parked

from rdzv_client import Client, JobSettings


def rdzvctl(
    *args: str, endpoint: str | None = None, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "rdzv_client.ctl"]
    if endpoint is not None:
        argv += ["--endpoint", endpoint]
    return subprocess.run(
        argv + list(args), check=False, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One memory-only server for the module (a start costs ~0.5 s); every test uses its own
    job. The tests' nodes share a host, and their jobs end: no quarantine of it between tests."""
    srv = ServerProcess(tmp_path_factory.mktemp("ctl-server"), durable=False, args=("--quarantine-after", "0"))
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def client(server: Any) -> Iterator[Client]:
    with Client(server.endpoint) as c:
        yield c


@pytest.fixture
def joined_job(client: Client) -> str:
    job = f"ctl-{uuid.uuid4().hex[:10]}"
    client.join(job, node_id="node-a", addr="10.1.2.3", nproc_per_node=2,
        settings=JobSettings(min_nodes=1, max_nodes=1), timeout=10)
    return job


def test_jobs_lists_the_job_in_a_table(server: Any, joined_job: str) -> None:
    out = rdzvctl("jobs", endpoint=server.endpoint)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["RDZV_ID", "STATE", "ROUND", "NODES", "WORLD_SIZE"]
    row = next(line.split() for line in lines if line.startswith(joined_job))
    assert row[1] == "complete" and row[3] == "1" and row[4] == "2"


def test_jobs_json_is_the_servers_document(server: Any, joined_job: str) -> None:
    out = rdzvctl("--json", "jobs", endpoint=server.endpoint)
    assert out.returncode == 0, out.stderr
    jobs = json.loads(out.stdout)["jobs"]
    assert any(j["rdzv_id"] == joined_job for j in jobs)


def test_show_prints_header_and_node_table(server: Any, joined_job: str) -> None:
    out = rdzvctl("show", joined_job, endpoint=server.endpoint)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"job {joined_job}  state complete  round ")
    assert lines[0].endswith("nodes 1 (1..1)  world_size 2")
    assert lines[2].split() == ["NODE_RANK", "NODE_ID", "ADDR", "NPROC", "RANKS", "ALIVE", "HEARTBEAT"]
    cells = lines[3].split()
    assert cells[:6] == ["0", "node-a", "10.1.2.3", "2", "0-1", "yes"]
    assert cells[6].endswith("s")


def test_show_json_has_the_membership_fields(server: Any, joined_job: str) -> None:
    out = rdzvctl("--json", "show", joined_job, endpoint=server.endpoint)
    doc = json.loads(out.stdout)
    assert doc["rdzv_id"] == joined_job and doc["nodes"][0]["global_ranks"] == [0, 1]


def test_kv_set_get_list_round_trip(server: Any, joined_job: str) -> None:
    assert rdzvctl("kv", "set", joined_job, "cfg/lr", "0.1", endpoint=server.endpoint).returncode == 0
    assert rdzvctl("kv", "set", joined_job, "cfg/bs", "64", endpoint=server.endpoint).returncode == 0
    got = rdzvctl("kv", "get", joined_job, "cfg/lr", endpoint=server.endpoint)
    assert (got.returncode, got.stdout) == (0, "0.1\n")
    listed = rdzvctl("kv", "list", joined_job, "cfg/", endpoint=server.endpoint)
    assert sorted(listed.stdout.splitlines()) == ["cfg/bs", "cfg/lr"]
    as_json = rdzvctl("--json", "kv", "get", joined_job, "cfg/bs", endpoint=server.endpoint)
    assert json.loads(as_json.stdout) == {"key": "cfg/bs", "value": "64"}


def test_the_endpoint_comes_from_the_environment(server: Any, joined_job: str) -> None:
    out = rdzvctl("jobs", env={"RDZV_ENDPOINT": server.endpoint})
    assert out.returncode == 0, out.stderr
    assert joined_job in out.stdout


def test_close_closes_the_job(server: Any, client: Client, joined_job: str) -> None:
    out = rdzvctl("close", joined_job, endpoint=server.endpoint)
    assert out.returncode == 0, out.stderr
    assert client.job(joined_job)["state"] == "closed"


def test_an_unknown_job_is_a_one_line_error_with_its_code(server: Any) -> None:
    out = rdzvctl("show", "no-such-job", endpoint=server.endpoint)
    assert out.returncode == 1
    first, *rest = out.stderr.splitlines()
    assert first.startswith("rdzvctl: error: ") and first.endswith("(job_not_found)")
    assert all(line.startswith("rdzvctl: hint: ") for line in rest)


def test_a_missing_key_exits_1(server: Any, joined_job: str) -> None:
    out = rdzvctl("kv", "get", joined_job, "absent", endpoint=server.endpoint)
    assert out.returncode == 1
    assert "absent" in out.stderr


def test_no_server_exits_3_with_a_hint() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Within PATIENCE: rdzvctl gives up after its own short budget, not the client's default.
    out = rdzvctl("jobs", endpoint=f"127.0.0.1:{port}", timeout=PATIENCE)
    assert out.returncode == 3
    lines = out.stderr.splitlines()
    assert lines[0].startswith("rdzvctl: error: ")
    assert lines[1] == (
        f"rdzvctl: hint: is the server running at 127.0.0.1:{port}? start it with `rdzv-server`, "
        "or point rdzvctl at it with --endpoint HOST:PORT or $RDZV_ENDPOINT"
    )


def test_usage_errors_exit_2() -> None:
    assert rdzvctl("kv", "get", "only-a-job").returncode == 2
    assert rdzvctl("frobnicate").returncode == 2


def test_events_prints_the_jobs_timeline_with_causes(server: Any, joined_job: str) -> None:
    out = rdzvctl("events", joined_job, endpoint=server.endpoint)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["SEQ", "TIME", "ROUND", "EVENT", "CAUSE", "NODE", "ADDR", "DETAIL"]
    rows = [line.split()[3:7] for line in lines[1:]]
    assert rows[:2] == [["job_created", "join", "-", "-"], ["node_joined", "candidate", "node-a", "10.1.2.3"]]
    assert rows[2][:2] == ["round_formed", "max_nodes"] and "world_size=2" in lines[3]
    as_json = rdzvctl("--json", "events", joined_job, "--since", "2", endpoint=server.endpoint)
    assert [json.loads(line)["kind"] for line in as_json.stdout.splitlines()] == ["round_formed"]


def test_events_follow_prints_new_events_and_ends_when_the_job_is_gone(server_factory: Any) -> None:
    srv = server_factory(args=("--job-ttl", "2"))
    job = f"ctl-{uuid.uuid4().hex[:10]}"
    with Client(srv.endpoint) as c:
        c.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        # A job with a node is not idle: it outlives the follow's start, however slow.
        c.join(job, node_id="node-a", addr="10.9.9.9", nproc_per_node=1,
            settings=JobSettings(min_nodes=1, max_nodes=1), timeout=10)
        follow = subprocess.Popen(
            [sys.executable, "-m", "rdzv_client.ctl", "--endpoint", srv.endpoint, "events", job, "--follow"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        wait_for_parked(srv, 1)  # following: its events long-poll is parked, the join printed
        c.leave(job, "node-a")  # a new event; the job is idle again: collected 2 s later
    out, err = follow.communicate(timeout=30)
    assert follow.returncode == 0, err
    assert "node_joined" in out and "10.9.9.9" in out and "left" in out
    assert out.rstrip().endswith("is gone (collected after its --job-ttl)")


def test_show_says_what_an_open_round_is_waiting_for(server: Any, client: Client) -> None:
    job = f"ctl-{uuid.uuid4().hex[:10]}"
    client.create_job(job, JobSettings(min_nodes=2, max_nodes=2))
    lines = rdzvctl("show", job, endpoint=server.endpoint).stdout.splitlines()
    assert lines[1] == "pending: waiting for min_nodes: 0 of 2 joined"
    assert lines[2:4] == ["", "no nodes in the current round"]


# The watch as `rdzvctl watch ...` under a person's terminal: whatever this process's own SIGINT
# disposition (a shell's background job ignores it, and a child inherits an ignored signal),
# Ctrl-C raises KeyboardInterrupt in it. -X faulthandler: a watch that hangs is sent SIGABRT
# and prints where it is.
_INTERRUPTIBLE_CTL = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv[0] = 'rdzvctl'; runpy.run_module('rdzv_client.ctl', run_name='__main__')"
)


def start_watch(endpoint: str, job: str, *args: str, stdout: Any = subprocess.PIPE) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-X", "faulthandler", "-c", _INTERRUPTIBLE_CTL, "--endpoint", endpoint, "watch", job, *args],
        stdout=stdout, stderr=subprocess.PIPE, text=True,
    )


def read_first_frame(watch: subprocess.Popen[str]) -> list[str]:
    """The lines of the first frame: a created job's frame ends with its job_created event."""
    assert watch.stdout is not None
    lines: list[str] = []
    for _ in range(50):  # bounded: a first frame is about ten lines
        line = watch.stdout.readline()
        assert line, f"the watch ended early: {lines} {watch.stderr.read() if watch.stderr else ''}"
        lines.append(line.rstrip("\n"))
        if "job_created" in line:
            return lines
    raise AssertionError(f"no job_created event in the first frame: {lines}")


def test_watch_redraws_when_a_node_joins(server: Any, client: Client) -> None:
    job = f"ctl-{uuid.uuid4().hex[:10]}"
    client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    # An --interval longer than our patience: a second frame in time can only come from the event.
    watch = start_watch(server.endpoint, job, "--frames", "2", "--interval", "25")  # its most
    first = read_first_frame(watch)
    client.join(job, node_id="node-w", addr="10.7.7.7", nproc_per_node=2,
        settings=JobSettings(min_nodes=1, max_nodes=1), timeout=10)
    rest, err = watch.communicate(timeout=PATIENCE)
    assert watch.returncode == 0, err
    assert first[0].startswith(f"job {job}  state open  round 0") and first[1].startswith("pending: ")
    assert not any("node_joined" in line for line in first)
    second = rest.splitlines()
    assert second[0] == "" and second[1].startswith(f"job {job}  state complete")  # a blank line between frames
    assert sum(line.startswith(f"job {job}  ") for line in second) == 1  # --frames 2: no third frame
    rows = [line.split() for line in second]
    assert ["0", "node-w", "10.7.7.7", "2", "0-1", "yes"] == next(r for r in rows if "node-w" in r)[:6]
    kinds = [r[3] for r in rows if len(r) > 3 and r[0].isdigit() and r[3].islower() and "_" in r[3]]
    assert kinds == ["job_created", "node_joined", "round_formed"]


def test_watch_ends_with_exit_0_when_the_job_is_collected(server_factory: Any) -> None:
    srv = server_factory(args=("--job-ttl", "2"))
    job = f"ctl-{uuid.uuid4().hex[:10]}"
    with Client(srv.endpoint) as c:
        c.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        # A node in it keeps the job from collection while rdzvctl starts (slow on a loaded host).
        c.join(job, node_id="node-a", addr="10.9.9.9", nproc_per_node=1,
            settings=JobSettings(min_nodes=1, max_nodes=1), timeout=10)
        watch = start_watch(srv.endpoint, job, "--interval", "1")
        read_first_frame(watch)
        c.leave(job, "node-a")  # the job is idle again: collected 2 s later
    out, err = watch.communicate(timeout=30)
    assert watch.returncode == 0, err
    assert "node_departed" in out and "left" in out
    assert out.rstrip().endswith(f"job {job} is gone (collected after its --job-ttl)")


def test_watch_ends_on_ctrl_c_with_exit_0_and_no_traceback(server: Any, client: Client) -> None:
    job = f"ctl-{uuid.uuid4().hex[:10]}"
    client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    watch = start_watch(server.endpoint, job, "--interval", "25")
    read_first_frame(watch)
    wait_for_parked(server, 1)  # parked in the events long-poll
    watch.send_signal(signal.SIGINT)
    try:
        _, err = watch.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        watch.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
        _, err = watch.communicate(timeout=10)
        raise AssertionError(f"the watch did not end on SIGINT; where it was:\n{err}") from None
    assert (watch.returncode, err) == (0, "")


def test_watch_on_a_terminal_clears_the_screen_for_each_frame(server: Any, client: Client) -> None:
    job = f"ctl-{uuid.uuid4().hex[:10]}"
    client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    main, replica = pty.openpty()
    try:
        watch = start_watch(server.endpoint, job, "--frames", "1", stdout=replica)
        os.close(replica)
        _, err = watch.communicate(timeout=30)
        assert watch.returncode == 0, err
        seen = b""
        for _ in range(100):  # bounded: the frame is a few hundred bytes
            try:
                chunk = os.read(main, 4096)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(main)
    assert seen.startswith(b"\x1b[H\x1b[2J" + f"job {job}  state open".encode())
    assert b"job_created" in seen
