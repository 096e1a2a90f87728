"""The node loop's heartbeat rule on a fake clock (``NodeLoop(clock=...)``): a node the server
has not heard from for a third of its TTL sends a beat (``Client.beat``) at once."""

from __future__ import annotations

import threading
from typing import Any, cast

from rdzv_client.client import Client
from rdzv_client.node import NodeLoop

# A TTL whose third no real clock passes during the test: only the fake clock can make a beat due.
TTL = 3000.0
PATIENCE = 15.0


class FakeClient:
    """Parks the long-poll watch until released; records the beats."""

    def __init__(self) -> None:
        self.beats: list[dict[str, Any]] = []
        self.beaten = threading.Event()
        self.released = threading.Event()

    def beat(self, run_id: str, node_id: str, **fields: Any) -> None:
        self.beats.append({"run_id": run_id, "node_id": node_id, **fields})
        self.beaten.set()

    def watch(self, run_id: str, node_id: str, **fields: Any) -> Any:
        self.released.wait(PATIENCE)
        raise RuntimeError("the test is over")


class SteppedClock:
    """Reads ``times`` in turn, then stays at the last one."""

    def __init__(self, *times: float) -> None:
        self._times = list(times)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._times.pop(0) if len(self._times) > 1 else self._times[0]


def test_a_node_unheard_for_a_third_of_the_ttl_beats_at_once() -> None:
    client = FakeClient()
    # Watching the round is contact at 0; the beat thread then reads a clock past TTL / 3.
    loop = NodeLoop(
        cast(Client, client), "job", "node-a", keep_alive_interval=1.0, heartbeat_ttl=TTL, clock=SteppedClock(0.0, TTL)
    )
    try:
        loop.watch(4)
        assert client.beaten.wait(PATIENCE)
        beat = client.beats[0]
        assert (beat["run_id"], beat["node_id"], beat["round"]) == ("job", "node-a", 4)
    finally:
        loop.stop(for_good=True)
        client.released.set()
