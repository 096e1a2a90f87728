"""rdzv_client: the client of rdzv-server, for agents, tools and tests.

What it owns: the public surface of the client package: the sync and async clients, every
error a caller can get from them (the :mod:`rdzv_client.error` tree, and the ValueErrors for
an unusable token or TLS file), the job's settings and their result records, and a worker's
:func:`progress` report. ``rdzvctl`` lives in :mod:`rdzv_client.ctl` and the wire contract in
:mod:`rdzv_client.wire`.

What it must not know: torch. Importing this package never imports torch; the torch
``Store`` and the torchrun handler live in their own module, imported only by torch's
entry point.

The clients are imported on first use (PEP 562): the server imports this package's wire
part (:mod:`rdzv_client.wire`, which runs this file first) and must not load the client's
transport, aiohttp's client side or its policy with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .error import (
    BadRequestError,
    ClientClosedError,
    ConflictError,
    HostCordonedError,
    JobClosedError,
    JobClosedInLineError,
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
# A worker's progress report (torch-free, stdlib only). Imported eagerly: the function is the
# package's ``progress`` attribute, never shadowed by its module's name.
from .progress import progress
from .record import Assignment, JobSettings

if TYPE_CHECKING:
    from .client import AsyncClient, Client, WatchResult
    from .credential import CredentialError
    from .tls import TLSConfigError

# Names served by __getattr__, from the module that defines them (the token lookup loads the
# wire, msgpack included, and the TLS one ssl: neither belongs in the server's core).
_LAZY = {
    "AsyncClient": "client",
    "Client": "client",
    "WatchResult": "client",
    "CredentialError": "credential",
    "TLSConfigError": "tls",
}

__all__ = [
    "Assignment",
    "AsyncClient",
    "BadRequestError",
    "Client",
    "ClientClosedError",
    "ConflictError",
    "CredentialError",
    "HostCordonedError",
    "JobClosedError",
    "JobClosedInLineError",
    "JobSettings",
    "JoinTimeoutError",
    "LimitError",
    "NotFoundError",
    "NotLeaderError",
    "RdzvConnectionError",
    "RdzvError",
    "RdzvTimeoutError",
    "ServerError",
    "TLSConfigError",
    "UnauthorizedError",
    "WatchResult",
    "progress",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once imported, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
