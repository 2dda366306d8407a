"""Worker for tests/zero/test_zero_init.py: a model built under ``flowtrain.zero.Init`` (DeepSpeed's
``zero.Init``), partitioned at construction, trained against the same model built whole.
Every rank writes ``<out>.rank<R>.json``.

Each rank seeds its own generator (rank 0's seed is the reference's), so the ranks build
different weights: Init must take rank 0's values. Cases:
  built        what Init left on each parameter: its slice's size, the bytes the parameter's
               own storage holds, and the whole values gathered back (against rank 0's)
  gathered     GatheredParameters(modifier_rank=1) on a partitioned weight before initialize:
               every rank's slice takes rank 1's edit
  s3, s3_bf16  stage 3 from the Init model against stage 3 from the whole model (the same
               edit made to it): losses and final parameters
  s1           stage 1 from an Init model (its parameters made whole first) against the same
  not_stage3   a config with stage 2 given to Init leaves the parameters whole
"""

from __future__ import annotations

import math
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

import flowtrain
from engine_common import start_watchdog, write
from zero3_worker import SEED, DeepNet, config, train

EDIT = 0.25


def build(init: bool, stage_config: dict[str, Any] | None = None) -> DeepNet:
    torch.manual_seed(SEED + 1000 * dist.get_rank())
    if not init:
        torch.manual_seed(SEED)  # rank 0's weights, whole, on every rank
        return DeepNet()
    with flowtrain.zero.Init(config_dict_or_path=stage_config or {"zero_optimization":
                                                                   {"stage": 3}}):
        return DeepNet()


def edit(model: DeepNet, init: bool) -> None:
    weight = model.blocks[0].fc.weight
    if init:
        with flowtrain.zero.GatheredParameters(weight, modifier_rank=1):
            if dist.get_rank() == 1:
                with torch.no_grad():
                    weight.fill_(EDIT)
    else:
        with torch.no_grad():
            weight.fill_(EDIT)


def case_built() -> dict[str, Any]:
    model = build(True)
    world = dist.get_world_size()
    out: dict[str, Any] = {"params": {}}
    for name, p in model.named_parameters():
        with flowtrain.zero.GatheredParameters(p):
            whole = p.detach().flatten().tolist()
        out["params"][name] = {
            "shape": list(p.shape), "ds_shape": list(p.ds_shape), "numel": p.ds_numel,
            "slice": p.ds_tensor.numel(), "expected_slice": math.ceil(p.numel() / world),
            "storage_bytes": p.untyped_storage().nbytes(), "whole": whole}
    out["reference"] = {n: p.detach().flatten().tolist()
                        for n, p in build(False).named_parameters()}
    return out


def case_gathered() -> dict[str, Any]:
    model = build(True)
    edit(model, True)
    weight = model.blocks[0].fc.weight
    with flowtrain.zero.GatheredParameters(weight):
        seen = weight.detach().flatten().tolist()
    return {"seen": seen, "slice": weight.ds_tensor.tolist(),
            "placeholder_after": weight.untyped_storage().nbytes()}


def case_train(stage: int, precision: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in ("init", "whole"):
        model = build(kind == "init")
        edit(model, kind == "init")
        engine, _, _, _ = flowtrain.initialize(model=model,
                                               config=config(stage, False, precision))
        losses = train(engine, 6)
        out[kind] = {"losses": losses, "params": {
            k: v.float().flatten().tolist() for k, v in engine.module_state_dict().items()}}
        engine.destroy()
        dist.barrier()
    return out


def case_not_stage3() -> dict[str, Any]:
    model = build(True, {"zero_optimization": {"stage": 2}})
    return {"partitioned": [n for n, p in model.named_parameters()
                            if getattr(p, "ds_tensor", None) is not None]}


def main() -> None:
    start_watchdog(150)
    torch.set_num_threads(1)
    flowtrain.init_distributed()
    cases = {"built": case_built, "gathered": case_gathered,
             "s3": lambda: case_train(3, "fp32"), "s3_bf16": lambda: case_train(3, "bf16"),
             "s1": lambda: case_train(1, "fp32"), "not_stage3": case_not_stage3}
    result: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            result[name] = case()
        except Exception:
            result[name] = {"error": traceback.format_exc()}
        dist.barrier()
    write(sys.argv[1], result)


if __name__ == "__main__":
    main()
