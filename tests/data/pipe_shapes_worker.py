"""Worker for tests/pipe/test_pipeline.py: a 2-stage pipeline whose micro-batches change size
between micro-batches, between steps and between train_batch and eval_batch (the stages'
messages change shape), against single-process training on the same micro-batches.

argv: OUT — every rank writes ``<OUT>.rank<R>.json``.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flowtrain
from engine_common import micro_batch, write
from flowtrain.pipe import PipelineModule
from pipe_worker import layers

LR = 0.01
# each entry: ("train" | "eval", rows of each of the 4 micro-batches)
PLAN = [("train", (4, 4, 3, 4)), ("eval", (6, 6, 2, 6)), ("train", (2, 5, 5, 1)),
        ("train", (4, 4, 4, 4)), ("eval", (4, 4, 4, 4)), ("train", (3, 3, 3, 3))]


def batches(i: int, rows: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [micro_batch(i, 0, m, size) for m, size in enumerate(rows)]


def reference() -> list[float]:
    model = nn.Sequential(*layers())
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    out = []
    for i, (kind, rows) in enumerate(PLAN):
        data = batches(i, rows)
        if kind == "eval":
            with torch.no_grad():
                out.append(sum(float(nn.functional.mse_loss(model(x), y)) for x, y in data)
                           / len(data))
            continue
        opt.zero_grad()
        losses = []
        for x, y in data:
            loss = nn.functional.mse_loss(model(x), y)
            (loss / len(data)).backward()
            losses.append(float(loss.detach()))
        opt.step()
        out.append(sum(losses) / len(losses))
    return out


def run(schedule: str) -> list[float]:
    module = PipelineModule(layers(), num_stages=2, loss_fn=nn.functional.mse_loss,
                            partition_method="parameters")
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
           "steps_per_print": 1000, "optimizer": {"type": "Adam", "params": {"lr": LR}},
           "pipeline": {"schedule": schedule}}
    engine, _, _, _ = flowtrain.initialize(model=module, config=cfg)
    out = []
    for i, (kind, rows) in enumerate(PLAN):
        data = iter(batches(i, rows))
        step = engine.train_batch if kind == "train" else engine.eval_batch
        out.append(float(step(data)))
    engine.destroy()
    return out


def main() -> None:
    torch.set_num_threads(1)
    out = sys.argv[1]
    flowtrain.init_distributed()
    result: dict[str, Any] = {"reference": reference()}
    for schedule in ("1f1b", "gpipe"):
        try:
            result[schedule] = run(schedule)
        except Exception:
            result[schedule] = {"error": traceback.format_exc()}
        dist.barrier()
    write(out, result)


if __name__ == "__main__":
    main()
