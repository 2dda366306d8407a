"""One plain fp32 state dict from a checkpoint saved on any number of ranks with any ZeRO stage,
for ``model.load_state_dict(torch.load(OUT))`` (what DeepSpeed's zero_to_fp32.py gives for its
checkpoints); ``flowtrain checkpoint consolidate`` writes it."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from flowtrain.checkpoint.atomic import ENGINE_FILE, LATEST, TENSOR_DIR, read_file, resolve
from flowtrain.checkpoint.manifest import CheckpointError, raise_problems, verify_part
from flowtrain.log import get_logger

log = get_logger("flowtrain.checkpoint")

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
    problems = verify_part(path, 0, 1)
    if problems is None:
        log.info("checkpoint has no manifest (written before checksums existed); reading it "
                 "unverified", path=str(path))
    else:
        raise_problems(path, problems)
    shared = read_file(path / ENGINE_FILE)
    if not isinstance(shared, dict) or not isinstance(shared.get("tensors"), dict):
        raise CheckpointError(f"checkpoint file {path / ENGINE_FILE} is not an engine state")
    try:
        state = full_state_dict(path / TENSOR_DIR, shared["tensors"])
    except CheckpointError:
        raise
    except Exception as exc:  # DCP's own errors name no file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"reading the tensors of checkpoint {path} failed "
                              f"({type(exc).__name__}: {first})") from None
    # .float() of an fp32 tensor is the tensor itself: tied names keep sharing one tensor
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def consolidate_to_file(checkpoint_dir: str | os.PathLike[str], out: str | os.PathLike[str],
                        tag: str | None = None) -> dict[str, torch.Tensor]:
    """``consolidate`` written to ``out`` with torch.save (through a temporary file, so ``out``
    is either the old file or the whole new one); returns the state dict."""
    target = Path(out)
    if target.is_dir():
        raise CheckpointError(f"output {str(target)!r} is a directory; give a file path to "
                              f"write, such as {str(target / 'model.pt')!r}")
    if not target.parent.is_dir():
        raise FileNotFoundError(f"cannot write {str(target)!r}: directory "
                                f"{str(target.parent)!r} does not exist")
    state = consolidate(checkpoint_dir, tag)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        torch.save(state, tmp)
        os.replace(tmp, target)
    except OSError as exc:
        raise CheckpointError(f"cannot write {str(target)!r}: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return state


def frozen_parameter_names(checkpoint_dir: str | os.PathLike[str],
                           tag: str | None = None) -> set[str]:
    """The names of the parameters the saving engine did not train (empty for checkpoints
    written before the description recorded them)."""
    path = checkpoint_path(checkpoint_dir, tag)
    shared = read_file(path / ENGINE_FILE)
    if not isinstance(shared, dict) or not isinstance(shared.get("tensors"), dict):
        raise CheckpointError(f"checkpoint file {path / ENGINE_FILE} is not an engine state")
    return set(shared["tensors"].get("frozen", ()))
