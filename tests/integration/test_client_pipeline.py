"""One pipelined stream connection per client (rdzv_client.stream): requests of many
threads share it, a parked long-poll does not hold up the calls behind it, and a
connection the server dropped is replaced at once. Also how the blocking transport
(SocketTransport) reads a reply: whole, in pieces, or refused."""

from __future__ import annotations

import http.client
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from server_process import ServerProcess

from rdzv_client import Client, JobSettings, frame, stream, wire
from rdzv_client.error import ServerError
from rdzv_client.stream import PipelinedSocketTransport, SocketTransport
from rdzv_client.transport import Answer, Endpoint, TransportError


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
        client.create_job("pipe", JobSettings(min_nodes=1, max_nodes=1))
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
        client.create_job("again", JobSettings(min_nodes=1, max_nodes=1))
        server.restart()  # a memory server: it comes back empty, on the same port
        client.create_job("again", JobSettings(min_nodes=1, max_nodes=1))  # on a fresh connection, no error
        assert client.num_keys("again") == 0
        assert transport.connections == 1


def test_a_stale_connection_whose_replacement_ends_as_it_opens_is_a_transport_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The resend of a request whose connection went stale must fail like any call (the
    client's retries take it from there), never with the transport's internal exception: a
    torchrun node's watch thread died of one after a replica fail-over and its node expired.

    The interleaving that did it is forced: a connection's reader thread sees the server's
    close before the request is registered on that connection (on a loaded host, it did)."""
    expect = stream._Link.expect

    def after_the_reader(link: Any, tag: int) -> Any:
        if link.received == 0:  # a connection that never answered: let its reader run first
            for _ in range(200):
                if link.ended is not None:
                    break
                threading.Event().wait(0.005)
        return expect(link, tag)

    monkeypatch.setattr(stream._Link, "expect", after_the_reader)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()  # the first connection answers its hello and one request, then ends
        with conn:
            preface = b""
            while len(preface) < len(wire.STREAM_PREFACE):
                preface += conn.recv(len(wire.STREAM_PREFACE) - len(preface))
            replies = frame.FrameDecoder(1 << 20)
            answered = 0
            while answered < 3:
                tag = msgpack.unpackb(replies.receive(conn.recv))[0]
                if answered < 2:
                    conn.sendall(wire.frame([tag, 200, {}]))
                answered += 1
        while True:  # every later connection ends as it opens
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    transport = PipelinedSocketTransport()
    endpoint = Endpoint("127.0.0.1", port)
    try:
        assert transport.call(endpoint, "job", "num_keys", {}, 10.0).status == 200
        for _ in range(20):
            with pytest.raises(TransportError):
                transport.call(endpoint, "job", "num_keys", {}, 10.0)
    finally:
        transport.close()
        listener.close()


def test_threads_waiting_for_a_connection_that_cannot_open_share_its_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Against a host that drops packets each connect waits out its timeout: threads that
    waited for one attempt must not then try one after another (a node's watch, beat and
    store calls would take three timeouts to fail over to another replica)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    filler = [socket.create_connection(("127.0.0.1", port))]  # the accept queue is full: SYNs are dropped
    for _ in range(3):
        probe = socket.socket()
        probe.setblocking(False)
        probe.connect_ex(("127.0.0.1", port))
        filler.append(probe)
    attempts: list[float] = []
    connect = socket.create_connection

    def counting(*args: Any, **kwargs: Any) -> socket.socket:
        attempts.append(time.monotonic())
        return connect(*args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counting)
    transport = PipelinedSocketTransport(connect_timeout=2.0)
    endpoint = Endpoint("127.0.0.1", port)
    outcomes: list[BaseException | None] = []

    def call() -> None:
        try:
            transport.call(endpoint, "job", "num_keys", {}, 10.0)
            outcomes.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcomes.append(exc)

    try:
        threads = [threading.Thread(target=call) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(outcomes) == 3 and all(isinstance(o, TransportError) for o in outcomes), outcomes
        assert len(attempts) == 1, f"{len(attempts)} connects for 3 calls that queued for one"
    finally:
        transport.close()
        for sock in filler:
            sock.close()
        listener.close()


def test_a_forked_child_opens_its_own_connection_and_the_parents_keeps_working(server: ServerProcess) -> None:
    client, transport = pipelined(server)
    with client:
        client.create_job("forked", JobSettings(min_nodes=1, max_nodes=1))
        assert client.add("forked", "n", 1) == 1  # the parent's connection is open
        pid = os.fork()
        if pid == 0:  # the child: its own connection (the parent's reader thread is not here)
            code = 1
            try:
                # (a read: a write would share the parent's client id and request numbers)
                code = 0 if client.get("forked", "n", timeout=5) == b"1" and transport.connections == 1 else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert client.add("forked", "n", 1) == 2  # the parent's connection still serves it
        assert transport.connections == 1



Script = list[Callable[[int], list[bytes]]]


def scripted_stream_server(script: Script) -> tuple[int, socket.socket]:
    """A raw stream server for one connection: after the preface, it answers the n-th request
    frame with the pieces ``script[n](tag)`` returns, each sent alone (with a pause between,
    so that each is a read of its own)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            decoder = frame.FrameDecoder(1 << 20)
            seen = b""
            while len(seen) < len(wire.STREAM_PREFACE):
                seen += conn.recv(len(wire.STREAM_PREFACE) - len(seen))
            decoder.feed(seen[len(wire.STREAM_PREFACE) :])
            for reply in script:
                try:
                    payload = decoder.receive(conn.recv)
                except EOFError:
                    return
                for piece in reply(msgpack.unpackb(payload)[0]):
                    conn.sendall(piece)
                    time.sleep(0.05)
            conn.recv(1)  # until the client closes

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], listener


