"""Worker for tests/launch/test_launch_restarts.py: trains a small model on data keyed by the step,
saving a checkpoint every CKPT_EVERY steps and loading the latest one at start (as a DeepSpeed
script does), and writes each step's loss. With KILL_AT set, rank 1 of the first attempt
(TORCHELASTIC_RESTART_COUNT 0) SIGKILLs itself after that step.

argv: OUT CKPT_DIR STEPS KILL_AT (0: never)
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

CKPT_EVERY = 5


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def main() -> None:
    out, ckpt, steps, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    flowtrain.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, *_ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    if (Path(ckpt) / "latest").exists():
        engine.load_checkpoint(ckpt)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    losses = {}
    while engine.global_steps < steps:
        x, y = batch(engine.global_steps, rank)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses[engine.global_steps] = float(loss)
        if engine.global_steps % CKPT_EVERY == 0:
            engine.save_checkpoint(ckpt)
        if kill_at and attempt == 0 and rank == 1 and engine.global_steps == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
    Path(f"{out}.attempt{attempt}.rank{rank}").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
