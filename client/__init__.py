"""rdzv_client: the client of rdzv-server, for agents, tools and tests.

What it owns: the public surface of the client package: the sync and async clients, their
error tree and their result records. ``rdzvctl`` lives in :mod:`rdzv_client.ctl` and the
wire contract in :mod:`rdzv_client.wire`.

What it must not know: torch. Importing this package never imports torch; the torch
``Store`` and the torchrun handler live in their own module, imported only by torch's
entry point.
"""

from __future__ import annotations

from .client import AsyncClient, Client, WatchResult
from .error import (
    BadRequestError,
    ConflictError,
    JobClosedError,
    JoinTimeoutError,
    LimitError,
    NotFoundError,
    NotLeaderError,
    RdzvConnectionError,
    RdzvError,
    RdzvTimeoutError,
    ServerError,
    UnauthorizedError,
)
from .wire import Assignment

__all__ = [
    "Assignment",
    "AsyncClient",
    "BadRequestError",
    "Client",
    "ConflictError",
    "JobClosedError",
    "JoinTimeoutError",
    "LimitError",
    "NotFoundError",
    "NotLeaderError",
    "RdzvConnectionError",
    "RdzvError",
    "RdzvTimeoutError",
    "ServerError",
    "UnauthorizedError",
    "WatchResult",
]
