"""How the engine holds a data-parallel group's gradients, parameters and optimizer state: a
strategy chosen once from the training spec (``strategy_for``) that the engine composes and
asks, instead of testing the ZeRO stage.

- ``Replicated`` (ZeRO 0): every rank holds the whole model; parameters are views of the
  gradient buckets' layout, the user's optimizer steps all of them (over fp32 master weights
  when the model trains in half precision).
- ``ShardedOptimizer`` (ZeRO 1-2): each rank steps its shard of fp32 master weights
  (``flowtrain.zero.ZeroOptimizer``); buckets are padded so that they cut into equal shards.
  Whether gradients stay whole or are reduce-scattered into a shard is the spec's reduction.
- ``ShardedParameters`` (ZeRO 3): as above, and each module's parameters are partitioned and
  gathered around their use (``flowtrain.zero.stage3``): one bucket per module.

Besides ``flowtrain.plan.spec``, ``strategy_for`` is the only place a stage number is
compared.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from flowtrain import comm
from flowtrain.engine.buckets import GradBuckets
from flowtrain.engine.optim_step import StepOutcome, StepStates, replicated_step, sharded_step
from flowtrain.engine.parts import EngineParts
from flowtrain.log import get_logger
from flowtrain.plan import BucketPlan, plan_units
from flowtrain.plan.spec import TrainingSpec
from flowtrain.plan.zero_stage import partitions_gradients, partitions_parameters, shards_optimizer
from flowtrain.zero.gathered import register
from flowtrain.zero.offload import OffloadTarget

if TYPE_CHECKING:
    from flowtrain.zero.sharded import ZeroOptimizer
    from flowtrain.zero.stage3 import Stage3Params

log = get_logger("flowtrain.engine")


class Strategy(ABC):
    """What the engine asks about holding its group's model states (see the module)."""

    name: ClassVar[str]

    def __init__(self, spec: TrainingSpec) -> None:
        self.spec = spec

    @property
    def sharded(self) -> bool:
        """A ZeroOptimizer holds this rank's shard of the optimizer states."""
        return False

    @property
    def bucket_pad(self) -> int:
        """Each bucket's length is padded to a multiple of this (shards cut evenly)."""
        return 1

    @property
    def master_weights(self) -> bool:
        """The engine keeps fp32 master weights of a half-precision model for the user's
        optimizer (a sharded strategy keeps its own, one shard a rank)."""
        return False

    @property
    def flat_model(self) -> bool:
        """The engine lays the parameters out as views of the bucket buffers (ZeRO lays its
        flat parameters out itself)."""
        return False

    @property
    def splits_tied_rows(self) -> bool:
        """A tied embedding's gradient may be reduced in two parts
        (``flowtrain.engine.embedding_rows``): its lookups' rows exchanged apart."""
        return False

    @property
    def observes_bucket_order(self) -> bool:
        """Buckets may be re-cut in the order gradients were seen to arrive
        (``flowtrain.engine.bucket_order``): with ZeRO the shards are cut once."""
        return False

    def no_sync_problem(self) -> str | None:
        """Why ``no_sync`` cannot skip a reduce here, or None where it can."""
        return None

    @property
    def peer_recoverable(self) -> bool:
        """``launch --peer-recovery`` can re-form the group around a lost rank: every rank
        holds, or mirrors, what another would need."""
        return True

    def needs_groups(self) -> bool:
        """Buckets follow the optimizer's parameter groups (a shard steps one group)."""
        return self.sharded

    def plan_buckets(self, parts: EngineParts, groups: list[int] | None
                     ) -> tuple[BucketPlan, ...] | None:
        """The buckets, where the strategy cuts them itself (None: the step plan's)."""
        return None

    @abstractmethod
    def build(self, parts: EngineParts, buckets: GradBuckets, optimizer: torch.optim.Optimizer
              ) -> tuple[ZeroOptimizer | None, Stage3Params | None]:
        """The ZeroOptimizer over the engine's ``buckets`` (pointed at by ``optimizer``) and
        the Stage3Params that gathers parameters around each module, where the strategy has
        them."""

    @abstractmethod
    def optimizer_step(self, states: StepStates, need_norm: bool) -> StepOutcome:
        """The optimizer step over the reduced gradients (``flowtrain.engine.optim_step``);
        ``need_norm``: the global gradient norm is wanted even without clipping."""


class Replicated(Strategy):
    name = "replicated"

    @property
    def master_weights(self) -> bool:
        return self.spec.precision != "fp32"

    @property
    def flat_model(self) -> bool:
        return True

    @property
    def splits_tied_rows(self) -> bool:
        return True

    @property
    def observes_bucket_order(self) -> bool:
        return True

    def build(self, parts: EngineParts, buckets: GradBuckets, optimizer: torch.optim.Optimizer
              ) -> tuple[ZeroOptimizer | None, Stage3Params | None]:
        return None, None

    def optimizer_step(self, states: StepStates, need_norm: bool) -> StepOutcome:
        return replicated_step(states, need_norm)


