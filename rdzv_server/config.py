"""The server's one validated configuration object.

Every setting has a command-line flag (``cli.py``) and an ``RDZV_*`` environment
variable of the same name (``--max-value-bytes`` <-> ``RDZV_MAX_VALUE_BYTES``); flags win.
Construction validates everything, so a bad setting stops the server before it binds.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .storage import default_data_dir

# 29400 is torchrun's default rendezvous port: `--rdzv-endpoint=HOST` alone reaches us.
DEFAULT_PORT = 29400
# torch stores hold small blobs (addresses, NCCL ids, pickled role infos); 16 MiB is generous.
DEFAULT_MAX_VALUE_BYTES = 16 * 1024 * 1024
# A body carries at most a few values (multi_set) plus framing.
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
# Long-polls answer after this long at most, so proxies and dead peers never pin a request forever.
DEFAULT_MAX_HOLD = 30.0
# A live agent re-polls on its kept-alive connection at once, so a drop that lasts this long
# means its process died; short enough that survivors hear of it within a second.
DEFAULT_DISCONNECT_GRACE = 0.5
# Closed and idle jobs stay visible for an hour, long enough to inspect what happened.
DEFAULT_JOB_TTL = 3600.0
# Records between snapshots: bounds replay time (~1 s per million records) and log size.
DEFAULT_SNAPSHOT_EVERY = 100_000
FSYNC_POLICIES = ("always", "batch", "never")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    """A setting is out of range; the message names the flag and what is allowed."""


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    data_dir: Path | None = None  # None: default_data_dir(), unless memory
    memory: bool = False
    fsync: str = "always"
    log_level: str = "info"
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_hold: float = DEFAULT_MAX_HOLD
    disconnect_grace: float = DEFAULT_DISCONNECT_GRACE
    job_ttl: float = DEFAULT_JOB_TTL
    snapshot_every: int = DEFAULT_SNAPSHOT_EVERY

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be 0..65535, got {self.port}")
        if self.fsync not in FSYNC_POLICIES:
            raise ConfigError(f"--fsync must be one of {', '.join(FSYNC_POLICIES)}, got {self.fsync!r}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.memory and self.data_dir is not None:
            raise ConfigError("--memory and --data-dir exclude each other: pick one")
        if self.max_value_bytes < 1:
            raise ConfigError("--max-value-bytes must be at least 1")
        if self.max_body_bytes < self.max_value_bytes:
            raise ConfigError("--max-body-bytes must be at least --max-value-bytes")
        for name in ("max_hold", "disconnect_grace", "job_ttl"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0")
        if self.snapshot_every < 1:
            raise ConfigError("--snapshot-every must be at least 1")

    def resolved_data_dir(self) -> Path | None:
        if self.memory:
            return None
        return self.data_dir if self.data_dir is not None else default_data_dir()
