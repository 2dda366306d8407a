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


def __getattr__(name: str) -> Any:
    # DeepSpeed scripts use deepspeed.checkpointing.checkpoint(...) and deepspeed.comm; load on use.
    if name in ("checkpointing", "comm", "actors"):
        import importlib

        return importlib.import_module(f"flowtrain.{name}")
    raise AttributeError(f"module 'flowtrain' has no attribute {name!r}")


def add_config_arguments(parser: Any) -> Any:
    """Adds ``--deepspeed``, ``--deepspeed_config`` and ``--local_rank`` to an argparse parser."""
    from flowtrain.api import add_config_arguments as _add

    return _add(parser)
