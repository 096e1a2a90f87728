"""The bench's simulated agents' transport (bench.transport.AsyncStreamTransport) against a
real server: asyncio tasks share one pipelined stream connection, as the plug-in's threads do."""

from __future__ import annotations

import asyncio

from server_process import ServerProcess

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
