"""A minimal asyncio client of etcd v3, spoken through etcd's own JSON gateway (``/v3/...``).

What it owns: the few etcd calls the replicated log and the election need (kv range, put,
delete-range, txn, compaction; lease grant, keepalive, revoke; watch; member list), the
base64 and int64-as-string encoding of the gateway (hidden: callers see ``bytes`` and
``int``), failing over between endpoints, TLS to etcd (:func:`etcd_ssl_context`), etcd's
user/password authentication (:func:`read_credentials`), and one error tree
(:class:`EtcdError`).

What it must not know: what keys mean (logs, elections), msgpack, or the state machine.

Why not a third-party etcd client. The maintained asyncio clients for etcd v3 are scarce
and stale (``aioetcd3`` and ``etcd3aio`` have had no release in years, ``python-etcd3`` is
synchronous and pins old ``grpcio``/``protobuf``), and each would pull in gRPC, a large
native dependency, for a handful of calls. The JSON gateway is etcd's own stable API,
served on every client URL since 3.3 (``/v3/`` since 3.4), and aiohttp is already the
server's HTTP stack. The cost is ours to carry: this module, about 1,000 lines.

Rules:
- Every request has a deadline (:attr:`EtcdClient.request_timeout_s`), and each try on one
  member a much shorter one (:attr:`EtcdClient.attempt_timeout_s`). A connection error, a
  try that ran out of time, or an answer of gRPC code 14 (unavailable: no leader, a member
  cut off) moves on to the next endpoint; after a pass over all of them, a short pause and
  another pass, until the request's deadline, when the call raises
  :class:`EtcdUnavailableError`. Why a deadline per try: a member whose leader just died
  holds a write until etcd's own request timeout (7 s) before it says so, while the other
  members elect a new leader in one or two seconds; a silent member (a hung host) never
  answers. The next request starts at the member after one that failed. A pass in which
  no member answered in time gives the next pass's tries half again as long, so a cluster
  that is merely slow everywhere still answers within the deadline.
- Every request asks etcd to refuse it at once when the member has no leader (gRPC
  metadata ``hasleader``, as etcd's own clients send it), instead of holding it: during
  etcd's election the client cycles through the members quickly and lands on the new
  leader's term within a pause of its start.
- The retry is therefore *at least once*, and a try abandoned after its deadline may still
  commit: callers send only requests that are safe to repeat (puts of the same value under
  the same compare, whose repeat reads back what the first one wrote; reads; lease grants
  whose spare lease expires).
- Any other error etcd answers (a bad request, a lease not found) raises
  :class:`EtcdRequestError` with etcd's gRPC code and message, at once: retrying cannot help.
- A failed compare in a txn is a result (``TxnResult.succeeded`` is false), not an error.
- A watch is one HTTP stream; it is not retried here (the caller knows from which revision
  to resume) and raises :class:`EtcdWatchCompactedError` when the history it asks for was
  compacted away. A watch never goes quiet unnoticed: after :data:`WATCH_QUIET_S` without a
  word from its member the client asks for a progress notification on the same stream
  (etcd answers it at once, events or none), and a member that does not answer within
  :data:`WATCH_PROGRESS_TIMEOUT_S` ends the watch with :class:`EtcdUnavailableError` (a
  SIGSTOPped member, a host gone without a reset). So does a stream that ends, and etcd
  canceling the watch because its member lost its leader.

TLS. ``https://`` endpoints, watch streams included, are verified with the
``ssl_context`` given (:func:`etcd_ssl_context` builds it from ``--etcd-ca``,
``--etcd-cert`` and ``--etcd-key``; without one, the system's CAs). A TLS failure that
retrying cannot fix (an untrusted certificate, a refused client certificate, a member that
does not speak TLS) moves on to the next endpoint like a lost connection, but when every
endpoint of a pass fails that way the call raises :class:`EtcdTLSError` at once, naming
the flag to fix, instead of retrying a misconfiguration.

Authentication. Given ``username`` and ``password`` (:func:`read_credentials` reads them
from ``--etcd-token-file``), the client calls ``/v3/auth/authenticate`` before its first
request and sends the token it gets in the ``Authorization`` header of every request and
watch. etcd 3.4 forgets a simple token after ``--auth-token-ttl`` (300 s) without use, and
on a restart; it then answers gRPC code 16 ``etcdserver: invalid auth token`` (HTTP 401;
a watch is instead confirmed and at once canceled with the same reason). That answer, and
the two that mean the same to a client holding credentials (``revision of auth store is
old``: users or roles changed under the token; ``user name is empty``: auth was turned on
after this client authenticated), make the client authenticate again, once, and retry the
request. Other refusals (a wrong password, a missing permission, no credentials where etcd
requires them) raise :class:`EtcdAuthError` at once, saying what to check. The password
and the token are never logged nor put in a message. If etcd answers that its auth is not
enabled, the client warns and goes on without a token.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import aiohttp

from rdzv_client.tls import no_key_password, ssl_reason

from .error import StorageError

logger = logging.getLogger(__name__)

# A follower answering a range or a txn takes a few ms; a leader election in etcd takes one
# to two election timeouts (1 s by default). 5 s covers that with room, and still lets a
# caller notice a dead cluster well within a lease TTL's order of magnitude.
DEFAULT_REQUEST_TIMEOUT_S = 5.0
# One member gets this long before the next is tried: far above a loaded member's answer
# (milliseconds; a 512 KiB txn tens of them) and well under etcd's election (1-2 s by
# default). A try sent to a follower that has not yet noticed its leader died is answered
# only after etcd's own 7 s, so the write lands with the first try after etcd's election:
# this deadline is how late it can be (with --election-timeout 500, writes resumed 0.6-1.3 s
# after the leader's SIGKILL with 0.25 s, 1.1-1.6 s with 0.5 s).
DEFAULT_ATTEMPT_TIMEOUT_S = 0.25
# A pass over every member in which none answered in time gives each try of the next pass
# this much longer (0.25, 0.375, 0.56 s...): a cluster slow everywhere still answers.
ATTEMPT_TIMEOUT_GROWTH = 1.5
# Between passes over every endpoint, when none answered: short against etcd's election,
# long enough not to spin on members that all say "no leader" (at most 10 passes a second).
DEFAULT_RETRY_PAUSE_S = 0.1
# gRPC metadata, sent through the gateway as a header, that makes etcd refuse a request (and
# cancel a watch) when the member has no leader rather than hold it (rpctypes.MetadataRequireLeaderKey).
REQUIRE_LEADER = {"Grpc-Metadata-Hasleader": "true"}
# A watch with nothing to say for this long is asked for a progress notification: etcd
# sends its own only every 10 minutes by default (--experimental-watch-progress-notify-interval).
WATCH_QUIET_S = 1.0
# A watch's member must answer that (or anything) within this long, else the watch is dead;
# it also bounds opening a watch. A member answers progress requests itself, at once.
WATCH_PROGRESS_TIMEOUT_S = 2.0
WATCH_PROGRESS_REQUEST = b'{"progress_request": {}}\n'
# A watch answer is one JSON line; this bounds what one line may buffer (etcd's own request
# limit is 1.5 MiB, and base64 plus JSON grow it by about a half).
MAX_WATCH_LINE_BYTES = 64 * 1024 * 1024

# gRPC status codes the gateway reports in ``code``.
GRPC_UNAVAILABLE = 14
GRPC_NOT_FOUND = 5
GRPC_FAILED_PRECONDITION = 9
GRPC_UNAUTHENTICATED = 16
# A canceled watch reports its reason as gRPC's text ("rpc error: code = Unauthenticated desc
# = ..."); these are gRPC's names of its status codes, to read the code back.
GRPC_CODE_NAMES = {
    "Canceled": 1, "Unknown": 2, "InvalidArgument": 3, "DeadlineExceeded": 4, "NotFound": 5,
    "AlreadyExists": 6, "PermissionDenied": 7, "ResourceExhausted": 8, "FailedPrecondition": 9,
    "Aborted": 10, "OutOfRange": 11, "Unimplemented": 12, "Internal": 13, "Unavailable": 14,
    "DataLoss": 15, "Unauthenticated": 16,
}  # fmt: skip
_GRPC_STATUS_TEXT = re.compile(r"rpc error: code = (\w+) desc = (.*)", re.DOTALL)

# TLS 1.0 and 1.1 are deprecated (RFC 8996); etcd 3.4 speaks 1.2 and 1.3.
TLS_MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2

# etcd 3.4's auth refusals, worded as the gateway reports them (etcd's
# api/v3rpc/rpctypes/error.go): whether authenticating again can cure it, and what the
# operator should check when it cannot. gRPC code 16 (UNAUTHENTICATED) is always the first
# kind, whatever its wording.
ERR_INVALID_AUTH_TOKEN = "etcdserver: invalid auth token"
ERR_AUTH_NOT_ENABLED = "etcdserver: authentication is not enabled"
_CHECK_CREDENTIALS = "check that the user in --etcd-token-file still exists in etcd with that password"
_GIVE_CREDENTIALS = "etcd requires authentication: give --etcd-token-file, a file holding USER:PASSWORD of an etcd user"
AUTH_REFUSALS: dict[str, tuple[bool, str]] = {
    ERR_INVALID_AUTH_TOKEN: (True, _CHECK_CREDENTIALS),
    "etcdserver: revision of auth store is old": (True, _CHECK_CREDENTIALS),
    "etcdserver: user name is empty": (True, _GIVE_CREDENTIALS),
    "etcdserver: authentication failed, invalid user ID or password": (
        False,
        "check the USER:PASSWORD in --etcd-token-file against etcd's users (etcdctl user get USER)",
    ),
    "etcdserver: permission denied": (
        False,
        (
            "grant the etcd user a role with readwrite permission on this cluster's --etcd-prefix "
            "(etcdctl role grant-permission ROLE --prefix=true readwrite PREFIX)"
        ),
    ),
}

CompareTarget = Literal["CREATE", "MOD", "VERSION", "VALUE", "LEASE"]
CompareResult = Literal["EQUAL", "GREATER", "LESS", "NOT_EQUAL"]


class EtcdError(StorageError):
    """Base class of every error this client raises on purpose."""


class EtcdUnavailableError(EtcdError):
    """No endpoint answered (connection refused, timeout, or no etcd leader) after every retry."""


class EtcdTLSError(EtcdError):
    """No endpoint could be reached over TLS for a reason retrying cannot fix: an untrusted
    certificate, a missing or refused client certificate, or a member that does not speak TLS."""


class EtcdRequestError(EtcdError):
    """etcd answered with an error; ``code`` is its gRPC status code, ``etcd_message`` its text."""

    def __init__(self, message: str, code: int, etcd_message: str) -> None:
        super().__init__(message)
        self.code = code
        self.etcd_message = etcd_message


class EtcdAuthError(EtcdRequestError):
    """etcd refused this client's credentials, token or permissions; the message says what to check.

    ``token_rejected`` is true when etcd only refused the token (expired, or older than a
    change to etcd's users): a client holding credentials has already authenticated again
    once and retried before this reaches its caller.
    """

    def __init__(self, message: str, code: int, etcd_message: str, *, token_rejected: bool) -> None:
        super().__init__(message, code, etcd_message)
        self.token_rejected = token_rejected


class EtcdConfigError(ValueError):
    """A TLS or credentials file given for etcd cannot be used; the message names its flag."""


class EtcdWatchCompactedError(EtcdError):
    """A watch asked for history etcd has compacted; ``compact_revision`` is the oldest kept."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


def etcd_ssl_context(ca_file: Path | None, cert_file: Path | None, key_file: Path | None) -> ssl.SSLContext:
    """The TLS context for etcd's ``https://`` endpoints: etcd's certificate verified (against
    ``ca_file``, ``--etcd-ca``, or else the system's CAs) and its host name checked; a client
    certificate (``cert_file`` and ``key_file``, ``--etcd-cert`` and ``--etcd-key``; the key
    may be in the certificate's file) for an etcd started with ``--client-cert-auth``.

    Raises :class:`EtcdConfigError` (one line, naming the flag) when a file cannot be read or
    does not hold what its flag names, or for a key without a certificate.
    """
    if key_file is not None and cert_file is None:
        raise EtcdConfigError(f"--etcd-key {key_file} needs its certificate: give --etcd-cert too")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the certificate and the host name
    context.minimum_version = TLS_MINIMUM_VERSION
    if ca_file is None:
        context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    else:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise EtcdConfigError(
                f"cannot load the etcd CA bundle {ca_file} (--etcd-ca): {ssl_reason(exc)}; "
                "give the PEM certificate(s) of the CA that signs etcd's certificates"
            ) from exc
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file, password=no_key_password)
        except (OSError, ValueError) as exc:
            flags = "--etcd-cert" if key_file is None else f"--etcd-cert, and key {key_file} (--etcd-key)"
            raise EtcdConfigError(
                f"cannot load the etcd client certificate {cert_file} ({flags}): {ssl_reason(exc)}; "
                "give a PEM certificate chain and its unencrypted PEM private key"
            ) from exc
    return context


