"""Worker for tests/checkpoint/test_zero_checkpoint.py: checkpoints saved on one world size and ZeRO
stage and loaded into another. Every rank writes ``<out>.rank<R>.json`` (per case: the global loss
of each step, the lr, counters, or the error); rank 0 also writes ``<out>.pt`` (per case: fp32
parameter values, from the engine's own memory, to compare with consolidated checkpoints).

The global batch is 8 samples of a 40-sample dataset whatever the world size (micro-batch
8 / N), read through the engine's dataloader, so every world size trains on the same samples
in the same steps and the loss curves agree to fp32 rounding.

Phases (argv[1]; argv[2] OUT, argv[3] CKPT, the directory all phases' checkpoints live in;
the 1-rank ones may run inside the test process through ``run_phase``):
  one_a  1 rank   the reference: stage 0, 8 steps, saving w1_s0 at step 4
  four   4 ranks  stage 2 (and 3) save at step 4; w1_s0 into stage 1 (and 3) (1 -> 4)
  two    2 ranks  w4_s2 into stage 0 (4 -> 2, 2 -> 0), w1_s0 into stage 1 (1 -> 2, 0 -> 1),
                  w4_s2 into bf16 stage 2 and into stage 1 accumulating 2 micro-batches
                  of 2 (the dataloader position maps from 4 to 8 batches); with stage 3:
                  w4_s3 into stage 1, w4_s2 into stage 3, custom_load_fn at stage 3;
                  stage 1 fp32 and bf16 save
  one_b  1 rank   w2_s1 into stage 2 (2 -> 1, 1 -> 2), w4_s2 / w4_s3 / w2_s1_bf16 into stage 0,
                  w4_s2 into fp16 stage 0;
                  load_module_only, custom_load_fn, entries that do not match
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flowtrain
from engine_common import IN_DIM, start_watchdog, write
from flowtrain.config.support import SUPPORTED_FEATURES

GLOBAL_BATCH, HALF, STEPS, SEED, LR, BUCKET = 8, 4, 8, 2024, 0.02, 37
STAGE3 = "zero_stage_3" in SUPPORTED_FEATURES
TRAINABLE = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "head.weight", "head.bias"]
WHOLE = ["shift", "frozen.weight", "frozen.bias"]  # a buffer and a frozen layer


class ReshardNet(nn.Module):
    """197 trainable parameters in odd sizes (bucket shards cut through parameters), a frozen
    layer and a buffer (saved whole, from rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(IN_DIM, 6)
        self.frozen.requires_grad_(False)
        self.fc1 = nn.Linear(6, 13)
        self.fc2 = nn.Linear(13, 7)
        self.head = nn.Linear(7, 1)
        self.register_buffer("shift", 0.1 * torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(x) + self.shift)
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(h)))))


def make_model(seed: int) -> ReshardNet:
    torch.manual_seed(seed)
    return ReshardNet()


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, IN_DIM, generator=g)
    return torch.utils.data.TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))


def config(stage: int, precision: str = "fp32", gas: int = 1) -> dict[str, Any]:
    world = dist.get_world_size()
    cfg: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world // gas,
        "gradient_accumulation_steps": gas, "gradient_clipping": 1.0, "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.002, "warmup_max_lr": LR,
                                                     "warmup_num_steps": 6,
                                                     "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET},
    }
    if stage == 3:  # the weights and fc1.bias partitioned, the two small biases kept whole
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 10
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":  # a dynamic scale small enough never to overflow here
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def build(stage: int, precision: str = "fp32", seed: int = SEED,
          change: Callable[[ReshardNet], None] | None = None, gas: int = 1) -> Any:
    # ranks start from different weights: the engine broadcasts rank 0's
    model = make_model(seed + 1000 * dist.get_rank())
    if change is not None:
        change(model)
    engine, _, loader, _ = flowtrain.initialize(model=model, training_data=dataset(),
                                                config=config(stage, precision, gas))
    return engine, loader


