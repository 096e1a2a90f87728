"""Finding what failed in torch's agent, from inside the rendezvous handler it calls.

What it owns: :func:`find_failure_report`, the one place where the plug-in leans on how
torch's elastic agent keeps its failures. torch hands a handler nothing about a failure:
after a worker failure with restarts left, ``SimpleElasticAgent._invoke_run`` calls
``_restart_workers`` -> ``_initialize_workers`` -> ``_rendezvous`` ->
``rdzv_handler.next_rendezvous()`` with no argument, and after the last failure
``launch_agent`` calls ``rdzv_handler.shutdown()`` from its ``finally``. In both places the
agent's latest ``RunResult`` (``state``, ``failures``: global rank -> ``ProcessFailure``) is
a local variable of a frame below the handler's: ``run_result`` in ``_invoke_run``,
``result`` in ``launch_agent`` (read in torch 2.4.1, 2.13, 2.14.1 and 2.15.0; see
docs/torch-compat.md, "What the failure report relies on").

Rules:
- The nearest ``RunResult`` on the calling thread's stack (at most :data:`MAX_FRAMES`
  frames up) is the agent's latest. Its type is what is looked for, not a variable's name
  or a method's, so a renamed local or an agent subclass with its own run loop
  (one that keeps its result in a local) is still found.
- A result whose state is FAILED or UNHEALTHY gives a report (with no failures in it:
  :data:`~rdzv_client.failure.NO_DETAIL`); any other state, or no result (the agent's first
  rendezvous), gives None. Nothing found is None too: the caller decides with
  :class:`~rdzv_client.failure.RendezvousEntries` whether that entry follows a failure.
- Never raises, never writes to torch's objects, never patches torch: reading frames is
  all it does. Call it on the thread torch called the handler on.

What it must not know: the server, the wire, the handler's other work. Importing it imports
torch: only the torch boundary imports it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Collection
from types import FrameType

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

from .failure import FailureReport, build_report

log = logging.getLogger(__name__)

# The handler's call sits a handful of frames above the agent's loop (torch's @prof wrappers
# add one per method); 64 covers that with room for a launcher of our own, and bounds the cost.
MAX_FRAMES = 64
FAILED_STATES = frozenset({WorkerState.FAILED, WorkerState.UNHEALTHY})


def find_failure_report(secrets: Collection[str] = ()) -> FailureReport | None:
    """The report of the failure that brought the agent into this call, or None when the
    agent holds no failed result (its first rendezvous, a membership change, a clean end) or
    none can be found. ``secrets`` are masked in messages (see :func:`build_report`)."""
    try:
        result = latest_run_result(inspect.currentframe())
        if result is None or result.state not in FAILED_STATES:
            return None
        return build_report(result.failures, secrets)
    except Exception:  # a torch we have not read: the caller reports no detail
        log.debug("The agent's failures could not be read.", exc_info=True)
        return None


def latest_run_result(frame: FrameType | None) -> RunResult | None:
    """The nearest ``RunResult`` held in a local variable of ``frame`` or a frame below it
    (its callers), looking at most :data:`MAX_FRAMES` frames."""
    for _ in range(MAX_FRAMES):
        if frame is None:
            return None
        for value in list(frame.f_locals.values()):
            if isinstance(value, RunResult):
                return value
        frame = frame.f_back
    return None
