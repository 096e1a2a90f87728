"""A worker for the end-to-end tests: checks its environment, runs a gloo all_reduce,
and writes what it saw to $RESULT_DIR/<restart>-<run_id>-<rank>.json.

Env knobs (set by the tests):
- RESULT_DIR (required): where the records go.
- STEPS (all_reduce iterations, default 1) and STEP_SLEEP (s between iterations, 0):
  how long the worker runs.
- STEPS_WHEN_WORLD_SIZE ("6:1" or "6:1,4:2"): override STEPS when WORLD_SIZE is the
  given size. Membership-change restarts keep TORCHELASTIC_RESTART_COUNT at 0, so the
  world size is what tells a test's final round from the long-running earlier ones:
  a test makes the early rounds long and the final round short.
- RUN_UNTIL (a file): the steps end early, all ranks together, once that file exists (a test
  that looks at a running job says when it is done looking).
- FAIL_ALWAYS: "1": every worker exits 1 on every attempt (a job that cannot run), before it
  imports torch (a failing start costs the shared test machine no torch import).
- NODE_NAME: the test's name for the node (recorded, and names the heartbeat file).
- EXIT_AT_END (with EXIT_AFTER_RESULTS, another node's RESULT_DIR): this worker runs to its
  end, then exits with that code once that node's workers have written their final records
  and exited: a node whose workers fail at the very end while the others' succeed (a mixed
  finish), in that order whatever the scheduling.

Besides the final record, every worker writes:
- $RESULT_DIR/started-<world>-<master_port>-<rank>.json once its process group is up
  (one per round the worker took part in, finished or not);
- $RESULT_DIR/hb-<local_rank>.json after every step (replaced atomically): world size,
  rank, step, time. A test reads it to see that training keeps making progress.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _write(path: Path, record: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _steps(world: int) -> int:
    steps = int(os.environ.get("STEPS", "1"))
    for item in filter(None, os.environ.get("STEPS_WHEN_WORLD_SIZE", "").split(",")):
        size, _, count = item.partition(":")
        if int(size) == world:
            steps = int(count)
    return steps


def main() -> int:
    env = {k: os.environ[k] for k in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
    )}
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    out = Path(os.environ["RESULT_DIR"])
    restart = int(env["TORCHELASTIC_RESTART_COUNT"])
    node = os.environ.get("NODE_NAME", "")
    if os.environ.get("FAIL_ALWAYS") == "1":
        print(f"train.py: rank {rank} fails on purpose (FAIL_ALWAYS, attempt {restart})", file=sys.stderr, flush=True)
        return 1
    import torch  # after the failures above: they need none of it
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://")
    started = time.time()
    _write(out / f"started-{world}-{env['MASTER_PORT']}-{rank}.json",
           dict(env, pid=os.getpid(), host_node=node, started=started))
    steps = _steps(world)
    pause = float(os.environ.get("STEP_SLEEP", "0"))
    # RUN_UNTIL=FILE: the run ends early, at the first step after FILE exists (a test's "I have
    # seen the job running"); every rank learns it from the same all_reduce, so all stop together.
    until = os.environ.get("RUN_UNTIL")
    total = None
    for step in range(steps):
        t = torch.tensor([float(rank + 1), float(bool(until) and Path(until or ".").exists())])
        dist.all_reduce(t)
        total = t[0].item()
        _write(out / f"hb-{env['LOCAL_RANK']}.json",
               {"world": world, "rank": rank, "step": step + 1, "steps": steps, "time": time.time()})
        if t[1].item() > 0:
            break
        if pause:
            time.sleep(pause)
    record = dict(env, all_reduce=total, expected=world * (world + 1) / 2, pid=os.getpid(),
                  host_node=node, started=started, finished=time.time(), steps=steps)
    _write(out / f"{restart}-{env['TORCHELASTIC_RUN_ID']}-{rank}.json", record)
    dist.destroy_process_group()
    code = int(os.environ.get("EXIT_AT_END", "0"))
    if code:
        peers = world - int(env["LOCAL_WORLD_SIZE"])
        _wait_for_peers(Path(os.environ["EXIT_AFTER_RESULTS"]), env["TORCHELASTIC_RUN_ID"], peers)
        print(f"train.py: rank {rank} exits {code} at its end on purpose (EXIT_AT_END)", file=sys.stderr, flush=True)
    return code


def _wait_for_peers(results: Path, run_id: str, count: int, timeout: float = 60.0) -> None:
    """Until ``count`` final records of ``run_id`` are in ``results`` and their workers have exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [json.loads(p.read_text())["pid"] for p in results.glob(f"*-{run_id}-*.json")]
        if len(pids) >= count and not any(_running(pid) for pid in pids):
            return
        time.sleep(0.05)


def _running(pid: int) -> bool:
    import psutil  # only this knob needs it

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


if __name__ == "__main__":
    sys.exit(main())
