"""A worker for the job-policy test (tests/e2e/test_policy_e2e.py), torch-free: global rank
FAIL_RANK fails on purpose FAILURES times in a row, then every rank exits 0.

The failures are counted in files (one per failure, in STATE_DIR, which every node shares on
this host), not by TORCHELASTIC_RESTART_COUNT: torch counts restarts per agent, and an agent
that restarts for another node's failure does not count it. The count a worker reads when it
starts names its round; the failing rank fails only once every rank of its round has
started, so no rank reads a count that its own round has already moved (it would finish while
its round fails: a mixed finish, which ends the job).

Env knobs (set by the test):
- FAIL_RANK, FAILURES, STATE_DIR: who fails, how often, where the count is kept.
- GATE: a file; before every failure but the first the failing rank waits for it, so that
  the test can change the job's policy between two failures whatever the scheduling.
- While failures are due the other ranks wait until their agent stops them for the restart.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

PATIENCE_S = 120.0  # a worker left waiting this long by a broken test ends by itself


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    state = Path(os.environ["STATE_DIR"])
    failed = len(list(state.glob("failed-*")))
    (state / f"started-{failed}-{rank}").touch()
    if failed >= int(os.environ["FAILURES"]):
        return 0
    deadline = time.monotonic() + PATIENCE_S
    if rank != int(os.environ["FAIL_RANK"]):
        while time.monotonic() < deadline:  # until the agent stops it for the restart
            time.sleep(0.1)
        return 2
    gate = Path(os.environ["GATE"])
    ready = [state / f"started-{failed}-{r}" for r in range(world)]
    while time.monotonic() < deadline and not (all(p.exists() for p in ready) and (failed == 0 or gate.exists())):
        time.sleep(0.05)
    (state / f"failed-{failed}").touch()
    print(f"policy_worker.py: rank {rank} fails on purpose (failure {failed + 1})", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
