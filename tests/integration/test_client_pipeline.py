"""One pipelined stream connection per client (rdzv_client.pipeline): requests of many
threads (or tasks) share it, a parked long-poll does not hold up the calls behind it, and a
connection the server dropped is replaced at once."""

from __future__ import annotations

import asyncio
import http.client
import threading
from typing import Any

from server_process import ServerProcess

from rdzv_client import AsyncClient, Client
from rdzv_client.credential import find_token
from rdzv_client.error import ClientClosedError
from rdzv_client.pipeline import AsyncStreamTransport, PipelinedSocketTransport


def stream_connections(server: ServerProcess) -> float:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("GET", "/metrics", headers=server.auth)
        body = conn.getresponse().read().decode()
    finally:
        conn.close()
    return next(float(l.rsplit(" ", 1)[1]) for l in body.splitlines() if l.startswith('rdzv_connections{protocol="stream"}'))


def pipelined(server: ServerProcess) -> tuple[Client, PipelinedSocketTransport]:
    transport = PipelinedSocketTransport(token=server.token)
    return Client(server.endpoint, retry_budget=10.0, transport=transport), transport


def test_threads_share_one_connection_and_a_parked_get_does_not_block_the_set_behind_it(server: ServerProcess) -> None:
    client, transport = pipelined(server)
    with client:
        client.create_job("pipe", min_nodes=1, max_nodes=1)
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(client.get("pipe", "k", timeout=30)))
        waiter.start()
        # The set travels on the connection the get is parked on, and wakes it.
        for i in range(20):
            client.add("pipe", "n", 1)
        client.set("pipe", "k", "v")
        waiter.join(30)
        assert got == [b"v"]
        assert client.add("pipe", "n", 0) == 20
        assert transport.connections == 1
        assert stream_connections(server) == 1


def test_a_connection_the_server_dropped_is_replaced_at_once(server: ServerProcess) -> None:
    client, transport = pipelined(server)
    with client:
        client.create_job("again", min_nodes=1, max_nodes=1)
        server.restart()  # a memory server: it comes back empty, on the same port
        client.create_job("again", min_nodes=1, max_nodes=1)  # on a fresh connection, no error
        assert client.num_keys("again") == 0
        assert transport.connections == 1


def test_asyncio_tasks_share_one_connection(server: ServerProcess) -> None:
    async def main() -> tuple[list[int], int]:
        transport = AsyncStreamTransport(token=find_token(None, None))
        async with AsyncClient(server.endpoint, transport=transport) as client:
            await client.create_job("tasks", min_nodes=1, max_nodes=1)
            parked = asyncio.ensure_future(client.get("tasks", "k", timeout=30))
            counts = await asyncio.gather(*(client.add("tasks", f"c{i % 4}", 1) for i in range(100)))
            await client.set("tasks", "k", "v")
            assert await parked == b"v"
            return sorted(counts), transport.connections

    counts, connections = asyncio.run(main())
    assert counts == sorted(n for _ in range(4) for n in range(1, 26))
    assert connections == 1


def test_many_threads_hand_the_reading_role_on_and_every_reply_finds_its_caller(server: ServerProcess) -> None:
    # No reader thread: whichever caller waits reads for all. Parked gets, while they read,
    # must hand the adds' replies out; adds finishing must hand the reading role on to them.
    client, transport = pipelined(server)
    with client:
        client.create_job("many", min_nodes=1, max_nodes=1)
        got: list[Any] = []
        parked = [
            threading.Thread(target=lambda i=i: got.append(client.get("many", f"k{i}", timeout=60))) for i in range(3)
        ]
        for t in parked:
            t.start()
        counts: list[int] = []
        lock = threading.Lock()

        def adds() -> None:
            for _ in range(100):
                n = client.add("many", "n", 1)
                with lock:
                    counts.append(n)

        workers = [threading.Thread(target=adds) for _ in range(6)]
        for t in workers:
            t.start()
        for t in workers:
            t.join(60)
        assert sorted(counts) == list(range(1, 601))
        for i in range(3):
            client.set("many", f"k{i}", f"v{i}")
        for t in parked:
            t.join(60)
        assert sorted(got) == [b"v0", b"v1", b"v2"]
        assert transport.connections == 1


def test_close_fails_a_parked_call_with_client_closed_error(server: ServerProcess) -> None:
    client, transport = pipelined(server)
    client.create_job("shut", min_nodes=1, max_nodes=1)
    failures: list[BaseException] = []
    started = threading.Event()

    def park() -> None:
        started.set()
        try:
            client.get("shut", "never", timeout=60)
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            failures.append(exc)

    waiter = threading.Thread(target=park)
    waiter.start()
    started.wait(30)
    client.add("shut", "n", 1)  # the connection is busy with the get or the get is yet to start
    client.close()
    waiter.join(30)
    assert not waiter.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], ClientClosedError), failures
