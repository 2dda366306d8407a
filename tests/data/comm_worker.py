"""Worker for tests/test_comm.py: one rank awaiting collectives from its runtime's loop."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import torch

from flowtrain import comm
from flowtrain.runtime.system import Runtime


async def checks(rank: int, world: int) -> dict:
    out: dict = {}
    t = torch.tensor([float(rank + 1)] * 3)
    await comm.all_reduce_async(t)
    out["all_reduce"] = t.tolist()

    b = torch.tensor([float(rank * 10 + 7)])
    await comm.broadcast_async(b, src=1)
    out["broadcast"] = b.tolist()

    gathered = torch.empty(2 * world)
    await comm.all_gather_into_tensor_async(gathered, torch.tensor([rank, rank + 0.5]))
    out["all_gather"] = gathered.tolist()

    full = torch.arange(2 * world, dtype=torch.float32) * (rank + 1)
    shard = torch.empty(2)
    await comm.reduce_scatter_tensor_async(shard, full)
    out["reduce_scatter"] = shard.tolist()

    # The loop stays free while a collective waits: rank 1 arrives late and a ticker runs.
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    if rank == 1:
        await asyncio.sleep(0.5)
    task = asyncio.ensure_future(ticker())
    seen_pending: list[str] = []

    async def watch() -> None:
        await asyncio.sleep(0.2)
        seen_pending.extend(comm.pending())

    watcher = asyncio.ensure_future(watch())
    late = torch.ones(4)
    await comm.all_reduce_async(late)
    await watcher
    task.cancel()
    out["late"] = late.tolist()
    out["ticks_while_waiting"] = ticks
    out["pending_seen"] = seen_pending

    # A collective a peer never joins ends with CollectiveTimeout instead of hanging.
    if rank == 0:
        try:
            await comm.all_reduce_async(torch.ones(1), timeout=0.5)
            out["timeout"] = "no timeout"
        except comm.CollectiveTimeout as exc:
            out["timeout"] = str(exc)
    return out


def main() -> None:
    rank, world, result_path = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[1]
    comm.init_distributed("gloo", timeout=30)
    runtime = Runtime(f"rank{rank}").start()
    result = runtime.call(checks, rank, world, timeout=60)
    with open(result_path, "w") as f:
        json.dump(result, f)
    # Rank 1 stays connected while rank 0's lone all-reduce runs into its timeout.
    time.sleep(1.5 if rank == 1 else 0.1)
    runtime.stop(timeout=5)
    os._exit(0)  # rank 0 left a collective unfinished on purpose; skip process-group teardown


if __name__ == "__main__":
    main()
