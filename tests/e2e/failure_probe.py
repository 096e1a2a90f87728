"""torchrun with a probe backend that reports what the failure finder finds, for
tests/e2e/test_failure_found.py: ``python failure_probe.py OUT_FILE TORCHRUN_ARGS...``.

The backend ``failure-probe`` is torch's own c10d handler behind a delegating handler whose
``next_rendezvous()`` and ``shutdown()`` first call
:func:`rdzv_client.torchrun.find_failure_report` (on the agent's thread, as the plug-in's
handler will) and append one JSON line to OUT_FILE: ``{"call": ..., "report": <wire map> |
null}``. Registered through torch's public registry before torchrun's ``main`` runs, so it
works on every torch (2.4 and 2.5 read no entry points). Nothing of torch is patched.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.run import main

from rdzv_client.torchrun import find_failure_report

BACKEND = "failure-probe"


class ProbeHandler(RendezvousHandler):
    def __init__(self, inner: RendezvousHandler, out_file: str) -> None:
        self.inner = inner
        self.out_file = out_file

    def _probe(self, call: str) -> None:
        report = find_failure_report()
        line = {"call": call, "report": None if report is None else report.to_wire(time.time())}
        with open(self.out_file, "a") as out:
            out.write(json.dumps(line) + "\n")

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return bool(self.inner.use_agent_store)

    def next_rendezvous(self) -> RendezvousInfo:
        self._probe("next_rendezvous")
        return self.inner.next_rendezvous()

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        self._probe("shutdown")
        return self.inner.shutdown()


def creator(out_file: str) -> Any:
    def create(params: RendezvousParameters) -> RendezvousHandler:
        backend, store = create_backend(params)
        return ProbeHandler(create_handler(store, backend, params), out_file)

    return create


if __name__ == "__main__":
    rendezvous_handler_registry.register(BACKEND, creator(sys.argv[1]))
    main(sys.argv[2:])
