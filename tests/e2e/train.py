"""A worker for the end-to-end tests: checks its environment, runs a gloo all_reduce,
and writes what it saw to $RESULT_DIR/<round>-<rank>.json.

Env knobs (set by the tests): RESULT_DIR (required), STEPS (all_reduce iterations, 1),
STEP_SLEEP (s between iterations, 0), FAIL_ONCE_RANK (this global rank exits 1 on its
first attempt, to exercise a worker-failure restart).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    env = {k: os.environ[k] for k in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
    )}
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    out = Path(os.environ["RESULT_DIR"])
    restart = int(env["TORCHELASTIC_RESTART_COUNT"])
    dist.init_process_group("gloo", init_method="env://")
    steps = int(os.environ.get("STEPS", "1"))
    pause = float(os.environ.get("STEP_SLEEP", "0"))
    total = None
    started = time.time()
    for _ in range(steps):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        total = t.item()
        if pause:
            time.sleep(pause)
    record = dict(env, all_reduce=total, expected=world * (world + 1) / 2, pid=os.getpid(),
                  host_node=os.environ.get("NODE_NAME", ""), started=started, finished=time.time())
    (out / f"{restart}-{env['TORCHELASTIC_RUN_ID']}-{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