class ShardedOptimizer(Strategy):
    """``partitions_gradients`` (ZeRO-2): each rank's gradients are its shard, whatever the
    reduce (DeepSpeed's stage 2 refuses ``no_sync`` even with ``reduce_scatter`` false)."""

    name = "sharded optimizer"

    def __init__(self, spec: TrainingSpec, *, partitions_gradients: bool = False) -> None:
        super().__init__(spec)
        self.partitions_gradients = partitions_gradients

    @property
    def sharded(self) -> bool:
        return True

    @property
    def bucket_pad(self) -> int:
        return self.spec.dp

    def no_sync_problem(self) -> str | None:
        if self.partitions_gradients:
            return (f"no_sync is not supported with ZeRO stage {self.spec.zero_stage}: "
                    f"gradients are partitioned as they are reduced (DeepSpeed refuses it too)")
        return None

    @property
    def peer_recoverable(self) -> bool:
        # a shard's mirror lives beside the shard on the compute device
        return self.spec.offload_optimizer == "none" and self.spec.offload_params == "none"

    def build(self, parts: EngineParts, buckets: GradBuckets, optimizer: torch.optim.Optimizer
              ) -> tuple[ZeroOptimizer | None, Stage3Params | None]:
        zero = _zero_optimizer(parts, buckets, optimizer, self.spec, partitions=False)
        return zero, None

    def optimizer_step(self, states: StepStates, need_norm: bool) -> StepOutcome:
        return sharded_step(states, need_norm)


class ShardedParameters(ShardedOptimizer):
    name = "sharded parameters"

    def __init__(self, spec: TrainingSpec) -> None:
        super().__init__(spec, partitions_gradients=True)

    @property
    def peer_recoverable(self) -> bool:
        return False

    def plan_buckets(self, parts: EngineParts, groups: list[int] | None
                     ) -> tuple[BucketPlan, ...] | None:
        return stage3_buckets(parts, groups) if self.spec.dp > 1 else None

    def build(self, parts: EngineParts, buckets: GradBuckets, optimizer: torch.optim.Optimizer
              ) -> tuple[ZeroOptimizer | None, Stage3Params | None]:
        if not self.spec.reduce_scatter and self.spec.dp > 1:
            log.warning("zero_optimization.reduce_scatter false is not honoured with stage 3: "
                        "flowtrain's stage 3 always reduce-scatters gradients (the same sums, "
                        "half the traffic of an all-reduce)", console=True)
        zero = _zero_optimizer(parts, buckets, optimizer, self.spec, partitions=True)
        if not any(zero.partitioned):
            register(zero, None)
            return zero, None
        from flowtrain.zero.stage3 import ParamFetcher, Stage3Params

        # all-gathers get their own group: they run while the reducer's reduces are in flight
        group = dist.new_group(ranks=parts.grid.dp_ranks if parts.grid is not None else
                               list(range(parts.world_size)), backend=dist.get_backend())
        actor = ParamFetcher(zero, group, timeout=comm.DEFAULT_TIMEOUT)
        fetcher = parts.spawn(actor)
        policy = self.spec.stage3
        stage3 = Stage3Params(parts.module, parts.trainable, zero, fetcher,
                              prefetch_numel=policy.prefetch_numel,
                              max_live_numel=policy.max_live_numel,
                              max_reuse_distance=policy.max_reuse_distance)
        stage3.fetcher_actor = actor
        register(zero, stage3)
        return zero, stage3


def strategy_for(spec: TrainingSpec) -> Strategy:
    """The strategy of ``spec``'s ZeRO stage."""
    stage = spec.zero_stage
    if not shards_optimizer(stage):
        return Replicated(spec)
    if not partitions_parameters(stage):
        return ShardedOptimizer(spec, partitions_gradients=partitions_gradients(stage))
    return ShardedParameters(spec)


# -- the pieces the sharded strategies build ----------------------------------------------------

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
    """ZeRO-3's buckets: one per module's own parameters (what one gather fetches)."""
    return plan_units(parts.param_specs, module_units(parts.module, parts.trainable),
                      bucket_numel=parts.bucket_numel,
                      persistence_threshold=parts.spec.stage3.persistence_threshold,
                      groups=groups)


def _zero_optimizer(parts: EngineParts, buckets: GradBuckets,
                    optimizer: torch.optim.Optimizer, spec: TrainingSpec, *,
                    partitions: bool) -> ZeroOptimizer:
    """The ZeroOptimizer the spec decides: its gradients scattered into a shard or kept whole
    (and then summed only in this rank's slice where the reduce scatters), its parameters
    partitioned (ZeRO-3), its optimizer offloaded; under ``launch --peer-recovery`` with a
    mirror of the next rank's shard (``flowtrain.zero.mirror``)."""
    from flowtrain.zero.sharded import ZeroOptimizer

    # the spec's "nvme" is refused before here (flowtrain.config.support): both land on the CPU
    host = torch.device("cpu")
    offload_optimizer = OffloadTarget(host, spec.offload_pin_memory) \
        if spec.offload_optimizer != "none" else None
    offload_param = OffloadTarget(host, spec.offload_pin_memory) \
        if spec.offload_params != "none" else None
    reduction = spec.reduction
    zero = ZeroOptimizer(parts.trainable, buckets, stage=spec.zero_stage,
                         world_size=parts.world_size, rank=parts.dp_rank,
                         group=parts.dp_group,
                         scattered=reduction.every_micro_batch,
                         sliced=reduction.op == "reduce_scatter" and
                         not reduction.every_micro_batch,
                         partitions=partitions,
                         offload_optimizer=offload_optimizer, offload_param=offload_param,
                         norm_over_world=parts.model_parallel, tp=parts.tp,
                         mirrored=spec.mirrored)
    zero.replace_in_optimizer(optimizer)
    return zero

