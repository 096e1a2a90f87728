"""AsyncClient: the client policy written once, as coroutines over an asyncio transport.

What it owns: one exchange's policy, end to end: request ids and the floor, per-request
timeouts, the retry loop (backoff, failover, leader redirects), long-polls whose deadline
the client owns, and every operation's method. :mod:`rdzv_client.client` states the rules.

What it must not know: how bytes travel (:mod:`rdzv_client.transport`), torch.

This file is also the source of the blocking :class:`Client`: :mod:`rdzv_client._unasync`
writes :mod:`rdzv_client.sync_client` from it by taking the ``async``/``await`` out and
naming the blocking transport (``python -m rdzv_client._unasync``; a unit test fails while
the generated file is stale). So the policy exists once, and the threaded client runs plain
functions: no event loop, no thread hop, no coroutine. Keep this file within what that
rewrite understands (its table of substitutions): no ``async with``/``async for``, no
asyncio but ``asyncio.sleep`` as the default pause.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import time
import urllib.parse
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

from . import wire
from .credential import find_token
from .error import BadRequestError, NotFoundError, NotLeaderError, RdzvConnectionError, RdzvError, RdzvTimeoutError, ServerError
from .policy import (
    DEFAULT_MAX_HOLD,
    DEFAULT_RETRY_BUDGET,
    EARLY_ANSWER_PAUSE,
    ELECTION_MAX_PAUSE,
    HOLD_FIELD,
    MAX_LEADER_REDIRECTS,
    REPLICAS_REQUEST_TIMEOUT,
    KeyLike,
    T,
    Unanswered,
    Unavailable,
    WatchResult,
    answer_body,
    as_bytes,
    backoff_delay,
    check_request,
    one_line,
    parse_endpoint,
    reply_bytes_list,
    reply_field,
    reply_map,
    reply_map_list,
    tls_context,
    tls_endpoints,
)
from .transport import (
    DEFAULT_CONNECTION_LIMIT,
    DEFAULT_MAX_RESPONSE_BYTES,
    DEFAULT_REQUEST_TIMEOUT,
    AiohttpTransport,
    Endpoint,
    KeptWatch,
    Transport,
    TransportError,
    forks,
)

# A refusal's settings unless given: the job it may create is the wire's default one.
_DEFAULT_SETTINGS = wire.JobSettings()

# The logger's name is the public module's, which users configure (and tests capture).
log = logging.getLogger("rdzv_client.client")


class AsyncClient:
    """An asyncio client of rdzv-server, over HTTP (:class:`AiohttpTransport`).

    Use it from one event loop; close it with :meth:`aclose` (or ``async with``): a call
    made afterwards raises :class:`RuntimeError`.

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
    ``transport_type`` builds the transport from those options (the torchrun handler's is
    pipelined); ``transport`` is one built already (tests).
    Time goes through two seams: every deadline (the retry budget, a long-poll's own
    timeout, the hold left to a re-poll) is read on ``clock`` (default ``time.monotonic``),
    and every pause (backoff, the early-answer pause) is ``sleep``: a test moves both.
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
        transport_type: Callable[..., Transport] = AiohttpTransport,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._endpoints = tls_endpoints(endpoint, tls)
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
        self._unanswered = Unanswered()
        self._forks = forks()
        self._transport: Transport = transport or transport_type(
            connection_limit=connection_limit,
            max_response_bytes=max_response_bytes,
            token=find_token(token, token_file),
            tls=tls_context(self._endpoints, ca_file, cert_file, key_file),
        )
        self._rng = rng or random.Random()
        self._sleep = sleep
        self._clock = clock
        self._closed = False
        # The watches the server parked for a node when it answered its join (join's
        # then_watch), by (rdzv_id, node_id): the node's watch of that round waits on it.
        self._kept: dict[tuple[str, str], KeptWatch] = {}

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._endpoints

    @property
    def client_id(self) -> str:
        """The first half of every ``rid`` this client sends."""
        return self._client_id

    async def aclose(self) -> None:
        """Close the connections (idempotent); a call made afterwards raises :class:`RuntimeError`."""
        if not self._closed:
            self._closed = True
            await self._transport.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ----------------------------------------------------------------- the exchange

    def _check_open(self) -> None:
        """Refuse a call made after close. Checked once, as a call starts: a call already
        under way when the client closes ends with its transport's error instead."""
        if self._closed:
            raise RuntimeError("this rdzv AsyncClient is closed")

    def next_rid(self) -> tuple[str, int]:
        """A fresh request id ``(client_id, seq)`` for one write (all its retries share it).

        It counts as unanswered (it holds the client's floor down) from now until a
        :meth:`request` that carries it returns or raises: send it.

        A forked child takes a client id of its own: numbering on under its parent's, its
        writes and the parent's would share rids, and the server would answer the later of
        two with the earlier one's recorded result without applying it."""
        if forks() != self._forks:
            self._client_id, self._unanswered, self._forks = uuid.uuid4().hex[:16], Unanswered(), forks()
        return (self._client_id, self._unanswered.issue())

    async def request(self, rdzv_id: str, req: wire.Request, *, deadline: float | None = None) -> dict[str, Any]:
        """Send one operation and return the server's reply map, retrying as the module says.

        A write without a ``rid`` gets one here; a write that has one keeps it (sending
        the same ``rid`` twice applies the write once). ``deadline`` (on the client's ``clock``)
        bounds retries and shrinks the hold of a long-poll request that is retried.
        """
        self._check_open()
        return await self._send(rdzv_id, req, deadline)

    async def _send(
        self, rdzv_id: str, req: wire.Request, deadline: float | None, then_watch: str | None = None
    ) -> dict[str, Any]:
        """:meth:`request` for a call already under way (a long-poll's next poll); ``then_watch``:
        the node whose next watch the server parks if it answers with an assignment (join's)."""
        check_request(rdzv_id, req)
        rid: tuple[Any, ...] | None = getattr(req, "rid", None) if req.writes else None
        if req.writes and rid is None:
            rid = self.next_rid()  # (registered as unanswered as it is issued)
        elif rid is not None and rid[0] == self._client_id:
            self._unanswered.add(rid[1])
        ours = rid is not None and rid[0] == self._client_id
        try:
            return await self._request(rdzv_id, req, rid if ours else None, deadline, then_watch)
        finally:
            if ours:
                assert rid is not None
                self._unanswered.discard(rid[1])

    async def _request(
        self, rdzv_id: str, req: wire.Request, rid: tuple[Any, ...] | None, deadline: float | None,
        then_watch: str | None = None,
    ) -> dict[str, Any]:
        field = HOLD_FIELD.get(type(req))

        async def attempt(endpoint: Endpoint) -> Any:
            # The request's wire map, then what each attempt changes in it, in place (the map
            # keeps its key order: the bytes are those of the request with these values).
            fields = wire.to_mapping(req)
            if rid is not None:  # every attempt tells the server what it may forget
                fields["rid"] = [rid[0], rid[1], self._unanswered.floor(rid[1])]
            hold = 0.0
            if field is not None:
                hold = float(getattr(req, field))
                if deadline is not None:
                    hold = max(0.0, min(hold, deadline - self._clock()))
                    fields[field] = hold
            timeout = hold + self._request_timeout
            if then_watch is None:
                return answer_body(await self._transport.call(endpoint, rdzv_id, req.op, fields, timeout))
            answer, kept = await self._transport.call_then_watch(
                endpoint, rdzv_id, req.op, fields, timeout, hold=self._max_hold
            )
            if kept is not None:
                self._keep(rdzv_id, then_watch, kept)
            return answer_body(answer)

        reply = await self._with_retries(f"{req.op} on job {rdzv_id}", attempt, deadline)
        if not isinstance(reply, dict):
            raise ServerError(f"the server's {req.op} reply is not a map: {reply!r:.200}")
        return reply

    def _keep(self, rdzv_id: str, node_id: str, kept: KeptWatch | None) -> None:
        """Keep ``kept`` for the node's next watch (None: keep none); one it replaces is dropped."""
        old = self._kept.pop((rdzv_id, node_id), None) if kept is None else self._kept.get((rdzv_id, node_id))
        if kept is not None:
            self._kept[(rdzv_id, node_id)] = kept
        if old is not None and old is not kept:
            self._transport.drop_kept(old)

    async def _get_json(self, path: str, what: str, hold: float = 0.0, *, method: str = "GET", body: Any = None) -> Any:
        self._check_open()

        async def attempt(endpoint: Endpoint) -> Any:
            timeout = hold + self._request_timeout
            if method == "GET":
                return answer_body(await self._transport.fetch(endpoint, path, timeout))
            return answer_body(await self._transport.fetch(endpoint, path, timeout, method=method, body=body))

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
            except (TransportError, Unavailable) as exc:
                failure: Exception = exc.error if isinstance(exc, Unavailable) else exc
                code = exc.error.code if isinstance(exc, Unavailable) else None
            tries += 1
            now = self._clock()
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
            named: Endpoint | None = parse_endpoint(failure.leader)
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
        now = self._clock()
        if now - sent < hold and now < deadline:
            await self._sleep(min(EARLY_ANSWER_PAUSE, deadline - now))

    async def _poll(self, rdzv_id: str, req: wire.Request, timeout: float, what: str) -> dict[str, Any]:
        """Re-send a long-poll ``req`` until its reply says ``found``; the deadline is ours."""
        self._check_open()
        field = HOLD_FIELD[type(req)]
        deadline = self._clock() + timeout
        while True:
            sent = self._clock()
            hold = max(0.0, min(deadline - sent, self._max_hold))
            reply = await self._send(rdzv_id, dataclasses.replace(req, **{field: hold}), deadline)
            if reply_field(reply, "found", bool, req.op):
                return reply
            if self._clock() >= deadline:
                raise RdzvTimeoutError(f"{what} within {timeout:g} s")
            await self._pause_if_early(sent, hold, deadline)

    # ----------------------------------------------------------------- store

    async def set(self, rdzv_id: str, key: KeyLike, value: KeyLike, *, round: int | None = None) -> None:
        """Store ``value`` under ``key``."""
        req = wire.SetRequest(rdzv_id, key=as_bytes("key", key), value=as_bytes("value", value), round=round)
        await self.request(rdzv_id, req)

    async def get(self, rdzv_id: str, key: KeyLike, *, timeout: float, round: int | None = None) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` s for it to be set.

        Raises :class:`RdzvTimeoutError` when the key is still missing at the deadline.
        """
        k = as_bytes("key", key)
        req = wire.GetRequest(key=k, round=round)
        reply = await self._poll(rdzv_id, req, timeout, f"key {k!r} of job {rdzv_id} was not set")
        return reply_field(reply, "value", bytes, "get")

    async def add(self, rdzv_id: str, key: KeyLike, amount: int, *, round: int | None = None) -> int:
        """Add ``amount`` to the integer at ``key`` (missing counts as 0); return the new value.

        Raises :class:`ConflictError` (``not_an_integer``) when the key holds something else.
        """
        req = wire.AddRequest(rdzv_id, key=as_bytes("key", key), amount=amount, round=round)
        reply = await self.request(rdzv_id, req)
        return reply_field(reply, "value", int, "add")

    async def compare_set(
        self, rdzv_id: str, key: KeyLike, expected: KeyLike, desired: KeyLike, *, round: int | None = None
    ) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; return the value now stored."""
        req = wire.CompareSetRequest(
            rdzv_id,
            key=as_bytes("key", key),
            expected=as_bytes("expected", expected),
            desired=as_bytes("desired", desired),
            round=round,
        )
        return reply_field(await self.request(rdzv_id, req), "value", bytes, "compare_set")

    async def append(self, rdzv_id: str, key: KeyLike, value: KeyLike, *, round: int | None = None) -> None:
        """Append ``value`` to the bytes at ``key`` (creating it)."""
        req = wire.AppendRequest(rdzv_id, key=as_bytes("key", key), value=as_bytes("value", value), round=round)
        await self.request(rdzv_id, req)

    async def multi_get(
        self, rdzv_id: str, keys: Sequence[KeyLike], *, timeout: float, round: int | None = None
    ) -> list[bytes]:
        """The values of ``keys`` in order, waiting up to ``timeout`` s for all of them.

        Raises :class:`RdzvTimeoutError` when some key is still missing at the deadline.
        """
        ks = tuple(as_bytes("key", k) for k in keys)
        req = wire.MultiGetRequest(keys=ks, round=round)
        reply = await self._poll(rdzv_id, req, timeout, f"some of {len(ks)} keys of job {rdzv_id} were not set")
        return reply_bytes_list(reply, "values", "multi_get", len(ks))

    async def multi_set(
        self, rdzv_id: str, keys: Sequence[KeyLike], values: Sequence[KeyLike], *, round: int | None = None
    ) -> None:
        """Set every ``keys[i]`` to ``values[i]`` in one atomic step."""
        req = wire.MultiSetRequest(
            rdzv_id,
            keys=tuple(as_bytes("key", k) for k in keys),
            values=tuple(as_bytes("value", v) for v in values),
            round=round,
        )
        await self.request(rdzv_id, req)

    async def check(self, rdzv_id: str, keys: Sequence[KeyLike], *, round: int | None = None) -> bool:
        """Whether every one of ``keys`` exists (does not wait)."""
        req = wire.CheckRequest(keys=tuple(as_bytes("key", k) for k in keys), round=round)
        return reply_field(await self.request(rdzv_id, req), "result", bool, "check")

    async def wait(self, rdzv_id: str, keys: Sequence[KeyLike], *, timeout: float, round: int | None = None) -> None:
        """Return once every one of ``keys`` exists.

        Raises :class:`RdzvTimeoutError` when some key is still missing after ``timeout`` s.
        """
        ks = tuple(as_bytes("key", k) for k in keys)
        req = wire.WaitRequest(keys=ks, round=round)
        await self._poll(rdzv_id, req, timeout, f"waited for {len(ks)} keys of job {rdzv_id}: not all were set")

    async def delete_key(self, rdzv_id: str, key: KeyLike, *, round: int | None = None) -> bool:
        """Delete ``key``; return whether it existed."""
        req = wire.DeleteKeyRequest(rdzv_id, key=as_bytes("key", key), round=round)
        return reply_field(await self.request(rdzv_id, req), "deleted", bool, "delete_key")

    async def num_keys(self, rdzv_id: str, *, round: int | None = None) -> int:
        """How many keys the job (or the job's ``round``) holds."""
        return reply_field(await self.request(rdzv_id, wire.NumKeysRequest(round=round)), "count", int, "num_keys")

    async def list_keys(self, rdzv_id: str, prefix: KeyLike = b"", *, round: int | None = None) -> list[bytes]:
        """The keys that start with ``prefix``."""
        req = wire.ListKeysRequest(prefix=as_bytes("prefix", prefix), round=round)
        return reply_bytes_list(await self.request(rdzv_id, req), "keys", "list_keys")

    # ----------------------------------------------------------------- jobs and rendezvous

    async def create_job(self, rdzv_id: str, settings: wire.JobSettings) -> None:
        """Create the job with ``settings`` (node counts, timeouts, the restart budget); a no-op
        when it exists with the same ones.

        Raises :class:`ConflictError` (``settings_conflict``) when it exists with others.
        """
        await self.request(rdzv_id, wire.CreateJobRequest(rdzv_id, settings))

    async def join(
        self,
        rdzv_id: str,
        *,
        node_id: str,
        addr: str,
        nproc_per_node: int,
        settings: wire.JobSettings,
        master_port: int = 0,
        timeout: float,
        host: str = "",
        topology: str = "",
        step: int | None = None,
        failure: wire.FailureWire | None = None,
        then_watch: bool = False,
    ) -> wire.Assignment:
        """Join the job's next round and wait (up to ``timeout`` s) for it to form.

        ``settings``: the job's, as this node proposes them (the first node's make the job;
        every later node must repeat them). ``master_port``: the port this node's workers
        would serve their store on should it become node rank 0; every node's assignment then
        carries node rank 0's. ``host``: the node's host name when it is not ``addr`` (cordons
        match either); ``topology``: its topology path (node ranks follow it). ``step``: the
        highest step this node's workers reported in the round it leaves (the crash-loop rule).
        ``failure``: why this node joins again, when its workers failed
        (``FailureReport.to_wire``): the job's timeline records it as ``workers_failed``.
        ``then_watch``: where the transport's connection takes it (the pipelined stream to a
        server whose hello lists ``then_watch``), the server parks the node's watch of the new
        round (``known=0``, held ``max_hold``) as it answers with the assignment, and the node's
        next ``watch(rdzv_id, node_id, round=that round, known=0, hold=max_hold or more)`` waits
        for that watch's answer instead of sending one: one request less per node and round.

        Raises :class:`HostCordonedError` (the node's host is cordoned),
        :class:`JoinTimeoutError` (the job's ``join_timeout`` passed on the server),
        :class:`JobClosedError`, :class:`ConflictError` (settings differ from the job's),
        :class:`RdzvTimeoutError` (this call's own ``timeout`` passed).
        """
        self._check_open()
        deadline = self._clock() + timeout
        sent = self._clock()
        hold = max(0.0, min(timeout, self._max_hold))
        req = wire.JoinRequest(
            rdzv_id,
            node_id=node_id,
            addr=addr,
            nproc_per_node=nproc_per_node,
            settings=settings,
            hold=hold,
            master_port=master_port,
            host=host,
            topology=topology,
            step=step,
            failure=failure,
        )
        reply: dict[str, Any] | None = None  # None: (re)send the join itself
        round_ = -1
        watcher = node_id if then_watch else None
        self._keep(rdzv_id, node_id, None)  # a watch kept for an earlier round is no one's now
        while True:
            try:
                if reply is None:
                    reply = await self._send(rdzv_id, dataclasses.replace(req, hold=hold), deadline, watcher)
                    round_ = reply_field(reply, "round", int, "join")
                else:
                    poll = wire.AwaitRoundRequest(node_id=node_id, round=round_, hold=hold)
                    reply = await self._send(rdzv_id, poll, deadline, watcher)
            except NotFoundError as exc:
                if exc.code is not wire.ErrorCode.NODE_NOT_FOUND or self._clock() >= deadline:
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
            if self._clock() >= deadline:
                raise RdzvTimeoutError(
                    f"node {node_id} got no place in a round of job {rdzv_id} within {timeout:g} s"
                )
            await self._pause_if_early(sent, hold, deadline)
            sent = self._clock()
            hold = max(0.0, min(deadline - sent, self._max_hold))

    async def watch(
        self, rdzv_id: str, node_id: str, *, round: int, known: int = -1, hold: float = 0.0, step: int | None = None
    ) -> WatchResult:
        """Heartbeat ``node_id``, then wait up to ``hold`` s (capped at ``max_hold``) for the
        job's ``num_nodes_waiting`` to differ from ``known``. ``step``: the node's current
        training step (soft state, for the job's steps over time).

        The watch a ``join(..., then_watch=True)`` had the server park for this node and round
        (``known=0``, no step, held ``max_hold``) is waited on instead of sending one; if its
        connection ended meanwhile (or the server was not ready), the watch is sent.

        Raises :class:`NotFoundError` when the job or the node is unknown to the server.
        """
        req = wire.WatchRequest(
            node_id=node_id, round=round, known=known, hold=max(0.0, min(hold, self._max_hold)), step=step
        )
        reply = await self._kept_answer(rdzv_id, req) if self._kept else None
        if reply is None:
            reply = await self.request(rdzv_id, req)
        return WatchResult(
            round=reply_field(reply, "round", int, "watch"),
            state=reply_field(reply, "state", str, "watch"),
            num_nodes_waiting=reply_field(reply, "num_nodes_waiting", int, "watch"),
            closed=reply_field(reply, "closed", bool, "watch"),
            cause=reply.get("cause") if isinstance(reply.get("cause"), str) else None,
            policy_version=_version(reply.get("policy_version")),
        )

    async def _kept_answer(self, rdzv_id: str, req: wire.WatchRequest) -> dict[str, Any] | None:
        """The answer of the watch the server parked for ``req``'s node (join's then_watch),
        when it is the watch ``req`` asks for; None when there is none to wait on, or it could
        not answer (its connection ended, it timed out, the server asked to try again): then
        send ``req``. Raises the watch's error, as a watch sent would."""
        self._check_open()
        key = (rdzv_id, req.node_id)
        kept = self._kept.get(key)
        # Another watch than the one parked (a beat's, of no hold): sent, the parked one left
        # for the watch it is (a later join drops it).
        if kept is None or (kept.round, kept.hold, req.known, req.step) != (req.round, req.hold, 0, None):
            return None
        if self._kept.pop(key, None) is not kept:
            return None  # another thread's watch took it
        try:
            answer = await self._transport.wait_kept(kept, kept.hold + self._request_timeout)
            if answer is None:
                return None
            reply = answer_body(answer)
        except (TransportError, Unavailable):
            return None
        if not isinstance(reply, dict):
            raise ServerError(f"the server's watch reply is not a map: {reply!r:.200}")
        return reply

    async def beat(self, rdzv_id: str, node_id: str, *, round: int, step: int | None = None) -> WatchResult | None:
        """Heartbeat ``node_id`` of round ``round`` (``step``: its current training step).

        One-way (no reply: ``wire.BeatRequest``) on the stream connection to the endpoint in
        use when its server said in its hello that it takes beats, no beat was refused there
        since, and something was answered on it within the request timeout; else a watch of
        no hold, answered, through the retries, fail-over and leader redirects of every call
        (an older server, no connection open yet, a follower that refused a beat, a server
        silent too long: its answer, or its absence, says whether it still serves).

        Returns the watch's answer when it went answered (a policy version among it), None when
        it went one-way (the watch's own answers and the assignments bring the news then).
        Raises what :meth:`watch` raises, when the beat goes answered.
        """
        self._check_open()
        req = wire.BeatRequest(node_id=node_id, round=round, step=step)
        check_request(rdzv_id, req)
        endpoint = self._endpoints[self._current]
        fields = wire.to_mapping(req)
        if await self._transport.notify(endpoint, rdzv_id, req.op, fields, answered_within=self._request_timeout):
            return None
        return await self.watch(rdzv_id, node_id, round=round, hold=0.0, step=step)

    async def leave(self, rdzv_id: str, node_id: str) -> None:
        """``node_id`` leaves the job gracefully: the other nodes do not restart for it."""
        await self.request(rdzv_id, wire.LeaveRequest(rdzv_id, node_id=node_id))

    async def close_job(
        self, rdzv_id: str, *, cause: str = "", node_id: str = "", failure: wire.FailureWire | None = None
    ) -> None:
        """Close the job: later joins fail with :class:`JobClosedError`. ``cause`` (one of
        ``wire.CLOSE_CAUSES``) tells the job's timeline who closed it; ``node_id`` which node's
        agent, and ``failure`` what failed in its workers (their run ended by it)."""
        await self.request(rdzv_id, wire.CloseRequest(rdzv_id, cause=cause, node_id=node_id, failure=failure))

    async def refuse(
        self, rdzv_id: str, *, node_id: str, addr: str, cause: str, detail: str = "", host: str = "",
        settings: wire.JobSettings = _DEFAULT_SETTINGS,
    ) -> None:
        """Tell the server this node is not fit to join (``cause``: ``health_check_failed``;
        ``detail``: the check's last output line, cut to what the server keeps): the job's
        timeline records ``node_refused``. ``settings`` (the node's, as it would join with
        them; default: the wire's) make the job if this node is its first."""
        req = wire.RefuseRequest(
            rdzv_id, node_id=node_id, addr=addr, cause=cause, detail=one_line(detail, wire.MAX_REASON_CHARS),
            settings=settings, host=host,
        )
        await self.request(rdzv_id, req)

    async def cordons(self) -> dict[str, Any]:
        """The cordons in effect: ``{"cordons": [...], "now"}``, each cordon a map with
        ``host``, ``since`` and ``until`` (None: until lifted) on the server's clock (``now``),
        ``left_s``, ``reason``, ``by`` (``operator`` or ``flapping``)."""
        body = await self._get_json("/v1/cordons", "listing cordons")
        cordons = reply_map_list(body, "cordons", "cordons")
        return {"cordons": cordons, "now": reply_field(body, "now", float, "cordons")}

    async def cordon(self, host: str, *, reason: str = "", duration: float | None = None) -> dict[str, Any]:
        """Cordon ``host`` (a node's host name or address): every job refuses its nodes, for
        ``duration`` seconds (None: until :meth:`uncordon`). Returns the cordon."""
        check_request("fleet", wire.CordonRequest("", host=host, reason=reason, duration=duration))
        body = await self._get_json(
            "/v1/cordons", f"cordoning {host}", method="POST", body={"host": host, "reason": reason, "duration": duration}
        )
        cordon: dict[str, Any] = reply_field(body, "cordon", dict, "cordon")
        return cordon

    async def uncordon(self, host: str) -> bool:
        """Lift ``host``'s cordon; False when it had none."""
        check_request("fleet", wire.UncordonRequest("", host=host))
        body = await self._get_json(f"/v1/cordons/{urllib.parse.quote(host, safe='')}", f"uncordoning {host}", method="DELETE")
        return reply_field(body, "uncordoned", bool, "uncordon")

    async def policies(self) -> list[dict[str, Any]]:
        """Every job policy, most specific first: each a map with ``pattern``, ``settings``
        (``{KEY: VALUE}``), ``changed_at`` (the server's clock), ``age_s`` (how long ago that
        was) and ``changed_by``."""
        body = await self._get_json("/v1/policies", "listing policies")
        return reply_map_list(body, "policies", "policies")

    async def policy(self, pattern: str) -> dict[str, Any]:
        """The policy of ``pattern`` (a job id or a glob over job ids), as :meth:`policies` gives
        each, with the server's ``now``. Raises :class:`NotFoundError` (``no_such_policy``)."""
        _check_pattern(pattern)
        body = await self._get_json(f"/v1/policies/{urllib.parse.quote(pattern, safe='')}", f"reading policy {pattern}")
        return reply_map(body, f"policy {pattern}")

    async def set_policy(self, pattern: str, settings: Mapping[str, object]) -> dict[str, Any]:
        """Merge ``settings`` into the policy of ``pattern`` (a job id, or a glob over job ids
        such as ``llm-*``), making it if new; returns the policy. Keys: ``wire.POLICY_KEYS``;
        values typed, or as an operator types them (``"6"``, ``"2.5"``, ``"true"``). Every job
        the pattern matches takes it at once (README "Job policy").

        Raises :class:`BadRequestError` (``bad_policy``: the message names the key) and
        :class:`UnauthorizedError` (``forbidden``: a read-only token, or one for some jobs only).
        """
        _check_pattern(pattern)
        try:
            typed = wire.policy_settings(settings)
        except wire.WireError as exc:
            raise BadRequestError(str(exc), code=exc.code) from exc
        body = await self._get_json(
            f"/v1/policies/{urllib.parse.quote(pattern, safe='')}", f"setting policy {pattern}", method="PUT",
            body={"settings": typed},
        )
        return reply_map(body, f"answer to setting policy {pattern}")

    async def unset_policy(self, pattern: str, keys: Sequence[str] = ()) -> dict[str, Any]:
        """Remove ``keys`` from the policy of ``pattern`` (none: the whole policy; a policy left
        with no key goes too): ``{"pattern", "removed": [KEY...]}``. Raises
        :class:`NotFoundError` (``no_such_policy``), as :meth:`set_policy` otherwise."""
        _check_pattern(pattern)
        check_request("fleet", wire.UnsetPolicyRequest("", pattern=pattern, keys=tuple(keys)))
        body = await self._get_json(
            f"/v1/policies/{urllib.parse.quote(pattern, safe='')}", f"unsetting policy {pattern}", method="DELETE",
            body={"keys": list(keys)} if keys else None,
        )
        return reply_map(body, f"answer to unsetting policy {pattern}")

    async def announced_policy_version(self) -> int | None:
        """The job-policy version the server announced in its stream hello (opening the
        connection if none is open): 0 while no policy was ever set on it, so there is none to
        fetch. None where it is not known: a transport without a hello (HTTP, TLS), a server
        older than the announcement or not serving (recovering, a follower), no reply within
        the connect timeout, or no connection."""
        self._check_open()
        try:
            reply = await self._transport.hello_reply(self._endpoints[self._current], self._request_timeout)
        except (TransportError, RdzvError):
            return None
        return wire.hello_policy_version(reply)

    async def effective_policy(self, rdzv_id: str) -> dict[str, Any]:
        """What the policies set for job ``rdzv_id`` (which need not exist yet): ``{"job",
        "settings": {KEY: VALUE}, "sources": {KEY: "policy PATTERN"}, "version"}``; only the keys
        some policy sets. ``version`` moves at every change of any policy."""
        check_request(rdzv_id, None)
        body: Any
        try:
            # The operation: on the node's stream connection where it has one (no HTTP connection
            # of its own; thousands of nodes start at once); a server before it has no such
            # operation (404 not_found) and is asked on its page instead.
            body = await self.request(rdzv_id, wire.PolicyRequest())
        except NotFoundError as exc:
            if exc.code is not wire.ErrorCode.NOT_FOUND:
                raise
            body = await self._get_json(f"/v1/policy?job={urllib.parse.quote(rdzv_id, safe='')}", f"reading the policy of job {rdzv_id}")
        reply_field(body, "settings", dict, f"policy of job {rdzv_id}")
        return reply_map(body, f"policy of job {rdzv_id}")

    async def jobs(self) -> list[dict[str, Any]]:
        """Every job the server knows, each a map with ``rdzv_id``, ``state``, ``round``, ``num_nodes``…"""
        body = await self._get_json("/v1/jobs", "listing jobs")
        return reply_map_list(body, "jobs", "jobs")

    async def job(self, rdzv_id: str) -> dict[str, Any]:
        """The membership document of one job (see DESIGN.md). Raises :class:`NotFoundError`."""
        check_request(rdzv_id, None)
        body = await self._get_json(f"/v1/jobs/{rdzv_id}", f"reading job {rdzv_id}")
        return reply_map(body, f"membership document of job {rdzv_id}")

    async def events(self, rdzv_id: str, *, since: int = 0, wait: float = 0.0) -> dict[str, Any]:
        """The job's timeline after event ``since``: ``{"events": [...], "next_seq", "first_seq",
        "now"}`` (each event: ``seq``, ``time`` and ``now`` on the server's clock, ``kind``,
        ``cause``, ``round``, ``node_id``, ``addr`` and details). With ``wait`` the server holds
        the request up to that long (capped by its --max-hold) while there is nothing newer.
        Raises :class:`NotFoundError`."""
        check_request(rdzv_id, None)
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
        self._check_open()
        for endpoint in self._endpoints:
            try:
                answer = await self._transport.fetch(endpoint, path, self._request_timeout)
            except (TransportError, ServerError):
                continue
            return answer.status == 200
        return False


def _version(value: object) -> int:
    """A reply's ``policy_version`` (0 from a server that does not say)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _check_pattern(pattern: str) -> None:
    """Refuse a pattern the server would refuse, before a round trip (:class:`BadRequestError`)."""
    try:
        wire.pattern_ok(pattern)
    except wire.WireError as exc:
        raise BadRequestError(str(exc), code=exc.code) from exc
