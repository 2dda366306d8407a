"""Activation checkpointing with DeepSpeed's module-level API (``configure``, ``checkpoint``),
built on torch.utils.checkpoint: a checkpointed function keeps only its inputs and recomputes
its activations during backward."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from flowtrain.log import get_logger

log = get_logger("flowtrain.checkpointing")


@dataclass
class _Settings:
    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    cpu_checkpointing: bool = False
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False
    configured: bool = False


_settings = _Settings()


def configure(mpu_: Any = None, deepspeed_config: Any = None,
              partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Sets how ``checkpoint`` behaves, from a config's ``activation_checkpointing`` section
    (``deepspeed_config``: a loaded config, a dict or a JSON path) and/or keyword overrides."""
    section: Any = None
    if deepspeed_config is not None:
        if isinstance(deepspeed_config, (str, dict)):
            from flowtrain.config import load_config

            deepspeed_config = load_config(deepspeed_config, check_supported=False)
        section = deepspeed_config.activation_checkpointing
    if section is not None:
        _settings.partition_activations = section.partition_activations
        _settings.contiguous_memory_optimization = section.contiguous_memory_optimization
        _settings.number_checkpoints = section.number_checkpoints
        _settings.cpu_checkpointing = section.cpu_checkpointing
        _settings.synchronize_checkpoint_boundary = section.synchronize_checkpoint_boundary
        _settings.profile = section.profile
    for name, value in (("partition_activations", partition_activations),
                        ("contiguous_memory_optimization", contiguous_checkpointing),
                        ("number_checkpoints", num_checkpoints),
                        ("cpu_checkpointing", checkpoint_in_cpu),
                        ("synchronize_checkpoint_boundary", synchronize), ("profile", profile)):
        if value is not None:
            setattr(_settings, name, value)
    if _settings.partition_activations and mpu_ is None:
        # Partitioning splits saved activations across tensor-parallel ranks; with none, there is
        # nothing to split, so it changes nothing here.
        log.info("partition_activations has no effect without tensor parallelism")
    _settings.configured = True


def is_configured() -> bool:
    return _settings.configured


def reset() -> None:
    """Back to the defaults (for tests and for a second engine in one process)."""
    global _settings
    _settings = _Settings()


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Runs ``function(*args)`` without keeping its activations; backward recomputes them.
    With ``cpu_checkpointing`` the saved inputs wait in (pinned) CPU memory."""
    if _settings.synchronize_checkpoint_boundary and torch.cuda.is_available():
        torch.cuda.synchronize()
    offload = (torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())
               if _settings.cpu_checkpointing else contextlib.nullcontext())
    with offload:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)


non_reentrant_checkpoint = checkpoint
