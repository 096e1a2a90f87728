"""``python -m bench.lab.ceiling``: where 8-client store throughput is lost, layer by layer (~1 minute).

What it owns: one diagnostic table, for the store throughput target that ``python -m bench``
measures through the plug-in's store (issue 15: 8-client ``add`` throughput >= 0.35x
TCPStore's). Each row is 8 client processes, each doing one request at a time for
``SECONDS``, on this machine's cores together with the server:

- ``echo``: a uvloop server that answers every length-prefixed frame with a fixed frame and
  does nothing else, with clients that are a bare blocking socket loop: the ceiling of any
  Python server with Python clients here.
- ``TCPStore``: torch's, ``add`` on a key of each client's own (C++ on both ends).
- ``rdzv-server, bare clients``: our server (``--memory``) with the same bare socket loop
  sending ``add`` frames (preface, hello, then ``[tag, "add", job, {key, amount, rid}]``,
  each with a request id as the client sends it, so the server keeps its exactly-once
  session as it does for the client): the server's own cost.
- ``rdzv-server, Client``: the same with ``rdzv_client.Client.add`` (the client's policy and
  its blocking transport).
- ``rdzv-server, RdzvStore``: the same through torch's ``Store`` API (the plug-in's store, as
  ``python -m bench`` measures it).

Rows are run in turn, twice, and each shows its ratio to TCPStore's figure of the same pass,
and the CPU each side spent per request (the clients' own ``process_time``, the server
process's, every thread's schedstat): under 8 clients on a few cores a layer does not cost
what it costs alone, and these columns say which side grew.

What it must not know: the other measurements; it starts its own servers on free ports.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import os
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from ..process import server_cpu_ns

CLIENTS = 8
SECONDS = 2.0
JOB = "ceiling"
_ECHO_REQUEST = struct.pack(">I", 40) + b"x" * 40
_ECHO_REPLY = struct.pack(">I", 12) + b"y" * 12
# What a bench client reads: far above any reply here (the server bounds itself).
READ_LIMIT = 1 << 24


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def replies(sock: socket.socket) -> Callable[[], bytes]:
    """The next frame's payload off ``sock``, one per call (the client package's frame reader)."""
    from rdzv_client import frame

    return functools.partial(frame.FrameDecoder(READ_LIMIT).receive, sock.recv)


# -- servers (each in a process of its own; ``ready`` set once it listens) -----------------


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport: Any = transport
        self._buffer = b""
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        from rdzv_client import frame

        buffer, pos, replies = self._buffer + data, 0, 0
        while (end := frame.frame_end(buffer, pos, READ_LIMIT)) is not None:
            pos, replies = end, replies + 1
        self._buffer = buffer[pos:]
        if replies:
            self._transport.write(_ECHO_REPLY * replies)


def echo_server(port: int, ready: Any) -> None:
    import uvloop

    async def serve() -> None:
        await asyncio.get_running_loop().create_server(_Echo, "127.0.0.1", port)
        ready.set()
        await asyncio.sleep(3600)

    uvloop.run(serve())


def _tcpstore_server(port: int, ready: Any) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ready.set()
    time.sleep(3600)
    del store


# -- clients (``start`` is the common start; each puts its count of requests on ``done``) ----


def _run(request: Callable[[int], object], start: Any, done: Any) -> None:
    """Call ``request(n)`` (n: requests made so far) from the common start for :data:`SECONDS`;
    put how many were made, and the CPU seconds this process spent making them, on ``done``."""
    start.wait()
    count, cpu, end = 0, time.process_time(), time.monotonic() + SECONDS
    while time.monotonic() < end:
        request(count)
        count += 1
    done.put((count, time.process_time() - cpu))


def _echo_client(port: int, token: str, start: Any, done: Any) -> None:
    sock = _connect(port)
    reply = replies(sock)

    def request(n: int) -> None:
        sock.sendall(_ECHO_REQUEST)
        reply()

    _run(request, start, done)


def _tcpstore_client(port: int, token: str, start: Any, done: Any) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    key = f"k{os.getpid()}"
    _run(lambda n: store.add(key, 1), start, done)


def _bare_client(port: int, token: str, start: Any, done: Any) -> None:
    import msgpack

    from rdzv_client import wire

    sock = _connect(port)
    reply = replies(sock)
    sock.sendall(wire.STREAM_PREFACE + wire.frame([1, wire.HELLO_OP, "", {"token": token}]))
    assert msgpack.unpackb(reply())[1] == 200, "the server refused the hello"
    key, session = f"k{os.getpid()}".encode(), f"bare{os.getpid()}"

    def request(n: int) -> None:
        # rid [client id, seq, floor]: one request at a time, so every earlier one is answered
        sock.sendall(wire.frame([n + 2, "add", JOB, {"key": key, "amount": 1, "rid": [session, n + 1, n + 1]}]))
        answer = msgpack.unpackb(reply())
        assert answer[1] == 200, answer

    _run(request, start, done)


def _client_client(port: int, token: str, start: Any, done: Any) -> None:
    from rdzv_client import Client

    client = Client(f"127.0.0.1:{port}", token=token)
    key = f"k{os.getpid()}"
    client.add(JOB, key, 1)  # connected and greeted before the start
    _run(lambda n: client.add(JOB, key, 1), start, done)


def _store_client(port: int, token: str, start: Any, done: Any) -> None:
    from rdzv_client import Client
    from rdzv_client.torchrun import RdzvStore

    store = RdzvStore(Client(f"127.0.0.1:{port}", token=token), JOB)
    key = f"k{os.getpid()}"
    store.add(key, 1)
    _run(lambda n: store.add(key, 1), start, done)


# -- runs ------------------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has spent so far, every thread."""
    ns = server_cpu_ns(pid)
    if ns is None:
        raise RuntimeError(f"cannot read the CPU time of process {pid} (Linux' /proc/PID/task/*/schedstat)")
    return ns / 1e9


