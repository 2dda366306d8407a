"""Pipeline parallelism: ``PipelineModule`` (a model as a sequence of layers cut into stages),
the 1F1B and GPipe schedules, and the engine's ``train_batch`` / ``eval_batch``."""

from flowtrain.pipe.module import LayerSpec, PipelineModule, partition_balanced
from flowtrain.plan.schedule import bubble_fraction, stage_ops

__all__ = ["LayerSpec", "PipelineModule", "bubble_fraction", "partition_balanced", "stage_ops"]
