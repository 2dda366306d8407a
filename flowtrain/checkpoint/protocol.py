"""What checkpointing needs of an engine: ``CheckpointableEngine``, the part of FlowtrainEngine (and
PipelineEngine) that saving and loading read and write, all under public names."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from flowtrain.config.model import FlowtrainConfig
    from flowtrain.engine.dataloader import DistributedLoader
    from flowtrain.engine.mixed import MasterWeights
    from flowtrain.parallel.grid import ProcessGrid
    from flowtrain.plan.spec import TrainingSpec
    from flowtrain.precision.loss_scaler import LossScaler
    from flowtrain.zero.sharded import ZeroOptimizer


class Stateful(Protocol):
    """What a checkpoint keeps of an lr scheduler: its state dict, and how it takes one back."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


class CheckpointableEngine(Protocol):
    """The engine as ``save_engine`` and ``load_engine`` see it."""

    # the model and what steps it
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    trainable: list[torch.nn.Parameter]  # the parameters with requires_grad, in model order
    master: MasterWeights | None  # fp32 masters of a 16-bit model without ZeRO
    zero: ZeroOptimizer | None  # ZeRO stages 1-3: the shards this rank holds
    zero_stage: int
    precision: str
    loss_scaler: LossScaler
    config: FlowtrainConfig  # recorded beside the checkpoint, never read for a decision
    spec: TrainingSpec
    training_dataloader: DistributedLoader | None

    # where this rank is: ``world_size`` and ``dp_rank`` count the data-parallel group, which
    # is the whole job unless pipeline or tensor parallelism (``model_parallel``, ``grid``)
    # splits the model
    global_rank: int
    world_size: int
    dp_rank: int
    model_parallel: bool
    grid: ProcessGrid | None

    # counters a resumed run continues from
    global_steps: int
    global_samples: int
    skipped_steps: int
    micro_steps: int

    # read-only here, so that an engine may hold a scheduler type that offers more (a step)
    @property
    def lr_scheduler(self) -> Stateful | None: ...

    @property
    def param_names(self) -> list[str]:
        """The name of each parameter of ``trainable``, as the module names it."""
        ...

    def gathered_parameters(self) -> AbstractContextManager[None]:
        """Every parameter whole inside the block (ZeRO stage 3 gathers them)."""
        ...

    def job_barrier(self, name: str) -> None:
        """Waits for every rank of the job (every stage and tensor slice too)."""
        ...

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zeroes the gradients (after a load, the next step starts from none)."""
        ...
