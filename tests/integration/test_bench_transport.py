"""The bench's simulated agents' transport (bench.transport.AsyncStreamTransport) against a
real server: asyncio tasks share one pipelined stream connection, as the plug-in's threads do."""

from __future__ import annotations

import asyncio

from server_process import ServerProcess
from test_stream_then_watch import FrameCountingProxy

from bench.transport import AsyncStreamTransport
from rdzv_client import AsyncClient, JobSettings
from rdzv_client.credential import find_token


def test_asyncio_tasks_share_one_connection(server: ServerProcess) -> None:
    async def main() -> tuple[list[int], int]:
        transport = AsyncStreamTransport(token=find_token(None, None))
        async with AsyncClient(server.endpoint, transport=transport) as client:
            await client.create_job("tasks", JobSettings(min_nodes=1, max_nodes=1))
            parked = asyncio.ensure_future(client.get("tasks", "k", timeout=30))
            counts = await asyncio.gather(*(client.add("tasks", f"c{i % 4}", 1) for i in range(100)))
            await client.set("tasks", "k", "v")
            assert await parked == b"v"
            return sorted(counts), transport.connections

    counts, connections = asyncio.run(main())
    assert counts == sorted(n for _ in range(4) for n in range(1, 26))
    assert connections == 1


def test_a_join_with_then_watch_has_the_next_watch_parked_and_the_watch_waits_on_it(server: ServerProcess) -> None:
    """As the plug-in's transport: the join carries then_watch on a connection whose hello
    listed it, and the agent's watch of the new round is that parked watch's answer (it comes
    when another node joins): no watch frame goes out (counted on the wire, through a proxy)."""
    proxy = FrameCountingProxy(server)

    async def main() -> tuple[int, int]:
        token = find_token(None, None)
        settings = JobSettings(1, 2, 0.0, 600.0, 30.0)
        async with AsyncClient(proxy.endpoint, transport=AsyncStreamTransport(token=token)) as a, \
                AsyncClient(server.endpoint, transport=AsyncStreamTransport(token=token)) as b:
            await a.create_job("then-watch", settings)  # the connection open, its hello answered
            assignment = await a.join("then-watch", node_id="a", addr="a", nproc_per_node=1, settings=settings,
                                      timeout=30.0, then_watch=True)
            watched = asyncio.ensure_future(a.watch("then-watch", "a", round=assignment.round, known=0, hold=60.0))
            joined = asyncio.ensure_future(b.join("then-watch", node_id="b", addr="b", nproc_per_node=1,
                                                  settings=settings, timeout=30.0))
            seen = await watched
            joined.cancel()
            return seen.num_nodes_waiting, assignment.round - seen.round

    try:
        assert asyncio.run(main()) == (1, 0)
    finally:
        proxy.close()
    assert proxy.sent == ["hello", "create", "join"]
