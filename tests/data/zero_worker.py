"""Worker for tests/zero/test_zero.py: ZeRO stages 1 and 2 against stage 0 on the same ranks.
Every rank writes ``<out>.rank<R>.json``.

Modes (argv[1]):
  compare OUT CHANNEL   for fp32, bf16 and fp16: stage 0, 1, 2 engines one after another
                        (CHANNEL shm or torch); losses, grad norms, params, memory_breakdown
  resume OUT CKPT       save at step 5, continue to 10; a fresh engine loads and runs 6..10
                        (stage 1 fp32 and stage 2 bf16); and one of the other stage
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flowtrain
from engine_common import IN_DIM, flat_params, micro_batch, start_watchdog, write

MICRO, GAS, STEPS, SEED, LR, CLIP = 4, 2, 10, 4321, 0.01, 0.3
BUCKET = 37  # buckets of 19, 135, 15, 120 and 4 elements: odd sizes, so shards are padded


class OddNet(nn.Module):
    """293 parameters; ``unused`` takes no part in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN_DIM, 15)
        self.fc2 = nn.Linear(15, 9)
        self.unused = nn.Linear(3, 1)
        self.head = nn.Linear(9, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def make_model(rank: int) -> OddNet:
    torch.manual_seed(SEED + 1000 * rank)  # ranks differ: the engine broadcasts rank 0's
    return OddNet()


def config(stage: int, precision: str, channel: str, **extra: Any) -> dict[str, Any]:
    world = dist.get_world_size()
    # fp16 with one micro-batch per step: stages 2-3 reduce every micro-batch, so with
    # accumulation their fp16 sums (and so the overflowing steps) differ from stage 0's
    gas = 1 if precision == "fp16" else GAS
    cfg: dict[str, Any] = {
        "train_batch_size": MICRO * gas * world, "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas, "gradient_clipping": CLIP,
        "optimizer": {"type": "Adam", "params": {"lr": LR}}, "steps_per_print": 1000,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET},
        "flowtrain": {"data_channel": channel},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        # 2**20 overflows the first steps: every stage must skip the same steps
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 20, "hysteresis": 1}
    cfg.update(extra)
    return cfg


def train(engine: Any, start: int, end: int) -> tuple[list[float], list[float | None]]:
    rank = dist.get_rank()
    dtype = next(engine.module.parameters()).dtype
    losses, norms = [], []
    gas = engine.gradient_accumulation_steps()
    for step in range(start, end):
        local = []
        for m in range(gas):
            x, y = micro_batch(step, rank, m, MICRO)
            loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            engine.step()
            local.append(float(loss.detach()))
        losses.append(sum(local) / gas)
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def run(stage: int, precision: str, channel: str) -> dict[str, Any]:
    model = make_model(dist.get_rank())
    engine, _, _, _ = flowtrain.initialize(model=model, config=config(stage, precision, channel))
    losses, norms = train(engine, 0, STEPS)
    out = {"losses": losses, "norms": norms, "params": flat_params(model),
           "buckets": engine.buckets.numels,
           "memory": engine.memory_breakdown(), "skipped": engine.skipped_steps,
           "loss_scale": engine.loss_scale}
    engine.destroy()
    return out


def mode_compare(out: str, channel: str) -> None:
    flowtrain.init_distributed()
    result: dict[str, Any] = {}
    for precision in ("fp32", "bf16", "fp16"):
        for stage in (0, 1, 2):
            if precision == "fp16" and stage == 1:
                continue
            name = f"{precision}_s{stage}"
            try:
                result[name] = run(stage, precision, channel)
            except Exception:
                result[name] = {"error": traceback.format_exc()}
            dist.barrier()
    write(out, result)


def resume_case(stage: int, precision: str, channel: str, ckpt: str) -> dict[str, Any]:
    rank = dist.get_rank()
    model = make_model(rank)
    engine, _, _, _ = flowtrain.initialize(model=model, config=config(stage, precision, channel))
    first, _ = train(engine, 0, 5)
    engine.save_checkpoint(ckpt, client_state={"stage": stage})
    straight, _ = train(engine, 5, STEPS)
    final = flat_params(model)
    engine.destroy()

    model = make_model(rank + 7)  # different weights: the load must replace them
    engine, _, _, _ = flowtrain.initialize(model=model, config=config(stage, precision, channel))
    path, client = engine.load_checkpoint(ckpt)
    assert client == {"stage": stage}, client
    resumed, _ = train(engine, 5, STEPS)
    out = {"straight": straight, "resumed": resumed, "global_steps": engine.global_steps,
           "params_equal": flat_params(model) == final}
    engine.destroy()

    # the same checkpoint into the other stage continues the same curve (it reshards)
    other = 1 if stage == 2 else 2
    model = make_model(rank + 7)
    engine, _, _, _ = flowtrain.initialize(model=model, config=config(other, precision, channel))
    engine.load_checkpoint(ckpt)
    out["other_stage"], _ = train(engine, 5, STEPS)
    engine.destroy()
    return out


def mode_resume(out: str, ckpt: str) -> None:
    flowtrain.init_distributed()
    result: dict[str, Any] = {}
    for stage, precision, channel in ((1, "fp32", "shm"), (2, "bf16", "torch")):
        name = f"s{stage}_{precision}"
        try:
            result[name] = resume_case(stage, precision, channel, os.path.join(ckpt, name))
        except Exception:
            result[name] = {"error": traceback.format_exc()}
        dist.barrier()
    write(out, result)


def main() -> None:
    start_watchdog(90)
    torch.set_num_threads(1)
    mode = sys.argv[1]
    if mode == "compare":
        mode_compare(sys.argv[2], sys.argv[3])
    elif mode == "resume":
        mode_resume(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