def reply(body: dict[str, Any], *, cuts: tuple[int, ...] = (), then: bytes = b"") -> Callable[[int], list[bytes]]:
    """A 200 reply frame with ``body``, cut at ``cuts``, with ``then`` sent after it."""

    def pieces(tag: int) -> list[bytes]:
        data = wire.frame([tag, 200, body]) + then
        bounds = [0, *cuts, len(data)]
        return [data[a:b] for a, b in zip(bounds, bounds[1:])]

    return pieces


def test_the_blocking_transport_reads_a_reply_whole_or_in_pieces_and_refuses_what_follows_or_exceeds_it() -> None:
    """SocketTransport takes a reply that arrives in one read or in several (the header
    split, the body split), and refuses a reply followed by bytes no request asked for, and
    one larger than its limit (on a connection's first request and on a later one)."""
    small, large = {"value": 7}, {"value": "x" * 200}
    limit = len(wire.pack([1, 200, small])) + 50
    script = [reply(small), reply(small), reply(small, cuts=(2, 7)), reply(small, then=b"\x00")]
    port, listener = scripted_stream_server(script)
    transport = SocketTransport(max_response_bytes=limit)
    endpoint = Endpoint("127.0.0.1", port)
    try:
        for _ in range(3):  # the first on a new connection, a later one whole, one in pieces
            assert transport.call(endpoint, "job", "add", {}, 10.0) == Answer(200, small)
        with pytest.raises(ServerError, match="bytes after its reply"):
            transport.call(endpoint, "job", "add", {}, 10.0)
    finally:
        transport.close()
        listener.close()
    for script in ([reply(large)], [reply(small), reply(large)]):
        port, listener = scripted_stream_server(script)
        transport = SocketTransport(max_response_bytes=limit)
        try:
            with pytest.raises(ServerError, match="exceeds the client's limit"):
                for _ in script:
                    transport.call(Endpoint("127.0.0.1", port), "job", "add", {}, 10.0)
        finally:
            transport.close()
            listener.close()
