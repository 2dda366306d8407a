"""One plain fp32 state dict from a checkpoint saved on any number of ranks with any ZeRO stage,
for ``model.load_state_dict(torch.load(OUT))`` (what DeepSpeed's zero_to_fp32.py gives for its
checkpoints); ``flowtrain checkpoint consolidate`` writes it."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from flowtrain.checkpoint.atomic import ENGINE_FILE, LATEST, TENSOR_DIR, resolve

__all__ = ["checkpoint_path", "consolidate", "consolidate_to_file", "frozen_parameter_names"]


def checkpoint_path(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Path:
    """One checkpoint's directory: ``checkpoint_dir`` itself, or its ``tag`` (or ``latest``)."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
    if tag is None and (root / ENGINE_FILE).is_file():
        return root  # one checkpoint's own directory
    path = resolve(root, tag)
    if path is None:
        raise FileNotFoundError(f"{str(root)!r} holds no {LATEST!r} file to name its newest "
                                f"checkpoint; pass --tag, or one checkpoint's directory")
    return path


def consolidate(checkpoint_dir: str | os.PathLike[str],
                tag: str | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict from a checkpoint: every trainable parameter as its fp32 master
    value in its shape, buffers and frozen parameters as fp32 (integer ones as saved), in the
    saved model's key order. ``checkpoint_dir`` is a save_dir (``tag`` or its ``latest``) or
    one checkpoint's directory. Needs no process group."""
    from flowtrain.checkpoint.load import full_state_dict

    path = checkpoint_path(checkpoint_dir, tag)
    shared = torch.load(path / ENGINE_FILE, map_location="cpu", weights_only=False)
    state = full_state_dict(path / TENSOR_DIR, shared["tensors"])
    # .float() of an fp32 tensor is the tensor itself: tied names keep sharing one tensor
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def consolidate_to_file(checkpoint_dir: str | os.PathLike[str], out: str | os.PathLike[str],
                        tag: str | None = None) -> dict[str, torch.Tensor]:
    """``consolidate`` written to ``out`` with torch.save (through a temporary file, so ``out``
    is either the old file or the whole new one); returns the state dict."""
    target = Path(out)
    if not target.parent.is_dir():
        raise FileNotFoundError(f"cannot write {str(target)!r}: directory "
                                f"{str(target.parent)!r} does not exist")
    state = consolidate(checkpoint_dir, tag)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        torch.save(state, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return state


def frozen_parameter_names(checkpoint_dir: str | os.PathLike[str],
                           tag: str | None = None) -> set[str]:
    """The names of the parameters the saving engine did not train (empty for checkpoints
    written before the description recorded them)."""
    path = checkpoint_path(checkpoint_dir, tag)
    shared = torch.load(path / ENGINE_FILE, map_location="cpu", weights_only=False)
    return set(shared["tensors"].get("frozen", ()))
