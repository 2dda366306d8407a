"""flowtrain: PyTorch training across processes as an actor/event pipeline.

``import flowtrain as deepspeed`` runs a DeepSpeed training script: ``initialize`` builds the
engine from the same arguments and ds_config.json.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "add_config_arguments", "init_distributed", "initialize"]


def initialize(*args: Any, **kwargs: Any) -> Any:
    """Builds the training engine; see ``flowtrain.api.initialize``."""
    from flowtrain.api import initialize as _initialize

    return _initialize(*args, **kwargs)


def init_distributed(*args: Any, **kwargs: Any) -> None:
    """Initialises torch.distributed and this rank's runtime (``deepspeed.init_distributed``)."""
    from flowtrain.api import init_distributed as _init

    _init(*args, **kwargs)


# What DeepSpeed scripts reach as attributes of the package (deepspeed.checkpointing,
# deepspeed.comm, deepspeed.zero.Init, deepspeed.ops.adam, deepspeed.utils.zero_to_fp32,
# deepspeed.pipe.PipelineModule): loaded on first use, so `import flowtrain` stays light.
_SUBMODULES = ("checkpointing", "comm", "actors", "zero", "ops", "utils", "pipe")


def __getattr__(name: str) -> Any:
    import importlib

    if name in _SUBMODULES:
        return importlib.import_module(f"flowtrain.{name}")
    if name == "DeepSpeedEngine":
        return importlib.import_module("flowtrain.engine.engine").FlowtrainEngine
    raise AttributeError(f"module 'flowtrain' has no attribute {name!r}")


def add_config_arguments(parser: Any) -> Any:
    """Adds ``--deepspeed``, ``--deepspeed_config`` and ``--local_rank`` to an argparse parser."""
    from flowtrain.api import add_config_arguments as _add

    return _add(parser)
