"""The server's key-value store over HTTP, driven by the real client against a real process:
every store operation, the torch rules they keep, key spaces per round and per job,
long-polls woken by writes from other connections, and long-poll deadlines."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from server_process import ServerProcess
from waiting import PATIENCE, call_within, parked_long_polls, served, wait_for_parked, wait_until

from rdzv_client import BadRequestError, Client, ConflictError, JobSettings, RdzvTimeoutError, wire

# Generous bound for "woken by a write, not by the timeout": far below every timeout used.
# A long-poll's timeout shorter than the server's default hold (30 s): one poll, which only
# a wake can answer before it times out. Waits on the test's side are bounded by PATIENCE too.
ONE_POLL = PATIENCE


def new_job() -> str:
    return f"store-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One memory-only server for the module (a start costs ~0.5 s); every test uses its own job."""
    srv = ServerProcess(tmp_path_factory.mktemp("store-server"), durable=False)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.endpoint, retry_budget=10.0) as c:
        yield c


@pytest.fixture
def job(client: Client) -> str:
    rdzv_id = new_job()
    client.create_job(rdzv_id, JobSettings(min_nodes=1, max_nodes=2))
    return rdzv_id


def in_thread(action: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``action`` in another thread; the list receives what it returns."""
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(action()), daemon=True)
    thread.start()
    return thread, got


# --------------------------------------------------------------------------- single operations


def test_set_then_get_returns_the_bytes_exactly(client: Client, job: str) -> None:
    client.set(job, "text", "hello")
    client.set(job, b"binary", b"\x00\xff\x80 raw")
    client.set(job, "empty", b"")
    assert client.get(job, "text", timeout=1) == b"hello"
    assert client.get(job, b"binary", timeout=1) == b"\x00\xff\x80 raw"
    assert client.get(job, "empty", timeout=1) == b""
    client.set(job, "text", "overwritten")
    assert client.get(job, "text", timeout=1) == b"overwritten"


def test_add_keeps_the_counter_as_decimal_bytes(client: Client, job: str) -> None:
    assert client.add(job, "counter", 5) == 5  # a missing key counts as 0
    assert client.get(job, "counter", timeout=1) == b"5"
    assert client.add(job, "counter", -7) == -2
    assert client.get(job, "counter", timeout=1) == b"-2"
    client.set(job, "preset", "40")
    assert client.add(job, "preset", 2) == 42
    assert client.get(job, "preset", timeout=1) == b"42"


def test_add_on_a_non_integer_is_not_an_integer_and_changes_nothing(client: Client, job: str) -> None:
    client.set(job, "word", "abc")
    with pytest.raises(ConflictError) as info:
        client.add(job, "word", 1)
    assert info.value.code is wire.ErrorCode.NOT_AN_INTEGER
    assert client.get(job, "word", timeout=1) == b"abc"
    assert client.num_keys(job) == 1


def test_an_add_whose_result_does_not_fit_the_wire_either_answers_or_changes_nothing(client: Client, job: str) -> None:
    # The stored integer is arbitrary text; the result of the add must still be answerable.
    big = 2**64
    client.set(job, "big", str(big))
    try:
        result = client.add(job, "big", 1)
    except (ConflictError, BadRequestError):
        assert client.get(job, "big", timeout=1) == str(big).encode()  # refused: unchanged
    else:
        assert result == big + 1
        assert client.get(job, "big", timeout=1) == str(big + 1).encode()


def test_compare_set_follows_torch_rules(client: Client, job: str) -> None:
    # Missing key, empty expected: desired is stored.
    assert client.compare_set(job, "fresh", "", "first") == b"first"
    assert client.get(job, "fresh", timeout=1) == b"first"
    # Missing key, non-empty expected: nothing is stored, expected comes back.
    assert client.compare_set(job, "absent", "guess", "never") == b"guess"
    assert client.check(job, ["absent"]) is False
    # Key holds expected: swapped.
    assert client.compare_set(job, "fresh", "first", "second") == b"second"
    assert client.get(job, "fresh", timeout=1) == b"second"
    # Key holds something else: unchanged, current value comes back.
    assert client.compare_set(job, "fresh", "first", "third") == b"second"
    assert client.get(job, "fresh", timeout=1) == b"second"


def test_append_creates_then_extends(client: Client, job: str) -> None:
    client.append(job, "log", "a")
    client.append(job, "log", b"\x00")
    client.append(job, "log", "bc")
    assert client.get(job, "log", timeout=1) == b"a\x00bc"


def test_multi_set_and_multi_get_keep_order(client: Client, job: str) -> None:
    client.multi_set(job, ["m/1", "m/2", "m/3"], ["one", b"two", "three"])
    assert client.multi_get(job, ["m/3", "m/1", "m/2"], timeout=1) == [b"three", b"one", b"two"]
    assert client.multi_get(job, ["m/2"], timeout=1) == [b"two"]


def test_check_is_true_only_when_every_key_exists(client: Client, job: str) -> None:
    client.multi_set(job, ["x", "y"], ["1", "2"])
    assert client.check(job, ["x"]) is True
    assert client.check(job, ["x", "y"]) is True
    assert client.check(job, ["x", "nope"]) is False
    assert client.check(job, ["nope"]) is False


def test_wait_returns_at_once_for_existing_keys(client: Client, job: str) -> None:
    client.multi_set(job, ["w1", "w2"], ["1", "2"])
    # Within our patience, though it may wait a minute: answered, not held (the server holds 30 s).
    call_within(lambda: client.wait(job, ["w1", "w2"], timeout=60), what="the wait for existing keys answered")


def test_delete_key_reports_whether_the_key_existed(client: Client, job: str) -> None:
    client.set(job, "doomed", "v")
    client.set(job, "kept", "v")
    assert client.delete_key(job, "doomed") is True
    assert client.delete_key(job, "doomed") is False
    assert client.delete_key(job, "never-was") is False
    assert client.check(job, ["doomed"]) is False
    assert client.get(job, "kept", timeout=1) == b"v"


def test_num_keys_counts_the_keys_of_the_job(client: Client, job: str) -> None:
    assert client.num_keys(job) == 0
    client.set(job, "a", "1")
    client.multi_set(job, ["b", "c"], ["2", "3"])
    client.add(job, "d", 1)
    client.append(job, "e", "x")
    assert client.num_keys(job) == 5
    client.set(job, "a", "again")  # an overwrite adds no key
    assert client.num_keys(job) == 5
    client.delete_key(job, "b")
    assert client.num_keys(job) == 4


def test_list_keys_by_prefix_is_sorted_and_exact(client: Client, job: str) -> None:
    client.multi_set(job, ["rank/1", "rank/0", "rank/10", "rankless", "other/rank/2"], ["a"] * 5)
    assert client.list_keys(job, "rank/") == [b"rank/0", b"rank/1", b"rank/10"]
    assert client.list_keys(job, "rank") == [b"rank/0", b"rank/1", b"rank/10", b"rankless"]
    assert client.list_keys(job, "missing/") == []
    assert client.list_keys(job) == sorted([b"rank/1", b"rank/0", b"rank/10", b"rankless", b"other/rank/2"])


# --------------------------------------------------------------------------- key spaces


def test_round_key_spaces_are_isolated_from_each_other_and_from_the_job(client: Client, job: str) -> None:
    client.set(job, "k", "job-wide")
    client.set(job, "k", "round-1", round=1)
    client.set(job, "k", "round-2", round=2)
    client.set(job, "only-in-1", "x", round=1)
    assert client.get(job, "k", timeout=1) == b"job-wide"
    assert client.get(job, "k", timeout=1, round=1) == b"round-1"
    assert client.get(job, "k", timeout=1, round=2) == b"round-2"
    assert client.num_keys(job) == 1
    assert client.num_keys(job, round=1) == 2
    assert client.num_keys(job, round=2) == 1
    assert client.list_keys(job, round=1) == [b"k", b"only-in-1"]
    assert client.check(job, ["only-in-1"]) is False
    assert client.check(job, ["only-in-1"], round=2) is False
    assert client.add(job, "n", 1, round=1) == 1
    assert client.add(job, "n", 1, round=2) == 1
    assert client.add(job, "n", 1) == 1
    assert client.delete_key(job, "k", round=1) is True
    assert client.get(job, "k", timeout=1) == b"job-wide"
    assert client.get(job, "k", timeout=1, round=2) == b"round-2"
    with pytest.raises(RdzvTimeoutError):
        client.get(job, "only-in-1", timeout=0.2, round=2)


def test_two_jobs_never_see_each_others_keys_or_nodes(client: Client) -> None:
    first, second = new_job(), new_job()
    for rdzv_id, node in ((first, "node-first"), (second, "node-second")):
        client.join(rdzv_id, node_id=node, addr=f"{node}.local", nproc_per_node=1,
            settings=JobSettings(min_nodes=1, max_nodes=1), timeout=10)
    client.set(first, "same-name", "first's")
    client.set(second, "same-name", "second's")
    client.set(first, "only-first", "1")
    assert client.get(first, "same-name", timeout=1) == b"first's"
    assert client.get(second, "same-name", timeout=1) == b"second's"
    assert client.check(second, ["only-first"]) is False
    assert client.list_keys(second) == [b"same-name"]
    assert client.num_keys(first) == 2 and client.num_keys(second) == 1
    client.delete_key(second, "same-name")
    assert client.get(first, "same-name", timeout=1) == b"first's"
    with pytest.raises(RdzvTimeoutError):
        client.get(second, "only-first", timeout=0.2)
    first_doc, second_doc = client.job(first), client.job(second)
    assert [n["node_id"] for n in first_doc["nodes"]] == ["node-first"]
    assert [n["node_id"] for n in second_doc["nodes"]] == ["node-second"]
    assert first_doc["rdzv_id"] == first and second_doc["rdzv_id"] == second


# --------------------------------------------------------------------------- long-polls


def test_a_blocking_get_is_woken_by_a_set_from_another_connection(server: Any, client: Client, job: str) -> None:
    getter, got = in_thread(lambda: client.get(job, "late", timeout=ONE_POLL))
    wait_for_parked(server, 1)  # it blocks: nothing to get yet
    with Client(server.endpoint, retry_budget=10.0) as other:
        other.set(job, "late", "arrived")
    getter.join(timeout=PATIENCE)
    assert got == [b"arrived"]  # woken: its one poll could not have timed out yet


@pytest.mark.parametrize("op", ["multi_get", "wait"])
def test_multi_key_long_polls_wake_when_the_last_missing_key_arrives(
    server: Any, client: Client, job: str, op: str
) -> None:
    client.set(job, "k1", "one")
    parked_after_k2: list[int] = []

    def set_the_rest() -> None:
        wait_for_parked(server, 1)
        with Client(server.endpoint, retry_budget=10.0) as other:
            other.set(job, "k2", "two")  # applied when acknowledged: still one missing, no answer yet
            parked_after_k2.append(parked_long_polls(server))
            other.set(job, "k3", "three")

    writer, _ = in_thread(set_the_rest)
    # One poll each: a timeout here means the last key did not wake it.
    if op == "multi_get":
        assert client.multi_get(job, ["k1", "k2", "k3"], timeout=ONE_POLL) == [b"one", b"two", b"three"]
    else:
        client.wait(job, ["k1", "k2", "k3"], timeout=ONE_POLL)
    writer.join(timeout=PATIENCE)
    assert parked_after_k2 == [1]


@pytest.mark.parametrize("op", ["get", "wait", "multi_get"])
def test_a_missing_key_times_out_after_the_callers_timeout(client: Client, job: str, op: str) -> None:
    # The elapsed time is the feature here (the caller's timeout, not sooner): wide on the late side.
    start = time.monotonic()
    with pytest.raises(RdzvTimeoutError):
        if op == "get":
            client.get(job, "never", timeout=0.5)
        elif op == "wait":
            client.wait(job, ["never"], timeout=0.5)
        else:
            client.multi_get(job, ["never"], timeout=0.5)
    assert 0.45 <= time.monotonic() - start < 5.0


def test_a_long_poll_longer_than_the_servers_hold_cap_waits_for_the_callers_timeout(server_factory: Any) -> None:
    capped = server_factory(args=("--max-hold", "0.5"))
    with Client(capped.endpoint, retry_budget=10.0) as c:
        rdzv_id = new_job()
        c.create_job(rdzv_id, JobSettings(min_nodes=1, max_nodes=1))
        polls = served(capped, "get")
        start = time.monotonic()
        with pytest.raises(RdzvTimeoutError):
            c.get(rdzv_id, "never", timeout=1.2)  # over two server holds
        # The elapsed time is the feature (the caller's timeout outlasts the server's cap): wide on the late side.
        assert 1.15 <= time.monotonic() - start < 5.0
        assert served(capped, "get") - polls >= 3  # re-polled as each hold ended

        # A value that arrives after several holds still answers the same call.
        polls = served(capped, "get")
        getter, got = in_thread(lambda: c.get(rdzv_id, "late", timeout=PATIENCE))
        wait_until(lambda: served(capped, "get") - polls >= 2, what="two holds of the get ended")
        with Client(capped.endpoint, retry_budget=10.0) as other:
            other.set(rdzv_id, "late", "after several holds")
        getter.join(timeout=PATIENCE)
        assert got == [b"after several holds"]
