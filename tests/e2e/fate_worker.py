"""A worker for tests/e2e/test_job_fate.py, under torch's ``@record``.

Each worker counts its own starts in ``$FATE_DIR`` (one file per start, by global rank), so
what it does depends on nothing but that count, whatever the timing of the other nodes:
- ``RANK`` ``$FAIL_RANK`` raises a CUDA-looking RuntimeError at its first start (exit code 1,
  the message in torch's error file);
- every other worker waits at its first start until its agent stops it (SIGTERM: its agent
  restarts for the failing node's re-join, which is not a failure of its own);
- at a later start every worker exits 0 at once: the re-formed round succeeds.
No process group: the failure and the restart are all the test looks at.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

MESSAGE = "CUDA error: an illegal memory access was encountered"
# Far beyond any restart the test waits for; a worker never outlives a broken test by more.
FIRST_START_WAIT_S = 120.0


@record
def main() -> None:
    folder, rank = Path(os.environ["FATE_DIR"]), os.environ["RANK"]
    earlier = list(folder.glob(f"start-{rank}-*"))
    (folder / f"start-{rank}-{uuid.uuid4().hex}").touch()
    if earlier:
        return  # the re-formed round: done
    if rank == os.environ["FAIL_RANK"]:
        raise RuntimeError(MESSAGE)
    time.sleep(FIRST_START_WAIT_S)  # its agent stops it first
    sys.exit(5)


if __name__ == "__main__":
    main()
