"""Worker for tests/engine/test_peer_recovery.py: ZeRO-1 under ``flowtrain launch --peer-recovery``
on 2 ranks trains 3 steps, saves a checkpoint, trains 2 more and loads the checkpoint back. Each
rank writes OUT.rank<R>.json: the digests of its own optimizer shard and of its mirror of the next
rank's shard, right after the load, and its own shard's digest as saved (step 3).

argv: OUT CKPT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

import flowtrain
from peer_recovery_worker import batch, make_model, shard_digest


def main() -> None:
    out, ckpt = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    model = make_model()
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
           "gradient_clipping": 0, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, optimizer, *_ = flowtrain.initialize(model=model,
                                                 model_parameters=model.parameters(), config=cfg)

    def train(steps: int) -> None:
        for _ in range(steps):
            x, y = batch(engine.global_steps, rank)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()

    train(3)
    saved = shard_digest(engine.zero.master, optimizer)
    engine.save_checkpoint(ckpt, tag="step3")
    train(2)
    engine.load_checkpoint(ckpt, tag="step3")
    mirror = engine.zero.mirror
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"saved": saved, "own": shard_digest(engine.zero.master, optimizer),
                   "mirror": shard_digest(mirror.master, mirror.optimizer),
                   "steps": engine.global_steps,
                   "layout": list(engine._layout)}, f)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
