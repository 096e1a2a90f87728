"""The rdzv-server client: :class:`AsyncClient` (asyncio) and :class:`Client` (threads).

What it owns:
- endpoint parsing (``host``, ``host:port``, ``[v6]:port``, ``http://…``, comma-separated
  lists for failover);
- client policy: per-request timeouts, retries with capped exponential backoff and full
  jitter inside a bounded retry budget, failover across endpoints, and the request ids
  (``rid``) that make a retried write apply exactly once;
- the client side of long-polls: the *client* owns a blocking call's deadline and re-polls
  with the time that remains;
- the choice of transport (the seam: :mod:`rdzv_client.transport`): HTTP for
  :class:`AsyncClient`, the stream protocol over blocking sockets for :class:`Client`
  (:mod:`rdzv_client.stream`).

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
- The policy is written once, as :class:`AsyncClient`'s coroutines (:mod:`rdzv_client.async_client`).
  :class:`Client` (:mod:`rdzv_client.sync_client`) is generated from them by
  :mod:`rdzv_client._unasync`, the ``await``s taken out, over a transport that blocks: plain
  calls in the calling thread, with no event loop, no thread hop and no coroutine; any number
  of threads may share it. The parts both use live in :mod:`rdzv_client.policy`.

This module is the package's public face for both clients: it names what they export.
"""

from __future__ import annotations

from .async_client import AsyncClient
from .policy import (
    DEFAULT_BACKOFF_BASE,
    DEFAULT_BACKOFF_CAP,
    DEFAULT_HEARTBEAT_TTL,
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_LAST_CALL_TIMEOUT,
    DEFAULT_MAX_HOLD,
    DEFAULT_RETRY_BUDGET,
    EARLY_ANSWER_PAUSE,
    ELECTION_MAX_PAUSE,
    MAX_LEADER_REDIRECTS,
    REPLICAS_REQUEST_TIMEOUT,
    RETRY_CODES,
    RETRY_STATUSES,
    KeyLike,
    WatchResult,
    backoff_delay,
    parse_endpoints,
)
from .sync_client import Client
from .transport import Endpoint

__all__ = [
    "DEFAULT_BACKOFF_BASE",
    "DEFAULT_BACKOFF_CAP",
    "DEFAULT_HEARTBEAT_TTL",
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_LAST_CALL_TIMEOUT",
    "DEFAULT_MAX_HOLD",
    "DEFAULT_RETRY_BUDGET",
    "EARLY_ANSWER_PAUSE",
    "ELECTION_MAX_PAUSE",
    "MAX_LEADER_REDIRECTS",
    "REPLICAS_REQUEST_TIMEOUT",
    "RETRY_CODES",
    "RETRY_STATUSES",
    "AsyncClient",
    "Client",
    "Endpoint",
    "KeyLike",
    "WatchResult",
    "backoff_delay",
    "parse_endpoints",
]
