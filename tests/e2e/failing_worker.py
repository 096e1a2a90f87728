"""A worker for tests/e2e/test_failure_found.py: under torch's ``@record``, the worker with
LOCAL_RANK 1 raises a CUDA-looking RuntimeError at every start; the others wait until the
agent stops them (SIGTERM), so that they are reported the same way in every run. No process
group: the failures are all the test looks at."""

from __future__ import annotations

import os
import signal

from torch.distributed.elastic.multiprocessing.errors import record

MESSAGE = "CUDA error: an illegal memory access was encountered"


@record
def main() -> None:
    if os.environ["LOCAL_RANK"] == "1":
        raise RuntimeError(MESSAGE + "\nCUDA kernel errors might be asynchronously reported")
    signal.pause()


if __name__ == "__main__":
    main()
