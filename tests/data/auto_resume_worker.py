"""Worker for tests/checkpoint/test_auto_resume.py: a script that never calls load_checkpoint; its
config's checkpoint.auto_resume resumes it. It trains a small model on data keyed by the step,
saves every CKPT_EVERY steps into checkpoint.save_dir, and writes each step's loss. With KILL_AT
set, rank 1 of the first attempt (TORCHELASTIC_RESTART_COUNT 0) SIGKILLs itself after that
step, before that step's checkpoint.

argv: OUT CKPT_DIR STEPS KILL_AT (0: never) ASYNC (1: checkpoint.async_save)
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import flowtrain
from restart_worker import batch  # the same data as the restart test's

CKPT_EVERY = 10


def main() -> None:
    out, ckpt, steps, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    async_save = sys.argv[5] == "1"
    flowtrain.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 50}},
           "checkpoint": {"save_dir": ckpt, "auto_resume": True, "async_save": async_save}}
    engine, *_ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    losses = {}
    while engine.global_steps < steps:
        x, y = batch(engine.global_steps, rank)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses[engine.global_steps] = float(loss)
        if kill_at and attempt == 0 and rank == 1 and engine.global_steps == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if engine.global_steps % CKPT_EVERY == 0:
            engine.save_checkpoint()
    engine.destroy()
    record = {"losses": losses, "resumed": engine.resumed_checkpoint,
              "client_state": engine.resumed_client_state}
    Path(f"{out}.attempt{attempt}.rank{rank}").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