def train(engine: Any, loader: Any, until: int) -> tuple[dict[int, float], dict[int, float]]:
    """Global loss (mean over ranks and micro-batches) and lr of every step up to ``until``."""
    dtype = next(p for p in engine.module.parameters()).dtype
    world = dist.get_world_size()
    losses, lrs = {}, {}
    window: list[torch.Tensor] = []
    while engine.global_steps < until:
        for x, y in loader:
            lr, before = engine.get_lr()[0], engine.global_steps
            loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            engine.step()
            window.append(loss.detach().float())
            if engine.global_steps == before:
                continue  # inside the accumulation window
            total = torch.stack(window).mean()
            window.clear()
            if world > 1:
                dist.all_reduce(total)
            losses[engine.global_steps] = float(total) / world
            lrs[engine.global_steps] = lr
            if engine.global_steps >= until:
                break
    return losses, lrs


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 value as this engine holds it (the master weights when
    there are any), gathered from the ranks' shards without flowtrain's checkpoint code."""
    if engine.zero is None:
        source = engine.master.master if engine.master is not None else engine.trainable
        return {n: p.detach().float().clone() for n, p in zip(engine.param_names, source)}
    zero = engine.zero
    plan = getattr(zero, "plan", None) or zero.buckets.plan
    mine = [(s.start, m.detach().float().cpu().clone()) for s, m in zip(zero.shards, zero.master)]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {}
    for b, bucket in enumerate(plan):
        flat = torch.zeros(max(start + t.numel() for start, t in (r[b] for r in everyone)))
        for rank in everyone:
            start, values = rank[b]
            flat[start:start + values.numel()] = values
        for slot in bucket.slots:
            out[engine.param_names[slot.index]] = flat[slot.offset:slot.offset + slot.numel].view(
                slot.shape).clone()
    return out


def module_params(engine: Any) -> dict[str, torch.Tensor]:
    """The module's own parameters and buffers (model dtype, as float)."""
    return {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}


# -- cases -----------------------------------------------------------------------------------------


def saving(name: str, stage: int, precision: str = "fp32") -> Callable[[str], dict[str, Any]]:
    """Trains to step 4, saves ``<CKPT>/<name>``, continues to step 8 uninterrupted."""

    def run(ckpt: str) -> dict[str, Any]:
        engine, loader = build(stage, precision)
        first, lrs = train(engine, loader, HALF)
        engine.save_checkpoint(os.path.join(ckpt, name), client_state={"saved_by": name})
        tensors = {"at_save": full_params(engine), "module_at_save": module_params(engine)}
        rest, more = train(engine, loader, STEPS)
        engine.destroy()
        return {"losses": {**first, **rest}, "lrs": {**lrs, **more}, "tensors": tensors}

    return run


def resuming(name: str, stage: int, precision: str = "fp32",
             gas: int = 1) -> Callable[[str], dict[str, Any]]:
    """A fresh engine (other initial weights) loads ``<CKPT>/<name>`` and trains steps 5-8."""

    def run(ckpt: str) -> dict[str, Any]:
        engine, loader = build(stage, precision, seed=SEED + 77, gas=gas)
        path, client = engine.load_checkpoint(os.path.join(ckpt, name))
        assert client == {"saved_by": name}, client
        steps = sorted({float(s["step"]) for s in engine.optimizer.state.values() if "step" in s})
        tensors = {"loaded": full_params(engine), "module_loaded": module_params(engine)}
        start, samples, micro = engine.global_steps, engine.global_samples, engine.micro_steps
        scale, taken = engine.loss_scale, loader.batches_taken
        losses, lrs = train(engine, loader, STEPS)
        engine.destroy()
        return {"losses": losses, "lrs": lrs, "start": start, "global_samples": samples,
                "optimizer_steps": steps, "loss_scale": scale, "micro_steps": micro,
                "batches_taken": taken,
                "tensors": tensors}

    return run


def module_only(ckpt: str) -> dict[str, Any]:
    """load_module_only: the weights, nothing of the optimizer or the counters."""
    engine, _ = build(1, seed=SEED + 77)
    engine.load_checkpoint(os.path.join(ckpt, "w4_s2"), load_module_only=True)
    out = {"global_steps": engine.global_steps, "optimizer_state": len(engine.optimizer.state),
           "tensors": {"loaded": full_params(engine)}}
    engine.destroy()
    return out


def custom_load(stage: int) -> Callable[[str], dict[str, Any]]:
    """custom_load_fn gets the whole fp32 state dict and the module; the optimizer loads too."""
    return lambda ckpt: _custom_load(ckpt, stage)


