"""`rdzv-server`: argument parsing only. Every flag also reads an RDZV_* environment variable."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .config import (
    DEFAULT_ETCD_SNAPSHOT_EVERY,
    ETCD_MAX_BODY_BYTES,
    ETCD_MAX_VALUE_BYTES,
    FSYNC_POLICIES,
    LOG_FORMATS,
    LOG_LEVELS,
    PRE_AUTH_SHARE,
    ConfigError,
    ServerConfig,
)

_DEFAULTS = ServerConfig()


def _env(name: str, default: object) -> object:
    return os.environ.get("RDZV_" + name.upper(), default)


def _flag(name: str) -> bool:
    return str(_env(name, "")).lower() in ("1", "true", "yes")


def _path(value: object) -> Path | None:
    return Path(str(value)).expanduser() if value not in (None, "") else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rdzv-server",
        description="Rendezvous key-value server for torchrun (--rdzv-backend=rdzv-server).",
        epilog="Every flag can also be set by an environment variable: --max-hold <-> RDZV_MAX_HOLD.",
    )
    p.add_argument("--host", default=_env("host", _DEFAULTS.host), help="address to bind (default %(default)s)")
    p.add_argument("--port", type=int, default=_env("port", _DEFAULTS.port), help="port (default %(default)s; 0 picks a free one)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--data-dir", type=Path, default=_env("data_dir", None), help="durable state directory (default ~/.local/state/rdzv-server)")
    where.add_argument("--memory", action="store_true", default=str(_env("memory", "")).lower() in ("1", "true", "yes"), help="keep everything in memory only (tests, throwaway runs)")
    p.add_argument("--fsync", choices=FSYNC_POLICIES, default=_env("fsync", _DEFAULTS.fsync), help="when to fsync the log (default %(default)s)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default=_env("log_level", _DEFAULTS.log_level))
    p.add_argument("--log-format", choices=LOG_FORMATS, default=_env("log_format", _DEFAULTS.log_format),
                   help="text for people, json for log pipelines: one object per line (default %(default)s)")
    p.add_argument("--max-value-bytes", type=int, default=_env("max_value_bytes", _DEFAULTS.max_value_bytes),
                   help=f"largest value (default %(default)s; with --etcd at most {ETCD_MAX_VALUE_BYTES})")
    p.add_argument("--max-body-bytes", type=int, default=_env("max_body_bytes", _DEFAULTS.max_body_bytes),
                   help=f"largest request body (default %(default)s; with --etcd at most {ETCD_MAX_BODY_BYTES})")
    p.add_argument("--max-hold", type=float, default=_env("max_hold", _DEFAULTS.max_hold), help="longest a long-poll is held, s")
    p.add_argument("--disconnect-grace", type=float, default=_env("disconnect_grace", _DEFAULTS.disconnect_grace), help="s a node may take to reconnect its watch before it is dead")
    p.add_argument("--job-ttl", type=float, default=_env("job_ttl", _DEFAULTS.job_ttl), help="s a closed or idle job is kept")
    p.add_argument("--quarantine-after", type=int, default=_env("quarantine_after", _DEFAULTS.quarantine_after),
                   help="cordon a host whose nodes died this many times within --quarantine-window (0: never; default %(default)s)")
    p.add_argument("--quarantine-window", type=float, default=_env("quarantine_window", _DEFAULTS.quarantine_window),
                   help="s over which a host's deaths count (default %(default)s)")
    p.add_argument("--quarantine-for", type=float, default=_env("quarantine_for", _DEFAULTS.quarantine_for),
                   help="s an automatically quarantined host stays cordoned (default %(default)s)")
    p.add_argument("--quarantine-failures", type=int, default=_env("quarantine_failures", _DEFAULTS.quarantine_failures),
                   help="cordon a host whose node's workers failed first in their round this many times within "
                        "--quarantine-window (0: never; default %(default)s)")
    p.add_argument("--quarantine-failure-lead", type=float,
                   default=_env("quarantine_failure_lead", _DEFAULTS.quarantine_failure_lead),
                   help="s a node's failure must come before any other node's of its round to count "
                        "(default %(default)s)")
    p.add_argument("--snapshot-every", type=int, default=_env("snapshot_every", None),
                   help=f"log records between snapshots (default {_DEFAULTS.snapshot_every}; with --etcd {DEFAULT_ETCD_SNAPSHOT_EVERY})")
    p.add_argument(
        "--truncate-corrupt-log",
        action="store_true",
        default=str(_env("truncate_corrupt_log", "")).lower() in ("1", "true", "yes"),
        help="if the log is damaged, keep every record before the damage and set the damaged files aside "
        "(renamed *.corrupt-<time>, never deleted) instead of refusing to start; later records are dropped",
    )
    security = p.add_argument_group("security", "README: Security")
    security.add_argument("--token-file", type=Path, default=_env("token_file", None),
                          help="file holding the bearer token clients must present; created (0600) if missing "
                               "(default $XDG_CONFIG_HOME/rdzv-server/token, i.e. ~/.config/rdzv-server/token)")
    security.add_argument("--read-token-file", type=Path, default=_env("read_token_file", None),
                          help="file holding a second, read-only token (dashboards, monitoring)")
    security.add_argument("--no-auth", action="store_true", default=_flag("no_auth"),
                          help="accept requests without a token: anyone who reaches the port controls every job")
    security.add_argument("--allowed-hosts", default=_env("allowed_hosts", ""),
                          help="comma-separated names the server answers to (Host header); others are refused")
    security.add_argument("--tls-cert", type=Path, default=_env("tls_cert", None), help="TLS certificate chain (PEM)")
    security.add_argument("--tls-key", type=Path, default=_env("tls_key", None), help="TLS private key (PEM)")
    security.add_argument("--tls-client-ca", type=Path, default=_env("tls_client_ca", None),
                          help="CA bundle (PEM): require client certificates it signed (mutual TLS)")
    ha = p.add_argument_group("replicas", "run as one replica of a cluster over etcd (README: High availability)")
    ha.add_argument("--etcd", default=_env("etcd", ""),
                    help="etcd client URLs, comma-separated (http://h1:2379,http://h2:2379,...): the log lives in etcd")
    ha.add_argument("--etcd-prefix", default=_env("etcd_prefix", _DEFAULTS.etcd_prefix),
                    help="key prefix of this cluster in etcd (default %(default)s)")
    ha.add_argument("--etcd-lease-ttl", type=int, default=_env("etcd_lease_ttl", _DEFAULTS.etcd_lease_ttl),
                    help="s: a dead leader is replaced within about this long (default %(default)s)")
    ha.add_argument("--etcd-token-file", type=Path, default=_env("etcd_token_file", None),
                    help="file holding USER:PASSWORD for etcd's authentication")
    ha.add_argument("--etcd-ca", type=Path, default=_env("etcd_ca", None), help="CA bundle that signs etcd's certificates (PEM)")
    ha.add_argument("--etcd-cert", type=Path, default=_env("etcd_cert", None), help="client certificate for etcd (PEM)")
    ha.add_argument("--etcd-key", type=Path, default=_env("etcd_key", None), help="client key for etcd (PEM)")
    ha.add_argument("--advertise-url", default=_env("advertise_url", None),
                    help="URL clients reach this replica at (followers name the leader by it); default from --host/--port")
    ha.add_argument("--replica-id", default=_env("replica_id", None), help="this replica's name (default HOSTNAME:PORT)")
    limits = p.add_argument_group("limits", "what one server holds at most (README: Limits)")
    for name, kind, text in _LIMITS:
        flag = "--" + name.replace("_", "-")
        limits.add_argument(flag, type=kind, default=_env(name, getattr(_DEFAULTS, name)), help=f"{text} (default %(default)s)")
    limits.add_argument("--max-pre-auth-bytes", type=int, default=_env("max_pre_auth_bytes", None),
                        help="bytes connections that have not shown a token may hold together, of --max-buffered-bytes "
                             f"(default 1/{PRE_AUTH_SHARE} of it, at least --max-head-bytes)")
    return p


_LIMITS: tuple[tuple[str, type, str], ...] = (
    ("max_connections", int, "open connections; beyond it the idle and slow ones are shed first"),
    ("max_buffered_bytes", int, "bytes of partly received requests over all connections"),
    ("idle_timeout", float, "s a connection with nothing in flight may stay silent"),
    ("read_timeout", float, "s a request or frame may take to arrive once its first byte did"),
    ("max_head_bytes", int, "bytes of one HTTP request head (request line and header fields)"),
    ("auth_timeout", float, "s a connection may take to show a token: a stream's hello, an HTTP head before it has"),
    ("max_jobs", int, "jobs held at once"),
    ("max_keys_per_job", int, "keys per job over all its rounds"),
    ("max_job_bytes", int, "bytes of keys and values per job"),
    ("max_sessions", int, "clients whose writes are remembered for exactly-once retries"),
    ("max_session_writes", int, "unacknowledged writes one client may have at once"),
    ("max_session_bytes", int, "bytes of write results kept for retries, over all clients"),
    ("session_ttl", float, "s a client's exactly-once session outlives its last write"),
    ("max_log_queue", int, "log records waiting to be written (to disk or etcd); past it writes get 503"),
    ("max_log_queue_bytes", int, "bytes of log records waiting to be written"),
)


def parse(argv: Sequence[str] | None = None) -> ServerConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    etcd = tuple(url.strip().rstrip("/") for url in str(args.etcd).split(",") if url.strip())
    try:
        return ServerConfig(
            host=args.host,
            port=int(args.port),
            data_dir=Path(args.data_dir) if args.data_dir is not None and not args.memory else None,
            memory=bool(args.memory),
            fsync=args.fsync,
            log_level=args.log_level,
            log_format=args.log_format,
            max_value_bytes=int(args.max_value_bytes),
            max_body_bytes=int(args.max_body_bytes),
            max_hold=float(args.max_hold),
            disconnect_grace=float(args.disconnect_grace),
            job_ttl=float(args.job_ttl),
            quarantine_after=int(args.quarantine_after),
            quarantine_window=float(args.quarantine_window),
            quarantine_for=float(args.quarantine_for),
            quarantine_failures=int(args.quarantine_failures),
            quarantine_failure_lead=float(args.quarantine_failure_lead),
            snapshot_every=int(args.snapshot_every) if args.snapshot_every is not None else (
                DEFAULT_ETCD_SNAPSHOT_EVERY if etcd else _DEFAULTS.snapshot_every
            ),
            truncate_corrupt_log=bool(args.truncate_corrupt_log),
            token_file=_path(args.token_file),
            read_token_file=_path(args.read_token_file),
            no_auth=bool(args.no_auth),
            allowed_hosts=tuple(h.strip().lower() for h in str(args.allowed_hosts).split(",") if h.strip()),
            tls_cert=_path(args.tls_cert),
            tls_key=_path(args.tls_key),
            tls_client_ca=_path(args.tls_client_ca),
            etcd=etcd,
            etcd_prefix=str(args.etcd_prefix),
            etcd_lease_ttl=int(args.etcd_lease_ttl),
            etcd_token_file=_path(args.etcd_token_file),
            etcd_ca=_path(args.etcd_ca),
            etcd_cert=_path(args.etcd_cert),
            etcd_key=_path(args.etcd_key),
            advertise_url=str(args.advertise_url).rstrip("/") if args.advertise_url else None,
            replica_id=str(args.replica_id) if args.replica_id else None,
            max_pre_auth_bytes=int(args.max_pre_auth_bytes) if args.max_pre_auth_bytes not in (None, "") else None,
            **{name: kind(getattr(args, name)) for name, kind, _ in _LIMITS},
        )
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: Sequence[str] | None = None) -> None:
    from .server import run

    config = parse(argv)
    sys.exit(run(config))
