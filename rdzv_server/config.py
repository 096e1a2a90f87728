"""The server's one validated configuration object.

Every setting has a command-line flag (``cli.py``) and an ``RDZV_*`` environment
variable of the same name (``--max-value-bytes`` <-> ``RDZV_MAX_VALUE_BYTES``); flags win.
Construction validates everything, so a bad setting stops the server before it binds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rdzv_client.wire import DEFAULT_MAX_HOLD, DEFAULT_PORT, MAX_CORDON_S, default_token_file

from .core.cordon import MAX_DEATHS_PER_HOST
from .core.machine import DEFAULT_SESSION_TTL, Limits
from .storage import DEFAULT_MAX_QUEUED_BYTES, DEFAULT_MAX_QUEUED_RECORDS, DEFAULT_SNAPSHOT_EVERY, default_data_dir

# torch stores hold small blobs (addresses, NCCL ids, pickled role infos); 16 MiB is generous.
DEFAULT_MAX_VALUE_BYTES = 16 * 1024 * 1024
# A body carries at most a few values (multi_set) plus framing.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
# A live agent re-polls on its kept-alive connection at once, so a drop that lasts this long
# means its process died; short enough that survivors hear of it within a second.
DEFAULT_DISCONNECT_GRACE = 0.5
# Closed and idle jobs stay visible for an hour, long enough to inspect what happened.
DEFAULT_JOB_TTL = 3600.0
# Automatic quarantine (README "Quarantine"): a host whose nodes died this many times ...
# Three, not two: one death is bad luck and two can be one bad job killing its agents twice
# (an OOM in the launcher); a third inside the window is the pattern of a bad host, and at
# fleet scale (a failure every ~3 h over 16K GPUs, spread over thousands of hosts) no healthy
# host dies three times in an hour by chance. 0 turns automatic quarantine off.
DEFAULT_QUARANTINE_AFTER = 3
# ... within this window (s): an hour spans several of a flapping host's restart cycles, and
# is short enough that deaths days apart (ordinary failures) never add up.
DEFAULT_QUARANTINE_WINDOW = 3600.0
# ... is cordoned this long (s): an hour keeps the job running without the host while someone
# looks, and lets a transient problem (a reboot, a driver reload) heal without an operator;
# `rdzvctl uncordon` ends it earlier, `rdzvctl cordon` without --for keeps it out for good.
DEFAULT_QUARANTINE_FOR = 3600.0
# Host-local failures (README "Job fate"): a host whose node's workers failed first in its round
# this many times within --quarantine-window is cordoned for --quarantine-for. Three, as for
# deaths: one is bad luck, two can be one job's bad data shard read twice (a script bug that
# follows a rank, not a host, lands on the same node when ranks are stable); a third in an hour
# is the pattern of a bad GPU or link, and the reason quotes the messages for the person who
# looks. 0 turns it off.
DEFAULT_QUARANTINE_FAILURES = 3
# ... counting a failure only when it came this many seconds before any other node's of the
# same round (or no other node failed). torch stamps failures in whole seconds; a peer's
# collective notices a dead rank within about a second (gloo, NCCL with async error handling),
# so 5 s separates "one node failed, the others were then stopped or timed out" from "every
# node hit the same bug at the same step" without waiting for NCCL's long timeouts.
DEFAULT_QUARANTINE_FAILURE_LEAD = 5.0
# A window longer than a year would count deaths no one remembers.
MAX_QUARANTINE_WINDOW_S = 366 * 86400.0
# -- limits (README "Limits"): nothing a client sends grows the server without bound. --
# Connections: a 10,000-node job holds about two each (watch + store); the rest of the fd
# limit stays free for the log and for new connections to be refused politely.
DEFAULT_MAX_CONNECTIONS = 50_000
# Bytes of requests received but not yet served, over all connections: four maximal bodies.
DEFAULT_MAX_BUFFERED_BYTES = 256 * 1024 * 1024
# A connection with nothing in flight and nothing sent for this long is closed (clients
# reconnect transparently), as aiohttp closes idle keep-alive connections after 75 s.
DEFAULT_IDLE_TIMEOUT = 75.0
# A request (headers and body) or a stream frame must arrive whole within this long of its
# first byte: a 64 MiB body needs ~2 MB/s; a slow-loris client is cut off.
DEFAULT_READ_TIMEOUT = 30.0
# -- before authentication (README "Security"): what a connection gets until it shows a token. --
# A request head (request line and every header field) in all: nginx's default takes 32 KiB
# (4 x 8 KiB buffers), Node's 16 KiB; our clients send about 300 bytes and a browser with
# cookies 1-2 KiB, so 32 KiB refuses no real client and makes a head cost at most that.
DEFAULT_MAX_HEAD_BYTES = 32 * 1024
# Of --max-buffered-bytes, what connections not yet authenticated may hold together: 1/8, so
# token holders keep 7/8 of the budget whatever strangers send (32 MiB of 256 MiB: at the
# connection limit still ~670 bytes a connection, more than a real client's hello or head).
PRE_AUTH_SHARE = 8
# A client sends its hello or request head in its first packets: 10 s covers three lost
# packets of a congested network (TCP retransmits after 1, 2 and 4 s) and a busy server, and
# a stranger's connection that says nothing useful costs the server 10 s at most, not 75.
DEFAULT_AUTH_TIMEOUT = 10.0
# Jobs live at once: far more than one cluster runs; each costs a few KB plus its keys.
DEFAULT_MAX_JOBS = 10_000
# Keys per job over all its rounds: torchrun writes a handful per worker per round.
DEFAULT_MAX_KEYS_PER_JOB = 1_000_000
# Bytes of keys and values per job: 16 max-size values, or millions of torch's small blobs.
DEFAULT_MAX_JOB_BYTES = 256 * 1024 * 1024
# Client sessions (exactly-once windows): one per agent and per worker store.
DEFAULT_MAX_SESSIONS = 100_000
# Writes of one client that may await their acknowledgement at once (threads x pipelining).
DEFAULT_MAX_SESSION_WRITES = 4096
# Bytes of write results kept for retries (only compare_set's carry a value), over all sessions.
DEFAULT_MAX_SESSION_BYTES = 256 * 1024 * 1024
# With --etcd: records between snapshots. Every record is an etcd revision kept until the
# next snapshot's compaction; 10,000 keeps etcd's history to a few MB.
DEFAULT_ETCD_SNAPSHOT_EVERY = 10_000
# With --etcd: the leader's lease. A dead leader is replaced within about this long; a GC
# pause or a slow etcd shorter than it does not cost a replica its leadership.
DEFAULT_ETCD_LEASE_TTL = 5
DEFAULT_ETCD_PREFIX = "/rdzv"
# The smallest --max-head-bytes: an ordinary browser request (with a few cookies) fits.
MIN_HEAD_BYTES = 1024
# With --etcd every write's record is one etcd request, and etcd refuses requests over
# 1.5 MiB: a value is capped at 1 MiB and a body at 1.5 MiB, so that nothing a client sends
# is far beyond what etcd takes. Each write's record is then checked against the log's own
# limit (storage.etcd_log.MAX_RECORD_BYTES) before it is applied: a multi_set or compare_set
# of large values is refused with 413 record_too_large, having changed nothing.
ETCD_MAX_VALUE_BYTES = 1024 * 1024
ETCD_MAX_BODY_BYTES = 1536 * 1024
FSYNC_POLICIES = ("always", "batch", "never")
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("text", "json")  # json: one object per line, for log pipelines (logformat.py)


class ConfigError(ValueError):
    """A setting is out of range; the message names the flag and what is allowed."""


#: One rule over a configuration: the message of its ConfigError, or None when it holds.
Check = Callable[["ServerConfig"], "str | None"]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _in_range(name: str, low: int, high: int) -> Check:
    def check(config: ServerConfig) -> str | None:
        value = getattr(config, name)
        return None if low <= value <= high else f"{_flag(name)} must be {low}..{high}, got {value}"

    return check


def _one_of(name: str, allowed: tuple[str, ...]) -> Check:
    def check(config: ServerConfig) -> str | None:
        value = getattr(config, name)
        return None if value in allowed else f"{_flag(name)} must be one of {', '.join(allowed)}, got {value!r}"

    return check


def _at_least(name: str, minimum: int, why: str = "") -> Check:
    """``name`` >= ``minimum``; ``why`` follows the number in the message (a unit, a reason)."""

    def check(config: ServerConfig) -> str | None:
        return None if getattr(config, name) >= minimum else f"{_flag(name)} must be at least {minimum}{why}"

    return check


def _not_below(name: str, other: str) -> Check:
    """``name`` >= the setting ``other``: one holds what the other sends."""

    def check(config: ServerConfig) -> str | None:
        return None if getattr(config, name) >= getattr(config, other) else f"{_flag(name)} must be at least {_flag(other)}"

    return check


def _positive(name: str) -> Check:
    def check(config: ServerConfig) -> str | None:
        return None if getattr(config, name) > 0 else f"{_flag(name)} must be > 0"

    return check


def _span(name: str, longest: float) -> Check:
    """A duration ``name`` in (0, ``longest``] seconds."""

    def check(config: ServerConfig) -> str | None:
        value = getattr(config, name)
        return None if 0 < value <= longest else f"{_flag(name)} must be > 0 s and at most {longest:.0f} s, got {value}"

    return check


def _paired(first: str, second: str) -> Check:
    """Two settings that only work together: both, or neither."""

    def check(config: ServerConfig) -> str | None:
        if (getattr(config, first) is None) == (getattr(config, second) is None):
            return None
        return f"{_flag(first)} and {_flag(second)} go together: give both, or neither"

    return check


def _one_log(config: ServerConfig) -> str | None:
    if config.memory and config.data_dir is not None:
        return "--memory and --data-dir exclude each other: pick one"
    return None


def _pre_auth_share(config: ServerConfig) -> str | None:
    """Strangers' share of the buffer holds one whole request head, and fits in the buffer."""
    share = config.pre_auth_bytes()
    if config.max_head_bytes <= share <= config.max_buffered_bytes:
        return None
    return (
        f"--max-pre-auth-bytes ({share}) must be at least --max-head-bytes ({config.max_head_bytes}) "
        f"and at most --max-buffered-bytes ({config.max_buffered_bytes})"
    )


