"""`rdzv-server`: argument parsing only. Every flag also reads an RDZV_* environment variable."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from .config import FSYNC_POLICIES, LOG_LEVELS, ConfigError, ServerConfig

_DEFAULTS = ServerConfig()


def _env(name: str, default: object) -> object:
    return os.environ.get("RDZV_" + name.upper(), default)


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
    p.add_argument("--max-value-bytes", type=int, default=_env("max_value_bytes", _DEFAULTS.max_value_bytes))
    p.add_argument("--max-body-bytes", type=int, default=_env("max_body_bytes", _DEFAULTS.max_body_bytes))
    p.add_argument("--max-hold", type=float, default=_env("max_hold", _DEFAULTS.max_hold), help="longest a long-poll is held, s")
    p.add_argument("--disconnect-grace", type=float, default=_env("disconnect_grace", _DEFAULTS.disconnect_grace), help="s a node may take to reconnect its watch before it is dead")
    p.add_argument("--job-ttl", type=float, default=_env("job_ttl", _DEFAULTS.job_ttl), help="s a closed or idle job is kept")
    p.add_argument("--snapshot-every", type=int, default=_env("snapshot_every", _DEFAULTS.snapshot_every), help="log records between snapshots")
    return p


def parse(argv: Sequence[str] | None = None) -> ServerConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return ServerConfig(
            host=args.host,
            port=int(args.port),
            data_dir=Path(args.data_dir) if args.data_dir is not None and not args.memory else None,
            memory=bool(args.memory),
            fsync=args.fsync,
            log_level=args.log_level,
            max_value_bytes=int(args.max_value_bytes),
            max_body_bytes=int(args.max_body_bytes),
            max_hold=float(args.max_hold),
            disconnect_grace=float(args.disconnect_grace),
            job_ttl=float(args.job_ttl),
            snapshot_every=int(args.snapshot_every),
        )
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: Sequence[str] | None = None) -> None:
    from .server import run

    config = parse(argv)
    sys.exit(run(config))
