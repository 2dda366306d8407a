"""The model and configs of the training-spec grid (tests/plan/test_spec_grid.py): a small
token model that the engine trains and ``flowtrain simulate --model spec_grid_model:factory``
traces, and the ds_config of each point of the grid, named by ``key``."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from plan_names_worker import Block  # an MLP block named as tensor parallelism splits

VOCAB, WIDTH, SEQ, MICRO = 64, 16, 8, 2
# small buckets: several reduces (and ZeRO-3 gathers) a step; both executors read this size
BUCKET = 1500


class TokenNet(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block(WIDTH) for _ in range(depth))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def factory() -> TokenNet:
    return TokenNet()


def batch(step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + mb)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


# one point of the grid: ZeRO stage, zero_optimization.reduce_scatter, gradient accumulation
# steps, overlap_comm, optimizer offload to the CPU
Point = tuple[int, bool, int, bool, bool]
GRID: list[Point] = [p for p in itertools.product((0, 1, 2, 3), (True, False), (1, 2),
                                                  (True, False), (False, True))
                     if not (p[0] == 0 and p[4])]  # offload needs ZeRO


def key(point: Point) -> str:
    stage, scatter, accumulation, overlap, offload = point
    return (f"z{stage}-rs{int(scatter)}-a{accumulation}-ov{int(overlap)}"
            f"-off{int(offload)}")


def point_of(text: str) -> Point:
    for point in GRID:
        if key(point) == text:
            return point
    raise ValueError(f"no grid point {text!r}")


def config(point: Point) -> dict[str, Any]:
    stage, scatter, accumulation, overlap, offload = point
    zero: dict[str, Any] = {"stage": stage, "reduce_scatter": scatter,
                            "overlap_comm": overlap, "reduce_bucket_size": BUCKET}
    if stage:
        zero["allgather_bucket_size"] = BUCKET
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=3000)
    return {"train_micro_batch_size_per_gpu": MICRO,
            "gradient_accumulation_steps": accumulation, "steps_per_print": 1000,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "zero_optimization": zero}
