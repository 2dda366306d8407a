"""How the engine sets ZeRO up from ``zero_optimization``: stage 3's module units, the
per-group bucketing, the ZeroOptimizer, and stage 3's fetcher actor and hooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from flowtrain import comm
from flowtrain.engine.buckets import GradBuckets
from flowtrain.engine.parts import EngineParts
from flowtrain.log import get_logger
from flowtrain.plan import BucketPlan, plan_units
from flowtrain.zero.gathered import register

if TYPE_CHECKING:
    from flowtrain.zero.sharded import ZeroOptimizer
    from flowtrain.zero.stage3 import Stage3Params

log = get_logger("flowtrain.zero")


def param_groups(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
                 ) -> list[int]:
    """Each trainable parameter's optimizer group index (ZeRO buckets never mix groups)."""
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups)
                for p in group["params"]}
    missing = [i for i, p in enumerate(params) if id(p) not in group_of]
    if missing:
        raise ValueError(f"ZeRO needs the optimizer to hold every trainable parameter of the "
                         f"model; it lacks {len(missing)} of {len(params)} (first: parameter "
                         f"#{missing[0]}, shape {tuple(params[missing[0]].shape)})")
    return [group_of[id(p)] for p in params]


def module_units(module: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[list[int]]:
    """Trainable parameter indices owned directly by each module, in module order; a shared
    parameter belongs to the first module that owns it."""
    index = {id(p): i for i, p in enumerate(params)}
    seen: set[int] = set()
    units = []
    for mod in module.modules():
        unit = []
        for p in mod._parameters.values():
            i = index.get(id(p)) if p is not None else None
            if i is not None and i not in seen:
                seen.add(i)
                unit.append(i)
        if unit:
            units.append(unit)
    return units


def stage3_buckets(parts: EngineParts, groups: list[int] | None) -> tuple[BucketPlan, ...]:
    """Stage 3's buckets: one per module's own parameters (what one gather fetches)."""
    return plan_units(parts.param_specs, module_units(parts.module, parts.trainable),
                      bucket_numel=parts.bucket_numel,
                      persistence_threshold=parts.spec.stage3.persistence_threshold,
                      groups=groups)


def build_zero(parts: EngineParts, buckets: GradBuckets, optimizer: torch.optim.Optimizer,
               ) -> tuple[ZeroOptimizer, Stage3Params | None]:
    """The ZeroOptimizer over the engine's gradient ``buckets`` (pointed at by ``optimizer``)
    and, for stage 3 on several ranks, the Stage3Params that gathers parameters around each
    module, as the engine's spec decides them (``parts.spec``: the reduction, offload, and
    under ``launch --peer-recovery`` with stages 1-2 a mirror of the next rank's shard,
    ``flowtrain.zero.mirror``)."""
    from flowtrain.zero.sharded import ZeroOptimizer

    zcfg = parts.config.zero_optimization
    if parts.zero_stage == 3 and not zcfg.reduce_scatter and parts.world_size > 1:
        log.warning("zero_optimization.reduce_scatter false is not honoured with stage 3: "
                    "flowtrain's stage 3 always reduce-scatters gradients (the same sums, "
                    "half the traffic of an all-reduce)", console=True)
    spec = parts.spec
    offload_optimizer = zcfg.offload_optimizer if spec.offload_optimizer != "none" else None
    offload_param = _Placement(torch.device("cpu")) if spec.offload_params != "none" else None
    zero = ZeroOptimizer(parts.trainable, buckets, stage=parts.zero_stage,
                         world_size=parts.world_size, rank=parts.dp_rank,
                         group=parts.dp_group,
                         reduce_scatter=spec.reduction.op == "reduce_scatter",
                         offload_optimizer=offload_optimizer, offload_param=offload_param,
                         norm_over_world=parts.model_parallel, tp=parts.tp, mirrored=spec.mirrored)
    zero.replace_in_optimizer(optimizer)
    if not any(zero.partitioned):
        if parts.zero_stage == 3:
            register(zero, None)
        return zero, None
    from flowtrain.zero.stage3 import ParamFetcher, Stage3Params

    # all-gathers get their own group: they run while the reducer's reduces are in flight
    group = dist.new_group(ranks=parts.grid.dp_ranks if parts.grid is not None else
                           list(range(parts.world_size)), backend=dist.get_backend())
    actor = ParamFetcher(zero, group, timeout=comm.DEFAULT_TIMEOUT)
    fetcher = parts.spawn(actor)
    stage3 = Stage3Params(parts.module, parts.trainable, zero, fetcher,
                          prefetch_numel=spec.stage3.prefetch_numel,
                          max_live_numel=spec.stage3.max_live_numel,
                          max_reuse_distance=spec.stage3.max_reuse_distance)
    stage3.fetcher_actor = actor
    register(zero, stage3)
    return zero, stage3


class _Placement:
    def __init__(self, device: torch.device) -> None:
        self.device = device
