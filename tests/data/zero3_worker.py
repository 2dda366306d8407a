"""Worker for tests/zero/test_zero3.py: ZeRO stages 1-3, with and without CPU offload, against
stage 0 on the same ranks; and model-state bytes per rank for the ZeRO paper's formulas.
Every rank writes ``<out>.rank<R>.json``.

Modes (argv[1]):
  compare OUT    fp32, 20 steps of 2 micro-batches: stage 0; 1, 2, 3 without and with
                 offload (stage 3 offloads parameters too); losses, final whole parameters,
                 and how stage 3 gathered
  all OUT        both of the above, in one launch
  memory OUT     fp32 and bf16 on a wider model (stage3_param_persistence_threshold 0):
                 memory_breakdown after 2 steps of stages 1, 2, 3
"""

from __future__ import annotations

import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

import flowtrain
from engine_common import IN_DIM, micro_batch, start_watchdog, write

MICRO, GAS, STEPS, SEED, LR, CLIP = 4, 2, 20, 97, 0.01, 0.5


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


class DeepNet(nn.Module):
    """Nested modules, one block run twice per forward (a module reused), one block under
    activation checkpointing (recomputed in backward), an unused layer."""

    def __init__(self, width: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_DIM, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.unused = nn.Linear(3, 3)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = self.blocks[0](h)
        h = torch.utils.checkpoint.checkpoint(self.blocks[1], h, use_reentrant=False)
        for block in self.blocks[2:]:
            h = block(block(h))
        return self.head(h)


def make_model(rank: int, width: int = 16) -> DeepNet:
    torch.manual_seed(SEED + 1000 * rank)  # ranks differ: the engine broadcasts rank 0's
    return DeepNet(width)


def config(stage: int, offload: bool, precision: str = "fp32", **zero: Any) -> dict[str, Any]:
    world = dist.get_world_size()
    z: dict[str, Any] = {"stage": stage, "reduce_bucket_size": 60}
    if stage == 3:
        z.update(stage3_param_persistence_threshold=20, stage3_prefetch_bucket_size=600,
                 stage3_max_reuse_distance=0)
    if offload:
        z["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            z["offload_param"] = {"device": "cpu"}
    z.update(zero)
    cfg: dict[str, Any] = {
        "train_batch_size": MICRO * GAS * world, "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "steps_per_print": 1000, "zero_optimization": z}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(engine: Any, steps: int) -> list[float]:
    rank = dist.get_rank()
    dtype = next(p for p in engine.module.parameters()).dtype
    losses = []
    for step in range(steps):
        local = []
        for m in range(GAS):
            x, y = micro_batch(step, rank, m, MICRO)
            loss = nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
            engine.backward(loss)
            engine.step()
            local.append(float(loss.detach()))
        losses.append(sum(local) / GAS)
    return losses


def run(stage: int, offload: bool, shared: bool = True) -> dict[str, Any]:
    model = make_model(dist.get_rank())
    cfg = config(stage, offload)
    cfg["flowtrain"] = {"zero_shared_params": shared}
    engine, _, _, _ = flowtrain.initialize(model=model, config=cfg)
    losses = train(engine, STEPS)
    out: dict[str, Any] = {"losses": losses}
    if engine.zero is not None:
        # the parameters in the host's shared memory (flowtrain.zero_shared_params)
        out["shared"] = engine.zero.param_channel is not None
    if engine.stage3 is not None:
        # between steps, partitioned parameters are empty placeholders on every rank
        out["released"] = sorted(n for n, p in model.named_parameters() if p.numel() == 0)
        out["gathered_numel"] = engine.stage3.fetcher_actor.gathered_numel
        out["trace_len"] = len(engine.stage3.trace or [])
    out["params"] = {k: v.flatten().tolist() for k, v in engine.module_state_dict().items()}
    out["memory"] = engine.memory_breakdown()
    engine.destroy()
    return out


def mode_compare(out: str | None) -> dict[str, Any]:
    flowtrain.init_distributed()
    result: dict[str, Any] = {}
    # "_own": each rank its own copy of the parameters, all-gathered after the step (and at
    # stage 3 gathered for each use), as across hosts, instead of the host's shared copy;
    # s3_own last, so its spans are the run's last engine's
    for stage, offload, shared in ((0, False, True), (1, False, True), (1, True, True),
                                   (2, False, True), (2, True, True), (3, False, True),
                                   (3, True, True), (2, False, False), (3, False, False)):
        name = f"s{stage}" + ("_offload" if offload else "") + ("" if shared else "_own")
        try:
            result[name] = run(stage, offload, shared)
        except Exception:
            result[name] = {"error": traceback.format_exc()}
        dist.barrier()
    if out is not None:
        write(out, result)
    return result


def mode_memory(out: str | None) -> dict[str, Any]:
    flowtrain.init_distributed()
    result: dict[str, Any] = {}
    for precision in ("fp32", "bf16"):
        for stage in (1, 2, 3):
            name = f"{precision}_s{stage}"
            try:
                model = make_model(dist.get_rank(), width=64)
                cfg = config(stage, False, precision, reduce_bucket_size=2000,
                             **({"stage3_param_persistence_threshold": 0} if stage == 3 else {}))
                engine, _, _, _ = flowtrain.initialize(model=model, config=cfg)
                train(engine, 2)
                psi = sum(b.numel for b in engine.plan.buckets)  # stage 3 params are empty
                result[name] = {"memory": engine.memory_breakdown(), "psi": psi}
                engine.destroy()
            except Exception:
                result[name] = {"error": traceback.format_exc()}
            dist.barrier()
    if out is not None:
        write(out, result)
    return result


def main() -> None:
    start_watchdog(150)
    torch.set_num_threads(1)
    mode = sys.argv[1]
    if mode == "compare":
        mode_compare(sys.argv[2])
    elif mode == "memory":
        mode_memory(sys.argv[2])
    elif mode == "all":  # one launch for both (rank start-up is the slow part)
        write(sys.argv[2], {**mode_compare(None), **mode_memory(None)})
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
