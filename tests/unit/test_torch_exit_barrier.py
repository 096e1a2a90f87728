"""What the mixed finish relies on in torch (docs/torch-compat.md): the exit barrier's keys.

The server imports no torch, so it watches the barrier under names declared in
``rdzv_client.record``; these tests hold them equal to torch's, one test per private name
of torch's (STYLE 16), plus torch's own barrier run against a recording store, so an upgrade
that renames or reshapes the barrier fails here, by name.
"""

from __future__ import annotations

from datetime import timedelta

from torch.distributed.elastic.agent.server import api as agent_api
from torch.distributed.elastic.utils import store as store_util

from rdzv_client.record import (
    EXIT_BARRIER_COUNT_KEY,
    EXIT_BARRIER_LAST_MEMBER_KEY,
    EXIT_BARRIER_PREFIX,
    EXIT_BARRIER_RELEASE_VALUE,
)


class RecordingStore:
    """The calls torch's barrier makes on the agent's store (the plug-in's ``RdzvStore``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.keys: dict[str, int | bytes] = {}
        self.timeout = timedelta(seconds=30)

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout

    def add(self, key: str, amount: int) -> int:
        self.calls.append(("add", key))
        value = int(self.keys.get(key, 0)) + amount
        self.keys[key] = value
        return value

    def set(self, key: str, value: str | bytes) -> None:
        self.calls.append(("set", key))
        self.keys[key] = value.encode() if isinstance(value, str) else value

    def wait(self, keys: list[str]) -> None:
        self.calls.append(("wait", tuple(keys)))
        assert all(k in self.keys for k in keys), "the barrier would wait here"

    def get(self, key: str) -> bytes:
        """torch 2.4's barrier waits with a blocking ``get`` of the key (later ones ``wait``)."""
        self.calls.append(("wait", (key,)))
        assert key in self.keys, "the barrier would wait here"
        value = self.keys[key]
        return value if isinstance(value, bytes) else str(value).encode()


def test_the_agent_enters_its_exit_barrier_under_the_prefix_the_server_watches() -> None:
    assert agent_api._TERMINAL_STATE_SYNC_ID == EXIT_BARRIER_PREFIX


def test_the_barriers_member_count_is_the_key_the_server_counts() -> None:
    assert (EXIT_BARRIER_PREFIX + store_util._NUM_MEMBERS).encode() == EXIT_BARRIER_COUNT_KEY


def test_the_barriers_last_member_key_is_the_key_the_server_sets() -> None:
    assert (EXIT_BARRIER_PREFIX + store_util._LAST_MEMBER_CHECKIN).encode() == EXIT_BARRIER_LAST_MEMBER_KEY


def test_torchs_barrier_adds_to_the_count_and_its_last_member_sets_the_key_others_wait_for() -> None:
    store = RecordingStore()
    store_util.barrier(store=store, world_size=1, key_prefix=EXIT_BARRIER_PREFIX, barrier_timeout=5)
    count, last = EXIT_BARRIER_COUNT_KEY.decode(), EXIT_BARRIER_LAST_MEMBER_KEY.decode()
    assert store.calls == [("add", count), ("set", last), ("wait", (last,))]
    assert store.keys[last] == EXIT_BARRIER_RELEASE_VALUE  # what the server sets in a mixed finish


def test_a_member_that_is_not_the_last_only_waits_for_the_key() -> None:
    store = RecordingStore()
    count, last = EXIT_BARRIER_COUNT_KEY.decode(), EXIT_BARRIER_LAST_MEMBER_KEY.decode()
    store.keys[last] = EXIT_BARRIER_RELEASE_VALUE  # released (by the server, say) before it came
    store_util.barrier(store=store, world_size=2, key_prefix=EXIT_BARRIER_PREFIX, barrier_timeout=5)
    assert store.calls == [("add", count), ("wait", (last,))]
