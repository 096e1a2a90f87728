"""TLS and mutual TLS against the real server process, with the real clients and rdzvctl.

A throwaway CA (``trustme``, made per module) signs the server's certificate for 127.0.0.1
and a client certificate. Checked as a user sees it: both protocols work over TLS on the one
port (the sync client's operations on the stream protocol, the async client's on HTTP); a
client that does not trust the server, or brings no certificate to a server that requires
one, fails with an error that names TLS; plain clients on the TLS port, and a TLS client on
a plain port, fail without hanging and the server keeps serving; the connection table's
deadlines and refusals still answer and close over TLS; a bad certificate or key stops the
server with a one-line error. Tokens come from the session's default token file, as on a
real host.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import ssl
import struct
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from raw_stream import FrameReader, read_until_eof, stream_frames
from server_process import ServerProcess, TLSFiles

from rdzv_client import AsyncClient, Client, JobSettings, RdzvConnectionError, wire

# --read-timeout and --idle-timeout of the deadline server, s.
SHORT = 1.0
# Far longer than any deadline the tests wait for; every wait ends by then.
PATIENCE = 15.0


def new_job() -> str:
    return f"tls-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return TLSFiles.make(tmp_path_factory.mktemp("tls"))


def _start(workdir: Path, **kwargs: Any) -> Iterator[ServerProcess]:
    srv = ServerProcess(workdir, durable=False, **kwargs)
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def tls_server(tmp_path: Path, tls_files: TLSFiles) -> Iterator[ServerProcess]:
    yield from _start(tmp_path, tls=tls_files)


@pytest.fixture
def mtls_server(tmp_path: Path, tls_files: TLSFiles) -> Iterator[ServerProcess]:
    yield from _start(tmp_path, tls=tls_files, mutual_tls=True)


@pytest.fixture
def deadline_server(tmp_path: Path, tls_files: TLSFiles) -> Iterator[ServerProcess]:
    """A TLS server with short idle and read deadlines."""
    args = ("--idle-timeout", str(SHORT), "--read-timeout", str(SHORT))
    yield from _start(tmp_path, tls=tls_files, args=args)


# --------------------------------------------------------------------------- raw clients


def client_ssl(files: TLSFiles, *, cert: bool = False) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(files.ca))
    if cert:
        context.load_cert_chain(str(files.client_cert), str(files.client_key))
    return context


@contextlib.contextmanager
def raw(srv: ServerProcess, context: ssl.SSLContext | None = None) -> Iterator[socket.socket]:
    """A connection to ``srv``, inside TLS when ``context`` is given."""
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=PATIENCE)
    try:
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
        yield sock
    finally:
        sock.close()


def frame(obj: Any) -> bytes:
    payload = msgpack.packb(obj, use_bin_type=True)
    return struct.pack(">I", len(payload)) + payload


def http_answer(data: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def get(srv: ServerProcess, context: ssl.SSLContext, path: str) -> tuple[int, bytes]:
    """One HTTPS GET with the token, on its own connection."""
    with raw(srv, context) as sock:
        sock.sendall(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {srv.token}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        data = read_until_eof(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def open_connections(srv: ServerProcess, context: ssl.SSLContext, protocol: str) -> int:
    """``rdzv_connections{protocol=...}`` from /metrics (the scrape's own connection is HTTP)."""
    status, body = get(srv, context, "/metrics")
    assert status == 200, body
    for line in body.decode().splitlines():
        if line.startswith(f'rdzv_connections{{protocol="{protocol}"}}'):
            return int(float(line.split()[-1]))
    raise AssertionError(f"no rdzv_connections for {protocol} in /metrics")


def assert_quiet(srv: ServerProcess) -> None:
    """Clients' mistakes are no server errors: no traceback, no ERROR line in its log."""
    text = srv.log_text()
    assert "Traceback" not in text and " ERROR " not in text, text


# --------------------------------------------------------------------------- both protocols


def test_the_sync_client_speaks_the_stream_protocol_over_tls(tls_server: ServerProcess, tls_files: TLSFiles) -> None:
    assert tls_server.scheme == "https"  # the ready line says so
    job = new_job()
    with Client(tls_server.url, ca_file=tls_files.ca) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        client.set(job, "k", "v")
        assert client.get(job, "k", timeout=1) == b"v"
        assert client.add(job, "n", 2) == 2
        assert client.multi_get(job, ["k", "n"], timeout=1) == [b"v", b"2"]
        assert job in [j["rdzv_id"] for j in client.jobs()]  # the JSON pages: HTTPS
        # The operations' pooled connection is a stream connection, and it is inside TLS:
        # this port speaks nothing else.
        assert open_connections(tls_server, client_ssl(tls_files), "stream") == 1
    assert_quiet(tls_server)


async def test_the_async_client_speaks_http_over_tls(tls_server: ServerProcess, tls_files: TLSFiles) -> None:
    job = new_job()
    # tls=True makes a HOST:PORT endpoint a TLS one.
    async with AsyncClient(tls_server.endpoint, tls=True, ca_file=str(tls_files.ca)) as client:
        await client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        await client.set(job, "k", b"v")
        assert await client.get(job, "k", timeout=1) == b"v"
        assert (await client.job(job))["rdzv_id"] == job
    assert_quiet(tls_server)


def test_many_threads_share_the_sync_clients_tls_pool(tls_server: ServerProcess, tls_files: TLSFiles) -> None:
    job = new_job()
    errors: list[BaseException] = []
    seen: list[bytes] = []
    with Client(tls_server.url, ca_file=tls_files.ca) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        client.multi_set(job, [f"k{i}" for i in range(8)], [f"v{i}" for i in range(8)])

        def work(i: int) -> None:  # reads: each thread checks out a pooled TLS connection per call
            try:
                for _ in range(20):
                    seen.append(client.get(job, f"k{i}", timeout=1))
                    assert client.check(job, [f"k{i}"])
            except BaseException as exc:  # noqa: BLE001 (reported below)
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(PATIENCE)
        assert not errors, errors
        assert sorted(seen) == sorted(f"v{i}".encode() for i in range(8) for _ in range(20))


# --------------------------------------------------------------------------- trust


def test_a_client_that_does_not_trust_the_server_fails_at_once_naming_tls(tls_server: ServerProcess) -> None:
    # The system store does not hold the test's CA. Retrying cannot fix that: the error comes
    # from the first attempt, not after the retry budget.
    with Client(tls_server.url, retry_budget=PATIENCE) as client, pytest.raises(RdzvConnectionError) as sync_error:
        client.set(new_job(), "k", "v")
    message = str(sync_error.value)
    assert "TLS handshake failed" in message and "CERTIFICATE_VERIFY_FAILED" in message, message
    assert "ca_file" in message and "retry budget" not in message, message

    async def use_async() -> None:
        async with AsyncClient(tls_server.url, retry_budget=PATIENCE) as client:
            await client.set(new_job(), "k", "v")

    with pytest.raises(RdzvConnectionError) as async_error:
        asyncio.run(use_async())
    assert "TLS handshake failed" in str(async_error.value) and "retry budget" not in str(async_error.value)
    assert_quiet(tls_server)


def test_a_certificate_for_another_name_is_refused(tmp_path: Path) -> None:
    # Signed by a CA the client trusts, but for another name: the hostname check is on by default.
    files = TLSFiles.make(tmp_path / "tls", server_names=("rdzv.example.org",))
    for srv in _start(tmp_path, tls=files):
        client = Client(srv.url, ca_file=files.ca, retry_budget=PATIENCE)
        with client, pytest.raises(RdzvConnectionError) as error:
            client.create_job(new_job(), JobSettings(min_nodes=1, max_nodes=1))
        assert "TLS handshake failed" in str(error.value) and "127.0.0.1" in str(error.value), error.value


def test_a_tls_client_on_a_plain_port_fails_at_once_naming_tls(server: ServerProcess, tls_files: TLSFiles) -> None:
    tls = Client(server.endpoint, tls=True, ca_file=tls_files.ca, retry_budget=PATIENCE)
    with tls, pytest.raises(RdzvConnectionError, match="does not speak TLS"):
        tls.set(new_job(), "k", "v")
    with Client(server.endpoint) as client:  # the plain port is unharmed
        client.create_job(new_job(), JobSettings(min_nodes=1, max_nodes=1))
    assert_quiet(server)


def test_tls_files_without_a_tls_endpoint_are_refused(tls_files: TLSFiles) -> None:
    # They would be ignored and the traffic would go in the clear.
    with pytest.raises(ValueError, match="no endpoint uses TLS"):
        Client("127.0.0.1:1", ca_file=tls_files.ca)
    with pytest.raises(ValueError, match="http://"):
        Client("http://127.0.0.1:1", tls=True)
    with pytest.raises(ValueError, match="CA bundle"):
        Client("https://127.0.0.1:1", ca_file=tls_files.ca.with_name("missing.pem"))


# --------------------------------------------------------------------------- mutual TLS


def test_mutual_tls_refuses_a_client_without_a_certificate(mtls_server: ServerProcess, tls_files: TLSFiles) -> None:
    # Raw: the server ends the connection instead of answering (in TLS 1.3 the client's side
    # of the handshake completes first, so the refusal shows on the first read).
    with raw(mtls_server, client_ssl(tls_files)) as sock, contextlib.suppress(ssl.SSLError, ConnectionError):
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_until_eof(sock) == b""
    # The real client: an error that says what may be missing.
    without = Client(mtls_server.url, ca_file=tls_files.ca, retry_budget=1)
    with without, pytest.raises(RdzvConnectionError, match="client certificate"):
        without.set(new_job(), "k", "v")
    assert_quiet(mtls_server)


def test_mutual_tls_serves_a_client_with_a_certificate(mtls_server: ServerProcess, tls_files: TLSFiles) -> None:
    job = new_job()
    certificate = {"ca_file": tls_files.ca, "cert_file": tls_files.client_cert, "key_file": tls_files.client_key}
    with Client(mtls_server.url, **certificate) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        client.set(job, "k", "v")
        assert client.jobs()

    async def use_async() -> bytes:
        async with AsyncClient(mtls_server.url, **certificate) as client:
            return await client.get(job, "k", timeout=1)

    assert asyncio.run(use_async()) == b"v"


# --------------------------------------------------------------------------- plain clients


def test_plain_clients_on_the_tls_port_are_closed_and_the_server_keeps_serving(
    tls_server: ServerProcess, tls_files: TLSFiles
) -> None:
    for hello in (b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", wire.STREAM_PREFACE):
        with raw(tls_server) as sock:
            sock.sendall(hello)
            assert read_until_eof(sock) == b"", hello  # closed, not answered in the clear, no hang
    plain = Client(tls_server.endpoint, retry_budget=1)
    with plain, pytest.raises(RdzvConnectionError, match="https://"):
        plain.set(new_job(), "k", "v")
    with Client(tls_server.url, ca_file=tls_files.ca) as client:
        client.create_job(new_job(), JobSettings(min_nodes=1, max_nodes=1))
    assert_quiet(tls_server)


def test_a_connection_that_never_starts_its_handshake_is_closed(deadline_server: ServerProcess) -> None:
    with raw(deadline_server) as sock:
        assert read_until_eof(sock) == b""  # after --read-timeout, well before PATIENCE


# --------------------------------------------------------------------------- the connection table


def test_idle_tls_connections_are_closed_and_the_clients_reconnect(
    deadline_server: ServerProcess, tls_files: TLSFiles
) -> None:
    job = new_job()
    context = client_ssl(tls_files)
    with Client(deadline_server.url, ca_file=tls_files.ca) as client:
        client.create_job(job, JobSettings(min_nodes=1, max_nodes=1))
        client.set(job, "k", "1")
        for _ in range(int(PATIENCE / 0.1)):  # the server sheds the idle pooled connection
            if open_connections(deadline_server, context, "stream") == 0:
                break
            threading.Event().wait(0.1)
        else:
            raise AssertionError("the idle stream connection was not closed")
        client.set(job, "k", "2")  # on a fresh connection
        assert client.get(job, "k", timeout=1) == b"2"

    async def use_async() -> bytes:
        async with AsyncClient(deadline_server.url, ca_file=tls_files.ca) as aclient:
            await aclient.set(job, "a", "1")
            await asyncio.sleep(SHORT * 2.5)  # the idle HTTP connection is closed meanwhile
            await aclient.set(job, "a", "2")
            return await aclient.get(job, "a", timeout=1)

    assert asyncio.run(use_async()) == b"2"
    assert_quiet(deadline_server)


def test_a_late_stream_frame_over_tls_is_answered_then_closed(
    deadline_server: ServerProcess, tls_files: TLSFiles
) -> None:
    with raw(deadline_server, client_ssl(tls_files)) as sock:
        sock.sendall(wire.STREAM_PREFACE + frame([1, wire.HELLO_OP, "", {"token": deadline_server.token}])[:5])
        frames = stream_frames(read_until_eof(sock))
    assert frames[-1][:2] == [0, 408] and frames[-1][2]["error"] == "request_timeout", frames


def test_a_late_http_request_over_tls_is_answered_then_closed(
    deadline_server: ServerProcess, tls_files: TLSFiles
) -> None:
    with raw(deadline_server, client_ssl(tls_files)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the head never ends
        status, body = http_answer(read_until_eof(sock))
    assert status == 408 and body["error"] == "request_timeout", body


def test_a_tls_connection_over_the_limit_is_answered_then_closed(tmp_path: Path, tls_files: TLSFiles) -> None:
    srv = ServerProcess(tmp_path, durable=False, tls=tls_files, args=("--max-connections", "1"))
    srv.start()
    try:
        job = new_job()
        # A long-poll on the one connection the server allows: it is busy, never shed. Held on a
        # raw TLS stream so that the test can end it by closing that connection (a client's next
        # request would need a second connection, refused until the long-poll timed out).
        with raw(srv, client_ssl(tls_files)) as holder:
            holder.sendall(
                wire.STREAM_PREFACE
                + frame([1, wire.HELLO_OP, "", {"token": srv.token}])
                + frame([2, "create", job, {"min_nodes": 1, "max_nodes": 1}])
                + frame([3, "get", job, {"key": b"never", "timeout": PATIENCE}])
            )
            replies = FrameReader(holder)
            assert [replies.recv()[:2] for _ in range(2)] == [[1, 200], [2, 200]]  # the get is parked
            answers = []
            for _ in range(int(PATIENCE / 0.1)):  # until the server counts the long-poll's connection
                with raw(srv, client_ssl(tls_files)) as sock:
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                    answers.append(http_answer(read_until_eof(sock)))
                if answers[-1][0] == 429:
                    break
                threading.Event().wait(0.1)
            status, body = answers[-1]
            assert status == 429 and body["error"] == "too_many_connections", answers
        # The long-poll's connection is closed: its place is free again.
        with Client(srv.url, ca_file=tls_files.ca, retry_budget=PATIENCE) as client:
            client.set(job, "never", "now")
            assert client.get(job, "never", timeout=1) == b"now"
    finally:
        srv.close()


# --------------------------------------------------------------------------- start-up


def _server_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rdzv_server", "--memory", "--host", "127.0.0.1", "--port", "0", *args]


@pytest.mark.parametrize(
    ("case", "flag_text"),
    [
        ("missing cert", "cannot load the TLS certificate"),
        ("key of another cert", "cannot load the TLS certificate"),
        ("cert as key", "cannot load the TLS certificate"),
        ("missing client CA", "cannot load the client CA bundle"),
    ],
)
def test_a_bad_certificate_or_key_stops_the_server_with_one_line(
    tmp_path: Path, tls_files: TLSFiles, case: str, flag_text: str
) -> None:
    other = TLSFiles.make(tmp_path / "other")
    cert, key, extra = str(tls_files.cert), str(tls_files.key), []
    if case == "missing cert":
        cert = str(tmp_path / "nope.pem")
    elif case == "key of another cert":
        key = str(other.key)
    elif case == "cert as key":
        key = cert
    else:
        extra = ["--tls-client-ca", str(tmp_path / "nope-ca.pem")]
    done = subprocess.run(
        _server_cmd("--tls-cert", cert, "--tls-key", key, *extra),
        check=False,
        capture_output=True,
        text=True,
        timeout=PATIENCE * 2,
    )
    assert done.returncode == 1, done
    assert "listening" not in done.stdout, done.stdout
    errors = [line for line in done.stderr.splitlines() if "rdzv-server: error:" in line]
    assert len(errors) == 1 and flag_text in errors[0], done.stderr
    assert "Traceback" not in done.stderr and "_ssl.c" not in done.stderr, done.stderr


# --------------------------------------------------------------------------- rdzvctl and the handler


def _rdzvctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RDZV_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "rdzv_client.ctl", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=PATIENCE * 2,
        env=full_env,
    )


def test_rdzvctl_takes_tls_flags_and_their_environment(mtls_server: ServerProcess, tls_files: TLSFiles) -> None:
    endpoint = mtls_server.endpoint
    ok = _rdzvctl(
        "--endpoint", endpoint, "--tls", "--ca-file", str(tls_files.ca),
        "--cert-file", str(tls_files.client_cert), "--key-file", str(tls_files.client_key), "--json", "jobs",
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"jobs": []}
    by_env = _rdzvctl(
        "--json", "jobs",
        env={
            "RDZV_ENDPOINT": endpoint, "RDZV_TLS": "1", "RDZV_CA_FILE": str(tls_files.ca),
            "RDZV_CERT_FILE": str(tls_files.client_cert), "RDZV_KEY_FILE": str(tls_files.client_key),
        },
    )
    assert by_env.returncode == 0, by_env.stderr
    untrusted = _rdzvctl("--endpoint", mtls_server.url, "jobs")
    assert untrusted.returncode == 3, untrusted
    assert "TLS handshake failed" in untrusted.stderr and "--ca-file" in untrusted.stderr, untrusted.stderr


def test_rdzvctl_takes_a_token_file(tls_server: ServerProcess, tls_files: TLSFiles, tmp_path: Path) -> None:
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-the-token\n")
    base = ("--endpoint", tls_server.url, "--ca-file", str(tls_files.ca))
    refused = _rdzvctl(*base, "--token-file", str(wrong), "jobs")
    assert refused.returncode == 1 and "unauthorized" in refused.stderr, refused
    right = tmp_path / "token"
    right.write_text(tls_server.token)
    assert _rdzvctl(*base, "--token-file", str(right), "jobs").returncode == 0


def test_the_torchrun_handlers_client_options_come_from_rdzv_conf(
    mtls_server: ServerProcess, tls_files: TLSFiles, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from rdzv_client.torchrun import client_options

    token_file = tmp_path / "token"
    token_file.write_text(mtls_server.token)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "elsewhere"))  # no default token file
    params = RendezvousParameters(
        backend="rdzv-server",
        endpoint=mtls_server.endpoint,  # HOST:PORT: tls=1 makes it TLS
        run_id=new_job(),
        min_nodes=1,
        max_nodes=1,
        tls="1",
        ca_file=str(tls_files.ca),
        cert_file=str(tls_files.client_cert),
        key_file=str(tls_files.client_key),
        token_file=str(token_file),
    )
    options = client_options(params)
    assert options == {
        "tls": True,
        "ca_file": str(tls_files.ca),
        "cert_file": str(tls_files.client_cert),
        "key_file": str(tls_files.client_key),
        "token_file": str(token_file),
    }
    with Client(mtls_server.endpoint, **options) as client:
        client.create_job(params.run_id, JobSettings(min_nodes=1, max_nodes=1))
    bare = RendezvousParameters(backend="rdzv-server", endpoint="h:1", run_id="j", min_nodes=1, max_nodes=1, tls="0")
    assert client_options(bare) == {}
