"""Worker for tests/launch/test_launch_stall.py: ``stall_worker.py OUTDIR``. Two ranks train a tiny
model with the engine; at step 3 rank 1 deadlocks in its own code (a lock it already holds)
while its heartbeats, sent from another thread, go on, and rank 0 waits in the gradient
all-reduce. The job must end naming rank 1, long before the collective's timeout."""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
from torch import nn

import flowtrain
from engine_common import make_model, micro_batch

outdir = sys.argv[1]
flowtrain.init_distributed()
rank = int(os.environ["RANK"])
engine, _, _, _ = flowtrain.initialize(model=make_model(0), config={
    "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1000,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
for step in range(50):
    if step == 3 and rank == 1:
        with open(os.path.join(outdir, "fault_time"), "w") as f:
            f.write(repr(time.time()))
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()  # never returns: this rank is stuck in its own code
    x, y = micro_batch(step, rank, 0, 4)
    loss = nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
torch.save({}, os.path.join(outdir, f"done{rank}"))
