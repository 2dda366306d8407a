"""A tiny rank script for the launcher tests: ``rank_job.py ACTION OUTDIR``.

Every rank joins a gloo group and all-reduces; then rank 1 does ACTION (ok, raise, sigkill,
sigstop, sigkill-busy) while the other ranks wait to be torn down (or finish, for ok).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

action, outdir = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
expected = world * (world + 1) / 2
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "FLOWTRAIN_RUN_DIR", "FLOWTRAIN_ERROR_FILE", "FLOWTRAIN_CONTROL_ENDPOINT",
         "FLOWTRAIN_JOB_ID", "FLOWTRAIN_LAUNCHED", "OMP_NUM_THREADS", "PYTHONUNBUFFERED",
         "FLOWTRAIN_TEST_FROM_ENV_FILE"]
with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
    json.dump({"env": {n: os.environ.get(n) for n in names}, "sum": t.item(), "expected": expected,
               "argv": sys.argv, "path0": sys.path[0], "name": __name__}, f)
print(f"rank {rank} all-reduced {t.item()}", flush=True)

if action == "ok":
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)

if action == "sigkill-busy":
    # Rank 0 sits in collectives when rank 1 dies, so its gloo error races the launcher's
    # view of rank 1's death; the death must still be named the root cause.
    deadline = time.time() + 0.5
    while rank != 1 or time.time() < deadline:
        dist.all_reduce(t)
    action = "sigkill"

if rank == 1:
    time.sleep(0.5)
    with open(os.path.join(outdir, "fault_time"), "w") as f:
        f.write(repr(time.time()))
    if action == "raise":
        raise ValueError(os.environ.get("BOOM_MESSAGE", "boom"))
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "sigstop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if action == "exit3":
        sys.exit(3)
time.sleep(60)  # the launcher must end this rank long before
