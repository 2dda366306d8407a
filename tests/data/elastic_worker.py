"""Worker for tests/launch/test_launch_elastic.py: ``elastic_worker.py OUTDIR CKPT KILL_AT STEPS``.

Trains a tiny model with a global batch of 16 samples per step (ZeRO-1; the config gives
train_batch_size and the micro batch, so accumulation follows the world size), each step's
samples fixed by the step and split by global index, so any world size sees the same global
batch; resumes from CKPT when it holds a checkpoint and saves one every 5 steps. Rank 0
appends each step's global mean loss to OUTDIR/losses.jsonl. In the first attempt, after step
KILL_AT (when >= 0), the last rank kills its node: its node launcher, the node's other ranks
and itself, as a lost host would go."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
from torch import nn

import flowtrain
from engine_common import IN_DIM, make_model, start_watchdog

GLOBAL, MICRO = 16, 4


def samples(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` (of GLOBAL // MICRO) of step ``step``'s global batch."""
    g = torch.Generator().manual_seed(7919 * step + 11)
    x = torch.randn(GLOBAL, IN_DIM, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return x[index * MICRO:(index + 1) * MICRO], y[index * MICRO:(index + 1) * MICRO]


def kill_node() -> None:
    me = psutil.Process()
    node_launcher = me.parent()
    assert node_launcher is not None
    for proc in node_launcher.children(recursive=True):
        if proc.pid != me.pid:
            proc.kill()
    node_launcher.kill()
    os.kill(me.pid, signal.SIGKILL)


def main() -> None:
    start_watchdog(150)
    torch.set_num_threads(1)
    out, ckpt, kill_at, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), \
        int(sys.argv[4])
    flowtrain.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("FLOWTRAIN_RESTART_COUNT", "0"))
    engine, _, _, _ = flowtrain.initialize(model=make_model(0), config={
        "train_batch_size": GLOBAL, "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}})
    if (ckpt / "latest").exists():
        engine.load_checkpoint(str(ckpt))
    gas = engine.gradient_accumulation_steps()
    for step in range(engine.global_steps, steps):
        total = 0.0
        for m in range(gas):
            x, y = samples(step, rank * gas + m)
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        mean = torch.tensor([total / gas])
        dist.all_reduce(mean)
        if rank == 0:
            with open(out / "losses.jsonl", "a") as f:
                f.write(json.dumps({"attempt": attempt, "step": step, "world": world,
                                    "gas": gas, "loss": mean.item() / world}) + "\n")
        if (step + 1) % 5 == 0:
            engine.save_checkpoint(str(ckpt))
        if attempt == 0 and step == kill_at and rank == world - 1:
            kill_node()
    engine.destroy()


if __name__ == "__main__":
    main()
