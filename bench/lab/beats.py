"""``python -m bench.lab.beats REV [REV ...]``: the server's CPU per heartbeat, this tree against
other revisions, with one and the same driver (~1 minute per revision).

What it owns: one comparison, for issue 29's target on the server's CPU per beat as a ratio to
an older revision's. The scale run (``python -m bench --only scale``) measures heartbeats with
thousands of simulated agents that share the two cores with the server, so its figure moves
with their load; here one asyncio process drives every server alike: :data:`NODES` stream
connections (preface, hello with the token), one node of one job joined on each, then for
:data:`SECONDS` each connection beats every ``NODES / RATE`` s (spread evenly), as the
plug-in's beat thread does: a one-way ``beat`` frame to a server whose hello announced it
(``wire.ONE_WAY_OPS``), else a watch of no hold, whose reply is read. The server's CPU is every
thread's schedstat over the stretch, divided by the beats sent (each checked applied: the job's
nodes are all alive at the end). Each revision's server, and this tree's twice (one-way beats,
and watches of no hold as an old client sends them), run in turn :data:`ROUNDS` times; the
table gives the medians and the ratio of this tree's one-way figure to each (issue 29's
target: at most 0.4 against eb0e1c3).

Revisions are installed as :mod:`bench.lab.versus` installs them (a worktree and a venv each,
under ``--work``, kept for the next run).

What it must not know: the client's policy and transports (the frames are written here, as the
plug-in writes them), the rest of the bench.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgpack

from ..process import server_cpu_ns
from .ceiling import free_port
from .versus import print_medians, revision_tree

NODES = 2048
RATE = 2000.0  # beats/s: a 16,384-node job's rate at the default TTL is ~4,900
SECONDS = 8.0
ROUNDS = 3
JOB = "beats"
ONE_WAY = "this tree, one-way beats"
ANSWERED = "this tree, watches of no hold"
_PREFACE = b"\x00RDZV1\r\n"


def _frame(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


class _Node(asyncio.Protocol):
    """One connection: replies by tag to futures; replies nobody waits for are counted."""

    def __init__(self) -> None:
        from rdzv_client import frame

        self.transport: Any = None
        self.replies = frame.FrameDecoder(1 << 24)
        self.waiting: dict[int, asyncio.Future[Any]] = {}
        self.hello: Any = None
        self.answered = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.replies.feed(data)
        while (payload := self.replies.next_payload()) is not None:
            tag, status, body = msgpack.unpackb(payload)
            self.answered += 1
            future = self.waiting.pop(tag, None)
            if future is not None:
                future.set_result((status, body))

    async def call(self, tag: int, op: str, fields: dict[str, Any]) -> Any:
        future = asyncio.get_running_loop().create_future()
        self.waiting[tag] = future
        self.transport.write(_frame([tag, op, JOB, fields]))
        return await future


def _cpu_s(pid: int) -> float:
    ns = server_cpu_ns(pid)
    if ns is None:
        raise RuntimeError("this measurement reads the server's CPU from Linux' schedstat, which is not here")
    return ns / 1e9


async def _drive(port: int, token: str, one_way: bool | None, pid: int) -> tuple[int, float, int]:
    """Join :data:`NODES` nodes, then beat; (beats sent, server CPU s over them, replies read)."""
    loop = asyncio.get_running_loop()
    nodes: list[_Node] = []
    for _ in range(NODES):
        _, node = await loop.create_connection(_Node, "127.0.0.1", port)
        node.transport.write(_PREFACE)
        nodes.append(node)
    greetings = await asyncio.gather(*(n.call(1, "hello", {"token": token}) for n in nodes))
    announced = "beat" in (greetings[0][1].get("one_way") or [])
    beat_one_way = announced if one_way is None else one_way and announced
    settings = {"nproc_per_node": 1, "min_nodes": NODES, "max_nodes": NODES, "heartbeat_ttl": 60.0, "hold": 60.0}
    joined = await asyncio.gather(*(
        n.call(2, "join", {"node_id": f"n{i}", "addr": "127.0.0.1", **settings}) for i, n in enumerate(nodes)
    ))  # fmt: skip
    round_ = joined[0][1]["round"]
    frames = [
        _frame([3, "beat", JOB, {"node_id": f"n{i}", "round": round_}]) if beat_one_way
        else _frame([3, "watch", JOB, {"node_id": f"n{i}", "round": round_, "hold": 0.0}])
        for i in range(NODES)
    ]  # fmt: skip
    answered0 = sum(n.answered for n in nodes)
    before = _cpu_s(pid)
    start = loop.time()
    sent = 0
    gap = 1.0 / RATE
    while (now := loop.time()) < start + SECONDS:
        due = int((now - start) / gap)  # every beat due by now, connection by connection in turn
        while sent <= due:
            nodes[sent % NODES].transport.write(frames[sent % NODES])
            sent += 1
        await asyncio.sleep(gap)
    await asyncio.sleep(0.5)  # the last beats read and answered
    cpu = _cpu_s(pid) - before
    answered = sum(n.answered for n in nodes) - answered0
    for n in nodes:
        n.transport.close()
    return sent, cpu, answered


def server_cpu_per_beat(python: str, one_way: bool | None) -> tuple[float, int]:
    """Start ``python -m rdzv_server --memory``; µs of its CPU per beat, and the replies read."""
    home = tempfile.mkdtemp(prefix="rdzv-beats-")
    port = free_port()
    proc = subprocess.Popen(
        [python, "-m", "rdzv_server", "--memory", "--host", "127.0.0.1", "--port", str(port),
         "--quarantine-after", "0"],
        env={**os.environ, "XDG_CONFIG_HOME": home}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd=home,  # (from this tree's folder, ``-m`` would import this tree's server whatever the python)
    )  # fmt: skip
    try:
        token_file = Path(home) / "rdzv-server" / "token"
        deadline = time.monotonic() + 30
        while not token_file.exists() or not _listening(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {port} did not start")
            time.sleep(0.05)
        import uvloop

        sent, cpu, answered = uvloop.run(_drive(port, token_file.read_text().strip(), one_way, proc.pid))
        return cpu / sent * 1e6, answered
    finally:
        proc.kill()
        proc.wait()


def _listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.beats", description=__doc__.split("\n\n")[0])
    parser.add_argument("revs", nargs="*", metavar="REV", help="git revisions to compare this tree with")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "rdzv-bench-versus",
                        help="where the revisions' trees and virtual environments are kept")
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, tuple[str, bool | None]] = {ONE_WAY: (sys.executable, True), ANSWERED: (sys.executable, False)}
    runs.update({rev: (revision_tree(rev, args.work)[0], None) for rev in args.revs})
    figures: dict[str, list[float]] = {name: [] for name in runs}
    for round_ in range(1, ROUNDS + 1):
        for name, (python, one_way) in runs.items():
            per_beat, answered = server_cpu_per_beat(python, one_way)
            figures[name].append(per_beat)
            print(f"round {round_}: {name}: {per_beat:.1f} µs per beat ({answered} replies read)", file=sys.stderr, flush=True)
    print(f"server CPU per beat (--memory, {NODES} connections, {RATE:g} beats/s for {SECONDS:g} s, {ROUNDS} rounds)")
    print_medians(figures, ONE_WAY)
    return 0


if __name__ == "__main__":
    sys.exit(main())