def _custom_load(ckpt: str, stage: int) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def load_fn(src: dict[str, torch.Tensor], dst: nn.Module) -> None:
        seen["keys"] = list(src)
        dst.load_state_dict(src)

    engine, _ = build(stage, seed=SEED + 77)
    engine.load_checkpoint(os.path.join(ckpt, "w4_s2"), custom_load_fn=load_fn)
    steps = sorted({float(s["step"]) for s in engine.optimizer.state.values()})
    out = {"keys": seen["keys"], "global_steps": engine.global_steps, "optimizer_steps": steps,
           "tensors": {"loaded": full_params(engine)}}
    engine.destroy()
    return out


def mismatches(ckpt: str) -> dict[str, Any]:
    """A layer of another size fails whatever ``load_module_strict``; an entry the checkpoint
    lacks fails when strict and is skipped otherwise."""
    out: dict[str, Any] = {}
    path = os.path.join(ckpt, "w4_s2")

    def wider_head(model: ReshardNet) -> None:
        model.head = nn.Linear(7, 2)

    def extra_buffer(model: ReshardNet) -> None:
        model.register_buffer("extra", torch.full((2,), 3.0))

    for name, change, strict in (("size", wider_head, False), ("strict", extra_buffer, True),
                                 ("lenient", extra_buffer, False)):
        engine, _ = build(2, seed=SEED + 77, change=change)
        try:
            engine.load_checkpoint(path, load_module_strict=strict)
            out[name] = None
        except RuntimeError as exc:
            out[name] = str(exc)
        if name == "lenient":
            out["extra"] = engine.module.extra.tolist()
            out["tensors"] = {"loaded": full_params(engine)}
        engine.destroy()
    return out


PHASES: dict[str, dict[str, Callable[[str], dict[str, Any]]]] = {
    "one_a": {"reference": saving("w1_s0", 0)},
    "four": {"save_s2": saving("w4_s2", 2), "save_s3": saving("w4_s3", 3),
             "w1_s0->s1": resuming("w1_s0", 1), "w1_s0->s3": resuming("w1_s0", 3)},
    "two": {"w4_s2->s0": resuming("w4_s2", 0), "w1_s0->s1": resuming("w1_s0", 1),
            "w4_s3->s1": resuming("w4_s3", 1), "w4_s2->s3": resuming("w4_s2", 3),
            "w4_s2->s2_bf16": resuming("w4_s2", 2, "bf16"),
            "w4_s2->s1_gas2": resuming("w4_s2", 1, gas=2),
            "custom_load_fn_s3": custom_load(3),
            "save_s1": saving("w2_s1", 1), "save_s1_bf16": saving("w2_s1_bf16", 1, "bf16")},
    "one_b": {"w2_s1->s2": resuming("w2_s1", 2), "w4_s2->s0": resuming("w4_s2", 0),
              "w4_s3->s0": resuming("w4_s3", 0), "w2_s1_bf16->s0": resuming("w2_s1_bf16", 0),
              "w4_s2->s0_fp16": resuming("w4_s2", 0, "fp16"),
              "module_only": module_only, "custom_load_fn": custom_load(1),
              "mismatches": mismatches},
}


def run_phase(phase: str, ckpt: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this rank's results by case, in JSON's types; the tensors by case). The 1-rank phases
    also run inside the test process (tests/checkpoint/test_zero_checkpoint.py), which spares a
    launch."""
    flowtrain.init_distributed()
    results: dict[str, Any] = {}
    tensors: dict[str, Any] = {}
    for case, run in PHASES[phase].items():
        if "s3" in case and not STAGE3:
            continue  # ZeRO stage 3 has not landed: the test skips these cases
        try:
            result = run(ckpt)
            tensors[case] = result.pop("tensors")
            results[case] = result
        except Exception:  # recorded so the other cases still report
            results[case] = {"error": traceback.format_exc()}
        dist.barrier()
    return json.loads(json.dumps(results)), tensors


def main() -> None:
    start_watchdog(90)
    torch.set_num_threads(1)
    phase, out, ckpt = sys.argv[1:4]
    results, tensors = run_phase(phase, ckpt)
    write(out, results)
    if dist.get_rank() == 0:
        torch.save(tensors, f"{out}.pt")


if __name__ == "__main__":
    main()
