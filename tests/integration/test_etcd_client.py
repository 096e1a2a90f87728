"""The etcd client's TLS and authentication against real etcd processes on 127.0.0.1.

TLS: a throwaway CA (``trustme``) signs a certificate for 127.0.0.1; an etcd serving its
client URL over https with it takes puts, gets, txns and watches from a client trusting that
CA; a client that does not trust it, or lacks the client certificate an etcd with
``--client-cert-auth`` requires, fails at once with :class:`EtcdTLSError` naming the flag.

Authentication: with etcd's auth on, the right USER:PASSWORD works for every call; a wrong
one, no credentials, or a user without permission raise :class:`EtcdAuthError` saying what
to check; a token etcd forgot (``--auth-token-ttl 1``, then idle) is renewed once, for
requests and watches alike, without the caller noticing. The password never reaches a log.

Losing a member (three members of their own): a put sent through a follower whose leader was
just SIGKILLed moves on to another member long before etcd would answer it (7 s); a watch
whose member is SIGSTOPped fails within seconds (its progress requests go unanswered) rather
than never.

The file and flag checks of :func:`etcd_ssl_context` and :func:`read_credentials` need no
etcd. The rest is skipped only when etcd is not installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from etcd_cluster import EtcdCluster, require_etcd, running_etcd
from server_process import TLSFiles

from rdzv_server.storage.etcd_client import (
    Compare,
    EtcdAuthError,
    EtcdClient,
    EtcdConfigError,
    EtcdTLSError,
    EtcdUnavailableError,
    Get,
    Put,
    WatchBatch,
    etcd_ssl_context,
    read_credentials,
)

STEP_S = 10.0  # what any one awaited step may take before the test fails instead of hanging
TOKEN_TTL_S = 1  # etcd's --auth-token-ttl for the expiry tests
# etcd drops an idle simple token once its TTL has passed, checking once a second.
TOKEN_EXPIRY_WAIT_S = TOKEN_TTL_S + 2.0
CLIENT_LOGGER = "rdzv_server.storage.etcd_client"
RENEWED = "authenticating again"
# etcd 3.4 answers a put sent to a follower whose leader just died after its request
# timeout (5 s + 2 election timeouts): "request timed out, possibly due to previous leader failure".
ETCD_ANSWERS_A_STALLED_PUT_S = 7.0
# A watch whose member went silent must fail well within this (not hang until a take-over).
SILENT_WATCH_NOTICED_S = 15.0


def new_key() -> bytes:
    return f"/rdzv-test/{uuid.uuid4().hex[:12]}".encode()


async def first_batch(client: EtcdClient, key: bytes, start_revision: int) -> WatchBatch:
    """The first batch of a watch on ``key`` from ``start_revision``, the watch then closed."""
    watch = client.watch(key, start_revision=start_revision)
    async with contextlib.aclosing(watch):  # type: ignore[type-var]
        return await asyncio.wait_for(anext(watch), STEP_S)


async def check_every_call(client: EtcdClient) -> None:
    """Put, get, txn, lease and watch all work through ``client``."""
    key = new_key()
    revision = await client.put(key, b"one")
    got = await client.get(key)
    assert got is not None and got.value == b"one" and got.mod_revision == revision
    result = await client.txn([Compare(key, "MOD", revision)], [Put(key, b"two"), Get(key)])
    assert result.succeeded and result.ranges[0][0].value == b"two"
    lease = await client.lease_grant(30)
    await client.put(key + b"/leased", b"x", lease=lease.id)
    assert (await client.lease_keepalive(lease.id)).ttl > 0
    await client.lease_revoke(lease.id)
    assert await client.get(key + b"/leased") is None
    batch = await first_batch(client, key, result.revision)
    assert [(event.kind, event.kv.value) for event in batch.events] == [("PUT", b"two")]


# ------------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    return TLSFiles.make(tmp_path_factory.mktemp("etcd-tls"))


@pytest.fixture(scope="module")
def etcd_tls(tls_files: TLSFiles) -> Iterator[EtcdCluster]:
    require_etcd()
    cluster = EtcdCluster(1, tls=tls_files).start()
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def etcd_mtls(tls_files: TLSFiles) -> Iterator[EtcdCluster]:
    require_etcd()
    cluster = EtcdCluster(1, tls=tls_files, client_cert_auth=True).start()
    yield cluster
    cluster.close()


async def test_put_get_txn_lease_and_watch_work_over_tls(etcd_tls: EtcdCluster, tls_files: TLSFiles) -> None:
    assert etcd_tls.client_urls[0].startswith("https://")
    client = EtcdClient(etcd_tls.client_urls, ssl_context=etcd_ssl_context(tls_files.ca, None, None))
    try:
        await check_every_call(client)
    finally:
        await client.close()


async def test_a_client_that_does_not_trust_etcds_ca_fails_at_once_naming_etcd_ca(etcd_tls: EtcdCluster) -> None:
    client = EtcdClient(etcd_tls.client_urls, retry_pause_s=5.0)  # the system's CAs only
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(EtcdTLSError, match="--etcd-ca") as raised:
            await asyncio.wait_for(client.get(b"k"), STEP_S)
        assert "certificate verify failed" in str(raised.value)
        assert loop.time() - started < 5.0, "a TLS misconfiguration is not retried"
        with pytest.raises(EtcdTLSError, match="--etcd-ca"):
            await asyncio.wait_for(first_batch(client, b"k", 1), STEP_S)
    finally:
        await client.close()


async def test_client_certificate_auth_takes_the_ca_signed_certificate_and_refuses_none(
    etcd_mtls: EtcdCluster, tls_files: TLSFiles
) -> None:
    with_cert = EtcdClient(
        etcd_mtls.client_urls,
        ssl_context=etcd_ssl_context(tls_files.ca, tls_files.client_cert, tls_files.client_key),
    )
    without_cert = EtcdClient(etcd_mtls.client_urls, ssl_context=etcd_ssl_context(tls_files.ca, None, None))
    try:
        await check_every_call(with_cert)
        with pytest.raises(EtcdTLSError, match="--etcd-cert and --etcd-key"):
            await asyncio.wait_for(without_cert.get(b"k"), STEP_S)
    finally:
        await with_cert.close()
        await without_cert.close()


def test_etcd_ssl_context_names_the_flag_of_the_file_it_cannot_load(tmp_path: Path, tls_files: TLSFiles) -> None:
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    missing = tmp_path / "missing.pem"
    cases = [
        ((missing, None, None), "--etcd-ca", "No such file"),
        ((garbage, None, None), "--etcd-ca", "PEM"),
        ((tls_files.ca, garbage, None), "--etcd-cert", "PEM"),
        ((tls_files.ca, tls_files.client_cert, garbage), "--etcd-key", "PEM"),
        ((tls_files.ca, tls_files.client_cert, missing), "--etcd-key", "No such file"),
        ((tls_files.ca, None, tls_files.client_key), "--etcd-cert too", "needs its certificate"),
    ]
    for args, flag, reason in cases:
        with pytest.raises(EtcdConfigError) as raised:
            etcd_ssl_context(*args)
        message = str(raised.value)
        assert isinstance(raised.value, ValueError)
        assert flag in message and reason in message and "\n" not in message, message
    context = etcd_ssl_context(tls_files.ca, tls_files.client_cert, tls_files.client_key)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


# ---------------------------------------------------------------------- credentials


def test_read_credentials_splits_user_from_password_at_the_first_colon(tmp_path: Path) -> None:
    path = tmp_path / "etcd-user"
    path.write_text("rdzv:pa:ss:word\n")
    assert read_credentials(path) == ("rdzv", "pa:ss:word")


def test_read_credentials_refuses_what_is_not_one_user_password_line_naming_the_flag(tmp_path: Path) -> None:
    secret = "s3cret-password"
    cases = {
        "": "is empty",
        "\n\n": "is empty",
        f"{secret}\n": "does not hold USER:PASSWORD",
        f":{secret}\n": "does not hold USER:PASSWORD",
        "rdzv:\n": "does not hold USER:PASSWORD",
        f"rdzv:{secret}\nother:{secret}\n": "has 2 lines",
    }
    for content, reason in cases.items():
        path = tmp_path / "etcd-user"
        path.write_text(content)
        with pytest.raises(EtcdConfigError) as raised:
            read_credentials(path)
        message = str(raised.value)
        assert isinstance(raised.value, ValueError)
        assert "--etcd-token-file" in message and reason in message and secret not in message, message
    with pytest.raises(EtcdConfigError, match=r"cannot read .*--etcd-token-file.*No such file"):
        read_credentials(tmp_path / "missing")


# ------------------------------------------------------------------------------ auth


@pytest.fixture(scope="module")
def root_password() -> str:
    return f"pw-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def etcd_auth(root_password: str) -> Iterator[EtcdCluster]:
    """etcd with authentication on (simple tokens, the default TTL of 300 s)."""
    require_etcd()
    cluster = EtcdCluster(1).start()
    root_token = cluster.enable_auth(root_password)
    # A user with no role: authenticated, but allowed no key.
    cluster.call("/v3/auth/user/add", {"name": "nobody", "password": "nobody-pw"}, token=root_token)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def etcd_short_tokens(root_password: str) -> Iterator[EtcdCluster]:
    """etcd with authentication on whose tokens expire after TOKEN_TTL_S idle seconds."""
    require_etcd()
    cluster = EtcdCluster(1, extra_args=("--auth-token-ttl", str(TOKEN_TTL_S))).start()
    cluster.enable_auth(root_password)
    yield cluster
    cluster.close()


@pytest.fixture(scope="module")
def etcd_no_auth() -> Iterator[EtcdCluster]:
    with running_etcd(1) as cluster:
        yield cluster


@pytest.fixture
async def root_client(etcd_short_tokens: EtcdCluster, root_password: str) -> AsyncIterator[EtcdClient]:
    client = EtcdClient(etcd_short_tokens.client_urls, username="root", password=root_password)
    yield client
    await client.close()


async def test_the_right_password_works_for_range_put_txn_lease_and_watch(
    etcd_auth: EtcdCluster, root_password: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=CLIENT_LOGGER)
    client = EtcdClient(etcd_auth.client_urls, username="root", password=root_password)
    try:
        await check_every_call(client)
    finally:
        await client.close()
    assert RENEWED not in caplog.text, "one token serves every call while it is fresh"
    assert root_password not in caplog.text


async def test_a_wrong_password_raises_an_auth_error_that_says_to_check_the_token_file(
    etcd_auth: EtcdCluster, root_password: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=CLIENT_LOGGER)
    wrong = f"wrong-{root_password}"
    client = EtcdClient(etcd_auth.client_urls, username="root", password=wrong)
    try:
        with pytest.raises(EtcdAuthError, match=r"'root'.*invalid user ID or password.*--etcd-token-file") as raised:
            await asyncio.wait_for(client.put(new_key(), b"x"), STEP_S)
        assert not raised.value.token_rejected
        with pytest.raises(EtcdAuthError, match="--etcd-token-file"):
            await asyncio.wait_for(first_batch(client, b"k", 1), STEP_S)
    finally:
        await client.close()
    assert wrong not in str(raised.value) and wrong not in caplog.text


async def test_a_client_without_credentials_is_told_to_give_the_token_file(etcd_auth: EtcdCluster) -> None:
    client = EtcdClient(etcd_auth.client_urls)
    try:
        with pytest.raises(EtcdAuthError, match="requires authentication: give --etcd-token-file"):
            await asyncio.wait_for(client.range(b"k"), STEP_S)
        with pytest.raises(EtcdAuthError, match="requires authentication: give --etcd-token-file"):
            await asyncio.wait_for(first_batch(client, b"k", 1), STEP_S)
    finally:
        await client.close()


async def test_a_user_without_permission_is_told_to_grant_it_a_role(etcd_auth: EtcdCluster) -> None:
    client = EtcdClient(etcd_auth.client_urls, username="nobody", password="nobody-pw")
    try:
        with pytest.raises(EtcdAuthError, match=r"'nobody'.*permission denied.*grant-permission") as raised:
            await asyncio.wait_for(client.put(new_key(), b"x"), STEP_S)
        assert raised.value.code == 7 and not raised.value.token_rejected
    finally:
        await client.close()


async def test_a_token_etcd_forgot_is_renewed_once_for_concurrent_requests(
    root_client: EtcdClient, root_password: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=CLIENT_LOGGER)
    key = new_key()
    await root_client.put(key, b"before")
    await asyncio.sleep(TOKEN_EXPIRY_WAIT_S)
    answers = await asyncio.wait_for(asyncio.gather(*(root_client.get(key) for _ in range(5))), STEP_S)
    assert [kv.value for kv in answers if kv is not None] == [b"before"] * 5
    assert caplog.text.count(RENEWED) == 1, caplog.text
    await asyncio.wait_for(root_client.put(key, b"after"), STEP_S)
    assert caplog.text.count(RENEWED) == 1
    assert root_password not in caplog.text


async def test_a_watch_opened_with_a_token_etcd_forgot_renews_it_and_streams(
    root_client: EtcdClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=CLIENT_LOGGER)
    key = new_key()
    revision = await root_client.put(key, b"watched")
    await asyncio.sleep(TOKEN_EXPIRY_WAIT_S)
    batch = await first_batch(root_client, key, revision)
    assert [(event.kind, event.kv.value) for event in batch.events] == [("PUT", b"watched")]
    assert caplog.text.count(RENEWED) == 1, caplog.text


async def test_credentials_for_an_etcd_without_auth_warn_and_go_on_without_a_token(
    etcd_no_auth: EtcdCluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=CLIENT_LOGGER)
    client = EtcdClient(etcd_no_auth.client_urls, username="root", password="unused-pw")
    try:
        await check_every_call(client)
    finally:
        await client.close()
    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1 and "authentication disabled" in warnings[0].getMessage()
    assert "unused-pw" not in caplog.text


# ----------------------------------------------------------------- losing a member


@pytest.fixture
def etcd3() -> Iterator[EtcdCluster]:
    """Three members of its own: each test kills or pauses one."""
    with running_etcd(3) as cluster:
        yield cluster


def followers_first(cluster: EtcdCluster) -> tuple[int, list[str]]:
    """etcd's leader, and every client URL with the followers first: a client of them talks
    to a follower, the member that is left without a leader when the leader dies."""
    leader = cluster.leader()
    order = [i for i in range(cluster.size) if i != leader] + [leader]
    return leader, [cluster.client_urls[i] for i in order]


async def test_a_put_through_a_member_that_lost_its_leader_moves_on_long_before_etcd_answers_it(
    etcd3: EtcdCluster,
) -> None:
    leader, urls = followers_first(etcd3)
    # A request timeout far above etcd's own: only the client's per-member deadline can move on.
    client = EtcdClient(urls, request_timeout_s=30.0)
    try:
        await client.put(new_key(), b"warm")  # answered by the first follower, which it keeps using
        etcd3.kill(leader)
        loop = asyncio.get_running_loop()
        started = loop.time()
        key = new_key()
        await asyncio.wait_for(client.put(key, b"v"), 30.0)
        took = loop.time() - started
        got = await client.get(key)
        assert got is not None and got.value == b"v"
        # The follower answers such a put only after etcd's own 7 s; an election takes 1-2 s.
        # How soon the client moves on is the feature here.
        assert took < ETCD_ANSWERS_A_STALLED_PUT_S - 1, f"the put took {took:.1f} s"
    finally:
        await client.close()


async def test_a_watch_whose_member_goes_silent_fails_within_seconds_not_never(etcd3: EtcdCluster) -> None:
    leader, urls = followers_first(etcd3)
    client = EtcdClient(urls)
    key = new_key()
    try:
        revision = await client.put(key, b"one")
        silent = etcd3.client_urls.index(urls[0])
        watching_before = await asyncio.to_thread(etcd3.watchers, silent)
        watch = client.watch(key, start_revision=revision + 1)
        seen: list[WatchBatch] = []

        async def consume() -> None:
            async for batch in watch:
                seen.append(batch)

        consumer = asyncio.ensure_future(consume())
        await asyncio.to_thread(etcd3.wait_for_watchers, silent, watching_before + 1)  # open on the first follower
        etcd3.pause(silent)
        try:
            with pytest.raises(EtcdUnavailableError, match="silent"):
                await asyncio.wait_for(consumer, SILENT_WATCH_NOTICED_S)
        finally:
            etcd3.resume(silent)
        assert not seen
    finally:
        await client.close()
