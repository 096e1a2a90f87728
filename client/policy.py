"""The client policy's shared parts: what :class:`AsyncClient` and :class:`Client` both use.

What it owns: the policy's settings (retry budget, backoff, long-poll holds, leader
redirects, the replicas' request timeout), endpoint parsing and the TLS choice they imply,
the backoff's jitter, the reply readers, and the bookkeeping of unanswered writes (the
floor every write sends). :mod:`rdzv_client.client` states the rules these serve.

What it must not know: how an answer arrives (no I/O, no asyncio here): the clients
(:mod:`rdzv_client.async_client` and the :mod:`rdzv_client.sync_client` generated from it)
do the exchanges.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
import ssl
import threading
from collections.abc import Sequence
from typing import Any, TypeVar, Union

from . import wire
from .error import BadRequestError, RdzvError, ServerError, error_from_body
from .tls import client_context
from .transport import Answer, Endpoint

T = TypeVar("T")


#: A key or value: ``str`` is sent as its UTF-8 bytes.
KeyLike = Union[str, bytes]

# A restarting server loads its snapshot and replays its log well within 30 s; past that,
# something is wrong that waiting longer will not fix.
DEFAULT_RETRY_BUDGET = 30.0
DEFAULT_MAX_HOLD = wire.DEFAULT_MAX_HOLD  # the server's cap: asking for longer gains nothing
# A node's heartbeat (a watch of no hold) goes out between this fraction and all of a third of
# its TTL after the server last heard from it (the torchrun handler; the bench's simulated agents).
BEAT_JITTER = 0.9
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
HOLD_FIELD: dict[type[wire.Request], str] = {
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


def parse_endpoint(spec: str) -> Endpoint:
    """One endpoint of :func:`parse_endpoints`'s list. Raises :class:`ValueError` naming it."""
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
    return tuple(parse_endpoint(part) for part in parts)


def tls_endpoints(spec: str, tls: bool) -> tuple[Endpoint, ...]:
    """The endpoints of ``spec``, every one TLS (``https``) when ``tls``. Raises ValueError."""
    endpoints = parse_endpoints(spec)
    if not tls:
        return endpoints
    plain = [part.strip() for part in spec.split(",") if part.strip().lower().startswith("http://")]
    if plain:
        raise ValueError(f"endpoint {plain[0]!r} says http:// but TLS was asked for (tls): use https:// or HOST:PORT")
    return tuple(dataclasses.replace(e, scheme="https") for e in endpoints)


def tls_context(
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
    # The server's job-policy version (0: no policy ever set, or a server without policies): a
    # node refetches its job's policy before its next join when it moved (README "Job policy").
    policy_version: int = 0


class Unavailable(Exception):
    """An answer that says "try again shortly" (502/503/504); only the retry loop sees it."""

    def __init__(self, error: RdzvError) -> None:
        super().__init__(str(error))
        self.error = error


def one_line(text: str, limit: int) -> str:
    """``text`` as one printable line of at most ``limit`` characters (a check's output line)."""
    line = "".join(ch if ch.isprintable() else " " for ch in text.strip())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def as_bytes(name: str, value: KeyLike) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"{name} must be str or bytes, not {type(value).__name__}")


def reply_field(reply: object, name: str, kind: type[T], op: str) -> T:
    value = reply.get(name) if isinstance(reply, dict) else None
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ServerError(f"the server's {op} reply has no valid {name!r} field: {reply!r:.200}")
    return value


def reply_bytes_list(reply: object, name: str, op: str, length: int | None = None) -> list[bytes]:
    values = reply_field(reply, name, list, op)
    if not all(isinstance(v, bytes) for v in values) or (length is not None and len(values) != length):
        raise ServerError(f"the server's {op} reply has an invalid {name!r} list")
    return values


def reply_map(reply: object, what: str) -> dict[str, Any]:
    """``reply`` itself, a map (a document the server answered: a job, a policy)."""
    if not isinstance(reply, dict):
        raise ServerError(f"the server's {what} is not a map")
    return reply


def reply_map_list(reply: object, name: str, op: str) -> list[dict[str, Any]]:
    """The list of maps in ``reply[name]`` (jobs, cordons, policies)."""
    values = reply_field(reply, name, list, op)
    if not all(isinstance(v, dict) for v in values):
        raise ServerError(f"the server's {op} reply holds something in {name!r} that is not a map")
    return values


class Unanswered:
    """The seqs of this client's writes still awaiting an answer (thread-safe: many
    threads share one sync client).

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


def answer_body(answer: Answer) -> Any:
    """The body of a 2xx answer; otherwise raise the error it stands for."""
    if 200 <= answer.status < 300:
        return answer.body
    error = error_from_body(answer.status, answer.body)
    if answer.status in RETRY_STATUSES or error.code in RETRY_CODES:
        raise Unavailable(error)
    raise error


def check_request(rdzv_id: str, req: wire.Request | None) -> None:
    """Reject what the server would reject, before spending a round trip on it."""
    try:
        wire.check_id("rdzv_id", rdzv_id)
        validate = getattr(req, "validate", None)
        if validate is not None:
            validate()
    except wire.WireError as exc:
        raise BadRequestError(str(exc), code=exc.code) from exc