def read_credentials(path: Path) -> tuple[str, str]:
    """The etcd user and password from ``path`` (``--etcd-token-file``): one line
    ``USER:PASSWORD``, as etcdctl's ``--user`` takes it (the password may hold colons).

    Raises :class:`EtcdConfigError` (a ``ValueError``) when the file cannot be read, is
    empty, or does not hold that one line; the message never quotes the file's content.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise EtcdConfigError(f"cannot read the etcd credentials file {path} (--etcd-token-file): {reason}") from exc
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise EtcdConfigError(
            f"the etcd credentials file {path} (--etcd-token-file) is empty; write USER:PASSWORD in it"
        )
    if len(lines) > 1:
        raise EtcdConfigError(
            f"the etcd credentials file {path} (--etcd-token-file) has {len(lines)} lines; "
            "it must hold one line, USER:PASSWORD"
        )
    user, colon, password = lines[0].strip().partition(":")
    if not colon or not user or not password:
        raise EtcdConfigError(
            f"the etcd credentials file {path} (--etcd-token-file) does not hold USER:PASSWORD "
            "(a user name, a colon, and a non-empty password on one line)"
        )
    return user, password


def _note_failure(endpoint: str, url: str, exc: BaseException, failures: list[str], tls_failures: list[str]) -> None:
    """Record why ``endpoint`` failed a request; a TLS failure also with its fix."""
    tls = _tls_failure(exc)
    if tls is not None:
        tls_failures.append(f"{endpoint}: {ssl_reason(tls)}; {_tls_hint(tls)}")
    failures.append(f"{url}: {exc!r}")


def _tls_failure(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error behind ``exc`` when retrying cannot fix it, else ``None``.

    That is a certificate this client does not trust, or a handshake either side refused (an
    alert: no or unknown client certificate, a peer that does not speak TLS). Not an EOF or
    reset mid-handshake (``ssl.SSLError``'s subclasses), which is a lost connection.
    """
    seen: BaseException | None = exc
    for _ in range(8):  # aiohttp wraps the SSL error once or twice; bounded against a cyclic chain
        if seen is None:
            break
        if isinstance(seen, ssl.SSLCertVerificationError) or type(seen) is ssl.SSLError:
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _tls_hint(error: ssl.SSLError) -> str:
    reason = ssl_reason(error)
    if isinstance(error, ssl.SSLCertVerificationError):
        return (
            "etcd's certificate is not trusted: give the CA that signed it with --etcd-ca, "
            "and name members by an address their certificate lists"
        )
    if "WRONG_VERSION_NUMBER" in reason:
        return "this member does not speak TLS: use http:// for it, or start etcd with --cert-file and --key-file"
    if "CERTIFICATE_REQUIRED" in reason or "BAD_CERTIFICATE" in reason or "UNKNOWN_CA" in reason:
        return "etcd requires a client certificate signed by its --trusted-ca-file: give --etcd-cert and --etcd-key"
    return "check etcd's --cert-file/--key-file and this server's --etcd-ca, --etcd-cert and --etcd-key"


