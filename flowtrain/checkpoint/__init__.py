"""Checkpoints: atomic directories (``atomic``), tensors through torch.distributed.checkpoint that
load into any world size, ZeRO stage and tensor-parallel size (``geometry``, ``save``, ``load``),
the engine's other state (``checkpointer``), and one fp32 state dict from any (``consolidate``)."""

from flowtrain.checkpoint.checkpointer import load_engine, save_engine
from flowtrain.checkpoint.consolidate import consolidate, consolidate_to_file
from flowtrain.checkpoint.protocol import CheckpointableEngine

__all__ = ["CheckpointableEngine", "consolidate", "consolidate_to_file", "load_engine",
           "save_engine"]
