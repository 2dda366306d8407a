"""``deepspeed.utils.zero_to_fp32``'s functions over flowtrain checkpoints (any world size, any
ZeRO stage): the model's fp32 weights as one plain state dict, without a process group. They
read what ``flowtrain.checkpoint.consolidate`` reads; ``checkpoint_dir`` is the directory given
to ``save_checkpoint`` (``tag`` or its ``latest`` picks the checkpoint) or one checkpoint's
own directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from flowtrain.checkpoint.consolidate import consolidate, frozen_parameter_names

WEIGHTS_NAME = "pytorch_model.bin"  # the names DeepSpeed (and HF's from_pretrained) use
SAFE_WEIGHTS_NAME = "model.safetensors"


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str],
                                             tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, Any]:
    """The model's state dict with every parameter as its fp32 master value. With
    ``exclude_frozen_parameters`` only the parameters that were trained (and buffers) are
    kept; ``lazy_mode`` is accepted, and the tensors are loaded at once."""
    state = consolidate(checkpoint_dir, tag)
    if exclude_frozen_parameters:
        frozen = frozen_parameter_names(checkpoint_dir, tag)
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str],
                                               max_shard_size: str | int = "5GB",
                                               safe_serialization: bool = False,
                                               tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> str:
    """Writes the fp32 state dict into ``output_dir`` (created if missing) as
    ``pytorch_model.bin``, or ``model.safetensors`` with ``safe_serialization``, as one file
    (``max_shard_size`` is accepted; the file is not split). Returns the file's path."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag,
                                                     exclude_frozen_parameters)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / (SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        if safe_serialization:
            try:
                from safetensors.torch import save_file
            except ImportError:
                raise ImportError("safe_serialization=True needs the safetensors package "
                                  "(pip install safetensors), or pass "
                                  "safe_serialization=False") from None
            # safetensors refuses tensors that share memory (tied weights): each gets its own
            save_file({k: v.contiguous().clone() for k, v in state.items()}, str(tmp))
        else:
            torch.save(state, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return str(target)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module,
                                         checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None) -> torch.nn.Module:
    """Moves ``model`` to the CPU and loads the checkpoint's fp32 weights into it (not
    strictly, as DeepSpeed does); returns the model. The model is then no longer usable with
    the engine that saved the checkpoint: build a new one."""
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


__all__ = ["convert_zero_checkpoint_to_fp32_state_dict", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint"]
