"""One rank of ``init_process_group("gloo", store=RdzvStore(...))`` (test_store_conformance).

Usage: python store_pg_worker.py ENDPOINT RDZV_ID RANK WORLD_SIZE OUT_JSON

Joins the process group through rdzv-server's store (no MASTER_ADDR, no TCPStore), runs
an all_reduce, a broadcast and a barrier, and writes what it saw to OUT_JSON.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from rdzv_client.torchrun import RdzvStore


def main() -> int:
    endpoint, rdzv_id, rank_text, world_text, out = sys.argv[1:6]
    rank, world = int(rank_text), int(world_text)
    store = RdzvStore(endpoint, rdzv_id, create=True, timeout=timedelta(seconds=60))
    started = time.monotonic()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    init_s = time.monotonic() - started
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    b = torch.tensor([float(rank * 10 + 7)])
    dist.broadcast(b, src=world - 1)
    dist.barrier()
    record = {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "all_reduce": t.item(),
        "broadcast": b.item(),
        "init_s": init_s,
        "keys": store.num_keys(),
    }
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(record))
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
