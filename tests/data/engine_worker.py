"""Worker for the engine end-to-end tests. Every rank writes ``<out>.rank<R>.json``.

Modes (argv[1]):
  dp OUT NAMES                comma-separated SCENARIOS: the engine and torch DDP on the same
                              model and data; custom stages (bucket_full halving, after_step)
  resume OUT CKPT PHASE [P]   PHASE full (20 steps), first (10 steps, save), second (load, 11-20);
                              P: dropout probability (0.3)
  crash OUT CKPT PHASE        single process; PHASE crash (save at 5, die mid-save at 10) or load
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flowtrain
from engine_common import dataset, flat_params, make_model, micro_batch, start_watchdog, write
from flowtrain.engine.stages import BucketFull, StepDone
from flowtrain.runtime.actor import Actor, handler

MICRO = 4
STEPS = 20
SEED = 1234
LR = 0.01


def config(*, gas: int = 1, world: int = 1, clip: float = 0.0, bucket: int | None = 64,
           optimizer: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_batch_size": MICRO * gas * world,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": optimizer or {"type": "Adam", "params": {"lr": LR}},
        "gradient_clipping": clip,
        "steps_per_print": 1000,
    }
    if bucket is not None:
        cfg["zero_optimization"] = {"stage": 0, "reduce_bucket_size": bucket}
    cfg.update(extra)
    return cfg


def rank_seed(rank: int) -> int:
    # Ranks start from different weights: the engine (and DDP) must broadcast rank 0's.
    return SEED + 1000 * rank


# -- dp -------------------------------------------------------------------------------------------


def run_engine(gas: int, clip: float, channel: str | None = None,
               steps_per_print: int = 1000) -> dict[str, Any]:
    """get_global_grad_norm is only computed when clipping or printing (as in DeepSpeed), so
    the unclipped runs print every step or clip at a threshold no gradient reaches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(rank_seed(rank))
    cfg = config(gas=gas, world=world, clip=clip, steps_per_print=steps_per_print)
    if channel is not None:
        cfg["flowtrain"] = {"data_channel": channel}
    engine, _, _, _ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                           config=cfg)
    losses, norms = [], []
    for step in range(STEPS):
        local = []
        for m in range(gas):
            x, y = micro_batch(step, rank, m, MICRO)
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            local.append(float(loss))
        losses.append(sum(local) / gas)
        norms.append(engine.get_global_grad_norm())
    out = {"losses": losses, "grad_norms": norms, "params": flat_params(model),
           "global_steps": engine.global_steps, "buckets": len(engine.buckets.flat)}
    engine.destroy()
    return out


