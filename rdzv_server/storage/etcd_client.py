"""A minimal asyncio client of etcd v3, spoken through etcd's own JSON gateway (``/v3/...``).

What it owns: the few etcd calls the replicated log and the election need (kv range, put,
delete-range, txn, compaction; lease grant, keepalive, revoke; watch; member list), the
base64 and int64-as-string encoding of the gateway (hidden: callers see ``bytes`` and
``int``), failing over between endpoints, and one error tree (:class:`EtcdError`).

What it must not know: what keys mean (logs, elections), msgpack, or the state machine.

Why not a third-party etcd client. The maintained asyncio clients for etcd v3 are scarce
and stale (``aioetcd3`` and ``etcd3aio`` have had no release in years, ``python-etcd3`` is
synchronous and pins old ``grpcio``/``protobuf``), and each would pull in gRPC, a large
native dependency, for a handful of calls. The JSON gateway is etcd's own stable API,
served on every client URL since 3.3 (``/v3/`` since 3.4), and aiohttp is already the
server's HTTP stack. The cost is ours to carry: this module is about 400 lines.

Rules:
- Every request has a timeout (:attr:`EtcdClient.request_timeout_s`). A connection error,
  a timeout, or an answer of gRPC code 14 (unavailable: no leader yet, a member cut off)
  moves on to the next endpoint; after ``retry_rounds`` passes over all endpoints with a
  short pause between passes, the call raises :class:`EtcdUnavailableError`. The retry is
  therefore *at least once*: callers send only requests that are safe to repeat (puts of
  the same value under the same compare, reads, lease grants whose spare lease expires).
- Any other error etcd answers (a bad request, a lease not found) raises
  :class:`EtcdRequestError` with etcd's gRPC code and message, at once: retrying cannot help.
- A failed compare in a txn is a result (``TxnResult.succeeded`` is false), not an error.
- A watch is one HTTP stream; it is not retried here (the caller knows from which revision
  to resume) and raises :class:`EtcdWatchCompactedError` when the history it asks for was
  compacted away.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import aiohttp

from .error import StorageError

logger = logging.getLogger(__name__)

# A follower answering a range or a txn takes a few ms; a leader election in etcd takes
# about one election timeout (1 s by default). 5 s covers that with room, and still lets a
# caller notice a dead cluster well within a lease TTL's order of magnitude.
DEFAULT_REQUEST_TIMEOUT_S = 5.0
# Three passes over every endpoint, 0.2 s apart: rides out an etcd leader election (about
# 1 s) without hanging a caller on a cluster that lost quorum.
DEFAULT_RETRY_ROUNDS = 3
DEFAULT_RETRY_PAUSE_S = 0.2
# A watch answer is one JSON line; this bounds what one line may buffer (etcd's own request
# limit is 1.5 MiB, and base64 plus JSON grow it by about a half).
MAX_WATCH_LINE_BYTES = 64 * 1024 * 1024

# gRPC status codes the gateway reports in ``code``.
GRPC_UNAVAILABLE = 14
GRPC_NOT_FOUND = 5

CompareTarget = Literal["CREATE", "MOD", "VERSION", "VALUE", "LEASE"]
CompareResult = Literal["EQUAL", "GREATER", "LESS", "NOT_EQUAL"]


class EtcdError(StorageError):
    """Base class of every error this client raises on purpose."""


class EtcdUnavailableError(EtcdError):
    """No endpoint answered (connection refused, timeout, or no etcd leader) after every retry."""


class EtcdRequestError(EtcdError):
    """etcd answered with an error; ``code`` is its gRPC status code, ``etcd_message`` its text."""

    def __init__(self, message: str, code: int, etcd_message: str) -> None:
        super().__init__(message)
        self.code = code
        self.etcd_message = etcd_message


class EtcdWatchCompactedError(EtcdError):
    """A watch asked for history etcd has compacted; ``compact_revision`` is the oldest kept."""

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


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
        retry_rounds: int = DEFAULT_RETRY_ROUNDS,
        retry_pause_s: float = DEFAULT_RETRY_PAUSE_S,
    ) -> None:
        """``endpoints`` are client URLs (``http://host:port``); raises ``ValueError`` for none."""
        if not endpoints:
            raise ValueError("EtcdClient needs at least one endpoint URL, such as http://127.0.0.1:2379.")
        self.endpoints = [url.rstrip("/") for url in endpoints]
        self.request_timeout_s = request_timeout_s
        self._retry_rounds = max(1, retry_rounds)
        self._retry_pause_s = retry_pause_s
        self._current = 0  # the endpoint that answered last: tried first next time
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        """Close the HTTP session (idempotent)."""
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    # ------------------------------------------------------------------ transport

    async def _call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``path`` on one endpoint after another; see the module docstring."""
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        failures: list[str] = []
        count = len(self.endpoints)
        for round_ in range(self._retry_rounds):
            if round_:
                await asyncio.sleep(self._retry_pause_s)
            for step in range(count):
                index = (self._current + step) % count
                url = self.endpoints[index] + path
                try:
                    async with self._http().post(url, json=body, timeout=timeout) as response:
                        text = await response.text()
                        status = response.status
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    failures.append(f"{url}: {exc!r}")
                    continue
                answer = self._decode(url, status, text)
                error = answer.get("error")
                if status == 200 and error is None:
                    self._current = index
                    return answer
                code = _int(answer.get("code"))
                message = str(answer.get("message") or error or text[:200])
                if code == GRPC_UNAVAILABLE:
                    failures.append(f"{url}: {message}")
                    continue
                raise EtcdRequestError(f"etcd refused {path} at {url}: {message} (gRPC code {code}).", code, message)
        raise EtcdUnavailableError(
            f"No etcd endpoint answered {path} after {self._retry_rounds} passes over {self.endpoints}; "
            f"check that a quorum of the cluster is up and reachable. Last errors: {'; '.join(failures[-count:])}"
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
        answer = await self._call("/v3/kv/range", body)
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
        answer = await self._call("/v3/kv/put", body)
        return _int(answer.get("header", {}).get("revision"))

    async def delete_range(self, key: bytes, range_end: bytes = b"") -> int:
        """Delete ``key`` (up to ``range_end``, excluded); return how many keys were deleted."""
        answer = await self._call("/v3/kv/deleterange", DeleteRange(key, range_end).to_json()["request_delete_range"])
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
        answer = await self._call("/v3/kv/txn", body)
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
        answer = await self._call("/v3/lease/grant", {"TTL": str(ttl_s)})
        return Lease(id=_int(answer.get("ID")), ttl=_int(answer.get("TTL")))

    async def lease_keepalive(self, lease_id: int) -> int:
        """Renew the lease; return its remaining TTL in seconds (0: it has expired or was revoked)."""
        answer = await self._call("/v3/lease/keepalive", {"ID": str(lease_id)})
        return _int(answer.get("result", {}).get("TTL"))

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
        caller stops iterating or the stream ends. Tries the endpoints in turn to open the
        stream, once each; raises :class:`EtcdUnavailableError` if none opens it or an open
        stream breaks (the caller resumes from the revision after the last event it saw), and :class:`EtcdWatchCompactedError` when ``start_revision``
        was compacted away.
        """
        create: dict[str, Any] = {"key": _b64(key)}
        if range_end:
            create["range_end"] = _b64(range_end)
        if start_revision:
            create["start_revision"] = str(start_revision)
        body = {"create_request": create}
        # No total timeout: a quiet watch is healthy. Connecting is bounded, and so is the
        # wait for the first answer (etcd confirms a watch at once).
        timeout = aiohttp.ClientTimeout(total=None, connect=self.request_timeout_s)
        failures: list[str] = []
        count = len(self.endpoints)
        for step in range(count):
            index = (self._current + step) % count
            url = self.endpoints[index] + "/v3/watch"
            try:
                response = await self._http().post(url, json=body, timeout=timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                failures.append(f"{url}: {exc!r}")
                continue
            async with response:
                if response.status != 200:
                    text = await response.text()
                    failures.append(f"{url}: HTTP {response.status} {text[:200]}")
                    continue
                try:
                    async for batch in self._watch_stream(url, response):
                        yield batch
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    raise EtcdUnavailableError(f"The watch stream from {url} broke: {exc!r}") from exc
                return
        raise EtcdUnavailableError(f"No etcd endpoint opened a watch on {key!r}: {'; '.join(failures)}")

    async def _watch_stream(self, url: str, response: aiohttp.ClientResponse) -> AsyncIterator[WatchBatch]:
        buffer = b""
        async for chunk in response.content.iter_any():
            buffer += chunk
            if len(buffer) > MAX_WATCH_LINE_BYTES:
                raise EtcdRequestError(f"A watch answer from {url} exceeds {MAX_WATCH_LINE_BYTES} bytes.", 0, "")
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.strip():
                    batch = self._watch_answer(url, line)
                    if batch is not None:
                        yield batch

    @staticmethod
    def _watch_answer(url: str, line: bytes) -> WatchBatch | None:
        answer = json.loads(line)
        if "error" in answer:
            error = answer["error"]
            message = str(error.get("message", error)) if isinstance(error, dict) else str(error)
            code = _int(error.get("code")) if isinstance(error, dict) else 0
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
        answer = await self._call("/v3/cluster/member/list", {})
        return [
            Member(
                id=_int(member.get("ID")),
                name=str(member.get("name", "")),
                client_urls=list(member.get("clientURLs", [])),
                peer_urls=list(member.get("peerURLs", [])),
            )
            for member in answer.get("members", [])
        ]