class Figure(NamedTuple):
    per_s: float  # requests per second, all clients together
    client_us: float  # CPU per request in the clients
    server_us: float  # CPU per request in the server process


def _throughput(client: Callable[..., None], port: int, token: str, server_pid: int) -> Figure:
    """:data:`CLIENTS` processes running ``client`` against ``port`` (served by ``server_pid``)."""
    ctx = mp.get_context("spawn")
    start, done = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=client, args=(port, token, start, done)) for _ in range(CLIENTS)]
    for proc in procs:
        proc.start()
    time.sleep(4.0)  # every client imported what it needs and connected
    served = cpu_s(server_pid)
    start.set()
    results = [done.get(timeout=120) for _ in procs]
    served = cpu_s(server_pid) - served  # (the clients are done: what it spent is on their requests)
    for proc in procs:
        proc.join(30)
    total = sum(count for count, _ in results)
    return Figure(total / SECONDS, sum(cpu for _, cpu in results) / total * 1e6, served / total * 1e6)


def in_process(server: Callable[[int, Any], None]) -> tuple[mp.process.BaseProcess, int, int]:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    port = free_port()
    proc = ctx.Process(target=server, args=(port, ready), daemon=True)
    proc.start()
    if not ready.wait(60):
        raise RuntimeError(f"{server.__name__} did not start")
    assert proc.pid is not None  # (started)
    return proc, port, proc.pid


def _rdzv_server() -> tuple[subprocess.Popen[bytes], int, str]:
    from rdzv_client import Client, JobSettings
    from rdzv_client.credential import find_token

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rdzv_server", "--memory", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    token = ""
    deadline = time.monotonic() + 30
    while True:
        try:
            token = find_token(None, None) or ""
            with Client(f"127.0.0.1:{port}", token=token, retry_budget=1.0) as client:
                client.create_job(JOB, JobSettings(min_nodes=1, max_nodes=1))
            return proc, port, token
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise
            time.sleep(0.2)


def main() -> int:
    rows: list[tuple[str, int, Figure, float]] = []
    for run in (1, 2):
        echo, echo_port, echo_pid = in_process(echo_server)
        figures = {"echo (bare uvloop server, bare clients)": _throughput(_echo_client, echo_port, "", echo_pid)}
        echo.kill()
        tcp, tcp_port, tcp_pid = in_process(_tcpstore_server)
        figures["TCPStore add"] = reference = _throughput(_tcpstore_client, tcp_port, "", tcp_pid)
        tcp.kill()
        server, port, token = _rdzv_server()
        try:
            for name, client in (
                ("rdzv-server add, bare clients", _bare_client),
                ("rdzv-server add, rdzv_client.Client", _client_client),
                ("rdzv-server add, RdzvStore (torch Store API)", _store_client),
            ):
                figures[name] = _throughput(client, port, token, server.pid)
        finally:
            server.kill()
            server.wait()
        for name, figure in figures.items():
            rows.append((name, run, figure, figure.per_s / reference.per_s))
            print(f"pass {run}: {name}: {figure.per_s:,.0f} requests/s", file=sys.stderr, flush=True)
    width = max(len(r[0]) for r in rows)
    print(f"{CLIENTS} clients, one request at a time each, {SECONDS:g} s, {os.cpu_count()} CPUs;"
          " CPU per request as each side spent it")
    print(f"{'what':<{width}}  pass  requests/s  x TCPStore  client µs  server µs")
    for name, run, figure, ratio in rows:
        print(f"{name:<{width}}  {run:>4}  {figure.per_s:>10,.0f}  {ratio:>10.2f}"
              f"  {figure.client_us:>9.1f}  {figure.server_us:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
