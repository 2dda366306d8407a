"""What saving and loading through torch.distributed.checkpoint share: its calls without its
warnings, the shapes and dtypes the files hold, and one all-gather of small objects."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from flowtrain.checkpoint.manifest import CheckpointError


def world_and_rank() -> tuple[int, int]:
    """(the job's world size, this rank), (1, 0) without a process group."""
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (pickled; for small objects)."""
    world, _ = world_and_rank()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


@contextmanager
def quiet() -> Iterator[None]:
    """DCP calls without ShardedTensor's deprecation warning and no_dist's notice."""
    # ShardedTensor warns that it will give way to DTensor; DTensor cannot describe the uneven,
    # bucket-aligned pieces ZeRO holds, so the warning says nothing actionable here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*ShardedTensor.*")
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def stored(directory: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor key the DCP files hold, with its full shape and dtype."""
    try:
        metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {directory / '.metadata'} is missing") from None
    except Exception as exc:  # DCP unpickles it: any error means damage
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"checkpoint file {directory / '.metadata'} is damaged or "
                              f"truncated ({type(exc).__name__}: {first})") from None
    return {k: (tuple(v.size), v.properties.dtype)
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)}
