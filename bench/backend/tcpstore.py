"""The reference line of the store measurement: a raw ``torch.distributed.TCPStore``.

Not a rendezvous backend: the store every torch job ends up using for its workers, and
the yardstick of the store targets. Its server runs in a process of its own.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..process import Service, free_port
from . import StoreSpec

if TYPE_CHECKING:
    from torch.distributed import Store

LABEL = "TCPStore (reference)"
#: The server process ends by itself after this long even if the bench died without killing it.
MAX_LIFETIME = 3 * 3600

_SERVE = """
import sys, time, torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False)
print("tcpstore ready", flush=True)
time.sleep(float(sys.argv[2]))  # until the bench kills us; bounded in case it never does
"""


class TCPStoreService:
    """A TCPStore server in its own process on a free loopback port."""

    def __init__(self) -> None:
        self.endpoint = ""
        self._service: Service | None = None

    def start(self, log_dir: Path) -> None:
        port = free_port()
        self._service = Service("tcpstore", [sys.executable, "-c", _SERVE, str(port), str(MAX_LIFETIME)], log_dir / "tcpstore.log")
        self._service.start(ready_line="tcpstore ready")
        self.endpoint = f"127.0.0.1:{port}"

    def stop(self) -> None:
        if self._service is not None:
            self._service.kill()
            self._service = None

    @property
    def pid(self) -> int | None:
        """The server process's pid (for its CPU time); None before start."""
        return self._service.pid if self._service is not None else None

    def store_spec(self) -> StoreSpec:
        return StoreSpec(__name__, self.endpoint)


def open_store(spec: StoreSpec) -> Store:
    """A plain TCPStore client."""
    from .c10d import open_store as open_tcp

    return open_tcp(spec)
