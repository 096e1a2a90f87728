"""The records the server and the client share: pure data, standard library only.

What it owns: the one declaration of each record that crosses between the two sides or
between the server's rings: the error codes with their one HTTP status each, the
validation error of a body (:class:`WireError`), a job's settings with their one set of
defaults (:class:`JobSettings`), and a node's place in a formed round (:class:`Assignment`).
:mod:`rdzv_client.wire` (which adds msgpack, framing and the requests) re-exports them, and
the server's ``core`` ring uses them directly: that is why this module imports nothing but
the standard library (a test keeps it so), and knows no encoding, no I/O and no clock.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

class ErrorCode(str, enum.Enum):
    """Stable wire error codes; each has exactly one HTTP status (see :data:`HTTP_STATUS`)."""

    BAD_REQUEST = "bad_request"
    INVALID_ID = "invalid_id"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    BODY_TOO_LARGE = "body_too_large"
    VALUE_TOO_LARGE = "value_too_large"
    NOT_FOUND = "not_found"
    JOB_NOT_FOUND = "job_not_found"
    NODE_NOT_FOUND = "node_not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    SETTINGS_CONFLICT = "settings_conflict"
    NOT_AN_INTEGER = "not_an_integer"
    JOB_CLOSED = "job_closed"
    # The job closed while the node was standby or waiting for a round: it exits gracefully.
    JOB_CLOSED_IN_LINE = "job_closed_in_line"
    JOIN_TIMEOUT = "join_timeout"
    NOT_READY = "not_ready"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    SHUTTING_DOWN = "shutting_down"
    # A follower replica of a replicated cluster (--etcd): the body's "leader" names the
    # leader's URL when one is known; ask it instead (same request id).
    NOT_LEADER = "not_leader"
    INTERNAL = "internal"
    # HTTP-level refusals (answered before a request reaches an operation).
    HEADERS_TOO_LARGE = "headers_too_large"
    EXPECTATION_FAILED = "expectation_failed"
    REQUEST_TIMEOUT = "request_timeout"
    # The Host is not one of the server's --allowed-hosts (a DNS-rebinding guard).
    HOST_NOT_ALLOWED = "host_not_allowed"
    # Limits (see README "Limits"): each refuses the request and changes nothing.
    TOO_MANY_CONNECTIONS = "too_many_connections"
    BUFFERS_FULL = "buffers_full"
    TOO_MANY_JOBS = "too_many_jobs"
    TOO_MANY_KEYS = "too_many_keys"
    JOB_STORE_FULL = "job_store_full"
    TOO_MANY_SESSIONS = "too_many_sessions"
    SESSION_FULL = "session_full"
    # The write's log record is larger than the log takes (with --etcd, etcd's request
    # limit); refused before it was applied: nothing changed.
    RECORD_TOO_LARGE = "record_too_large"
    # The log has as many records waiting to be written as it may hold (--max-log-queue,
    # --max-log-queue-bytes); nothing changed: retry shortly.
    LOG_QUEUE_FULL = "log_queue_full"
    # The server's own log failed a write (a full or failing disk): it acknowledges
    # nothing more and stops; retry once it is back (or at another replica).
    LOG_FAILED = "log_failed"


HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.INVALID_ID: 400,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.BODY_TOO_LARGE: 413,
    ErrorCode.VALUE_TOO_LARGE: 413,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.JOB_NOT_FOUND: 404,
    ErrorCode.NODE_NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.SETTINGS_CONFLICT: 409,
    ErrorCode.NOT_AN_INTEGER: 409,
    ErrorCode.JOB_CLOSED: 410,
    ErrorCode.JOB_CLOSED_IN_LINE: 410,
    ErrorCode.JOIN_TIMEOUT: 408,
    ErrorCode.NOT_READY: 503,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.SHUTTING_DOWN: 503,
    ErrorCode.NOT_LEADER: 503,
    ErrorCode.INTERNAL: 500,
    ErrorCode.HEADERS_TOO_LARGE: 431,
    ErrorCode.EXPECTATION_FAILED: 417,
    ErrorCode.REQUEST_TIMEOUT: 408,
    ErrorCode.HOST_NOT_ALLOWED: 421,
    ErrorCode.TOO_MANY_CONNECTIONS: 429,
    ErrorCode.BUFFERS_FULL: 429,
    ErrorCode.TOO_MANY_JOBS: 429,
    ErrorCode.TOO_MANY_KEYS: 429,
    ErrorCode.JOB_STORE_FULL: 413,
    ErrorCode.TOO_MANY_SESSIONS: 429,
    ErrorCode.SESSION_FULL: 429,
    ErrorCode.RECORD_TOO_LARGE: 413,
    ErrorCode.LOG_QUEUE_FULL: 503,
    ErrorCode.LOG_FAILED: 503,
}


class WireError(ValueError):
    """A body that does not decode or does not validate; always rendered as ``bad_request``."""

    code = ErrorCode.BAD_REQUEST


def nonnegative(name: str, value: float | None) -> None:
    """Raise :class:`WireError` unless ``value`` (a duration, seconds) is ``None`` or ``>= 0``."""
    if value is not None and value < 0:
        raise WireError(f"field {name!r} must be >= 0, got {value}")


#: Field metadata of an inline record (see :func:`inline`) and of its fields a body must carry.
INLINE_KEY = "inline"
REQUIRED_KEY = "required"


def inline(*, required: tuple[str, ...] = (), default_factory: Callable[[], Any] | None = None) -> Any:
    """A field holding a record whose fields the wire map and the log record spell in its
    place, as they always have (a join's settings: ``min_nodes`` ... beside ``node_id``).

    ``required`` names the record's fields a body must carry although the record has
    defaults for them (a join must say ``min_nodes`` and ``max_nodes``; a create need not)."""
    metadata = {INLINE_KEY: True, REQUIRED_KEY: required}
    if default_factory is None:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default_factory=default_factory, metadata=metadata)


#: The most nodes a job may take (``max_nodes``).
MAX_NODES = 1_000_000


@dataclass(frozen=True)
class JobSettings:
    """A job's settings: what the first node (or a create) proposes and every later node must
    repeat. The defaults are torch's own, so a torchrun job behaves as with its c10d backend."""

    min_nodes: int = 1
    max_nodes: int = 1
    last_call_timeout: float = 30.0  # torch: last_call_timeout 30 s
    join_timeout: float = 600.0  # torch: join_timeout 600 s
    heartbeat_ttl: float = 15.0  # torch: heartbeat 5 s x 3 attempts

    def validate(self) -> None:
        """Raise :class:`WireError` unless 1 <= min_nodes <= max_nodes <= MAX_NODES, the
        timeouts are >= 0 and the TTL is > 0."""
        if self.min_nodes < 1 or self.max_nodes < self.min_nodes:
            raise WireError(
                f"need 1 <= min_nodes <= max_nodes, got min_nodes={self.min_nodes} max_nodes={self.max_nodes}"
            )
        if self.max_nodes > MAX_NODES:
            raise WireError(f"max_nodes must be at most {MAX_NODES}")
        nonnegative("last_call_timeout", self.last_call_timeout)
        nonnegative("join_timeout", self.join_timeout)
        if self.heartbeat_ttl <= 0:
            raise WireError(f"heartbeat_ttl must be > 0, got {self.heartbeat_ttl}")


@dataclass(frozen=True)
class Assignment:
    """A node's place in a formed round."""

    round: int
    node_rank: int
    num_nodes: int
    world_size: int
    nproc_per_node: int
    global_rank_start: int
    master_addr: str
    master_port: int = 0  # node rank 0's offered port; 0 from a server or node that has none
