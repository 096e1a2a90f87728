"""The rdzv-server client: :class:`AsyncClient` (asyncio) and :class:`Client` (threads).

What it owns:
- endpoint parsing (``host``, ``host:port``, ``[v6]:port``, ``http://…``, comma-separated
  lists for failover);
- client policy: per-request timeouts, retries with capped exponential backoff and full
  jitter inside a bounded retry budget, failover across endpoints, and the request ids
  (``rid``) that make a retried write apply exactly once;
- the client side of long-polls: the *client* owns a blocking call's deadline and re-polls
  with the time that remains;
- the choice of transport (:mod:`rdzv_client.transport`): HTTP for :class:`AsyncClient`,
  the stream protocol over blocking sockets for :class:`Client`.

What it must not know: torch (the torch ``Store`` and the torchrun handler wrap this
module), the server's internals. It shares only :mod:`rdzv_client.wire` with the server.

Rules it keeps:
- Only failures that say "try again shortly" are retried: no HTTP answer at all
  (refused, reset, timed out, truncated) and 502/503/504 (``not_ready`` while a server
  recovers, ``shutting_down``). A 4xx is the caller's mistake and is raised at once.
- A write gets its ``rid`` once, before the first attempt, and every retry resends that
  same ``rid``; so a write whose answer was lost is not applied twice. Each attempt also
  sends the client's *floor*, its lowest seq still awaiting an answer: the server keeps
  every result at or above it, so a retry is recognised however many threads share the
  client and however many writes they sent meanwhile.
- ``too_many_connections`` and ``buffers_full`` (a busy server shedding load) are retried
  like 503s; every other limit is the caller's to act on (:class:`LimitError`).
- A follower replica answers ``not_leader`` (a 503) naming the leader's URL. When that URL
  is one of the client's endpoints (same host and port; the endpoint keeps its own scheme)
  the client moves there and retries at once, same ``rid``, no backoff; after
  ``MAX_LEADER_REDIRECTS`` such hops in a row it backs off as for any 503. A leader that
  is not among the endpoints is never followed (:meth:`AsyncClient._leader_index` says why).
- Retrying stops at the retry budget (counted from the first failure of a call) or at the
  call's own deadline, whichever comes first, with :class:`RdzvConnectionError`.
- The policy is written once, as AsyncClient's coroutines. :class:`Client` runs those
  same coroutines in the calling thread over a transport that blocks instead of awaiting
  (so they never suspend): no event loop, no thread hop; any number of threads may share it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import random
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar, Union

from . import wire
from .credential import find_token
from .error import (
    BadRequestError,
    NotFoundError,
    NotLeaderError,
    RdzvConnectionError,
    RdzvError,
    RdzvTimeoutError,
    ServerError,
    error_from_body,
)
from .tls import client_context
from .transport import (
    DEFAULT_CONNECTION_LIMIT,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_REQUEST_TIMEOUT,
    AiohttpTransport,
    Answer,
    Endpoint,
    SocketTransport,
    Transport,
    TransportError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A key or value: ``str`` is sent as its UTF-8 bytes.
KeyLike = Union[str, bytes]

# A restarting server loads its snapshot and replays its log well within 30 s; past that,
# something is wrong that waiting longer will not fix.
DEFAULT_RETRY_BUDGET = 30.0
# The server caps long-polls near 30 s; asking for longer only keeps a possibly dead
# connection open longer before the client notices.
DEFAULT_MAX_HOLD = 30.0
# First retry comes quickly: a restarted server is usually listening again in well under 1 s.
DEFAULT_BACKOFF_BASE = 0.05
# Never sleep so long that a recovered server sits idle waiting for us.
DEFAULT_BACKOFF_CAP = 2.0
# A long-poll that came back "not yet" before its hold ended did not hold (a server
# shutting down, a proxy); pausing this long keeps such a loop from spinning.
EARLY_ANSWER_PAUSE = 0.05
# The job settings a node proposes unless told otherwise: the one set of defaults, JobSettings's.
_SETTINGS = wire.JobSettings()
DEFAULT_LAST_CALL_TIMEOUT = _SETTINGS.last_call_timeout
DEFAULT_JOIN_TIMEOUT = _SETTINGS.join_timeout
DEFAULT_HEARTBEAT_TTL = _SETTINGS.heartbeat_ttl

# A follower's not_leader is followed at once; more hops than this in a row, with no other
# outcome between them, mean the replicas disagree about who leads (an election under way,
# a stale view): from then on the client backs off as for any 503 instead of bouncing.
MAX_LEADER_REDIRECTS = 3
# While replicas elect a leader (they answer not_leader), retries pause at most this long, so
# a client notices the new leader within about this of its election instead of after a
# grown exponential backoff (followers answer cheaply; an election lasts about a lease TTL).
ELECTION_MAX_PAUSE = 0.25
# With several endpoints (replicas), a server silent this long beyond a request's hold is
# treated as failed and the next one is tried: a frozen leader (a paused VM) must not stall
# the agents' heartbeats past their TTL while another replica takes over within a lease TTL.
# The torchrun handler's watch holds a third of its TTL (10 s by default): 3.3 + 5 s leaves
# the new leader's grace (a full TTL from its take-over) with room to spare.
# One server alone keeps DEFAULT_REQUEST_TIMEOUT: there is nowhere else to go.
REPLICAS_REQUEST_TIMEOUT = 5.0

# Statuses that mean "this server (or the proxy before it) cannot answer right now".
RETRY_STATUSES = frozenset({502, 503, 504})
# Limits that say "busy now", not "too much": the server had no room for this request yet.
RETRY_CODES = frozenset({wire.ErrorCode.TOO_MANY_CONNECTIONS, wire.ErrorCode.BUFFERS_FULL})

# The field of each long-poll request that says how long the server may hold it.
_HOLD_FIELD: dict[type[wire.Request], str] = {
    wire.GetRequest: "timeout",
    wire.MultiGetRequest: "timeout",
    wire.WaitRequest: "timeout",
    wire.JoinRequest: "hold",
    wire.AwaitRoundRequest: "hold",
    wire.WatchRequest: "hold",
}


# --------------------------------------------------------------------------- endpoints


def _parse_port(text: str, spec: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ValueError(f"endpoint {spec!r} has no valid port: {text!r} is not 1-65535")
    return int(text)


def _parse_endpoint(spec: str) -> Endpoint:
    text = spec
    scheme = "http"
    if "://" in text:
        scheme, _, text = text.partition("://")
        scheme = scheme.lower()
        if scheme not in ("http", "https"):
            raise ValueError(f"endpoint {spec!r}: only http:// and https:// are supported")
        text = text.rstrip("/")
        if "/" in text:
            raise ValueError(f"endpoint {spec!r}: give only scheme, host and port, no path")
    port = wire.DEFAULT_PORT
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise ValueError(f"endpoint {spec!r}: '[' without a closing ']'")
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"endpoint {spec!r}: expected ':PORT' after ']'")
            port = _parse_port(rest[1:], spec)
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = _parse_port(port_text, spec)
    else:
        host = text  # a bare name, or a bare IPv6 address (several colons) on the default port
    if not host or any(c.isspace() or c in "/[]@?#" for c in host):
        raise ValueError(f"endpoint {spec!r} has no valid host")
    return Endpoint(host=host, port=port, scheme=scheme)


def parse_endpoints(spec: str) -> tuple[Endpoint, ...]:
    """Parse ``"a:29400,b:29400"`` (any of ``host``, ``host:port``, ``[v6]:port``, ``http://host:port``).

    Raises :class:`ValueError` naming the bad entry.
    """
    parts = [part.strip() for part in spec.split(",")]
    if not any(parts):
        raise ValueError("no rdzv-server endpoint given: expected HOST[:PORT][,HOST[:PORT]...]")
    if not all(parts):
        raise ValueError(f"endpoint list {spec!r} has an empty entry")
    return tuple(_parse_endpoint(part) for part in parts)


def _tls_endpoints(spec: str, tls: bool) -> tuple[Endpoint, ...]:
    """The endpoints of ``spec``, every one TLS (``https``) when ``tls``. Raises ValueError."""
    endpoints = parse_endpoints(spec)
    if not tls:
        return endpoints
    plain = [part.strip() for part in spec.split(",") if part.strip().lower().startswith("http://")]
    if plain:
        raise ValueError(f"endpoint {plain[0]!r} says http:// but TLS was asked for (tls): use https:// or HOST:PORT")
    return tuple(dataclasses.replace(e, scheme="https") for e in endpoints)


def _tls_context(
    endpoints: Sequence[Endpoint],
    ca_file: str | os.PathLike[str] | None,
    cert_file: str | os.PathLike[str] | None,
    key_file: str | os.PathLike[str] | None,
) -> ssl.SSLContext | None:
    """The client's TLS context when an endpoint uses TLS, else None.

    Raises ValueError when TLS files are given for endpoints that do not use TLS (they would
    be ignored, and the traffic sent in the clear), and ``TLSConfigError`` (a ValueError)
    when a file cannot be used.
    """
    if not any(e.scheme == "https" for e in endpoints):
        if ca_file or cert_file or key_file:
            raise ValueError(
                "ca_file, cert_file and key_file are TLS options, but no endpoint uses TLS: "
                "give https:// endpoints or tls=True (torchrun: --rdzv-conf tls=1; rdzvctl: --tls)"
            )
        return None
    return client_context(ca_file=ca_file or None, cert_file=cert_file or None, key_file=key_file or None)


def backoff_delay(
    attempt: int,
    rng: random.Random,
    *,
    base: float = DEFAULT_BACKOFF_BASE,
    cap: float = DEFAULT_BACKOFF_CAP,
) -> float:
    """Full-jitter backoff: uniform in ``[0, min(cap, base * 2**attempt)]`` (attempt counts from 0).

    Jitter spreads the retries of many nodes that lost the same server at the same moment.
    """
    return rng.uniform(0.0, min(cap, base * 2.0 ** min(attempt, 62)))


# --------------------------------------------------------------------------- results


@dataclasses.dataclass(frozen=True)
class WatchResult:
    """What a watch (heartbeat + long-poll) saw."""

    round: int
    state: str
    num_nodes_waiting: int
    closed: bool
    cause: str | None = None  # why the job closed (e.g. restart_budget_exhausted), from a server that says


class _Unavailable(Exception):
    """An answer that says "try again shortly" (502/503/504); only the retry loop sees it."""

    def __init__(self, error: RdzvError) -> None:
        super().__init__(str(error))
        self.error = error


def _one_line(text: str, limit: int) -> str:
    """``text`` as one printable line of at most ``limit`` characters (a check's output line)."""
    line = "".join(ch if ch.isprintable() else " " for ch in text.strip())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _as_bytes(name: str, value: KeyLike) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{name} must be str or bytes, not {type(value).__name__}")


def _reply_field(reply: object, name: str, kind: type[T], op: str) -> T:
    value = reply.get(name) if isinstance(reply, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ServerError(f"the server's {op} reply has no valid {name!r} field: {reply!r:.200}")
    return value


def _reply_bytes_list(reply: object, name: str, op: str, length: int | None = None) -> list[bytes]:
    values = _reply_field(reply, name, list, op)
    if not all(isinstance(v, bytes) for v in values) or (length is not None and len(values) != length):
        raise ServerError(f"the server's {op} reply has an invalid {name!r} list")
    return values


class _Unanswered:
    """The seqs of this client's writes still awaiting an answer (thread-safe: the sync
    client runs the same coroutines in many threads).

    A seq is issued and registered under one lock (:meth:`issue`): were it registered after
    being drawn, another thread could meanwhile report a floor above it, and the server would
    refuse it as an answered write's stale copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seqs: set[int] = set()
        self._next = itertools.count(1)

    def issue(self) -> int:
        with self._lock:
            seq = next(self._next)
            self._seqs.add(seq)
            return seq

    def add(self, seq: int) -> None:
        with self._lock:
            self._seqs.add(seq)

    def discard(self, seq: int) -> None:
        with self._lock:
            self._seqs.discard(seq)

    def floor(self, seq: int) -> int:
        """The lowest unanswered seq, ``seq`` included: every seq below it was answered."""
        with self._lock:
            return min(min(self._seqs, default=seq), seq)


def _answer(answer: Answer) -> Any:
    """The body of a 2xx answer; otherwise raise the error it stands for."""
    if 200 <= answer.status < 300:
        return answer.body
    error = error_from_body(answer.status, answer.body)
    if answer.status in RETRY_STATUSES or error.code in RETRY_CODES:
        raise _Unavailable(error)
    raise error


def _validated(rdzv_id: str, req: wire.Request | None) -> None:
    """Reject what the server would reject, before spending a round trip on it."""
    try:
        wire.check_id("rdzv_id", rdzv_id)
        validate = getattr(req, "validate", None)
        if validate is not None:
            validate()
    except wire.WireError as exc:
        raise BadRequestError(str(exc), code=exc.code) from exc


# --------------------------------------------------------------------------- async client


class AsyncClient:
    """An asyncio client of rdzv-server. Use it from one event loop; close it with :meth:`aclose`.

    ``endpoint`` is ``HOST[:PORT]`` or a comma-separated list of them (failover, in order);
    for a replicated server list every replica, as its ``--advertise-url`` names it: a
    follower's answer sends the client to the leader only when the leader is in the list.
    ``request_timeout`` is how long beyond a request's own hold an answer may take before
    the endpoint counts as failed: 30 s with one endpoint, 5 s with several (a frozen
    leader is left for the next replica well within a node's heartbeat TTL).
    ``token`` / ``token_file`` name the bearer token; without them the client looks where
    :mod:`rdzv_client.credential` says (``RDZV_TOKEN``, ``RDZV_TOKEN_FILE``, the default file
    the server creates), and raises ``CredentialError`` (a ValueError) for an unreadable one.
    TLS: an ``https://`` endpoint uses it, and ``tls=True`` uses it for every endpoint;
    ``ca_file`` is the CA bundle to trust (default: the system's), ``cert_file`` / ``key_file``
    a client certificate for a server that requires one (``--tls-client-ca``). The server's
    certificate must be valid for the endpoint's host. A file that cannot be used raises
    ``TLSConfigError`` (a ValueError), as do TLS files given with no TLS endpoint.
    Every method may raise :class:`RdzvConnectionError` (no server reachable within
    ``retry_budget``), :class:`BadRequestError` (invalid ids, keys or sizes),
    :class:`UnauthorizedError` (no valid token, or a read-only one for a write) and
    :class:`ServerError`; the others are listed per method.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        retry_budget: float = DEFAULT_RETRY_BUDGET,
        request_timeout: float | None = None,
        max_hold: float = DEFAULT_MAX_HOLD,
        connection_limit: int = DEFAULT_CONNECTION_LIMIT,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        client_id: str | None = None,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        tls: bool = False,
        ca_file: str | os.PathLike[str] | None = None,
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
        transport: Transport | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._endpoints = _tls_endpoints(endpoint, tls)
        if request_timeout is None:
            request_timeout = DEFAULT_REQUEST_TIMEOUT if len(self._endpoints) == 1 else REPLICAS_REQUEST_TIMEOUT
        if retry_budget < 0 or request_timeout <= 0 or max_hold < 0:
            raise ValueError("retry_budget and max_hold must be >= 0 and request_timeout > 0")
        self._current = 0
        self._unlisted_leader: str | None = None  # the last leader URL warned about, to warn once
        self._retry_budget = retry_budget
        self._request_timeout = request_timeout
        self._max_hold = max_hold
        self._client_id = client_id or uuid.uuid4().hex[:16]
        if not 0 < len(self._client_id) <= wire.MAX_CLIENT_ID_CHARS:
            raise ValueError(f"client_id must be 1..{wire.MAX_CLIENT_ID_CHARS} characters")
        self._unanswered = _Unanswered()
        self._transport: Transport = transport or AiohttpTransport(
            connection_limit=connection_limit,
            max_response_bytes=max_response_bytes,
            token=find_token(token, token_file),
            tls=_tls_context(self._endpoints, ca_file, cert_file, key_file),
        )
        self._rng = rng or random.Random()
        self._sleep = sleep

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._endpoints

    @property
    def client_id(self) -> str:
        """The first half of every ``rid`` this client sends."""
        return self._client_id

    async def aclose(self) -> None:
        """Close the connections; the client must not be used afterwards."""
        await self._transport.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ----------------------------------------------------------------- the exchange

    def next_rid(self) -> tuple[str, int]:
        """A fresh request id ``(client_id, seq)`` for one write (all its retries share it).

        It counts as unanswered (it holds the client's floor down) from now until a
        :meth:`request` that carries it returns or raises: send it."""
        return (self._client_id, self._unanswered.issue())

    async def request(self, rdzv_id: str, req: wire.Request, *, deadline: float | None = None) -> dict[str, Any]:
        """Send one operation and return the server's reply map, retrying as the module says.

        A write without a ``rid`` gets one here; a write that has one keeps it (sending
        the same ``rid`` twice applies the write once). ``deadline`` (``time.monotonic()``)
        bounds retries and shrinks the hold of a long-poll request that is retried.
        """
        _validated(rdzv_id, req)
        rid: tuple[Any, ...] | None = getattr(req, "rid", None) if req.writes else None
        if req.writes and rid is None:
            rid = self.next_rid()
        ours = rid is not None and rid[0] == self._client_id
        if ours:
            assert rid is not None
            self._unanswered.add(rid[1])
        try:
            return await self._request(rdzv_id, req, rid if ours else None, deadline)
        finally:
            if ours:
                assert rid is not None
                self._unanswered.discard(rid[1])

    async def _request(
        self, rdzv_id: str, req: wire.Request, rid: tuple[Any, ...] | None, deadline: float | None
    ) -> dict[str, Any]:
        field = _HOLD_FIELD.get(type(req))

        async def attempt(endpoint: Endpoint) -> Any:
            this = req
            if rid is not None:  # every attempt tells the server what it may forget
                this = dataclasses.replace(req, rid=(rid[0], rid[1], self._unanswered.floor(rid[1])))  # type: ignore[call-arg]
            hold = 0.0
            if field is not None:
                hold = float(getattr(req, field))
                if deadline is not None:
                    hold = max(0.0, min(hold, deadline - time.monotonic()))
                    this = dataclasses.replace(this, **{field: hold})
            fields = wire.to_mapping(this)
            return _answer(await self._transport.call(endpoint, rdzv_id, req.op, fields, hold + self._request_timeout))

        reply = await self._with_retries(f"{req.op} on job {rdzv_id}", attempt, deadline)
        if not isinstance(reply, dict):
            raise ServerError(f"the server's {req.op} reply is not a map: {reply!r:.200}")
        return reply

    async def _get_json(self, path: str, what: str, hold: float = 0.0, *, method: str = "GET", body: Any = None) -> Any:
        async def attempt(endpoint: Endpoint) -> Any:
            timeout = hold + self._request_timeout
            if method == "GET":
                return _answer(await self._transport.fetch(endpoint, path, timeout))
            return _answer(await self._transport.fetch(endpoint, path, timeout, method=method, body=body))

        return await self._with_retries(what, attempt, None)

    async def _with_retries(
        self, what: str, attempt: Callable[[Endpoint], Awaitable[T]], deadline: float | None
    ) -> T:
        tries = 0  # failed attempts, leader redirects included
        waits = 0  # backoff sleeps so far: the backoff's exponent
        redirects = 0  # leader redirects followed in a row, with no other outcome between
        electing = False  # a replica answered not_leader: a new leader is due within a lease TTL
        refused: set[int] = set()  # endpoints this call could not reach: a stale "leader" to skip
        give_up_at: float | None = None
        while True:
            index = self._current
            endpoint = self._endpoints[index]
            try:
                return await attempt(endpoint)
            except (TransportError, _Unavailable) as exc:
                failure: Exception = exc.error if isinstance(exc, _Unavailable) else exc
                code = exc.error.code if isinstance(exc, _Unavailable) else None
            tries += 1
            now = time.monotonic()
            if give_up_at is None:
                give_up_at = now + self._retry_budget
                if deadline is not None:
                    give_up_at = min(give_up_at, deadline)
            if now >= give_up_at:
                raise RdzvConnectionError(self._unreachable(what, tries, failure), code=code) from failure
            electing = electing or code is wire.ErrorCode.NOT_LEADER
            if isinstance(failure, TransportError):
                refused.add(index)
            leader = self._leader_index(failure, index) if redirects < MAX_LEADER_REDIRECTS else None
            if leader in refused:  # the follower's view is older than our failure: try the others
                leader = None
            if leader is not None:
                redirects += 1
                self._current = leader  # what the follower said beats a concurrent call's rotation
                log.info(
                    "Request for %s: rdzv-server at %s is a follower; sending it to the leader at %s.",
                    what,
                    endpoint,
                    self._endpoints[leader],
                )
                continue
            redirects = 0
            if self._current == index:  # fail over, unless a concurrent call already did
                self._current = (index + 1) % len(self._endpoints)
            delay = backoff_delay(waits, self._rng)
            # A replica answered not_leader: the leader it names may be the dead one (until its
            # lease expires), and a new one is due within a lease TTL. Followers answer at once
            # and cheaply: ask again soon, not seconds later.
            if electing:
                delay = min(delay, ELECTION_MAX_PAUSE)
            delay = min(delay, give_up_at - now)
            waits += 1
            (log.warning if waits == 1 else log.debug)(
                "Request for %s to rdzv-server at %s failed (%s); retrying in %.2f s (attempt %d).",
                what,
                endpoint,
                failure,
                delay,
                tries,
            )
            await self._sleep(delay)

    def _leader_index(self, failure: Exception, answered: int) -> int | None:
        """The index of the endpoint that ``failure`` (a follower's ``not_leader``) names as
        the leader; None when it names none, names the endpoint that answered, or names one
        this client was not given (warned about once: a misconfiguration).

        Only the configured endpoints are followed, never a URL as such: the token, the CA
        to trust and the names certificates must carry are configured for that list, and
        an answer (from a misconfigured replica, or whoever answers in its place) must not
        send them to another host. The match is on host and port; the endpoint keeps the
        scheme it was configured with.
        """
        if not isinstance(failure, NotLeaderError) or failure.leader is None:
            return None
        try:
            named: Endpoint | None = _parse_endpoint(failure.leader)
        except ValueError:
            named = None
        if named is not None:
            for index, endpoint in enumerate(self._endpoints):
                if endpoint.port == named.port and endpoint.host.lower() == named.host.lower():
                    return index if index != answered else None
        if failure.leader != self._unlisted_leader:
            self._unlisted_leader = failure.leader
            log.warning(
                "rdzv-server at %s is a follower and names the leader %.200r, which is not one of this "
                "client's endpoints (%s); the client does not follow it and tries its endpoints in turn. "
                "Give every replica an --advertise-url that is one of the endpoints clients are given.",
                self._endpoints[answered],
                failure.leader,
                ",".join(str(e) for e in self._endpoints),
            )
        return None

    def _unreachable(self, what: str, tries: int, failure: Exception) -> str:
        where = ", ".join(str(e) for e in self._endpoints)
        if isinstance(failure, NotLeaderError):
            return (
                f"could not complete {what}: no rdzv-server replica at {where} was the leader within "
                f"the retry budget of {self._retry_budget:g} s ({tries} attempts; last failure: {failure}); "
                "an election may be under way, or the leader is not among these endpoints "
                "(`rdzvctl cluster` shows the replicas and their URLs)"
            )
        return (
            f"could not complete {what}: no rdzv-server at {where} answered within the retry "
            f"budget of {self._retry_budget:g} s ({tries} attempts; last failure: {failure}); "
            "check that rdzv-server is running there, that this host can reach it "
            "(firewall, hostname), and that the endpoint is right"
        )

    async def _pause_if_early(self, sent: float, hold: float, deadline: float) -> None:
        now = time.monotonic()
        if now - sent < hold and now < deadline:
            await self._sleep(min(EARLY_ANSWER_PAUSE, deadline - now))

    async def _poll(self, rdzv_id: str, req: wire.Request, timeout: float, what: str) -> dict[str, Any]:
        """Re-send a long-poll ``req`` until its reply says ``found``; the deadline is ours."""
        field = _HOLD_FIELD[type(req)]
        deadline = time.monotonic() + timeout
        while True:
            sent = time.monotonic()
            hold = max(0.0, min(deadline - sent, self._max_hold))
            reply = await self.request(rdzv_id, dataclasses.replace(req, **{field: hold}), deadline=deadline)
            if _reply_field(reply, "found", bool, req.op):
                return reply
            if time.monotonic() >= deadline:
                raise RdzvTimeoutError(f"{what} within {timeout:g} s")
            await self._pause_if_early(sent, hold, deadline)

    # ----------------------------------------------------------------- store

    async def set(self, rdzv_id: str, key: KeyLike, value: KeyLike, *, round: int | None = None) -> None:
        """Store ``value`` under ``key``."""
        req = wire.SetRequest(rdzv_id, key=_as_bytes("key", key), value=_as_bytes("value", value), round=round)
        await self.request(rdzv_id, req)

    async def get(self, rdzv_id: str, key: KeyLike, *, timeout: float, round: int | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` s for it to be set.

        Raises :class:`RdzvTimeoutError` when the key is still missing at the deadline.
        """
        k = _as_bytes("key", key)
        req = wire.GetRequest(key=k, round=round)
        reply = await self._poll(rdzv_id, req, timeout, f"key {k!r} of job {rdzv_id} was not set")
        return _reply_field(reply, "value", bytes, "get")

    async def add(self, rdzv_id: str, key: KeyLike, amount: int, *, round: int | None = None) -> int:
        """Add ``amount`` to the integer at ``key`` (missing counts as 0); return the new value.

        Raises :class:`ConflictError` (``not_an_integer``) when the key holds something else.
        """
        req = wire.AddRequest(rdzv_id, key=_as_bytes("key", key), amount=amount, round=round)
        reply = await self.request(rdzv_id, req)
        return _reply_field(reply, "value", int, "add")

    async def compare_set(
        self, rdzv_id: str, key: KeyLike, expected: KeyLike, desired: KeyLike, *, round: int | None = None
    ) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return the value now stored."""
        req = wire.CompareSetRequest(
            rdzv_id,
            key=_as_bytes("key", key),
            expected=_as_bytes("expected", expected),
            desired=_as_bytes("desired", desired),
            round=round,
        )
        return _reply_field(await self.request(rdzv_id, req), "value", bytes, "compare_set")

    async def append(self, rdzv_id: str, key: KeyLike, value: KeyLike, *, round: int | None = None) -> None:
        """Append ``value`` to the bytes at ``key`` (creating it)."""
        req = wire.AppendRequest(rdzv_id, key=_as_bytes("key", key), value=_as_bytes("value", value), round=round)
        await self.request(rdzv_id, req)

    async def multi_get(
        self, rdzv_id: str, keys: Sequence[KeyLike], *, timeout: float, round: int | None = None
    ) -> list[bytes]:
        """The values of ``keys`` in order, waiting up to ``timeout`` s for all of them.

        Raises :class:`RdzvTimeoutError` when some key is still missing at the deadline.
        """
        ks = tuple(_as_bytes("key", k) for k in keys)
        req = wire.MultiGetRequest(keys=ks, round=round)
        reply = await self._poll(rdzv_id, req, timeout, f"some of {len(ks)} keys of job {rdzv_id} were not set")
        return _reply_bytes_list(reply, "values", "multi_get", len(ks))

    async def multi_set(
        self, rdzv_id: str, keys: Sequence[KeyLike], values: Sequence[KeyLike], *, round: int | None = None
    ) -> None:
        """Set every ``keys[i]`` to ``values[i]`` in one atomic step."""
        req = wire.MultiSetRequest(
            rdzv_id,
            keys=tuple(_as_bytes("key", k) for k in keys),
            values=tuple(_as_bytes("value", v) for v in values),
            round=round,
        )
        await self.request(rdzv_id, req)

    async def check(self, rdzv_id: str, keys: Sequence[KeyLike], *, round: int | None = None) -> bool:
        """Whether every one of ``keys`` exists (does not wait)."""
        req = wire.CheckRequest(keys=tuple(_as_bytes("key", k) for k in keys), round=round)
        return _reply_field(await self.request(rdzv_id, req), "result", bool, "check")

    async def wait(self, rdzv_id: str, keys: Sequence[KeyLike], *, timeout: float, round: int | None = None) -> None:
        """Return once every one of ``keys`` exists.

        Raises :class:`RdzvTimeoutError` when some key is still missing after ``timeout`` s.
        """
        ks = tuple(_as_bytes("key", k) for k in keys)
        req = wire.WaitRequest(keys=ks, round=round)
        await self._poll(rdzv_id, req, timeout, f"waited for {len(ks)} keys of job {rdzv_id}: not all were set")

    async def delete_key(self, rdzv_id: str, key: KeyLike, *, round: int | None = None) -> bool:
        """Delete ``key``; return whether it existed."""
        req = wire.DeleteKeyRequest(rdzv_id, key=_as_bytes("key", key), round=round)
        return _reply_field(await self.request(rdzv_id, req), "deleted", bool, "delete_key")

    async def num_keys(self, rdzv_id: str, *, round: int | None = None) -> int:
        """How many keys the job (or the job's ``round``) holds."""
        return _reply_field(await self.request(rdzv_id, wire.NumKeysRequest(round=round)), "count", int, "num_keys")

    async def list_keys(self, rdzv_id: str, prefix: KeyLike = b"", *, round: int | None = None) -> list[bytes]:
        """The keys that start with ``prefix``."""
        req = wire.ListKeysRequest(prefix=_as_bytes("prefix", prefix), round=round)
        return _reply_bytes_list(await self.request(rdzv_id, req), "keys", "list_keys")

    # ----------------------------------------------------------------- jobs and rendezvous

    async def create_job(
        self,
        rdzv_id: str,
        *,
        min_nodes: int,
        max_nodes: int,
        last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
        heartbeat_ttl: float = DEFAULT_HEARTBEAT_TTL,
    ) -> None:
        """Create the job with these settings; a no-op when it exists with the same ones.

        Raises :class:`ConflictError` (``settings_conflict``) when it exists with others.
        """
        req = wire.CreateJobRequest(
            rdzv_id, wire.JobSettings(min_nodes, max_nodes, last_call_timeout, join_timeout, heartbeat_ttl)
        )
        await self.request(rdzv_id, req)

    async def join(
        self,
        rdzv_id: str,
        *,
        node_id: str,
        addr: str,
        nproc_per_node: int,
        min_nodes: int,
        max_nodes: int,
        last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
        heartbeat_ttl: float = DEFAULT_HEARTBEAT_TTL,
        master_port: int = 0,
        timeout: float,
        host: str = "",
        topology: str = "",
        max_restarts: int | None = None,
    ) -> wire.Assignment:
        """Join the job's next round and wait (up to ``timeout`` s) for it to form.

        ``master_port``: the port this node's workers would serve their store on should it
        become node rank 0; every node's assignment then carries node rank 0's. ``host``: the
        node's host name when it is not ``addr`` (cordons match either); ``topology``: its
        topology path (node ranks follow it); ``max_restarts``: the job-wide restart budget.

        Raises :class:`HostCordonedError` (the node's host is cordoned), :class:`JoinTimeoutError` (the job's ``join_timeout`` passed on the server),
        :class:`JobClosedError`, :class:`ConflictError` (settings differ from the job's),
        :class:`RdzvTimeoutError` (this call's own ``timeout`` passed).
        """
        deadline = time.monotonic() + timeout
        sent = time.monotonic()
        hold = max(0.0, min(timeout, self._max_hold))
        req = wire.JoinRequest(
            rdzv_id,
            node_id=node_id,
            addr=addr,
            nproc_per_node=nproc_per_node,
            settings=wire.JobSettings(min_nodes, max_nodes, last_call_timeout, join_timeout, heartbeat_ttl, max_restarts),
            hold=hold,
            master_port=master_port,
            host=host,
            topology=topology,
        )
        reply: dict[str, Any] | None = None  # None: (re)send the join itself
        round_ = -1
        while True:
            try:
                if reply is None:
                    reply = await self.request(rdzv_id, dataclasses.replace(req, hold=hold), deadline=deadline)
                    round_ = _reply_field(reply, "round", int, "join")
                else:
                    poll = wire.AwaitRoundRequest(node_id=node_id, round=round_, hold=hold)
                    reply = await self.request(rdzv_id, poll, deadline=deadline)
            except NotFoundError as exc:
                if exc.code is not wire.ErrorCode.NODE_NOT_FOUND or time.monotonic() >= deadline:
                    raise
                # The server dropped this node from the line (its poll came back later than the
                # heartbeat TTL, e.g. on an overloaded host): it is alive, so take a place again.
                log.warning("Node %s was dropped from job %s while waiting (%s); joining again.", node_id, rdzv_id, exc)
                reply = None
                continue
            assignment = reply.get("assignment")
            if assignment is not None:
                try:
                    return wire.assignment_from_wire(assignment)
                except wire.WireError as exc:
                    raise ServerError(f"the server sent an invalid assignment: {exc}") from exc
            if time.monotonic() >= deadline:
                raise RdzvTimeoutError(
                    f"node {node_id} got no place in a round of job {rdzv_id} within {timeout:g} s"
                )
            await self._pause_if_early(sent, hold, deadline)
            sent = time.monotonic()
            hold = max(0.0, min(deadline - sent, self._max_hold))

    async def watch(
        self, rdzv_id: str, node_id: str, *, round: int, known: int = -1, hold: float = 0.0
    ) -> WatchResult:
        """Heartbeat ``node_id``, then wait up to ``hold`` s (capped at ``max_hold``) for the
        job's ``num_nodes_waiting`` to differ from ``known``.

        Raises :class:`NotFoundError` when the job or the node is unknown to the server.
        """
        req = wire.WatchRequest(node_id=node_id, round=round, known=known, hold=max(0.0, min(hold, self._max_hold)))
        reply = await self.request(rdzv_id, req)
        return WatchResult(
            round=_reply_field(reply, "round", int, "watch"),
            state=_reply_field(reply, "state", str, "watch"),
            num_nodes_waiting=_reply_field(reply, "num_nodes_waiting", int, "watch"),
            closed=_reply_field(reply, "closed", bool, "watch"),
            cause=reply.get("cause") if isinstance(reply.get("cause"), str) else None,
        )

    async def leave(self, rdzv_id: str, node_id: str) -> None:
        """``node_id`` leaves the job gracefully: the other nodes do not restart for it."""
        await self.request(rdzv_id, wire.LeaveRequest(rdzv_id, node_id=node_id))

    async def close_job(self, rdzv_id: str, *, cause: str = "") -> None:
        """Close the job: later joins fail with :class:`JobClosedError`. ``cause`` (one of
        ``wire.CLOSE_CAUSES``) tells the job's timeline who closed it."""
        await self.request(rdzv_id, wire.CloseRequest(rdzv_id, cause=cause))

    async def refuse(
        self, rdzv_id: str, *, node_id: str, addr: str, cause: str, detail: str = "", host: str = "",
        min_nodes: int = 1, max_nodes: int = 1, max_restarts: int | None = None,
    ) -> None:
        """Tell the server this node is not fit to join (``cause``: ``health_check_failed``;
        ``detail``: the check's last output line, cut to what the server keeps): the job's
        timeline records ``node_refused``. The node counts (``min_nodes``...) make the job if
        this node is its first."""
        settings = wire.JobSettings(min_nodes=min_nodes, max_nodes=max_nodes, max_restarts=max_restarts)
        req = wire.RefuseRequest(
            rdzv_id, node_id=node_id, addr=addr, cause=cause, detail=_one_line(detail, wire.MAX_REASON_CHARS),
            settings=settings, host=host,
        )
        await self.request(rdzv_id, req)

    async def cordons(self) -> dict[str, Any]:
        """The cordons in effect: ``{"cordons": [...], "now"}``, each cordon a map with
        ``host``, ``since`` and ``until`` (None: until lifted) on the server's clock (``now``),
        ``left_s``, ``reason``, ``by`` (``operator`` or ``flapping``)."""
        body = await self._get_json("/v1/cordons", "listing cordons")
        cordons = _reply_field(body, "cordons", list, "cordons")
        if not all(isinstance(c, dict) for c in cordons):
            raise ServerError("the server's cordon list holds something that is not a map")
        return {"cordons": cordons, "now": _reply_field(body, "now", float, "cordons")}

    async def cordon(self, host: str, *, reason: str = "", duration: float | None = None) -> dict[str, Any]:
        """Cordon ``host`` (a node's host name or address): every job refuses its nodes, for
        ``duration`` seconds (None: until :meth:`uncordon`). Returns the cordon."""
        _validated("fleet", wire.CordonRequest("", host=host, reason=reason, duration=duration))
        body = await self._get_json(
            "/v1/cordons", f"cordoning {host}", method="POST", body={"host": host, "reason": reason, "duration": duration}
        )
        cordon = _reply_field(body, "cordon", dict, "cordon")
        return cordon

    async def uncordon(self, host: str) -> bool:
        """Lift ``host``'s cordon; False when it had none."""
        _validated("fleet", wire.UncordonRequest("", host=host))
        body = await self._get_json(f"/v1/cordons/{urllib.parse.quote(host, safe='')}", f"uncordoning {host}", method="DELETE")
        return _reply_field(body, "uncordoned", bool, "uncordon")

    async def jobs(self) -> list[dict[str, Any]]:
        """Every job the server knows, each a map with ``rdzv_id``, ``state``, ``round``, ``num_nodes``…"""
        body = await self._get_json("/v1/jobs", "listing jobs")
        jobs = _reply_field(body, "jobs", list, "jobs")
        if not all(isinstance(j, dict) for j in jobs):
            raise ServerError("the server's job list holds something that is not a map")
        return jobs

    async def job(self, rdzv_id: str) -> dict[str, Any]:
        """The membership document of one job (see DESIGN.md). Raises :class:`NotFoundError`."""
        _validated(rdzv_id, None)
        body = await self._get_json(f"/v1/jobs/{rdzv_id}", f"reading job {rdzv_id}")
        if not isinstance(body, dict):
            raise ServerError(f"the server's membership document of job {rdzv_id} is not a map")
        return body

    async def events(self, rdzv_id: str, *, since: int = 0, wait: float = 0.0) -> dict[str, Any]:
        """The job's timeline after event ``since``: ``{"events": [...], "next_seq", "first_seq",
        "now"}`` (each event: ``seq``, ``time`` and ``now`` on the server's clock, ``kind``,
        ``cause``, ``round``, ``node_id``, ``addr`` and details). With ``wait`` the server holds
        the request up to that long (capped by its --max-hold) while there is nothing newer.
        Raises :class:`NotFoundError`."""
        _validated(rdzv_id, None)
        if since < 0 or wait < 0:
            raise ValueError("since and wait must be >= 0")
        path = f"/v1/jobs/{rdzv_id}/events?since={int(since)}&wait={float(wait):g}"
        body = await self._get_json(path, f"reading the events of job {rdzv_id}", hold=wait)
        if not isinstance(body, dict) or not isinstance(body.get("events"), list):
            raise ServerError(f"the server's events of job {rdzv_id} are not a map with a list of events")
        return body

    async def cluster(self) -> dict[str, Any]:
        """Who serves, as the replica that answers sees it: ``mode`` (``"replicated"`` or
        ``"single"``), ``this`` (that replica's id), ``leader`` (``{"id", "url", "since"}``, or
        None during an election), ``replicas`` (each ``id``, ``url``, ``role``, ``since`` (in
        that role since), ``started``, ``applied_index``; times are Unix seconds on the
        server's clock) and ``etcd`` (None, or ``prefix``, ``endpoints`` and ``members``).

        Raises :class:`NotFoundError` from a server too old to have ``/v1/cluster``.
        """
        body = await self._get_json("/v1/cluster", "reading the cluster")
        if not isinstance(body, dict) or not isinstance(body.get("replicas"), list):
            raise ServerError("the server's cluster document is not a map with a list of replicas")
        return body

    async def healthy(self) -> bool:
        """Whether the first endpoint that answers says its process is up (one try each, no retry budget)."""
        return await self._probe("/healthz")

    async def ready(self) -> bool:
        """Whether the first endpoint that answers has recovered its store and accepts requests.

        With replicas, a follower that has caught up is ready too: it sends this client's
        requests on to the leader (:meth:`cluster` says which replica leads).
        """
        return await self._probe("/readyz")

    async def _probe(self, path: str) -> bool:
        for endpoint in self._endpoints:
            try:
                answer = await self._transport.fetch(endpoint, path, self._request_timeout)
            except (TransportError, ServerError):
                continue
            return answer.status == 200
        return False


# --------------------------------------------------------------------------- sync client


def _drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (its transport blocks instead) to its end."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("a blocking rdzv Client call tried to suspend: its transport must block, not await")


async def _blocking_sleep(seconds: float) -> None:
    time.sleep(seconds)  # noqa: ASYNC251 (driven by _drive in the caller's thread, never in a loop)


class Client:
    """A thread-safe blocking client of rdzv-server, with the methods of :class:`AsyncClient`.

    The calling thread does the work: the same client policy as :class:`AsyncClient`
    (it *is* an AsyncClient, driven without an event loop) over a :class:`SocketTransport`,
    whose pooled connections speak the stream protocol. Any number of threads may share
    one ``Client``; each call holds one connection while it runs. Close it with
    :meth:`close` (or use it as a context manager): calls in flight then raise
    :class:`RdzvError`, later calls :class:`RuntimeError`. After ``fork``, the child opens
    its own connections. Its token and TLS options, and its errors, are those of :class:`AsyncClient`.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        retry_budget: float = DEFAULT_RETRY_BUDGET,
        request_timeout: float | None = None,
        max_hold: float = DEFAULT_MAX_HOLD,
        connection_limit: int = DEFAULT_CONNECTION_LIMIT,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        client_id: str | None = None,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        tls: bool = False,
        ca_file: str | os.PathLike[str] | None = None,
        cert_file: str | os.PathLike[str] | None = None,
        key_file: str | os.PathLike[str] | None = None,
        transport: Transport | None = None,
    ) -> None:
        self._transport = transport or SocketTransport(
            connection_limit=connection_limit,
            max_response_bytes=max_response_bytes,
            token=find_token(token, token_file),
            tls=_tls_context(_tls_endpoints(endpoint, tls), ca_file, cert_file, key_file),
        )
        self._async = AsyncClient(
            endpoint,
            tls=tls,
            retry_budget=retry_budget,
            request_timeout=request_timeout,
            max_hold=max_hold,
            client_id=client_id,
            transport=self._transport,
            sleep=_blocking_sleep,
        )
        self._closed = False

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._async.endpoints

    @property
    def client_id(self) -> str:
        return self._async.client_id

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise RuntimeError("this rdzv Client is closed")
        return _drive(coro)

    def close(self) -> None:
        """Close every connection; calls in flight raise :class:`RdzvError` (idempotent)."""
        if not self._closed:
            self._closed = True
            _drive(self._async.aclose())

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ----------------------------------------------------------------- the methods

    def next_rid(self) -> tuple[str, int]:
        return self._async.next_rid()

    def request(self, rdzv_id: str, req: wire.Request) -> dict[str, Any]:
        return self._run(self._async.request(rdzv_id, req))

    def set(self, rdzv_id: str, key: KeyLike, value: KeyLike, *, round: int | None = None) -> None:
        self._run(self._async.set(rdzv_id, key, value, round=round))

    def get(self, rdzv_id: str, key: KeyLike, *, timeout: float, round: int | None = None) -> bytes:
        return self._run(self._async.get(rdzv_id, key, timeout=timeout, round=round))

    def add(self, rdzv_id: str, key: KeyLike, amount: int, *, round: int | None = None) -> int:
        return self._run(self._async.add(rdzv_id, key, amount, round=round))

    def compare_set(
        self, rdzv_id: str, key: KeyLike, expected: KeyLike, desired: KeyLike, *, round: int | None = None
    ) -> bytes:
        return self._run(self._async.compare_set(rdzv_id, key, expected, desired, round=round))

    def append(self, rdzv_id: str, key: KeyLike, value: KeyLike, *, round: int | None = None) -> None:
        self._run(self._async.append(rdzv_id, key, value, round=round))

    def multi_get(
        self, rdzv_id: str, keys: Sequence[KeyLike], *, timeout: float, round: int | None = None
    ) -> list[bytes]:
        return self._run(self._async.multi_get(rdzv_id, keys, timeout=timeout, round=round))

    def multi_set(
        self, rdzv_id: str, keys: Sequence[KeyLike], values: Sequence[KeyLike], *, round: int | None = None
    ) -> None:
        self._run(self._async.multi_set(rdzv_id, keys, values, round=round))

    def check(self, rdzv_id: str, keys: Sequence[KeyLike], *, round: int | None = None) -> bool:
        return self._run(self._async.check(rdzv_id, keys, round=round))

    def wait(self, rdzv_id: str, keys: Sequence[KeyLike], *, timeout: float, round: int | None = None) -> None:
        self._run(self._async.wait(rdzv_id, keys, timeout=timeout, round=round))

    def delete_key(self, rdzv_id: str, key: KeyLike, *, round: int | None = None) -> bool:
        return self._run(self._async.delete_key(rdzv_id, key, round=round))

    def num_keys(self, rdzv_id: str, *, round: int | None = None) -> int:
        return self._run(self._async.num_keys(rdzv_id, round=round))

    def list_keys(self, rdzv_id: str, prefix: KeyLike = b"", *, round: int | None = None) -> list[bytes]:
        return self._run(self._async.list_keys(rdzv_id, prefix, round=round))

    def create_job(
        self,
        rdzv_id: str,
        *,
        min_nodes: int,
        max_nodes: int,
        last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
        heartbeat_ttl: float = DEFAULT_HEARTBEAT_TTL,
    ) -> None:
        self._run(
            self._async.create_job(
                rdzv_id,
                min_nodes=min_nodes,
                max_nodes=max_nodes,
                last_call_timeout=last_call_timeout,
                join_timeout=join_timeout,
                heartbeat_ttl=heartbeat_ttl,
            )
        )

    def join(
        self,
        rdzv_id: str,
        *,
        node_id: str,
        addr: str,
        nproc_per_node: int,
        min_nodes: int,
        max_nodes: int,
        last_call_timeout: float = DEFAULT_LAST_CALL_TIMEOUT,
        join_timeout: float = DEFAULT_JOIN_TIMEOUT,
        heartbeat_ttl: float = DEFAULT_HEARTBEAT_TTL,
        master_port: int = 0,
        timeout: float,
        host: str = "",
        topology: str = "",
        max_restarts: int | None = None,
    ) -> wire.Assignment:
        return self._run(
            self._async.join(
                rdzv_id,
                node_id=node_id,
                addr=addr,
                nproc_per_node=nproc_per_node,
                min_nodes=min_nodes,
                max_nodes=max_nodes,
                last_call_timeout=last_call_timeout,
                join_timeout=join_timeout,
                heartbeat_ttl=heartbeat_ttl,
                master_port=master_port,
                timeout=timeout,
                host=host,
                topology=topology,
                max_restarts=max_restarts,
            )
        )

    def watch(self, rdzv_id: str, node_id: str, *, round: int, known: int = -1, hold: float = 0.0) -> WatchResult:
        return self._run(self._async.watch(rdzv_id, node_id, round=round, known=known, hold=hold))

    def leave(self, rdzv_id: str, node_id: str) -> None:
        self._run(self._async.leave(rdzv_id, node_id))

    def close_job(self, rdzv_id: str, *, cause: str = "") -> None:
        self._run(self._async.close_job(rdzv_id, cause=cause))

    def refuse(
        self, rdzv_id: str, *, node_id: str, addr: str, cause: str, detail: str = "", host: str = "",
        min_nodes: int = 1, max_nodes: int = 1, max_restarts: int | None = None,
    ) -> None:
        self._run(self._async.refuse(
            rdzv_id, node_id=node_id, addr=addr, cause=cause, detail=detail, host=host,
            min_nodes=min_nodes, max_nodes=max_nodes, max_restarts=max_restarts,
        ))

    def cordons(self) -> dict[str, Any]:
        return self._run(self._async.cordons())

    def cordon(self, host: str, *, reason: str = "", duration: float | None = None) -> dict[str, Any]:
        return self._run(self._async.cordon(host, reason=reason, duration=duration))

    def uncordon(self, host: str) -> bool:
        return self._run(self._async.uncordon(host))

    def jobs(self) -> list[dict[str, Any]]:
        return self._run(self._async.jobs())

    def job(self, rdzv_id: str) -> dict[str, Any]:
        return self._run(self._async.job(rdzv_id))

    def events(self, rdzv_id: str, *, since: int = 0, wait: float = 0.0) -> dict[str, Any]:
        return self._run(self._async.events(rdzv_id, since=since, wait=wait))

    def cluster(self) -> dict[str, Any]:
        return self._run(self._async.cluster())

    def healthy(self) -> bool:
        return self._run(self._async.healthy())

    def ready(self) -> bool:
        return self._run(self._async.ready())