def run_ddp(gas: int, clip: float) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model = make_model(rank_seed(rank))
    ddp = DDP(model, find_unused_parameters=True)
    opt = torch.optim.Adam(ddp.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        local = []
        for m in range(gas):
            x, y = micro_batch(step, rank, m, MICRO)
            ctx = ddp.no_sync() if m < gas - 1 else contextlib.nullcontext()
            with ctx:
                loss = nn.functional.mse_loss(ddp(x), y)
                (loss / gas).backward()
            local.append(float(loss))
        norms.append(float(torch.nn.utils.clip_grad_norm_(
            ddp.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
        losses.append(sum(local) / gas)
    return {"losses": losses, "grad_norms": norms, "params": flat_params(model)}


class Halve(Actor):
    """bucket_full stage: halves each bucket's gradient in place before it is reduced."""

    def __init__(self) -> None:
        self.calls = 0

    @handler
    async def full(self, msg: BucketFull) -> None:
        self.calls += 1
        msg.grad.mul_(0.5)

    @handler
    async def count(self, msg: HowMany) -> int:
        return self.calls


@dataclass(frozen=True)
class HowMany:
    pass


class StepCounter(Actor):
    """after_step stage: counts StepDone messages."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    @handler
    async def done(self, msg: StepDone) -> None:
        self.steps.append(msg.step)

    @handler
    async def count(self, msg: HowMany) -> list[int]:
        return list(self.steps)


def run_stage(halve: bool, gas: int = 2, steps: int = 3) -> dict[str, Any]:
    """SGD without momentum: the first step's update with the halving stage is half the update
    without it; the after_step counter sees one StepDone per optimizer step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(rank_seed(rank))
    sgd = {"type": "SGD", "params": {"lr": 0.1}}
    engine, _, _, _ = flowtrain.initialize(model=model,
                                           config=config(gas=gas, world=world, optimizer=sgd))
    before = flat_params(model)
    halver = engine.add_stage(Halve(), at="bucket_full") if halve else None
    counter = engine.add_stage(StepCounter(), at="after_step")
    after = None
    for step in range(steps):
        for m in range(gas):
            x, y = micro_batch(step, rank, m, MICRO)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()
        if after is None:
            after = flat_params(model)
    out = {"delta": {k: [a - b for a, b in zip(after[k], before[k])] for k in before},
           "step_done": counter.ask_from_thread(HowMany()), "global_steps": engine.global_steps,
           "bucket_full_calls": halver.ask_from_thread(HowMany()) if halver else None,
           "buckets": len(engine.buckets.flat)}
    engine.destroy()
    return out


SCENARIOS = {
    # one engine per process: a second engine on the same rank cannot be built (see tests)
    # gas1 reduces over the default channel (shared memory for CPU ranks of one host), gas4
    # over torch.distributed (gloo)
    "gas1": lambda: run_engine(1, 0.0, steps_per_print=1), "gas1_ddp": lambda: run_ddp(1, 0.0),
    "gas4": lambda: run_engine(4, 1e9, channel="torch"), "gas4_ddp": lambda: run_ddp(4, 0.0),
    "second_engine": lambda: run_engine(1, 0.0, channel="torch"),
    "clip": lambda: run_engine(1, 0.5), "clip_ddp": lambda: run_ddp(1, 0.5),
    "stage_off": lambda: run_stage(False), "stage_half": lambda: run_stage(True),
}


def mode_dp(out: str, names: str) -> None:
    flowtrain.init_distributed()
    result: dict[str, Any] = {}
    for name in names.split(","):
        try:
            result[name] = SCENARIOS[name]()
        except Exception:  # recorded so the other scenarios still report
            result[name] = {"error": traceback.format_exc()}
        dist.barrier()
    write(out, result)


# -- resume ---------------------------------------------------------------------------------------


def mode_resume(out: str, ckpt_dir: str, phase: str, dropout: str = "0.3") -> None:
    flowtrain.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(rank_seed(rank), dropout=float(dropout))
    cfg = config(world=world, clip=1.0, bucket=64,
                 scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0,
                                                           "warmup_max_lr": LR,
                                                           "warmup_num_steps": 8,
                                                           "warmup_type": "linear"}})
    engine, _, loader, _ = flowtrain.initialize(model=model, model_parameters=model.parameters(),
                                                training_data=dataset(), config=cfg)
    start, layout_at_load, layout_before_load = 0, None, engine.bucket_layout()
    if phase == "second":
        path, client = engine.load_checkpoint(ckpt_dir)
        start, layout_at_load = engine.global_steps, engine.bucket_layout()
        assert path is not None and client == {"note": "half"}, (path, client)
    end = 10 if phase == "first" else STEPS
    losses, lrs = {}, {}
    while engine.global_steps < end:
        for x, y in loader:
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses[engine.global_steps] = float(loss)
            lrs[engine.global_steps] = engine.get_lr()[0]
            if engine.global_steps >= end:
                break
    if phase == "first":
        engine.save_checkpoint(ckpt_dir, client_state={"note": "half"})
    write(out, {"start": start, "losses": losses, "lrs": lrs, "params": flat_params(model),
                "global_steps": engine.global_steps, "torch_rng_next": torch.rand(3).tolist(),
                "layout_before_load": layout_before_load, "layout_at_load": layout_at_load,
                "layout": engine.bucket_layout()})


# -- crash mid-save (single process) --------------------------------------------------------------


def mode_crash(out: str, ckpt_dir: str, phase: str) -> None:
    import flowtrain.checkpoint.atomic as ckpt

    model = make_model(SEED)
    engine, _, _, _ = flowtrain.initialize(model=model, config=config())

    def train(n: int) -> None:
        for _ in range(n):
            x, y = micro_batch(engine.global_steps, 0, 0, MICRO)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            engine.step()

    if phase == "crash":
        train(5)
        engine.save_checkpoint(ckpt_dir)
        write(out, {"step5_params": flat_params(model), "global_steps": engine.global_steps})
        train(5)
        original = ckpt.save_file

        def save_then_die(obj: Any, path: Path) -> None:
            original(obj, path)
            os._exit(17)  # killed after the first file of the step-10 checkpoint

        ckpt.save_file = save_then_die
        engine.save_checkpoint(ckpt_dir)
        write(out, {"error": "save_checkpoint returned; the crash did not happen"})
        return
    path, _ = engine.load_checkpoint(ckpt_dir)
    loaded = {"path": path, "params": flat_params(model), "global_steps": engine.global_steps}
    train(5)  # a later save over the leftover staging directory works
    engine.save_checkpoint(ckpt_dir)
    loaded["after_resave"] = sorted(os.listdir(ckpt_dir))
    loaded["latest_after_resave"] = Path(ckpt_dir, "latest").read_text().strip()
    write(out, loaded)


def main() -> None:
    start_watchdog(90)
    torch.set_num_threads(1)
    mode = sys.argv[1]
    if mode == "dp":
        mode_dp(sys.argv[2], sys.argv[3])
    elif mode == "resume":
        mode_resume(*sys.argv[2:6])
    elif mode == "crash":
        mode_crash(*sys.argv[2:5])
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
