"""A custom stage: an actor wired between "bucket full" and "reduce" that clips each rank's
local gradient buckets to a norm before they are averaged, and one after the step that reports
what it did. Run on 2 ranks:

    flowtrain launch --nproc-per-node 2 examples/custom_stage.py
"""

from __future__ import annotations

import torch

import flowtrain
from flowtrain.actors import Actor, handler
from flowtrain.engine.stages import BucketFull, StepDone


class LocalBucketClip(Actor):
    """Scales a bucket down when its local norm exceeds ``max_norm``: one rank's outlier batch
    cannot dominate the average. Runs on the rank's event loop, in the reducer's path."""

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm
        self.clipped = 0
        self.seen = 0

    @handler
    async def bucket_full(self, msg: BucketFull) -> None:
        self.seen += 1
        norm = float(msg.grad.norm())
        if norm > self.max_norm:
            msg.grad.mul_(self.max_norm / norm)
            self.clipped += 1


class StepReporter(Actor):
    def __init__(self, clip: LocalBucketClip, rank: int) -> None:
        self.clip = clip
        self.rank = rank

    @handler
    async def step_done(self, msg: StepDone) -> None:
        if msg.step % 10 == 0:
            print(f"rank {self.rank} step {msg.step}: loss {msg.loss:.4f}, buckets clipped "
                  f"locally {self.clip.clipped}/{self.clip.seen}", flush=True)


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    config = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "steps_per_print": 1000,
              "zero_optimization": {"reduce_bucket_size": 1024}}
    engine, *_ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=config)
    clip = LocalBucketClip(max_norm=0.5)
    engine.add_stage(clip, at="bucket_full", name="local-bucket-clip")
    engine.add_stage(StepReporter(clip, engine.global_rank), at="after_step", name="reporter")
    g = torch.Generator().manual_seed(engine.global_rank)
    target = torch.nn.Linear(32, 1)
    for _ in range(30):
        x = torch.randn(16, 32, generator=g)
        y = target(x).detach() + 0.1 * torch.randn(16, 1, generator=g)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()


if __name__ == "__main__":
    main()
