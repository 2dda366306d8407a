"""Worker for tests/checkpoint/test_async_checkpoint.py: 2 ranks under ZeRO stage STAGE (each rank
holds pieces of the parameters and optimizer state, saved as sharded tensors). After 3 steps, and
again after 5, every rank saves synchronously into SYNC_DIR and then asynchronously into ASYNC_DIR;
each async write waits until 2 more steps have changed every shard, so it must come from the host
copies. The second async save refills the first one's host buffers and reuses their sharded-tensor
descriptions, so it shows that what is reused holds the new values.

argv: SYNC_DIR ASYNC_DIR STAGE
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import torch
from torch import nn

import flowtrain
import flowtrain.checkpoint.save as dcp_save
from flowtrain.checkpoint import save_engine


def main() -> None:
    sync_dir, async_dir, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
    flowtrain.init_distributed()
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 37), nn.GELU(), nn.Linear(37, 5))  # odd sizes
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 100},
           "checkpoint": {"save_dir": async_dir, "async_save": True}}
    engine, *_ = flowtrain.initialize(model=model, config=cfg)

    def train(steps: int) -> None:
        for _ in range(steps):
            g = torch.Generator().manual_seed(100 * engine.global_steps + rank)
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 5, generator=g)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()

    real_write = dcp_save.write
    train(3)
    for steps_after in (2, 1):
        save_engine(engine, sync_dir)
        trained_on = threading.Event()

        def write_later(*args: Any, trained_on: threading.Event = trained_on) -> None:
            if not trained_on.wait(60):
                raise RuntimeError("save_checkpoint did not return before its write")
            real_write(*args)

        dcp_save.write = write_later
        engine.save_checkpoint()
        train(steps_after)
        trained_on.set()
        engine.wait_for_checkpoint()
    engine.destroy()


if __name__ == "__main__":
    main()