async def _within(opening: Awaitable[aiohttp.ClientResponse], timeout_s: float) -> aiohttp.ClientResponse:
    """The response ``opening`` gives within ``timeout_s``, else ``asyncio.TimeoutError``.

    Not asyncio.wait_for, which (before Python 3.12) returns the response instead of raising
    when the caller is cancelled just as it arrives; here the caller's cancellation always
    wins, and a response that came too late is closed.
    """
    task = asyncio.ensure_future(opening)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except BaseException:
        task.cancel()
        task.add_done_callback(_close_response)
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_close_response)
        raise asyncio.TimeoutError()
    return task.result()


def _close_response(task: asyncio.Future[aiohttp.ClientResponse]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()


async def _request_lines(requests: asyncio.Queue[bytes | None]) -> AsyncIterator[bytes]:
    """A watch's request body: each line put in ``requests``, until ``None``."""
    while (line := await requests.get()) is not None:
        yield line


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _int(value: Any) -> int:
    # The gateway writes int64 as strings and leaves out zero values altogether.
    return int(value) if value else 0


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd stores it; revisions are etcd's (cluster-wide, increasing)."""

    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KeyValue:
        return cls(
            key=_unb64(data.get("key")),
            value=_unb64(data.get("value")),
            create_revision=_int(data.get("create_revision")),
            mod_revision=_int(data.get("mod_revision")),
            version=_int(data.get("version")),
            lease=_int(data.get("lease")),
        )


@dataclass(frozen=True)
class RangeResult:
    """A range's keys, whether more matched than ``limit``, and the revision it was read at."""

    kvs: list[KeyValue]
    more: bool
    count: int
    revision: int


@dataclass(frozen=True)
class Compare:
    """One txn condition: ``target`` of ``key`` compared (``result``) with ``value``.

    ``value`` is an ``int`` for ``CREATE``, ``MOD``, ``VERSION`` and ``LEASE`` and ``bytes``
    for ``VALUE``. A missing key has create revision 0, which is how "exists" is tested.
    """

    key: bytes
    target: CompareTarget
    value: int | bytes
    result: CompareResult = "EQUAL"

    def to_json(self) -> dict[str, Any]:
        field_name = {
            "CREATE": "create_revision",
            "MOD": "mod_revision",
            "VERSION": "version",
            "VALUE": "value",
            "LEASE": "lease",
        }[self.target]
        value = _b64(self.value) if isinstance(self.value, bytes) else str(self.value)
        return {"key": _b64(self.key), "target": self.target, "result": self.result, field_name: value}


@dataclass(frozen=True)
class Put:
    """A txn operation: put ``value`` at ``key``, attached to ``lease`` when not 0."""

    key: bytes
    value: bytes
    lease: int = 0

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": _b64(self.key), "value": _b64(self.value)}
        if self.lease:
            body["lease"] = str(self.lease)
        return {"request_put": body}


@dataclass(frozen=True)
class _KeyRange:
    """A txn operation on ``key`` (up to ``range_end``, excluded, when given)."""

    key: bytes
    range_end: bytes = b""
    operation: ClassVar[str] = ""

    def to_json(self) -> dict[str, Any]:
        body = {"key": _b64(self.key)}
        if self.range_end:
            body["range_end"] = _b64(self.range_end)
        return {self.operation: body}


@dataclass(frozen=True)
class DeleteRange(_KeyRange):
    """A txn operation: delete ``key`` (up to ``range_end``, excluded, when given)."""

    operation: ClassVar[str] = "request_delete_range"


@dataclass(frozen=True)
class Get(_KeyRange):
    """A txn operation: read ``key`` (up to ``range_end``, excluded, when given)."""

    operation: ClassVar[str] = "request_range"


TxnOp = Put | DeleteRange | Get


@dataclass(frozen=True)
class TxnResult:
    """Whether the compares held, the txn's revision, and the keys each ``Get`` read, in order."""

    succeeded: bool
    revision: int
    ranges: list[list[KeyValue]] = field(default_factory=list)


@dataclass(frozen=True)
class Lease:
    """A granted lease: its id and the TTL etcd granted (seconds)."""

    id: int
    ttl: int


@dataclass(frozen=True)
class LeaseRenewal:
    """A keepalive's answer: the lease's TTL from the renewal on (seconds; 0: the lease is
    gone), and the event loop's time when the request etcd answered was sent."""

    ttl: int
    sent: float


@dataclass(frozen=True)
class WatchEvent:
    """One change: ``kind`` is ``PUT`` or ``DELETE``; ``kv`` holds the key (and value, for a put)."""

    kind: Literal["PUT", "DELETE"]
    kv: KeyValue


@dataclass(frozen=True)
class WatchBatch:
    """The events of one watch answer (all from one or more consecutive revisions), and its header revision."""

    events: list[WatchEvent]
    revision: int


@dataclass(frozen=True)
class Member:
    """A member of the etcd cluster."""

    id: int
    name: str
    client_urls: list[str]
    peer_urls: list[str]


class EtcdClient:
    """The client; see the module docstring. Call :meth:`close` when done."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        attempt_timeout_s: float = DEFAULT_ATTEMPT_TIMEOUT_S,
        retry_pause_s: float = DEFAULT_RETRY_PAUSE_S,
        ssl_context: ssl.SSLContext | None = None,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        """``endpoints`` are client URLs (``http://host:port`` or ``https://host:port``).

        ``ssl_context`` verifies ``https://`` endpoints (default: the system's CAs);
        ``username`` and ``password`` turn on etcd's authentication. Raises ``ValueError``
        for no endpoint, or for only one of ``username`` and ``password``.
        """
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint URL, such as http://127.0.0.1:2379.")
        if (username is None) != (password is None):
            raise ValueError("EtcdClient needs both username and password for etcd's authentication, or neither.")
        self.endpoints = [url.rstrip("/") for url in endpoints]
        self.request_timeout_s = request_timeout_s
        self.attempt_timeout_s = min(attempt_timeout_s, request_timeout_s)
        self._retry_pause_s = retry_pause_s
        self._current = 0  # the endpoint that answered last: tried first next time
        self._session: aiohttp.ClientSession | None = None
        self._ssl_context = ssl_context
        self.username = username
        self._password = password
        self._token: str | None = None  # None with credentials: not yet, or auth not enabled in etcd
        self._authenticated = False  # whether _token is what the last authenticate gave
        self._auth_lock = asyncio.Lock()  # one authenticate at a time; the others reuse its token

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # The connector's context applies to https:// URLs only, watches included.
            ssl_setting: ssl.SSLContext | bool = self._ssl_context if self._ssl_context is not None else True
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ssl_setting))
        return self._session

    # ------------------------------------------------------------------ transport

    async def _call(self, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
        """POST ``body`` to ``path`` with this client's token, authenticating again once if
        etcd refused the token; see the module docstring. Returns etcd's answer and the loop
        time the try that got it was sent at."""
        token = await self._request_token()
        try:
            return await self._post(path, body, token)
        except EtcdAuthError as exc:
            if not exc.token_rejected or self.username is None:
                raise
        token = await self._renew_token(token)
        return await self._post(path, body, token)

    async def _request_token(self) -> str | None:
        """The token to send: authenticates first when this client has credentials and no token yet."""
        if self.username is not None and not self._authenticated:
            async with self._auth_lock:
                if not self._authenticated:
                    await self._authenticate()
        return self._token

    async def _renew_token(self, rejected: str | None) -> str | None:
        """Authenticate again, unless another request already did since ``rejected`` was refused."""
        async with self._auth_lock:
            if self._token == rejected:
                logger.info("etcd refused the auth token of user %r; authenticating again.", self.username)
                await self._authenticate()
        return self._token

    async def _authenticate(self) -> None:
        """Get a token for this client's user (the caller holds ``_auth_lock``)."""
        body = {"name": self.username, "password": self._password}
        try:
            answer, _ = await self._post("/v3/auth/authenticate", body, None)
        except EtcdRequestError as exc:
            if exc.code != GRPC_FAILED_PRECONDITION or exc.etcd_message != ERR_AUTH_NOT_ENABLED:
                raise
            logger.warning(
                "etcd at %s has authentication disabled; sending requests without a token "
                "(the user %r from --etcd-token-file is not used).",
                self.endpoints[self._current],
                self.username,
            )
            self._token = None
        else:
            token = answer.get("token")
            if not isinstance(token, str) or not token:
                message = f"etcd answered /v3/auth/authenticate for user {self.username!r} without a token."
                raise EtcdRequestError(message, 0, "")
            self._token = token
        self._authenticated = True

    async def _post(self, path: str, body: dict[str, Any], token: str | None) -> tuple[dict[str, Any], float]:
        """POST ``body`` to ``path`` on one endpoint after another until the request's
        deadline; see the module docstring. Returns the answer and when its try was sent."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        headers = {"Content-Type": "application/json", **REQUIRE_LEADER}
        if token:
            headers["Authorization"] = token
        # A file-like body: aiohttp warns (ResourceWarning) on a bytes or JSON body over 1 MiB,
        # and a txn of log records may come near etcd's 1.5 MiB limit. One reader per attempt.
        encoded = json.dumps(body).encode()
        failures: list[str] = []
        count = len(self.endpoints)
        attempt_timeout = self.attempt_timeout_s
        passes = 0
        while True:  # bounded by the deadline: every try and every pause is cut to what is left
            tls_failures: list[str] = []
            timed_out = 0
            first = self._current
            for step in range(count):
                sent = loop.time()
                if sent >= deadline:
                    break
                index = (first + step) % count
                url = self.endpoints[index] + path
                timeout = aiohttp.ClientTimeout(total=min(attempt_timeout, deadline - sent))
                try:
                    data = io.BytesIO(encoded)
                    async with self._http().post(url, data=data, headers=headers, timeout=timeout) as response:
                        text = await response.text()
                        status = response.status
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    _note_failure(self.endpoints[index], url, exc, failures, tls_failures)
                    timed_out += isinstance(exc, asyncio.TimeoutError)
                    self._move_past(index)
                    continue
                answer = self._decode(url, status, text)
                error = answer.get("error")
                if status == 200 and error is None:
                    self._current = index
                    return answer, sent
                code = _int(answer.get("code"))
                message = str(answer.get("message") or error or text[:200])
                if isinstance(error, dict):  # a streaming call's error (lease keepalive) is an object
                    code = _int(error.get("grpc_code") or error.get("code"))
                    message = str(error.get("message") or error)
                if code == GRPC_UNAVAILABLE:
                    failures.append(f"{url}: {message}")
                    self._move_past(index)
                    continue
                raise self._refusal(url, code, message)
            passes += 1
            if timed_out == count:  # no member answered in time, not even "no leader": slow, not dead
                attempt_timeout *= ATTEMPT_TIMEOUT_GROWTH
            if len(tls_failures) == count:
                raise EtcdTLSError(f"No etcd endpoint could be reached over TLS for {path}: {'; '.join(tls_failures)}.")
            if loop.time() + self._retry_pause_s >= deadline:
                break
            await asyncio.sleep(self._retry_pause_s)
        raise EtcdUnavailableError(
            f"No etcd endpoint answered {path} within {self.request_timeout_s:g} s ({passes} passes over "
            f"{self.endpoints}); check that a quorum of the cluster is up and reachable. "
            f"Last errors: {'; '.join(failures[-count:])}"
        )

    def _move_past(self, index: int) -> None:
        """Endpoint ``index`` failed: the next request starts at the one after it (unless
        another request already moved on), not where it would wait out a deadline again."""
        if self._current == index:
            self._current = (index + 1) % len(self.endpoints)

    def _refusal(self, url: str, code: int, message: str) -> EtcdRequestError:
        """The error for etcd's refusal at ``url``: :class:`EtcdAuthError` for an auth refusal."""
        known = AUTH_REFUSALS.get(message)
        if known is None and code != GRPC_UNAUTHENTICATED:
            return EtcdRequestError(f"etcd refused {url}: {message} (gRPC code {code}).", code, message)
        renewable, advice = known or (True, _CHECK_CREDENTIALS)
        if self.username is None:
            who = "this client, which has no etcd credentials"
            advice = _GIVE_CREDENTIALS
        else:
            who = f"etcd user {self.username!r}"
        return EtcdAuthError(
            f"etcd refused {url} for {who}: {message} (gRPC code {code}); {advice}.",
            code,
            message,
            token_rejected=renewable,
        )

    @staticmethod
    def _decode(url: str, status: int, text: str) -> dict[str, Any]:
        try:
            answer = json.loads(text) if text else {}
        except ValueError as exc:
            raise EtcdRequestError(f"{url} answered HTTP {status} with non-JSON: {text[:200]!r}.", 0, text[:200]) from exc
        if not isinstance(answer, dict):
            raise EtcdRequestError(f"{url} answered HTTP {status} with {text[:200]!r}.", 0, text[:200])
        return answer

    # ------------------------------------------------------------------------- kv

    async def range(
        self,
        key: bytes,
        range_end: bytes = b"",
        *,
        limit: int = 0,
        revision: int = 0,
        sort_by_create: bool = False,
    ) -> RangeResult:
        """Keys from ``key`` (to ``range_end``, excluded), at ``revision`` (0: the newest).

        ``limit`` caps the keys returned (0: no cap); ``sort_by_create`` orders them by
        create revision, oldest first (otherwise by key).
        """
        body: dict[str, Any] = {"key": _b64(key)}
        if range_end:
            body["range_end"] = _b64(range_end)
        if limit:
            body["limit"] = str(limit)
        if revision:
            body["revision"] = str(revision)
        if sort_by_create:
            body["sort_order"] = "ASCEND"
            body["sort_target"] = "CREATE"
        answer, _ = await self._call("/v3/kv/range", body)
        return RangeResult(
            kvs=[KeyValue.from_json(kv) for kv in answer.get("kvs", [])],
            more=bool(answer.get("more")),
            count=_int(answer.get("count")),
            revision=_int(answer.get("header", {}).get("revision")),
        )

    async def get(self, key: bytes) -> KeyValue | None:
        """The key, or ``None`` when it does not exist."""
        result = await self.range(key)
        return result.kvs[0] if result.kvs else None

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Put ``value`` at ``key``; return the revision it was written at."""
        body = Put(key, value, lease).to_json()["request_put"]
        answer, _ = await self._call("/v3/kv/put", body)
        return _int(answer.get("header", {}).get("revision"))

    async def delete_range(self, key: bytes, range_end: bytes = b"") -> int:
        """Delete ``key`` (up to ``range_end``, excluded); return how many keys were deleted."""
        answer, _ = await self._call("/v3/kv/deleterange", DeleteRange(key, range_end).to_json()["request_delete_range"])
        return _int(answer.get("deleted"))

    async def txn(
        self, compare: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = ()
    ) -> TxnResult:
        """Run ``success`` if every compare holds, else ``failure``, atomically.

        A failed compare is a result (``succeeded`` false), not an error. etcd refuses a
        txn with more operations than its ``--max-txn-ops`` (128 by default) or a request
        larger than its ``--max-request-bytes`` (1.5 MiB by default) with
        :class:`EtcdRequestError`.
        """
        body = {
            "compare": [c.to_json() for c in compare],
            "success": [op.to_json() for op in success],
            "failure": [op.to_json() for op in failure],
        }
        answer, _ = await self._call("/v3/kv/txn", body)
        ranges = [
            [KeyValue.from_json(kv) for kv in response["response_range"].get("kvs", [])]
            for response in answer.get("responses", [])
            if "response_range" in response
        ]
        return TxnResult(
            succeeded=bool(answer.get("succeeded")),
            revision=_int(answer.get("header", {}).get("revision")),
            ranges=ranges,
        )

    async def compact(self, revision: int) -> None:
        """Drop etcd's history (old versions, deleted keys) before ``revision``."""
        await self._call("/v3/kv/compaction", {"revision": str(revision)})

    # ---------------------------------------------------------------------- lease

    async def lease_grant(self, ttl_s: int) -> Lease:
        """A new lease that expires ``ttl_s`` seconds after its last keepalive."""
        answer, _ = await self._call("/v3/lease/grant", {"TTL": str(ttl_s)})
        return Lease(id=_int(answer.get("ID")), ttl=_int(answer.get("TTL")))

    async def lease_keepalive(self, lease_id: int) -> LeaseRenewal:
        """Renew the lease; return its TTL from now on (0: it has expired or was revoked) and
        when the renewal etcd answered was sent (etcd counts the TTL from no earlier)."""
        answer, sent = await self._call("/v3/lease/keepalive", {"ID": str(lease_id)})
        return LeaseRenewal(ttl=_int(answer.get("result", {}).get("TTL")), sent=sent)

    async def lease_revoke(self, lease_id: int) -> None:
        """Revoke the lease, deleting every key attached to it; a lease already gone is fine."""
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease_id)})
        except EtcdRequestError as exc:
            if exc.code != GRPC_NOT_FOUND:
                raise

    # ---------------------------------------------------------------------- watch

    async def watch(self, key: bytes, range_end: bytes = b"", *, start_revision: int = 0) -> AsyncIterator[WatchBatch]:
        """Stream the changes to ``key`` (to ``range_end``) from ``start_revision`` (0: from now).

        Yields one :class:`WatchBatch` per answer with events, in revision order, until the
        caller stops iterating. Tries the endpoints in turn to open the stream, once each;
        raises :class:`EtcdUnavailableError` if none opens it or an open stream breaks, ends,
        goes silent (see the module docstring) or loses its member's leader (the caller
        resumes from the revision after the last event it saw),
        :class:`EtcdTLSError` if every endpoint failed TLS, and
        :class:`EtcdWatchCompactedError` when ``start_revision`` was compacted away. When etcd
        cancels the watch because it refused the token, the client authenticates again and
        reopens the watch after the last event it yielded, once per refusal in a row;
        other refusals raise :class:`EtcdAuthError`.
        """
        token = await self._request_token()
        renewed = False  # a renewal that no answer has yet proved good
        while True:
            try:
                async for batch in self._watch_once(key, range_end, start_revision, token):
                    renewed = False
                    start_revision = batch.events[-1].kv.mod_revision + 1
                    yield batch
                raise AssertionError("unreachable: a watch stream ends only by raising")
            except EtcdAuthError as exc:
                if not exc.token_rejected or self.username is None or renewed:
                    raise
            token = await self._renew_token(token)
            renewed = True

    async def _watch_once(
        self, key: bytes, range_end: bytes, start_revision: int, token: str | None
    ) -> AsyncIterator[WatchBatch]:
        """One watch stream, opened on the first endpoint that takes it; see :meth:`watch`."""
        create: dict[str, Any] = {"key": _b64(key), "progress_notify": True}
        if range_end:
            create["range_end"] = _b64(range_end)
        if start_revision:
            create["start_revision"] = str(start_revision)
        headers = {"Content-Type": "application/json", **REQUIRE_LEADER}
        if token:
            headers["Authorization"] = token
        # No total timeout: a quiet watch is healthy, and _watch_stream checks that its member
        # still answers. Opening it is bounded: etcd confirms a watch at once.
        timeout = aiohttp.ClientTimeout(total=None, connect=WATCH_PROGRESS_TIMEOUT_S)
        failures: list[str] = []
        tls_failures: list[str] = []
        count = len(self.endpoints)
        for step in range(count):
            index = (self._current + step) % count
            url = self.endpoints[index] + "/v3/watch"
            # The request body stays open: the gateway passes each JSON line sent on it to the
            # watch as one request, which is how a progress notification is asked for. Go's
            # server answers such a body only once the client waits for "100 Continue".
            requests: asyncio.Queue[bytes | None] = asyncio.Queue()
            requests.put_nowait(json.dumps({"create_request": create}).encode() + b"\n")
            post = self._http().post(url, data=_request_lines(requests), headers=headers, timeout=timeout, expect100=True)
            try:
                response = await _within(post, WATCH_PROGRESS_TIMEOUT_S)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                requests.put_nowait(None)
                _note_failure(self.endpoints[index], url, exc, failures, tls_failures)
                continue
            try:
                if response.status != 200:
                    text = await response.text()
                    failures.append(f"{url}: HTTP {response.status} {text[:200]}")
                    continue
                try:
                    async for batch in self._watch_stream(url, response, requests):
                        yield batch
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    raise EtcdUnavailableError(f"The watch stream from {url} broke: {exc!r}") from exc
            finally:
                requests.put_nowait(None)  # ends the request body, if aiohttp still sends it
                response.close()  # never back to the pool: the stream is etcd's until closed
        if len(tls_failures) == count:
            raise EtcdTLSError(f"No etcd endpoint could be reached over TLS for a watch: {'; '.join(tls_failures)}.")
        raise EtcdUnavailableError(f"No etcd endpoint opened a watch on {key!r}: {'; '.join(failures)}")

    async def _watch_stream(
        self, url: str, response: aiohttp.ClientResponse, requests: asyncio.Queue[bytes | None]
    ) -> AsyncIterator[WatchBatch]:
        """The batches of one open watch; raises :class:`EtcdUnavailableError` when the
        stream ends or its member stops answering (see the module docstring)."""
        loop = asyncio.get_running_loop()
        heard = loop.time()  # when the member last said anything, or the caller took a batch
        busy = False  # the caller holds a batch: the stream is not being read meanwhile
        silent = False

        async def watchdog() -> None:
            # A timer beside the read, not a timeout around it: asyncio.wait_for (before
            # Python 3.12) can swallow a cancellation that meets a completed read, and the
            # caller's cancellation of a watch must always end it.
            nonlocal silent
            while True:  # cancelled with the stream
                await asyncio.sleep(max(0.0, heard + WATCH_QUIET_S - loop.time()))
                if busy or loop.time() - heard < WATCH_QUIET_S:
                    continue
                asked = loop.time()
                requests.put_nowait(WATCH_PROGRESS_REQUEST)
                await asyncio.sleep(WATCH_PROGRESS_TIMEOUT_S)
                if heard < asked and not busy:
                    silent = True
                    response.close()  # the read below fails at once
                    return

        def dead() -> EtcdUnavailableError:
            return EtcdUnavailableError(
                f"The watch at {url} answered no progress request within {WATCH_PROGRESS_TIMEOUT_S:g} s: "
                "its member is silent (stopped, or cut off)."
            )

        buffer = b""
        dog = loop.create_task(watchdog(), name=f"rdzv-etcd-watchdog {url}")
        try:
            async for chunk in response.content.iter_any():
                heard = loop.time()
                buffer += chunk
                if len(buffer) > MAX_WATCH_LINE_BYTES:
                    raise EtcdRequestError(f"A watch answer from {url} exceeds {MAX_WATCH_LINE_BYTES} bytes.", 0, "")
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        batch = self._watch_answer(url, line)
                        if batch is not None:
                            busy = True
                            yield batch
                            busy, heard = False, loop.time()
        except aiohttp.ClientError as exc:
            if silent:
                raise dead() from exc
            raise
        finally:
            dog.cancel()
        raise dead() if silent else EtcdUnavailableError(f"The watch stream from {url} ended.")

    def _watch_answer(self, url: str, line: bytes) -> WatchBatch | None:
        answer = json.loads(line)
        if "error" in answer:
            error = answer["error"]
            message = str(error.get("message", error)) if isinstance(error, dict) else str(error)
            code = _int(error.get("code") or error.get("grpc_code")) if isinstance(error, dict) else 0
            if code == GRPC_UNAVAILABLE:  # its member has no leader (etcd cancels such watches)
                raise EtcdUnavailableError(f"The watch at {url} failed: {message}")
            refusal = self._refusal(url, code, message)
            if isinstance(refusal, EtcdAuthError):
                raise refusal
            raise EtcdRequestError(f"The watch at {url} failed: {message}", code, message)
        result = answer.get("result", {})
        compacted = _int(result.get("compact_revision"))
        if compacted:
            raise EtcdWatchCompactedError(
                f"The watch at {url} asked for history etcd compacted (oldest kept revision {compacted}); "
                "read the current state again and watch from there.",
                compacted,
            )
        if result.get("canceled"):
            reason = str(result.get("cancel_reason", "no reason given"))
            # etcd words a refused watch as gRPC's text: "rpc error: code = Unauthenticated desc = ...".
            status = _GRPC_STATUS_TEXT.fullmatch(reason)
            if status is not None:
                code = GRPC_CODE_NAMES.get(status.group(1), 0)
                if code == GRPC_UNAVAILABLE:
                    raise EtcdUnavailableError(f"etcd canceled the watch at {url}: {reason}")
                refusal = self._refusal(url, code, status.group(2))
                if isinstance(refusal, EtcdAuthError):
                    raise refusal
            raise EtcdRequestError(f"etcd canceled the watch at {url}: {reason}", 0, reason)
        events = [
            WatchEvent("DELETE" if event.get("type") == "DELETE" else "PUT", KeyValue.from_json(event.get("kv", {})))
            for event in result.get("events", [])
        ]
        if not events:
            return None  # the "created" confirmation, or a progress notification
        return WatchBatch(events=events, revision=_int(result.get("header", {}).get("revision")))

    # -------------------------------------------------------------------- cluster

    async def member_list(self) -> list[Member]:
        """The cluster's members, as the answering endpoint sees them."""
        answer, _ = await self._call("/v3/cluster/member/list", {})
        return [
            Member(
                id=_int(member.get("ID")),
                name=str(member.get("name", "")),
                client_urls=list(member.get("clientURLs", [])),
                peer_urls=list(member.get("peerURLs", [])),
            )
            for member in answer.get("members", [])
        ]
