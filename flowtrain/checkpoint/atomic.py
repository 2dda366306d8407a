"""Checkpoints written atomically: every rank writes into a temporary directory, rank 0 renames
it into place once all are done, and the ``latest`` pointer moves last. A crash at any point
leaves the previous checkpoint, and ``latest`` pointing at it.

A checkpoint directory holds ``engine_state.pt`` (rank 0: everything that is not a big tensor),
``rank<R>_states.pt`` per rank (random generators) and ``tensors/``, the parameters and
optimizer state as torch.distributed.checkpoint files (see ``save``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flowtrain.log import get_logger

log = get_logger("flowtrain.checkpoint")

ENGINE_FILE = "engine_state.pt"
TENSOR_DIR = "tensors"
LATEST = "latest"
# What checkpoints before the DCP layout held instead of ENGINE_FILE and TENSOR_DIR.
LEGACY_MODEL_FILE = "mp_rank_00_model_states.pt"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}_states.pt"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_file(obj: Any, path: Path) -> None:
    """torch.save then fsync, so a later rename publishes complete bytes."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_latest(save_dir: Path, tag: str) -> None:
    tmp = save_dir / f".{LATEST}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, save_dir / LATEST)
    _fsync_dir(save_dir)


def validate_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or "/" in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(f"checkpoint tag must be a plain directory name, got {tag!r}")
    return tag


def save(save_dir: str | os.PathLike[str], tag: str, *, rank: int, shared: dict[str, Any] | None,
         per_rank: dict[str, Any], barrier: Callable[[str], None], save_latest: bool = True,
         write_tensors: Callable[[Path], None] | None = None) -> Path:
    """Writes one checkpoint. ``write_tensors`` (every rank, collectively) writes the tensor
    files into the directory it is given; ``shared`` (rank 0 only) is the engine state and goes
    last; ``per_rank`` what differs between ranks (random generators). Every rank calls this."""
    root = Path(save_dir)
    tag = validate_tag(tag)
    staging = root / f".{tag}.partial"
    final = root / tag
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if staging.exists():  # left by a run that crashed mid-save
            shutil.rmtree(staging)
        staging.mkdir()
    barrier(f"ckpt-{tag}-staged")
    if write_tensors is not None:
        write_tensors(staging / TENSOR_DIR)
    save_file(per_rank, staging / rank_file(rank))
    if rank == 0:
        assert shared is not None
        save_file(shared, staging / ENGINE_FILE)
    barrier(f"ckpt-{tag}-written")
    if rank == 0:
        _fsync_dir(staging)
        old = root / f".{tag}.replaced"
        if final.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        os.replace(staging, final)
        _fsync_dir(root)
        if save_latest:
            write_latest(root, tag)
        if old.exists():
            shutil.rmtree(old)
        log.info("checkpoint saved", path=str(final))
    barrier(f"ckpt-{tag}-published")
    return final


def resolve(load_dir: str | os.PathLike[str], tag: str | None) -> Path | None:
    """The checkpoint directory to load: ``tag`` or what ``latest`` names; None if there is none."""
    root = Path(load_dir)
    if tag is None:
        latest = root / LATEST
        if not latest.is_file():
            return None
        tag = latest.read_text(encoding="utf-8").strip()
    path = root / validate_tag(tag)
    replaced = root / f".{tag}.replaced"
    if not path.exists() and (replaced / ENGINE_FILE).is_file():
        # A crash while re-saving the same tag, between moving the old copy aside and
        # publishing the new one: the old copy is still whole.
        path = replaced
    if not (path / ENGINE_FILE).is_file():
        if (path / LEGACY_MODEL_FILE).is_file():
            raise ValueError(f"checkpoint {path} was written by an older flowtrain (one "
                             f"{LEGACY_MODEL_FILE}, no {ENGINE_FILE} and {TENSOR_DIR}/); "
                             f"this version reads only the torch.distributed.checkpoint layout")
        raise FileNotFoundError(f"checkpoint {path} is incomplete or missing: no {ENGINE_FILE}")
    return path


def load(path: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The shared state and this rank's state (None when the checkpoint was written by fewer
    ranks than are loading it)."""
    shared = torch.load(path / ENGINE_FILE, map_location="cpu", weights_only=False)
    mine = path / rank_file(rank)
    per_rank = torch.load(mine, map_location="cpu", weights_only=False) if mine.is_file() else None
    return shared, per_rank
