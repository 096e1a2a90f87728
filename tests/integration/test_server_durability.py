"""Durability of the real server process: acknowledged writes survive SIGKILL (also under
concurrent writers, across snapshots built while they write), membership survives a restart
(with a TTL of grace for every node), a torn log tail is truncated at recovery, damage
mid-log refuses to start until --truncate-corrupt-log keeps what precedes it, SIGTERM shuts
down cleanly, a rid applies once across a restart, and recovery starts from a snapshot."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import re
import struct
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from server_process import ServerProcess
from waiting import wait_until, wait_until_async

from rdzv_client import Client, wire
from rdzv_server.config import ServerConfig
from rdzv_client.record import JobSettings
from rdzv_server.core import command as c
from rdzv_server.service import Service


def new_job() -> str:
    return f"durable-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def client(durable_server: ServerProcess) -> Iterator[Client]:
    # Generous budget: calls made across a restart retry until the server is back.
    with Client(durable_server.endpoint, retry_budget=30.0) as c:
        yield c


def start_again(srv: ServerProcess) -> None:
    """Start a stopped server on its port and data dir again.

    The fixture's ``restart()`` drops the old process's stdout pipe unclosed, and its
    ResourceWarning (warnings are errors) would fail whichever test the collector runs in.
    """
    srv.kill()
    if srv.proc is not None and srv.proc.stdout is not None:
        srv.proc.stdout.close()
    srv.start()


def crash_and_restart(srv: ServerProcess) -> None:
    """SIGKILL (no flush, no goodbye), then start again."""
    srv.kill()
    start_again(srv)


def newest_segment(data_dir: Path) -> Path:
    segments = sorted(data_dir.glob("log-*.bin"))
    assert segments, f"no log segment in {data_dir}: {sorted(p.name for p in data_dir.iterdir())}"
    return segments[-1]


def recovered_records(srv: ServerProcess) -> int:
    """How many log records the latest start replayed (from its 'Recovered …' log line)."""
    found = re.findall(r"Recovered \d+ jobs \((\d+) log records\)", srv.log_text())
    assert found, f"no recovery line in the server log:\n{srv.log_text()}"
    return int(found[-1])


def test_every_acknowledged_write_survives_a_sigkill(durable_server: ServerProcess, client: Client) -> None:
    job = new_job()
    client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    for i in range(100):
        client.set(job, f"key/{i}", f"value-{i}")
        assert client.add(job, "counter", 1) == i + 1
    client.set(job, "in-round", "r3", round=3)
    client.append(job, "appended", "ab")
    client.append(job, "appended", "cd")
    client.multi_set(job, ["m/x", "m/y"], ["X", "Y"])
    assert client.compare_set(job, "swapped", "", "first") == b"first"
    assert client.compare_set(job, "swapped", "first", "second") == b"second"
    client.set(job, "deleted", "soon gone")
    assert client.delete_key(job, "deleted") is True
    crash_and_restart(durable_server)
    with Client(durable_server.endpoint, retry_budget=10.0) as after:
        assert after.ready() is True
        values = after.multi_get(job, [f"key/{i}" for i in range(100)], timeout=1)
        assert values == [f"value-{i}".encode() for i in range(100)]
        assert after.get(job, "counter", timeout=1) == b"100"
        assert after.add(job, "counter", 1) == 101
        assert after.get(job, "in-round", timeout=1, round=3) == b"r3"
        assert after.get(job, "appended", timeout=1) == b"abcd"
        assert after.multi_get(job, ["m/x", "m/y"], timeout=1) == [b"X", b"Y"]
        assert after.get(job, "swapped", timeout=1) == b"second"
        assert after.check(job, ["deleted"]) is False
        assert after.num_keys(job) == 100 + 1 + 1 + 2 + 1 + 0
        assert after.num_keys(job, round=3) == 1


def test_membership_survives_a_restart_and_every_node_gets_a_ttl_of_grace(
    durable_server: ServerProcess, client: Client
) -> None:
    job = new_job()
    ttl = 1.5
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # join blocks until the round forms
        futures = {
            node: pool.submit(
                client.join,
                job,
                node_id=node,
                addr=f"{node}.local",
                nproc_per_node=nproc,
                settings=JobSettings(min_nodes=2, max_nodes=2, heartbeat_ttl=ttl),
                timeout=20,
            )
            for node, nproc in (("a", 2), ("b", 3))
        }
        assigned = {node: f.result(timeout=30) for node, f in futures.items()}
    before = client.job(job)
    assert before["state"] == "complete"

    durable_server.kill()
    start_again(durable_server)
    with Client(durable_server.endpoint, retry_budget=10.0) as after:
        # "a" beats first, as its agent would, before anything else is asked
        after.watch(job, "a", round=before["round"], known=0)
        doc = after.job(job)
        assert doc["state"] == "complete"
        assert doc["round"] == before["round"] == assigned["a"].round
        assert doc["world_size"] == 5 and doc["num_nodes"] == 2
        ranks = {n["node_id"]: (n["node_rank"], n["global_ranks"]) for n in doc["nodes"]}
        assert ranks == {n["node_id"]: (n["node_rank"], n["global_ranks"]) for n in before["nodes"]}
        assert ranks["a"][0] == assigned["a"].node_rank and ranks["b"][0] == assigned["b"].node_rank
        assert all(n["alive"] for n in doc["nodes"])  # nobody is dead because the server was down
        # "a" resumes heartbeating at once; "b" never does. "a" must outlive the grace,
        # and "b" must be found dead only once its TTL of grace has passed. Like an agent,
        # "a" beats well inside its TTL: each watch is a beat, held at most ttl / 3.
        deadline = time.monotonic() + ttl + 5.0
        while True:
            hold = min(ttl / 3, max(0.0, deadline - time.monotonic()))
            seen = after.watch(job, "a", round=doc["round"], known=0, hold=hold)
            if seen.num_nodes_waiting > 0 or time.monotonic() >= deadline:
                break
        assert seen.num_nodes_waiting == 1, "the silent node was never found dead after the restart"
        # On the server's own clock: recovery gave "b" a whole TTL before its death.
        events = after.events(job)["events"]
        (restarted,) = [e for e in events if e["kind"] == "server_restarted"]
        (died,) = [e for e in events if e["kind"] == "node_departed"]
        assert died["node_id"] == "b" and died["cause"] == "heartbeat_expired"
        assert died["time"] - restarted["time"] >= ttl, f"b was declared dead {died['time'] - restarted['time']:.2f} s after recovery"
        nodes = {n["node_id"]: n for n in after.job(job)["nodes"]}
        assert nodes["a"]["alive"] is True
        assert nodes["b"]["alive"] is False


@pytest.mark.parametrize("damage", ["garbage appended", "last frame truncated"])
def test_a_torn_last_record_is_truncated_and_everything_before_it_recovers(
    durable_server: ServerProcess, client: Client, damage: str
) -> None:
    job = new_job()
    client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    for i in range(30):
        client.set(job, f"k{i}", f"v{i}")
    durable_server.kill()
    assert durable_server.data_dir is not None
    segment = newest_segment(durable_server.data_dir)
    size = segment.stat().st_size
    if damage == "garbage appended":
        # A frame header that promises 64 bytes, followed by fewer: a write cut short.
        with segment.open("ab") as f:
            f.write(struct.pack("<II", 64, 0xDEADBEEF) + b"torn-write-cut-short")
        survivors = 30
    else:
        with segment.open("r+b") as f:
            f.truncate(size - 3)
        survivors = 29  # the set of k29 was the newest record: it is the torn one
    start_again(durable_server)
    with Client(durable_server.endpoint, retry_budget=10.0) as after:
        assert after.ready() is True
        assert after.multi_get(job, [f"k{i}" for i in range(survivors)], timeout=1) == [
            f"v{i}".encode() for i in range(survivors)
        ]
        assert after.num_keys(job) == survivors
        assert "torn" in durable_server.log_text().lower()
        # Appending continues where the good prefix ends, and that survives too.
        after.set(job, "after-repair", "kept")
    crash_and_restart(durable_server)
    with Client(durable_server.endpoint, retry_budget=10.0) as again:
        assert again.get(job, "after-repair", timeout=1) == b"kept"
        assert again.num_keys(job) == survivors + 1


def frames(segment: Path) -> list[tuple[int, dict[str, Any]]]:
    """(byte offset, record) of every frame of a clean segment."""
    data = segment.read_bytes()
    found, offset = [], 0
    while offset < len(data):
        length, _ = struct.unpack_from("<II", data, offset)
        found.append((offset, msgpack.unpackb(data[offset + 8 : offset + 8 + length], raw=False, strict_map_key=False)))
        offset += 8 + length
    return found


def test_damage_mid_log_refuses_to_start_until_truncate_corrupt_log_keeps_every_key_before_it(
    durable_server: ServerProcess, client: Client
) -> None:
    job = new_job()
    client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    for i in range(30):
        client.set(job, f"k{i}", f"v{i}")  # acknowledged: fsynced
    durable_server.kill()
    assert durable_server.data_dir is not None
    segment = newest_segment(durable_server.data_dir)
    (bad,) = [offset for offset, record in frames(segment) if record["cmd"].get("key") == b"k10"]
    data = bytearray(segment.read_bytes())
    data[bad + 12] ^= 0xFF  # a bit flip inside the record that set k10; k11..k29 stay intact
    segment.write_bytes(bytes(data))

    logged = len(durable_server.log_text())
    with pytest.raises(RuntimeError, match="server did not start"):
        start_again(durable_server)
    assert durable_server.proc is not None and durable_server.proc.returncode == 1
    said = durable_server.log_text()[logged:]
    errors = [line for line in said.splitlines() if line.startswith("rdzv-server: error:")]
    assert len(errors) == 1, said
    assert f"file {segment}, offset {bad}" in errors[0]
    assert "--truncate-corrupt-log" in errors[0]
    assert "Traceback" not in said

    durable_server.args = ("--truncate-corrupt-log",)
    start_again(durable_server)
    with Client(durable_server.endpoint, retry_budget=10.0) as after:
        assert after.ready() is True
        assert after.multi_get(job, [f"k{i}" for i in range(10)], timeout=1) == [f"v{i}".encode() for i in range(10)]
        assert after.num_keys(job) == 10
        after.set(job, "after-repair", "kept")
    assert "--truncate-corrupt-log: dropped every record after record" in durable_server.log_text()
    (aside,) = durable_server.data_dir.glob(segment.name + ".corrupt-*")
    assert aside.read_bytes() == bytes(data)  # the damaged file, set aside whole

    durable_server.args = ()
    crash_and_restart(durable_server)  # the repaired log needs no flag
    with Client(durable_server.endpoint, retry_budget=10.0) as again:
        assert again.get(job, "after-repair", timeout=1) == b"kept"
        assert again.num_keys(job) == 11


def test_sigkill_under_concurrent_writes_loses_no_acknowledged_write_across_snapshots(server_factory: Any) -> None:
    # Snapshots every 100 records: builds run back to back while the writers write, so the
    # kill lands amid segment rotations, builds and installs.
    srv: ServerProcess = server_factory(durable=True, args=("--snapshot-every", "100"))
    assert srv.data_dir is not None
    job = new_job()
    with Client(srv.endpoint, retry_budget=10.0) as c:
        c.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    writers = 4
    acked = [-1] * writers  # the highest i each writer had acknowledged
    stop = threading.Event()

    def write(w: int) -> None:
        with Client(srv.endpoint, retry_budget=1.0) as own:
            i = 0
            while not stop.is_set():
                try:
                    own.set(job, f"w{w}/{i}", f"value-{i}")
                except Exception:  # noqa: BLE001 (the server was killed mid-request)
                    return
                acked[w] = i
                i += 1

    threads = [threading.Thread(target=write, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    try:
        wait_until(
            lambda: sum(acked) >= 600 and len(list(srv.data_dir.glob("snapshot-*.msgpack"))) >= 2, timeout=60,
            what=f"600 writes acked and two snapshots (acked {acked}, in {srv.data_dir})",
        )
        srv.kill()  # SIGKILL amid the writes
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    total = sum(a + 1 for a in acked)
    assert list(srv.data_dir.glob("snapshot-*.msgpack"))
    start_again(srv)
    with Client(srv.endpoint, retry_budget=10.0) as after:
        for w in range(writers):
            keys = [f"w{w}/{i}" for i in range(acked[w] + 1)]
            assert after.multi_get(job, keys, timeout=1) == [f"value-{i}".encode() for i in range(acked[w] + 1)]
        # Writes in flight at the kill may or may not have been applied; none beyond that.
        assert total <= after.num_keys(job) <= total + writers
    assert recovered_records(srv) < total  # it recovered from a snapshot, not the whole log


def test_sigterm_exits_zero_and_keeps_the_data(durable_server: ServerProcess, client: Client) -> None:
    job = new_job()
    client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    client.set(job, "before", "sigterm")
    assert client.add(job, "n", 7) == 7
    assert durable_server.terminate() == 0
    start_again(durable_server)
    with Client(durable_server.endpoint, retry_budget=10.0) as after:
        assert after.get(job, "before", timeout=1) == b"sigterm"
        assert after.add(job, "n", 0) == 7


def test_a_write_resent_with_its_rid_after_a_crash_applies_once(durable_server: ServerProcess, client: Client) -> None:
    job = new_job()
    client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    resent = wire.AddRequest(job, key=b"counter", amount=1, rid=client.next_rid())
    assert client.request(job, resent) == {"value": 1}
    crash_and_restart(durable_server)
    # The client never saw an answer (as far as it knows): it re-sends the same request.
    assert client.request(job, resent) == {"value": 1}
    crash_and_restart(durable_server)
    assert client.request(job, resent) == {"value": 1}
    assert client.request(job, wire.AddRequest(job, key=b"counter", amount=1, rid=client.next_rid())) == {"value": 2}
    assert client.get(job, "counter", timeout=1) == b"2"


def test_recovery_starts_from_a_snapshot(server_factory: Any) -> None:
    srv: ServerProcess = server_factory(durable=True, args=("--snapshot-every", "50"))
    job = new_job()
    with Client(srv.endpoint, retry_budget=10.0) as c:
        c.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        for i in range(100):
            c.set(job, f"s/{i}", str(i))
            c.add(job, "counter", 1)
    assert srv.data_dir is not None
    data_dir = srv.data_dir
    # Written off the request path (.tmp until renamed).
    wait_until(lambda: list(data_dir.glob("snapshot-*.msgpack")), what=f"a snapshot in {data_dir}")
    crash_and_restart(srv)
    with Client(srv.endpoint, retry_budget=10.0) as after:
        assert after.multi_get(job, [f"s/{i}" for i in range(100)], timeout=1) == [str(i).encode() for i in range(100)]
        assert after.get(job, "counter", timeout=1) == b"100"
        assert after.num_keys(job) == 101
    assert list(srv.data_dir.glob("snapshot-*.msgpack"))
    assert recovered_records(srv) < 201  # the snapshot covered a prefix; only the tail was replayed


async def test_snapshots_are_rebuilt_from_the_log_never_read_from_the_live_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # In process: nothing proportional to the state may run on the event loop, so the
    # service must never ask its live machine for a snapshot.
    config = ServerConfig(data_dir=tmp_path / "data", fsync="always", snapshot_every=5)
    svc = Service(config)
    await svc.start()
    assert gc.isenabled()  # recovery gave the collector back
    monkeypatch.setattr(svc.machine, "to_snapshot", lambda: pytest.fail("the live state was snapshotted"))
    try:
        await svc.write(c.Create("job", JobSettings(1, 1, 1.0, 600.0, 600.0)))
        for i in range(5):
            await svc.write(c.Set("job", b"k%d" % i, b"v%d" % i))
        assert config.data_dir is not None
        data_dir = config.data_dir

        async def snapshot_written() -> list[Path]:
            return list(data_dir.glob("snapshot-*.msgpack"))

        await wait_until_async(snapshot_written, timeout=30, what="a snapshot written")
    finally:
        await svc.close()
    again = Service(config)
    await again.start()
    try:
        assert again.recovered_records <= 1  # the snapshot covered the writes
        assert [again.machine.kv("job").get(None, b"k%d" % i) for i in range(5)] == [b"v%d" % i for i in range(5)]
    finally:
        await again.close()


def _post_json(srv: ServerProcess, rdzv_id: str, op: str, fields: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        srv.url + wire.op_path(rdzv_id, op),
        data=json.dumps(fields).encode(),
        headers={"Content-Type": "application/json", **srv.auth},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


@pytest.mark.parametrize(
    "fields",
    [
        {"key": "scoped", "value": "v", "round": 2**70},  # a round number the log cannot encode
        {"key": "dedup", "value": "v", "rid": ["client", 2**70]},  # a rid seq the log cannot encode
    ],
    ids=["round beyond int64", "rid seq beyond uint64"],
)
def test_what_clients_read_before_a_crash_is_what_recovery_rebuilds(
    durable_server: ServerProcess, client: Client, fields: dict[str, Any]
) -> None:
    # Linearizable and durable: no client may observe a write that a crash takes back.
    job = new_job()
    client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
    status, _ = _post_json(durable_server, job, "set", fields)
    scope = fields.get("round")

    def visible() -> tuple[int, Any]:
        return _post_json(durable_server, job, "num_keys", {"round": scope} if scope is not None else {})

    before = visible()
    crash_and_restart(durable_server)
    after = visible()
    assert before == after, f"the set answered {status}; readers saw {before} before the crash and {after} after"
    assert status < 500, f"the set answered {status} (internal error)"