def _auth_or_none(config: ServerConfig) -> str | None:
    if config.no_auth and (config.token_file is not None or config.read_token_file is not None):
        return "--no-auth excludes --token-file and --read-token-file: pick one"
    return None


def _etcd_or_local_log(config: ServerConfig) -> str | None:
    if config.etcd and (config.memory or config.data_dir is not None):
        return "--etcd keeps the log in etcd: it excludes --memory and --data-dir"
    return None


def _etcd_urls(config: ServerConfig) -> str | None:
    for url in config.etcd:
        if not url.startswith(("http://", "https://")):
            return f"--etcd takes client URLs such as http://10.0.0.1:2379, got {url!r}"
    return None


def _etcd_prefix(config: ServerConfig) -> str | None:
    prefix = config.etcd_prefix
    if prefix.startswith("/") and prefix.rstrip("/") != "":
        return None
    return f"--etcd-prefix must be a path under / such as /rdzv, got {prefix!r}"


def _advertise_url(config: ServerConfig) -> str | None:
    url = config.advertise_url
    if url is None or url.startswith(("http://", "https://")):
        return None
    return f"--advertise-url must be http://HOST:PORT or https://HOST:PORT, got {url!r}"


def _client_ca_needs_tls(config: ServerConfig) -> str | None:
    if config.tls_client_ca is not None and config.tls_cert is None:
        return "--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS first)"
    return None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    data_dir: Path | None = None  # None: default_data_dir(), unless memory
    memory: bool = False
    fsync: str = "always"
    log_level: str = "info"
    log_format: str = "text"
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_hold: float = DEFAULT_MAX_HOLD
    disconnect_grace: float = DEFAULT_DISCONNECT_GRACE
    job_ttl: float = DEFAULT_JOB_TTL
    snapshot_every: int = DEFAULT_SNAPSHOT_EVERY
    # -- automatic quarantine (README "Quarantine") --
    quarantine_after: int = DEFAULT_QUARANTINE_AFTER  # deaths of one host's nodes (0: off)
    quarantine_window: float = DEFAULT_QUARANTINE_WINDOW  # ... within this many seconds
    quarantine_for: float = DEFAULT_QUARANTINE_FOR  # cordon it this long
    quarantine_failures: int = DEFAULT_QUARANTINE_FAILURES  # host-local failures within the window (0: off)
    quarantine_failure_lead: float = DEFAULT_QUARANTINE_FAILURE_LEAD  # ... each ahead of the others' by this
    # Recovery keeps the records before damage in the log and sets the damaged files aside,
    # instead of refusing to start (storage/recovery.py); an operator's decision, so off.
    truncate_corrupt_log: bool = False
    # -- security (README "Security") --
    token_file: Path | None = None  # None: wire.default_token_file(), created 0600 if missing
    read_token_file: Path | None = None  # a read-only token, for dashboards and monitoring
    no_auth: bool = False
    allowed_hosts: tuple[str, ...] = ()  # Host header names accepted; empty: any
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # require client certificates signed by this CA (mutual TLS)
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    read_timeout: float = DEFAULT_READ_TIMEOUT
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    max_pre_auth_bytes: int | None = None  # None: 1/PRE_AUTH_SHARE of max_buffered_bytes (pre_auth_bytes())
    auth_timeout: float = DEFAULT_AUTH_TIMEOUT
    max_jobs: int = DEFAULT_MAX_JOBS
    max_keys_per_job: int = DEFAULT_MAX_KEYS_PER_JOB
    max_job_bytes: int = DEFAULT_MAX_JOB_BYTES
    max_sessions: int = DEFAULT_MAX_SESSIONS
    max_session_writes: int = DEFAULT_MAX_SESSION_WRITES
    max_session_bytes: int = DEFAULT_MAX_SESSION_BYTES
    session_ttl: float = DEFAULT_SESSION_TTL
    max_log_queue: int = DEFAULT_MAX_QUEUED_RECORDS  # records waiting to be written (local or etcd)
    max_log_queue_bytes: int = DEFAULT_MAX_QUEUED_BYTES
    # -- replicas (README "High availability") --
    etcd: tuple[str, ...] = ()  # etcd client URLs: run as one replica of a cluster over etcd
    etcd_prefix: str = DEFAULT_ETCD_PREFIX  # one prefix per cluster
    etcd_lease_ttl: int = DEFAULT_ETCD_LEASE_TTL
    etcd_token_file: Path | None = None  # USER:PASSWORD for etcd's auth
    etcd_ca: Path | None = None
    etcd_cert: Path | None = None
    etcd_key: Path | None = None
    advertise_url: str | None = None  # how clients reach this replica; default from host and port
    replica_id: str | None = None  # default: the host name and port

    def __post_init__(self) -> None:
        """Fit the sizes to etcd's limits (with ``--etcd``), then run ``CHECKS`` in order:
        the first that fails raises :class:`ConfigError` with its message."""
        if self.etcd:  # what etcd takes (see ETCD_MAX_VALUE_BYTES); the server logs it at start
            object.__setattr__(self, "max_value_bytes", min(self.max_value_bytes, ETCD_MAX_VALUE_BYTES))
            object.__setattr__(self, "max_body_bytes", min(self.max_body_bytes, ETCD_MAX_BODY_BYTES))
        for check in CHECKS:
            problem = check(self)
            if problem is not None:
                raise ConfigError(problem)

    def pre_auth_bytes(self) -> int:
        """Bytes connections not yet authenticated may hold together (``--max-pre-auth-bytes``)."""
        if self.max_pre_auth_bytes is not None:
            return self.max_pre_auth_bytes
        return max(self.max_buffered_bytes // PRE_AUTH_SHARE, self.max_head_bytes)  # one whole head at least

    def resolved_token_file(self) -> Path | None:
        """The write token's file; None with auth off."""
        if self.no_auth:
            return None
        return self.token_file if self.token_file is not None else default_token_file()

    def limits(self) -> Limits:
        return Limits(
            max_jobs=self.max_jobs,
            max_keys_per_job=self.max_keys_per_job,
            max_job_bytes=self.max_job_bytes,
            max_sessions=self.max_sessions,
            max_session_writes=self.max_session_writes,
            max_session_bytes=self.max_session_bytes,
        )

    def resolved_data_dir(self) -> Path | None:
        if self.memory:
            return None
        return self.data_dir if self.data_dir is not None else default_data_dir()


_COUNTS = (
    "max_connections", "max_jobs", "max_keys_per_job", "max_sessions", "max_session_writes", "max_log_queue",
    "max_log_queue_bytes",
)
_DURATIONS = ("max_hold", "disconnect_grace", "job_ttl", "idle_timeout", "read_timeout", "session_ttl", "auth_timeout")

#: Every rule a ServerConfig keeps, in the order they are checked (the first broken one is
#: reported). A new flag adds its row here.

def _quarantine_failure_lead(config: ServerConfig) -> str | None:
    value = config.quarantine_failure_lead
    return None if 0 <= value <= MAX_QUARANTINE_WINDOW_S else (
        f"--quarantine-failure-lead must be 0..{MAX_QUARANTINE_WINDOW_S:.0f} s, got {value}"
    )


CHECKS: tuple[Check, ...] = (
    _in_range("port", 0, 65535),
    _one_of("fsync", FSYNC_POLICIES),
    _one_of("log_level", LOG_LEVELS),
    _one_of("log_format", LOG_FORMATS),
    _one_log,
    _at_least("max_value_bytes", 1),
    _not_below("max_body_bytes", "max_value_bytes"),
    _not_below("max_buffered_bytes", "max_body_bytes"),
    _not_below("max_session_bytes", "max_value_bytes"),
    _not_below("max_job_bytes", "max_value_bytes"),
    *(_at_least(name, 1) for name in _COUNTS),
    _at_least("max_head_bytes", MIN_HEAD_BYTES, " (a browser's ordinary request head)"),
    _pre_auth_share,
    *(_positive(name) for name in _DURATIONS),
    _at_least("snapshot_every", 1),
    _in_range("quarantine_after", 0, MAX_DEATHS_PER_HOST),
    _span("quarantine_window", MAX_QUARANTINE_WINDOW_S),
    _span("quarantine_for", MAX_CORDON_S),
    _in_range("quarantine_failures", 0, MAX_DEATHS_PER_HOST),
    _quarantine_failure_lead,
    _auth_or_none,
    _etcd_or_local_log,
    _etcd_urls,
    _etcd_prefix,
    _at_least("etcd_lease_ttl", 2, " s (etcd's shortest lease is about 1.5 s)"),
    _paired("etcd_cert", "etcd_key"),
    _advertise_url,
    _paired("tls_cert", "tls_key"),
    _client_ca_needs_tls,
)
