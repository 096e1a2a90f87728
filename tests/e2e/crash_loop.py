"""A worker for the crash-loop tests (tests/e2e/test_crash_loop.py): it never finishes.

Env knobs (set by the tests):
- FAIL_AFTER_S: run this long (seconds), then exit 1: a worker that fails soon after every start.
- PROGRESS_TO=N: report steps with ``rdzv_client.progress``: on the first attempt
  (TORCHELASTIC_RESTART_COUNT 0) steps 1..N, on every later one step N again (resumed from its
  checkpoint and got no further); then exit 1.
"""

from __future__ import annotations

import os
import sys
import time

import rdzv_client


def main() -> int:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = os.environ["RANK"]
    last = os.environ.get("PROGRESS_TO")
    if last is not None:
        first = 1 if attempt == 0 else int(last)
        for step in range(first, int(last) + 1):
            rdzv_client.progress(step)
            time.sleep(0.2)
    time.sleep(float(os.environ.get("FAIL_AFTER_S", "0")))
    print(f"crash_loop.py: rank {rank} fails on purpose (attempt {attempt})", file=sys.stderr, flush=True)
    return 1  # rdzv_client.progress's last step reaches the agent at this exit


if __name__ == "__main__":
    sys.exit(main())
