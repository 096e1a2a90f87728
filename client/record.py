"""The records the server and the client share: pure data, standard library only.

What it owns: the one declaration of each record that crosses between the two sides or
between the server's rings: the error codes with their one HTTP status each, the
validation error of a body (:class:`WireError`), a job's settings with their one set of
defaults (:class:`JobSettings`), a node's place in a formed round (:class:`Assignment`), the
event vocabulary of a job's timeline (:class:`Kind`, :class:`Cause`),
and every write request, which is at once the wire record the client sends, the core
command the server applies and the record its log keeps (:class:`Command` and its
subclasses; field metadata says which fields the wire map or the log record leave out).
:mod:`rdzv_client.wire` (which adds msgpack, framing, the read requests and the schema that
validates decoded bodies) re-exports them, and the server's ``core`` ring uses them
directly: that is why this module imports nothing but the standard library (a test keeps
it so), and knows no encoding, no I/O and no clock.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeGuard

ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+~-]{0,199}$")
# Keys are torch store keys (paths of short names); 4 KiB leaves room for deep prefixes.
MAX_KEY_BYTES = 4096
# Bound on the number of keys one multi_* / check / wait request may name.
MAX_KEYS_PER_REQUEST = 10_000
# Nodes send their address; 255 is the DNS name limit.
MAX_ADDR_CHARS = 255


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
    # The joining node's host is cordoned (rdzvctl cordon, or quarantined for flapping): the
    # message names the cordon and its reason. Not retried: the agent exits non-zero.
    HOST_CORDONED = "host_cordoned"
    # A job policy (rdzvctl policy set) names a key the server does not know, or a value that
    # key cannot take: the message names the key. Nothing changed.
    BAD_POLICY = "bad_policy"
    # No policy has this pattern (rdzvctl policy show / unset PATTERN).
    NO_SUCH_POLICY = "no_such_policy"


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
    ErrorCode.HOST_CORDONED: 403,
    ErrorCode.BAD_POLICY: 400,
    ErrorCode.NO_SUCH_POLICY: 404,
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
#: Field metadata of a field added after the format was fixed (see :func:`optional`).
OMIT_KEY = "omit_default"


def optional(default: Any) -> Any:
    """A field the wire map and the log record carry only when it differs from ``default``.

    Fields added after the format was fixed (the fleet controls: a node's host name and
    topology, a job's restart budget) are declared so: a request or record that does not
    use them is the very bytes it was before (``tests/unit/test_wire_recorded.py``), and
    an old record without them reads back with the default."""
    return dataclasses.field(default=default, metadata={OMIT_KEY: True})


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
#: The largest job-wide restart budget (``max_restarts``): far beyond any real job's.
MAX_RESTARTS = 1_000_000
# A round shorter than two minutes that ends by a failure is a crash, not training: a job
# that loads, runs and checkpoints fails later than that (README "A crash loop stops itself").
DEFAULT_MIN_ROUND_SECONDS = 120.0
# Off unless asked for (max_fast_failures=5 is the README's advice: five such rounds in a row
# cost at most ~10 minutes): on by default it would stop jobs that today run until torch's
# --max-restarts, which is the one limit their owners chose.
DEFAULT_MAX_FAST_FAILURES = 0
#: The longest min_round_seconds (a day): longer would call every round of a real job fast.
MAX_MIN_ROUND_SECONDS = 86400.0
#: A node's topology path (``zone1/rack12/switch3``) and host name: at most this long.
MAX_TOPOLOGY_CHARS = 255
#: A cordon's reason, and a refusal's detail (a health check's last line): at most this long.
MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class JobSettings:
    """A job's settings: what the first node (or a create) proposes and every later node must
    repeat. The defaults are torch's own, so a torchrun job behaves as with its c10d backend."""

    min_nodes: int = 1
    max_nodes: int = 1
    last_call_timeout: float = 30.0  # torch: last_call_timeout 30 s
    join_timeout: float = 600.0  # torch: join_timeout 600 s
    heartbeat_ttl: float = 15.0  # torch: heartbeat 5 s x 3 attempts
    # The job-wide restart budget (--rdzv-conf max_restarts=N): failure-caused re-formations
    # the job may take before the server closes it (None: no budget, torch's behaviour).
    max_restarts: int | None = optional(None)
    # The crash-loop rule (--rdzv-conf min_round_seconds=S,max_fast_failures=K): a round that
    # ends by a failure within S seconds of forming (or, with progress reports, without
    # progress) is a fast failure; K in a row close the job (0: never). README says why these.
    min_round_seconds: float = optional(DEFAULT_MIN_ROUND_SECONDS)
    max_fast_failures: int = optional(DEFAULT_MAX_FAST_FAILURES)

    def validate(self) -> None:
        """Raise :class:`WireError` unless 1 <= min_nodes <= max_nodes <= MAX_NODES, the
        timeouts are >= 0, the TTL is > 0, the restart budget (if any) is 0..MAX_RESTARTS,
        min_round_seconds is 0..MAX_MIN_ROUND_SECONDS and max_fast_failures 0..MAX_RESTARTS."""
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
        if self.max_restarts is not None and not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise WireError(f"max_restarts must be 0..{MAX_RESTARTS}, got {self.max_restarts}")
        if not 0 <= self.min_round_seconds <= MAX_MIN_ROUND_SECONDS:
            raise WireError(f"min_round_seconds must be 0..{MAX_MIN_ROUND_SECONDS:.0f}, got {self.min_round_seconds}")
        if not 0 <= self.max_fast_failures <= MAX_RESTARTS:
            raise WireError(f"max_fast_failures must be 0..{MAX_RESTARTS}, got {self.max_fast_failures}")


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
    # Every node of the round runs nproc_per_node workers, so each node's global ranks are
    # node_rank * nproc_per_node onward and torch needs no worker-rank exchange (False from a
    # server that does not say).
    uniform_nproc: bool = False
    # The server's policy version when the assignment was read (0: no policy ever set, or a
    # server that has none): a node refetches its job's policy only when it changed.
    policy_version: int = 0


def step_ok(step: int | None) -> None:
    """Raise :class:`WireError` unless ``step`` (a training step a worker reported) is ``None``
    or fits in 0..2**63-1."""
    if step is not None and not 0 <= step < 2**63:
        raise WireError(f"step must be 0..2**63-1, got {step}")


def check_id(kind: str, value: object) -> str:
    """Return ``value`` if it is a valid rdzv_id / node_id, else raise :class:`WireError`."""
    if not isinstance(value, str) or not ID_PATTERN.match(value):
        err = WireError(
            f"{kind} {value!r} is not valid: use 1-200 characters of letters, digits and ._:@+~- "
            "starting with a letter or digit"
        )
        err.code = ErrorCode.INVALID_ID
        raise err
    return value


def host_ok(name: str, value: str, *, empty: bool = False) -> None:
    """A host name or address: 1..MAX_ADDR_CHARS printable characters, no spaces (or empty, if allowed)."""
    if not value and empty:
        return
    if not 0 < len(value) <= MAX_ADDR_CHARS or not value.isprintable() or any(ch.isspace() for ch in value):
        raise WireError(f"{name} must be 1..{MAX_ADDR_CHARS} printable characters without spaces, got {value[:64]!r}")


def topology_ok(value: str) -> None:
    """A topology path: at most MAX_TOPOLOGY_CHARS printable characters, no spaces."""
    if len(value) > MAX_TOPOLOGY_CHARS or not value.isprintable() or any(ch.isspace() for ch in value):
        raise WireError(
            f"topology must be at most {MAX_TOPOLOGY_CHARS} printable characters without spaces "
            f"(a path such as zone1/rack12/switch3), got {value[:64]!r}"
        )


def reason_ok(name: str, value: str) -> None:
    if len(value) > MAX_REASON_CHARS or not value.isprintable():
        raise WireError(f"{name} must be at most {MAX_REASON_CHARS} printable characters on one line")


def key_ok(name: str, key: bytes) -> None:
    if len(key) == 0 or len(key) > MAX_KEY_BYTES:
        raise WireError(f"{name} must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


def keys_ok(keys: tuple[bytes, ...]) -> None:
    for k in keys:
        key_ok("key", k)


# -- a node's failure report: what failed in its workers (rdzv_client.failure builds it) --

# A report names a few workers, not a node's 8 GPUs times N: the first failures explain a
# restart, the rest are usually their echo (peers killed, collectives timing out).
MAX_REPORTED_WORKERS = 8
# One line of an exception fits; a traceback or a dump does not.
MAX_MESSAGE_CHARS = 512
NO_DETAIL = "workers failed (no detail)"


def signal_name(exit_code: int) -> str:
    """The signal that ended a process torch reports with ``exit_code`` (negative: killed by
    that signal), e.g. ``SIGKILL`` for -9; ``""`` for an exit code of 0 or more."""
    if exit_code >= 0:
        return ""
    try:
        return signal.Signals(-exit_code).name
    except ValueError:
        return f"signal {-exit_code}"


def exit_signature(exit_code: int) -> str:
    """How a process ended, in the words of a report: ``SIGKILL`` for one killed by a signal,
    ``exit code 3`` otherwise."""
    return signal_name(exit_code) or f"exit code {exit_code}"


@dataclass(frozen=True)
class WorkerFailure:
    """One failed worker: where it ran, how it ended, when, and why in one line."""

    global_rank: int
    local_rank: int
    exit_code: int  # negative: killed by signal -exit_code (torch's convention)
    failed_at: float  # seconds on the holder's clock (the node's, or the server's); on the wire, an age
    message: str

    @property
    def signal(self) -> str:
        return signal_name(self.exit_code)

    @property
    def exit_signature(self) -> str:
        return exit_signature(self.exit_code)


@dataclass(frozen=True)
class FailureReport:
    """What failed in one node's workers in one round: at most :data:`MAX_REPORTED_WORKERS`
    failures, earliest first, and how many workers failed in all (0 when not known).

    On the wire (a re-join's or a close's ``failure`` field) it is the map :meth:`to_wire`
    makes, each time an age (the server is the only clock); the server places the ages on
    its own clock when it applies the command (:meth:`from_wire` with its ``now``), so a
    replayed log makes the same events."""

    failures: tuple[WorkerFailure, ...]
    failed_workers: int

    @classmethod
    def no_detail(cls) -> FailureReport:
        """The report of a restart whose failures could not be found."""
        return cls((), 0)

    @property
    def detail(self) -> bool:
        return bool(self.failures)

    def summary(self) -> str:
        """One line for a log or an error message, e.g. ``rank 1 (local 1) exit code 1:
        RuntimeError: boom; 3 more failed``."""
        if not self.failures:
            return NO_DETAIL
        first = self.failures[0]
        line = f"rank {first.global_rank} (local {first.local_rank}) {first.exit_signature}"
        if first.message != first.exit_signature:
            line += f": {first.message}"
        others = max(self.failed_workers, len(self.failures)) - 1
        return line + (f"; {others} more failed" if others else "")

    def to_wire(self, now: float) -> dict[str, Any]:
        """The report as a map of str/int/float, each failure's time as ``age_s`` (seconds
        before ``now``, the sender's clock; never negative)."""
        return {
            "failed_workers": self.failed_workers,
            "failures": [
                {
                    "global_rank": f.global_rank,
                    "local_rank": f.local_rank,
                    "exit_code": f.exit_code,
                    "age_s": max(0.0, now - f.failed_at),
                    "message": f.message,
                }
                for f in self.failures
            ],
        }

    @classmethod
    def from_wire(cls, body: object, now: float) -> FailureReport:
        """The report :meth:`to_wire` made, each time placed on the receiver's clock
        (``now - age_s``). Raises ValueError for a body that breaks the bounds or the types."""
        if not isinstance(body, Mapping) or set(body) != {"failed_workers", "failures"}:
            raise ValueError("a failure report is a map of failed_workers and failures")
        total, entries = body["failed_workers"], body["failures"]
        if not is_int(total) or total < 0 or not isinstance(entries, (list, tuple)):
            raise ValueError("failed_workers must be a count and failures a list")
        if len(entries) > MAX_REPORTED_WORKERS:
            raise ValueError(f"a failure report names at most {MAX_REPORTED_WORKERS} workers")
        if total < len(entries):
            raise ValueError("failed_workers counts every failure the report names")
        return cls(tuple(_failure_from_wire(e, now) for e in entries), total)


_FAILURE_FIELDS = {"global_rank", "local_rank", "exit_code", "age_s", "message"}


def _failure_from_wire(entry: object, now: float) -> WorkerFailure:
    if not isinstance(entry, Mapping) or set(entry) != _FAILURE_FIELDS:
        raise ValueError(f"a failure is a map of {sorted(_FAILURE_FIELDS)}")
    age, message = entry["age_s"], entry["message"]
    ints = (entry["global_rank"], entry["local_rank"], entry["exit_code"])
    if not all(is_int(v) and -(2**31) <= v < 2**31 for v in ints):
        raise ValueError("a failure's ranks and exit code must be integers")
    if not is_number(age) or age < 0:
        raise ValueError("a failure's age_s must be a number of seconds, 0 or more")
    if not isinstance(message, str) or len(message) > MAX_MESSAGE_CHARS:
        raise ValueError(f"a failure's message is a string of at most {MAX_MESSAGE_CHARS} characters")
    return WorkerFailure(ints[0], ints[1], ints[2], now - float(age), message)


#: A failure report as a request carries it: the map :meth:`FailureReport.to_wire` makes.
FailureWire = dict[str, Any]


def failure_wire(value: object) -> FailureWire:
    """A request's ``failure`` field, checked (:meth:`FailureReport.from_wire`) and spelled
    the one way the log keeps it (ages as floats, lists). Raises :class:`WireError`."""
    try:
        report = FailureReport.from_wire(value, 0.0)
    except ValueError as exc:
        raise WireError(f"field 'failure': {exc}") from exc
    return report.to_wire(0.0)


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[float]:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# --------------------------------------------------------------------------- write requests


#: Field metadata: a field the wire map does not carry (a command's ``rdzv_id``: the route
#: or the frame names the job), and a field the log record does not keep (``rid``, which the
#: log keeps beside the command, and ``hold``, how long this one request waits).
WIRE_KEY = "wire"
LOG_KEY = "log"


def wire_only(default: Any) -> Any:
    """A request field the log record does not keep."""
    return dataclasses.field(default=default, metadata={LOG_KEY: False})


@dataclass(frozen=True)
class Request:
    """Base of every operation request. ``op`` names the route ``POST /v1/jobs/{rdzv_id}/<op>``."""

    op: ClassVar[str]
    #: True when the operation changes state (logged, deduplicated by ``rid``).
    writes: ClassVar[bool] = False


@dataclass(frozen=True)
class Command(Request):
    """Base of every change to the server's state, as a value: a write request is one (the
    client sends it, core applies it, the log records it), and so are the server's own
    commands (timers, recovery) in ``rdzv_server.core.command``.

    ``rdzv_id`` is not in the wire map (the route or frame names the job)."""

    writes: ClassVar[bool] = True
    rdzv_id: str = dataclasses.field(metadata={WIRE_KEY: False})

    def to_record(self) -> dict[str, Any]:
        """The log record: :func:`spelled` for the log, then ``op``."""
        record = spelled(self, LOG_KEY)
        record["op"] = self.op
        return record


#: In a spelling plan, the "default" of a field that is kept whatever it holds.
_KEEP = object()

#: Per metadata key that leaves fields out (WIRE_KEY, LOG_KEY), per record class: each field
#: kept, in order, with the default it is left out at (or ``_KEEP``) and whether it is inline.
_PLANS: dict[str, dict[type[Any], tuple[tuple[str, Any, bool], ...]]] = {}


def spelled(record: Any, leave_out: str) -> dict[str, Any]:
    """The fields of ``record`` (a dataclass) as the wire map (``leave_out=WIRE_KEY``) or the
    log record (``LOG_KEY``) spells them, one rule for both: in declaration order (the order
    is the bytes), without the fields whose metadata says ``leave_out: False``, an inline
    record's fields spelled in its place, a field added later (:func:`optional`) left out
    while it holds its default. The rule is read from a plan derived once per class, not
    generated as code: a store write's record costs a loop over its five fields."""
    cls = type(record)
    plan = _PLANS.setdefault(leave_out, {}).get(cls)
    if plan is None:
        plan = _PLANS[leave_out][cls] = tuple(
            (f.name, f.default if f.metadata.get(OMIT_KEY) else _KEEP, bool(f.metadata.get(INLINE_KEY)))
            for f in dataclasses.fields(cls)
            if f.metadata.get(leave_out, True)
        )
    out: dict[str, Any] = {}
    for name, default, inlined in plan:
        value = getattr(record, name)
        if inlined:
            out.update(spelled(value, leave_out))
        elif default is _KEEP or value != default:
            out[name] = value
    return out


# `rid` is [client_id: str, seq: int(, floor: int)]; checked by _convert_rid.
Rid = tuple[Any, ...] | None


# -- the event vocabulary of a job's timeline (the server's core.event keeps the timeline) --


class Kind(str, enum.Enum):
    JOB_CREATED = "job_created"
    JOB_CLOSED = "job_closed"
    NODE_JOINED = "node_joined"
    ROUND_FORMED = "round_formed"
    STANDBY_PROMOTED = "standby_promoted"
    NODE_DEPARTED = "node_departed"
    JOIN_REFUSED = "join_refused"
    SERVER_RESTARTED = "server_restarted"
    # Fleet control (README "Fleet control"):
    NODE_REFUSED = "node_refused"  # a node was not admitted: its health check failed, or its host is cordoned
    HOST_CORDONED = "host_cordoned"  # a host of one of the job's nodes was cordoned
    HOST_UNCORDONED = "host_uncordoned"  # ... and its cordon lifted
    RESTART_COUNTED = "restart_counted"  # a failure spent one restart of the job's budget
    FAST_FAILURE = "fast_failure"  # a round ended by a failure soon after forming, or without progress
    # The server ended torch's exit barrier of a round for its finished nodes: the round lost a
    # member that had not finished, so the barrier could never complete (a mixed finish)
    EXIT_BARRIER_RELEASED = "exit_barrier_released"
    # Job fate (README "Job fate"):
    WORKERS_FAILED = "workers_failed"  # a node's workers failed: its report (ranks, exit codes, messages)
    # Job policy (README "Job policy"): an operator's change moved one of the job's effective settings
    POLICY_CHANGED = "policy_changed"


class Cause(str, enum.Enum):
    """Why: the ``cause`` of each kind of event."""

    # job_created
    JOIN = "join"  # the first node's join made it
    CREATE = "create"  # a client created it (a store-only job, rdzvctl)
    # node_joined: the place the node got in line
    CANDIDATE = "candidate"  # in the round that is forming
    WAITING = "waiting"  # after a round formed: makes the running nodes restart into the next
    STANDBY = "standby"  # max_nodes are in: a spare
    REJOINED = "rejoined"  # a member of the last round is back (its workers restarted)
    # round_formed
    MAX_NODES = "max_nodes"  # max_nodes joined
    MEMBERS_BACK = "members_back"  # every live member of the last round re-joined, spares filled it
    LAST_CALL = "last_call"  # last_call_timeout passed after min_nodes joined
    # node_departed
    CONNECTION_CLOSED = "connection_closed"  # its agent's watch dropped and did not return
    HEARTBEAT_EXPIRED = "heartbeat_expired"  # silent for the heartbeat TTL (a host that vanished)
    LEFT = "left"  # a graceful leave (the agent finished)
    JOIN_TIMEOUT = "join_timeout"  # waited longer than join_timeout for a round
    NOT_REJOINED = "not_rejoined"  # a live member of the last round that the next round formed without
    # join_refused
    SETTINGS_CONFLICT = "settings_conflict"  # the node asked for other --nnodes / --rdzv-conf settings
    # node_refused
    HEALTH_CHECK_FAILED = "health_check_failed"  # the node's health_check command failed before its join
    CORDONED = "cordoned"  # the node's host is cordoned (node_refused; node_departed: taken out of line)
    # host_cordoned, host_uncordoned: OPERATOR (rdzvctl), or
    FLAPPING = "flapping"  # the server quarantined a host whose nodes kept dying
    # (or WORKERS_FAILED: the server quarantined a host whose workers kept failing there alone)
    # restart_counted
    MEMBER_DIED = "member_died"  # a member of the formed round died
    WORKERS_FAILED = "workers_failed"  # a member re-joined its formed round: its workers failed
    # server_restarted
    RECOVERY = "recovery"  # the server restarted and rebuilt its state from its log
    LEADER_CHANGED = "leader_changed"  # another replica took over as leader (--etcd)
    # job_closed
    AGENT = "agent"  # a torchrun agent closed it: its shutdown (the run ended) or set_closed()
    OPERATOR = "operator"  # rdzvctl close
    CLOSED = "closed"  # a client that did not say who it is
    RESTART_BUDGET_EXHAUSTED = "restart_budget_exhausted"  # a failure beyond max_restarts (the server)
    RESTART_STORM = "restart_storm"  # max_fast_failures fast failures in a row (the server: a crash loop)
    # fast_failure
    SHORT_ROUND = "short_round"  # the round ended by a failure within min_round_seconds of forming
    NO_PROGRESS = "no_progress"  # the round ended by a failure and its step did not grow
    # (a job outliving --job-ttl is collected, timeline and all: that is the end of its story)
    # job_closed, exit_barrier_released: a mixed finish (the server; docs/job-fate.md)
    WORKERS_FAILED_AFTER_FINISH = "workers_failed_after_finish"  # a member re-joined after others had finished
    MEMBER_DEPARTED_AFTER_FINISH = "member_departed_after_finish"  # a member died or left after others had finished
    # round_formed's opened_by (why the round before it gave way): WORKERS_FAILED, MEMBER_DIED, or
    MEMBER_LEFT = "member_left"  # a member left (its agent finished) and the round re-formed without it
    SCALE_UP = "scale_up"  # a node arrived after the round formed (waiting): the running nodes restart for it
    # workers_failed: REJOINED (the report came with the node's re-join), AGENT (with its agent's final close)
    # policy_changed: OPERATOR (rdzvctl policy set / unset)


#: Who closes a job, as its timeline records it ("": not said).
CLOSE_CAUSES = ("", Cause.AGENT.value, Cause.OPERATOR.value)

# torch's exit barrier (``torch.distributed.elastic.utils.store.barrier``, called by the agent's
# ``_exit_barrier`` once its workers succeeded) on the round's store: each agent adds 1 to
# ``<prefix>/num_members``; the one that brings it to the number of nodes sets
# ``<prefix>/last_member``, which every agent waits for. Both keys are in the round's key space
# (the plug-in's store is scoped to its round). The server watches the count and, in a mixed
# finish, sets the key itself (docs/job-fate.md); it imports no torch, so the names live here,
# held equal to torch's by tests/unit/test_torch_exit_barrier.py.
EXIT_BARRIER_PREFIX = "torchelastic/agent/terminal_state"  # torch's _TERMINAL_STATE_SYNC_ID
EXIT_BARRIER_COUNT_KEY = (EXIT_BARRIER_PREFIX + "/num_members").encode()  # + torch's _NUM_MEMBERS
EXIT_BARRIER_LAST_MEMBER_KEY = (EXIT_BARRIER_PREFIX + "/last_member").encode()  # + _LAST_MEMBER_CHECKIN
EXIT_BARRIER_RELEASE_VALUE = b"<val_ignored>"  # what torch's last member sets (nobody reads it)


@dataclass(frozen=True)
class SetRequest(Command):
    op: ClassVar[str] = "set"
    key: bytes
    value: bytes
    round: int | None = None
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        key_ok("key", self.key)


@dataclass(frozen=True)
class AddRequest(Command):
    op: ClassVar[str] = "add"
    key: bytes
    amount: int
    round: int | None = None
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        key_ok("key", self.key)
        if not -(2**63) <= self.amount < 2**63:
            raise WireError("amount must fit in a signed 64-bit integer")


@dataclass(frozen=True)
class CompareSetRequest(Command):
    op: ClassVar[str] = "compare_set"
    key: bytes
    expected: bytes
    desired: bytes
    round: int | None = None
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        key_ok("key", self.key)


@dataclass(frozen=True)
class AppendRequest(Command):
    op: ClassVar[str] = "append"
    key: bytes
    value: bytes
    round: int | None = None
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        key_ok("key", self.key)


@dataclass(frozen=True)
class MultiSetRequest(Command):
    op: ClassVar[str] = "multi_set"
    keys: tuple[bytes, ...]
    values: tuple[bytes, ...]
    round: int | None = None
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        keys_ok(self.keys)
        unpaired = self.unpaired()
        if unpaired:
            raise WireError(unpaired)

    def unpaired(self) -> str | None:
        """Why the keys and values do not pair up, or None: the one check, which the wire
        makes of a body (:class:`WireError`) and core of a command built some other way."""
        if len(self.keys) != len(self.values):
            return f"multi_set got {len(self.keys)} keys but {len(self.values)} values"
        return None


@dataclass(frozen=True)
class DeleteKeyRequest(Command):
    op: ClassVar[str] = "delete_key"
    key: bytes
    round: int | None = None
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        key_ok("key", self.key)


@dataclass(frozen=True)
class CreateJobRequest(Command):
    """Create the job with these settings (idempotent; conflicting settings are a 409)."""

    op: ClassVar[str] = "create"
    settings: JobSettings = inline(default_factory=JobSettings)
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        self.settings.validate()


@dataclass(frozen=True)
class JoinRequest(Command):
    """Join the job's next round; creates the job from these settings if it does not exist.

    The server holds the request up to ``hold`` seconds for the round to complete.
    """

    op: ClassVar[str] = "join"
    node_id: str
    addr: str
    nproc_per_node: int
    settings: JobSettings = inline(required=("min_nodes", "max_nodes"))
    hold: float = wire_only(0.0)
    rid: Rid = wire_only(None)
    #: The port this node's workers would serve their store on if it becomes node rank 0 (0: none).
    master_port: int = 0
    #: The node's host name, when it is not ``addr`` (a cordon names a host by either).
    host: str = optional("")
    #: The node's topology path (``RDZV_TOPOLOGY``, e.g. ``zone1/rack12/switch3``): node ranks follow it.
    topology: str = optional("")
    #: The highest step the node's workers reported (``rdzv_client.progress``) in the round it
    #: leaves by this re-join (None: none reported). Logged, so the crash-loop rule replays.
    step: int | None = optional(None)
    #: What failed in the node's workers, when it re-joins because they failed (a
    #: :meth:`FailureReport.to_wire` map; None: nothing failed, or a client that does not say).
    failure: FailureWire | None = optional(None)

    def validate(self) -> None:
        check_id("node_id", self.node_id)
        step_ok(self.step)
        if not 0 <= self.master_port <= 65535:
            raise WireError(f"master_port must be 0..65535, got {self.master_port}")
        if not 0 < len(self.addr) <= MAX_ADDR_CHARS:
            raise WireError(f"addr must be 1..{MAX_ADDR_CHARS} characters")
        if not 1 <= self.nproc_per_node <= 65536:
            raise WireError(f"nproc_per_node must be 1..65536, got {self.nproc_per_node}")
        host_ok("host", self.host, empty=True)
        topology_ok(self.topology)
        self.settings.validate()
        nonnegative("hold", self.hold)


@dataclass(frozen=True)
class LeaveRequest(Command):
    """A node leaves gracefully (torchrun agent shutdown): survivors do not restart for it."""

    op: ClassVar[str] = "leave"
    node_id: str
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        check_id("node_id", self.node_id)


@dataclass(frozen=True)
class CloseRequest(Command):
    """set_closed(): later joins fail with ``job_closed``. ``cause`` says who closes it:
    ``agent`` (a torchrun agent: its shutdown or set_closed), ``operator`` (rdzvctl)."""

    op: ClassVar[str] = "close"
    cause: str = ""
    rid: Rid = wire_only(None)
    #: The node whose agent closes the job (its shutdown), when it says.
    node_id: str = optional("")
    #: What failed in that node's workers, when its run ended by their failure (an agent's
    #: shutdown after its last restart): the job's timeline records it before the close.
    failure: FailureWire | None = optional(None)

    def validate(self) -> None:
        if self.cause not in CLOSE_CAUSES:
            raise WireError(f"cause must be one of {', '.join(map(repr, CLOSE_CAUSES))}, got {self.cause[:32]!r}")
        if self.node_id:
            check_id("node_id", self.node_id)
        elif self.failure is not None:
            raise WireError("a close that reports a failure must name its node_id")


#: Why a node refuses itself before joining (``refuse``): its health check failed.
REFUSE_CAUSES = (Cause.HEALTH_CHECK_FAILED.value,)


@dataclass(frozen=True)
class RefuseRequest(Command):
    """A node is not fit to join: it ran its ``health_check`` before the join and the check
    failed. The server records ``node_refused`` (``cause``, ``detail``: the check's last output
    line) in the job's timeline, creating the job from ``settings`` if it has none yet, and
    admits nothing: the node's agent exits."""

    op: ClassVar[str] = "refuse"
    node_id: str
    addr: str
    cause: str
    detail: str = ""
    settings: JobSettings = inline(default_factory=JobSettings)
    host: str = optional("")
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        check_id("node_id", self.node_id)
        host_ok("addr", self.addr)
        host_ok("host", self.host, empty=True)
        if self.cause not in REFUSE_CAUSES:
            raise WireError(f"cause must be one of {', '.join(map(repr, REFUSE_CAUSES))}, got {self.cause[:32]!r}")
        reason_ok("detail", self.detail)
        self.settings.validate()


#: Who cordons a host: an operator (rdzvctl), or the server for flapping or for its workers'
#: failures that were its own (automatic quarantine).
CORDON_BY = (Cause.OPERATOR.value, Cause.FLAPPING.value, Cause.WORKERS_FAILED.value)


@dataclass(frozen=True)
class CordonRequest(Command):
    """Cordon ``host`` (a node's host name or address): every job refuses its joins until it
    is uncordoned or ``duration`` seconds pass (None: until uncordoned). Cordoning a cordoned
    host replaces its cordon. ``rdzv_id`` is ``""`` for an operator's cordon, or the job whose
    deaths made the server quarantine the host (``by="flapping"``)."""

    op: ClassVar[str] = "cordon"
    host: str
    reason: str = ""
    duration: float | None = None
    by: str = "operator"
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        host_ok("host", self.host)
        reason_ok("reason", self.reason)
        if self.duration is not None and not 0 < self.duration <= MAX_CORDON_S:
            raise WireError(f"duration must be > 0 and at most {MAX_CORDON_S:.0f} s, got {self.duration}")
        if self.by not in CORDON_BY:
            raise WireError(f"by must be one of {', '.join(map(repr, CORDON_BY))}, got {self.by[:32]!r}")


#: The longest timed cordon (a year): longer is "until uncordoned" (no duration).
MAX_CORDON_S = 366 * 86400.0


@dataclass(frozen=True)
class UncordonRequest(Command):
    """Lift the cordon of ``host``; answers ``{"uncordoned": bool}`` (False: it had none)."""

    op: ClassVar[str] = "uncordon"
    host: str
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        host_ok("host", self.host)


# -- job policy (README "Job policy"; the server's core/policy.py keeps the table) ------------

#: The job settings a policy may set: every field of :class:`JobSettings`.
POLICY_JOB_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(JobSettings))
#: The node-side keys a policy may set: the plug-in runs them before each of its node's joins.
POLICY_NODE_KEYS = ("health_check", "health_check_timeout", "gpu_check")
POLICY_KEYS = POLICY_JOB_KEYS + POLICY_NODE_KEYS
#: A policy's pattern: a job id, or a glob over job ids (fnmatch: ``*``, ``?``, ``[...]``).
POLICY_PATTERN = re.compile(r"^[A-Za-z0-9._:@+~*?\[\]!-]{1,200}$")
#: A health check is a command line: this long at most.
MAX_HEALTH_CHECK_CHARS = 4096
#: The longest timeout a policy may set (a year): longer is a typo, not a wish.
MAX_POLICY_SECONDS = 366 * 86400.0
_TRUE_WORDS = {"1", "true", "yes", "on"}
_FALSE_WORDS = {"0", "false", "no", "off"}


def bad_policy(message: str) -> WireError:
    """A :class:`WireError` answered as ``400 bad_policy`` (the message names the key)."""
    err = WireError(message)
    err.code = ErrorCode.BAD_POLICY
    return err


def pattern_ok(pattern: object) -> str:
    """``pattern`` if it is a job id or a glob over job ids, else raise ``bad_policy``."""
    if not isinstance(pattern, str) or not POLICY_PATTERN.match(pattern):
        raise bad_policy(
            f"policy pattern {str(pattern)[:64]!r} is not valid: use a job id or a glob over job ids "
            "(1-200 characters of letters, digits, ._:@+~- and the wildcards * ? [...])"
        )
    return pattern


def _policy_number(key: str, raw: object, integer: bool) -> float:
    if isinstance(raw, str):
        text = raw
        try:
            raw = int(text) if integer else float(text)
        except ValueError:
            raise bad_policy(f"policy key {key}: {text[:32]!r} is not {'an integer' if integer else 'a number'}") from None
    if integer and not is_int(raw):
        raise bad_policy(f"policy key {key} takes an integer, got {str(raw)[:32]!r}")
    if not is_number(raw):
        raise bad_policy(f"policy key {key} takes a number of seconds, got {str(raw)[:32]!r}")
    return raw


#: Per integer key of a policy: its least and greatest value.
_POLICY_INTS = {
    "min_nodes": (1, MAX_NODES),
    "max_nodes": (1, MAX_NODES),
    "max_restarts": (0, MAX_RESTARTS),
    "max_fast_failures": (0, MAX_RESTARTS),
}
#: Per duration key (seconds): its least value, whether that least is excluded, and its greatest.
_POLICY_SECONDS = {
    "last_call_timeout": (0.0, False, MAX_POLICY_SECONDS),
    "join_timeout": (0.0, False, MAX_POLICY_SECONDS),
    "heartbeat_ttl": (0.0, True, MAX_POLICY_SECONDS),
    "min_round_seconds": (0.0, False, MAX_MIN_ROUND_SECONDS),
    "health_check_timeout": (0.0, True, MAX_POLICY_SECONDS),
}


def policy_value(key: str, raw: object) -> Any:
    """The typed value of policy key ``key`` from ``raw`` (a JSON value, or the string an
    operator typed: ``"6"``, ``"2.5"``, ``"true"``). Raises ``bad_policy`` naming the key."""
    if key in _POLICY_INTS:
        low, high = _POLICY_INTS[key]
        value = int(_policy_number(key, raw, True))
        if not low <= value <= high:
            raise bad_policy(f"policy key {key} must be {low}..{high}, got {value}")
        return value
    if key in _POLICY_SECONDS:
        least, open_least, most = _POLICY_SECONDS[key]
        seconds = float(_policy_number(key, raw, False))
        if seconds < least or (open_least and seconds == least) or seconds > most:
            raise bad_policy(
                f"policy key {key} must be {'>' if open_least else '>='} {least:g} and at most {most:.0f} s, got {seconds:g}"
            )
        return seconds
    if key == "gpu_check":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in _TRUE_WORDS | _FALSE_WORDS:
            return raw.lower() in _TRUE_WORDS
        raise bad_policy(f"policy key gpu_check takes true or false, got {str(raw)[:32]!r}")
    if key == "health_check":
        if not isinstance(raw, str) or len(raw) > MAX_HEALTH_CHECK_CHARS or not raw.isprintable():
            raise bad_policy(f"policy key health_check takes a command line of at most {MAX_HEALTH_CHECK_CHARS} printable characters")
        return raw
    raise bad_policy(f"policy key {str(key)[:64]!r} is not known: the keys are {', '.join(POLICY_KEYS)}")


def policy_settings(settings: object) -> dict[str, Any]:
    """A policy's settings, each checked and typed (:func:`policy_value`), in the order of
    :data:`POLICY_KEYS`; ``min_nodes <= max_nodes`` when it sets both. Raises ``bad_policy``."""
    if not isinstance(settings, Mapping) or not settings:
        raise bad_policy("a policy sets at least one key: {\"settings\": {KEY: VALUE, ...}}")
    for key in settings:
        if key not in POLICY_KEYS:
            policy_value(str(key), None)  # raises, naming the key
    typed = {key: policy_value(key, settings[key]) for key in POLICY_KEYS if key in settings}
    if "min_nodes" in typed and "max_nodes" in typed and typed["min_nodes"] > typed["max_nodes"]:
        raise bad_policy(
            f"policy keys min_nodes and max_nodes: need min_nodes <= max_nodes, got {typed['min_nodes']} > {typed['max_nodes']}"
        )
    return typed


@dataclass(frozen=True)
class SetPolicyRequest(Command):
    """Merge ``settings`` (typed: :func:`policy_settings`) into the policy of ``pattern``,
    making it if new. ``rdzv_id`` is ``""``: a policy concerns every job it matches."""

    op: ClassVar[str] = "set_policy"
    pattern: str
    settings: dict[str, Any]
    by: str = Cause.OPERATOR.value
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        pattern_ok(self.pattern)
        if policy_settings(self.settings) != self.settings:
            raise bad_policy("a policy's settings must be typed as policy_settings() types them")
        reason_ok("by", self.by)


@dataclass(frozen=True)
class UnsetPolicyRequest(Command):
    """Remove ``keys`` from the policy of ``pattern`` (none: the whole policy; a policy left
    with no key is removed too). ``rdzv_id`` is ``""``."""

    op: ClassVar[str] = "unset_policy"
    pattern: str
    keys: tuple[str, ...] = ()
    by: str = Cause.OPERATOR.value
    rid: Rid = wire_only(None)

    def validate(self) -> None:
        pattern_ok(self.pattern)
        for key in self.keys:
            if key not in POLICY_KEYS:
                policy_value(key, None)  # raises, naming the key
        reason_ok("by", self.by)
