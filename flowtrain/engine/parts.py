"""The typed seams of the engine: ``EngineParts``, what an engine hands the pieces it builds
(ZeRO, health), and the Protocols naming what the pipeline stage actor, telemetry and the FLOPs
profiler read from a live engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from flowtrain.engine.stages import Stages
from flowtrain.engine.timing import StepTimer
from flowtrain.parallel.grid import ProcessGrid
from flowtrain.plan import StepPlan
from flowtrain.plan.buckets import ParamSpec
from flowtrain.plan.spec import TrainingSpec
from flowtrain.runtime.actor import Actor, ActorRef


@dataclass(frozen=True)
class EngineParts:
    """The parts of an engine that ZeRO (``flowtrain.engine.strategy``) and the health figures
    (``flowtrain.engine.health``) are built from. Taken once the model is cast to its training
    dtype and before ZeRO stage 3 replaces partitioned parameters with empty placeholders, so
    ``param_specs`` keeps every parameter's full shape."""

    spec: TrainingSpec  # the config's decisions (flowtrain.plan.spec.resolve)
    module: torch.nn.Module
    trainable: list[torch.nn.Parameter]
    param_specs: list[ParamSpec]
    grid: ProcessGrid | None  # with pipeline or tensor parallelism
    dp_group: Any  # the data-parallel process group; None: the whole world
    world_size: int  # of the data-parallel group
    dp_rank: int
    model_parallel: bool  # pipeline or tensor parallel: other ranks hold other parts
    # starts an actor on this rank's runtime (taken on first use: a one-rank engine may
    # never need one)
    spawn: Callable[[Actor], ActorRef[Any]]

    @property
    def zero_stage(self) -> int:
        return self.spec.zero_stage

    @property
    def bucket_numel(self) -> int:
        return self.spec.bucket_numel

    @property
    def tp(self) -> int:
        """The tensor-parallel degree (1 without a grid)."""
        return self.grid.shape.tp if self.grid is not None else 1


class StageCompute(Protocol):
    """What a pipeline stage actor (``flowtrain.pipe.stage.PipeStage``) runs its forward and
    backward instructions on: the pipeline engine, called on the actor's compute thread."""

    @property
    def timer(self) -> StepTimer: ...

    def stage_forward(self, mb: int, x: Any, labels: Any, train: bool,
                      chunk: int | None = None) -> Any: ...

    def stage_backward(self, mb: int, out: Any, grad: Any, last: bool,
                       chunk: int | None = None) -> None: ...


class HealthFigures(Protocol):
    """The health figures of an engine (``flowtrain.engine.health.Health``)."""

    @property
    def forward_flops(self) -> float | None: ...

    def figures(self, step_s: float | None, comm_s: float | None
                ) -> dict[str, float | None]: ...


class TimedEngine(Protocol):
    """An engine whose step timer telemetry reads (``TelemetryTap``)."""

    @property
    def timer(self) -> StepTimer: ...


class TelemetrySource(TimedEngine, Protocol):
    """What ``flowtrain.telemetry.actor`` reads from an engine and wires into it."""

    @property
    def spec(self) -> TrainingSpec: ...
    @property
    def health(self) -> HealthFigures: ...
    @property
    def precision(self) -> str: ...
    @property
    def zero_stage(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def trainable(self) -> list[torch.nn.Parameter]: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def stages(self) -> Stages: ...

    def memory_breakdown(self) -> dict[str, int]: ...

    def add_stage(self, actor: Any, at: str, name: str | None = None) -> Any: ...


class ProfiledEngine(TimedEngine, Protocol):
    """What ``FlopsProfiler(model, ds_engine=...)`` reads from an engine for its report: the
    world and batch sizes, the last step's timings, and under ZeRO stage 3 the full sizes of
    partitioned parameters (from the step plan)."""

    @property
    def world_size(self) -> int: ...
    @property
    def stage3(self) -> object | None: ...

    def train_micro_batch_size_per_gpu(self) -> int: ...

    def gradient_accumulation_steps(self) -> int: ...
    @property
    def trainable(self) -> list[torch.nn.Parameter]: ...
    @property
    def plan(self) -> StepPlan: ...


__all__ = ["EngineParts", "HealthFigures", "ParamSpec", "ProfiledEngine", "StageCompute",
           "TelemetrySource", "TimedEngine"]
