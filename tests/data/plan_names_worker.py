"""Worker for tests/plan/test_plan_names.py: a small model trained a few steps under one parallel
layout, launched with ``flowtrain launch --run-dir``, so the run directory holds what each rank
recorded (``spans/rank{R}.jsonl``) and planned (``plan.json``, ``stages/``).

argv: MODE, one of dp | zero3 | pipe | interleaved | tpdp
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import flowtrain
from flowtrain.pipe import LayerSpec, PipelineModule

STEPS, MICRO, WIDTH = 3, 4, 32


class Block(nn.Module):
    """An MLP block whose projections carry the names tensor parallelism splits by."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return self.head(x)


def batch(step: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + mb)
    return torch.randn(MICRO, 8, generator=g), torch.randn(MICRO, 4, generator=g)


def config(mode: str) -> dict[str, object]:
    cfg: dict[str, object] = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2,
        "steps_per_print": 1000, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        # small buckets: several reduces (and ZeRO-3 gathers) a step
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 3000}}
    if mode == "zero3":
        # every micro-batch reduce-scatters; each module's parameters gathered around its use
        cfg["zero_optimization"] = {"stage": 3, "reduce_bucket_size": 3000,
                                    "stage3_param_persistence_threshold": 0,
                                    "stage3_prefetch_bucket_size": 5000}
    if mode in ("pipe", "interleaved"):
        cfg["gradient_accumulation_steps"] = 4
    if mode == "interleaved":  # two model chunks on each of the 2 stages
        cfg["pipeline"] = {"schedule": "interleaved", "virtual_stages": 2}
    if mode == "tpdp":
        cfg["tensor_parallel"] = {"tp_size": 2}
    return cfg


def main() -> None:
    mode = sys.argv[1]
    torch.manual_seed(0)
    flowtrain.init_distributed()
    cfg = config(mode)
    if mode in ("pipe", "interleaved"):
        layers = [LayerSpec(nn.Linear, 8, WIDTH), nn.ReLU(), LayerSpec(nn.Linear, WIDTH, WIDTH),
                  nn.ReLU(), LayerSpec(nn.Linear, WIDTH, WIDTH), LayerSpec(nn.Linear, WIDTH, 4)]
        module = PipelineModule(layers, num_stages=2, loss_fn=nn.functional.mse_loss,
                                partition_method="uniform")
        engine, *_ = flowtrain.initialize(model=module, config=cfg)
        for step in range(STEPS):
            engine.train_batch(iter([batch(step, m) for m in range(4)]))
        engine.destroy()
        return
    model = Net()
    engine, *_ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                      config=cfg)
    for step in range(STEPS):
        for m in range(engine.gradient_accumulation_steps()):
            x, y = batch(step, m)
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
    engine.destroy()


if __name__ == "__main__":
    main()
