"""A worker for tests/e2e/test_job_fate.py, under torch's ``@record``.

Each worker counts its own starts in ``$FATE_DIR`` (one file per start, by global rank), so
what it does depends on nothing but that count, whatever the timing of the other nodes.
During its first ``$FAIL_STARTS`` starts (default 1):
- a failing worker (``RANK`` is ``$FAIL_RANK``, or its node has ``FAIL_HERE=1``) raises a
  CUDA-looking RuntimeError (exit code 1, the message in torch's error file); with
  ``FAIL_TOGETHER=1`` (every node fails) it first waits for the others (:func:`meet`), so that
  every node's workers fail at the same moment, as a bug in the script makes them, and it
  ends at once (:func:`fail_together`);
- every other worker waits until its agent stops it (SIGTERM: its agent restarts for the
  failing node's re-join, which is not a failure of its own).
At a later start every worker exits 0 at once: the re-formed round succeeds.

Only a failing worker imports torch (for ``@record`` and its error file): the others need none
of it, and a torch import costs the shared test machine seconds of CPU per start.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

MESSAGE = "CUDA error: an illegal memory access was encountered"
# Far beyond any restart the test waits for; a worker never outlives a broken test by more.
FIRST_START_WAIT_S = 120.0


def meet(folder: Path, attempt: int, world_size: int) -> None:
    """Wait until every worker of the round is at this point (a file each), so that they all
    fail within a few milliseconds of each other. (A gloo barrier would leave a process group
    to tear down at exit, which delays one worker's end by a varying time.)"""
    (folder / f"ready-{attempt}-{os.environ['RANK']}").touch()
    deadline = time.monotonic() + FIRST_START_WAIT_S
    while len(list(folder.glob(f"ready-{attempt}-*"))) < world_size and time.monotonic() < deadline:
        time.sleep(0.005)


def fail_together(folder: Path, attempt: int, world_size: int) -> None:
    """Meet every worker of the round (:func:`meet`), then end as ``@record`` ends a raising
    worker (its error file, exit code 1), but at once: an interpreter's teardown after torch
    takes a varying time, and the other node's agent, told of this node's re-join, would then
    stop its own failing worker first (a membership restart reports no failure;
    docs/job-fate.md, part 4). torch is imported before the meeting, not between it and the end."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    meet(folder, attempt, world_size)
    ErrorHandler().record_exception(RuntimeError(MESSAGE))
    os._exit(1)


def fail() -> None:
    """Raise the CUDA-looking error under torch's ``@record``: its error file, exit code 1."""
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def illegal_memory_access() -> None:
        raise RuntimeError(MESSAGE)

    illegal_memory_access()


def main() -> None:
    folder, rank = Path(os.environ["FATE_DIR"]), os.environ["RANK"]
    earlier = list(folder.glob(f"start-{rank}-*"))
    (folder / f"start-{rank}-{uuid.uuid4().hex}").touch()
    if len(earlier) >= int(os.environ.get("FAIL_STARTS", "1")):
        return  # the re-formed round: done
    if rank == os.environ.get("FAIL_RANK") or os.environ.get("FAIL_HERE") == "1":
        if os.environ.get("FAIL_TOGETHER") == "1":
            fail_together(folder, len(earlier), int(os.environ["WORLD_SIZE"]))
        fail()
    time.sleep(FIRST_START_WAIT_S)  # its agent stops it first
    sys.exit(5)


if __name__ == "__main__":
    main()
