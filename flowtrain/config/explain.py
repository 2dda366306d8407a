"""Turns pydantic validation errors into one plain line per problem, naming the key path, the
expected type and, for unknown keys, the closest known key."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from flowtrain.config.fields import show

# Misnamings that difflib does not find on its own (different word order, other libraries'
# names). The value is shown verbatim after "did you mean".
MISNAMED: dict[str, str] = {
    "comm_overlap": "overlap_comm",
    "overlap_communication": "overlap_comm",
    "max_grad_norm": "gradient_clipping (a top-level key)",
    "clip_grad": "gradient_clipping (a top-level key)",
    "grad_clip": "gradient_clipping (a top-level key)",
    "batch_size": "train_batch_size",
    "micro_batch_size": "train_micro_batch_size_per_gpu",
    "micro_batch_size_per_gpu": "train_micro_batch_size_per_gpu",
    "grad_accum_steps": "gradient_accumulation_steps",
    "gradient_accumulation": "gradient_accumulation_steps",
    "gradient_accumulation_dtype": "data_types.grad_accum_dtype",
    "zero": "zero_optimization",
    "zero_stage": "zero_optimization.stage",
    "lr_scheduler": "scheduler",
    "seed": "flowtrain.seed",
    "bf16_enabled": "bf16.enabled",
    "fp16_enabled": "fp16.enabled",
    "offload_params": "offload_param",
    "cpu_offload_optimizer": "offload_optimizer",
    "persistence_threshold": "stage3_param_persistence_threshold",
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
}


def suggestion(key: str, known: list[str]) -> str | None:
    """The closest known key to a misspelt one, or None when nothing is close."""
    if key in MISNAMED:
        return MISNAMED[key]
    lowered = {k.lower(): k for k in known}
    if key.lower() in lowered:  # wrong case only
        return lowered[key.lower()]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    return close[0] if close else None


def unknown_key_message(path: str, key: str, known: list[str]) -> str:
    best = suggestion(key, known)
    if best is not None:
        return f"{path}: unknown key; did you mean {best}?"
    listing = ", ".join(sorted(known)) if len(known) <= 12 else "see the DeepSpeed config docs"
    return f"{path}: unknown key (known keys here: {listing})"


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model class that validates the mapping at ``loc`` (None for free-form dicts)."""
    cls: Any = root
    for part in loc:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        cls = field.annotation
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def join(prefix: str, loc: tuple[Any, ...]) -> str:
    parts = ([prefix] if prefix else []) + [str(p) for p in loc]
    return ".".join(parts) or "(top level)"


def explain(exc: ValidationError, root: type[BaseModel], prefix: str = "") -> list[str]:
    """One message per error in ``exc``; ``prefix`` is the key path of ``root`` in the config."""
    lines: list[str] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        path = join(prefix, loc)
        kind = err["type"]
        if kind == "extra_forbidden":
            parent = _model_at(root, loc[:-1])
            known = list(parent.model_fields) if parent is not None else []
            lines.append(unknown_key_message(path, str(loc[-1]), known))
        elif kind == "missing":
            lines.append(f"{path}: required key is missing")
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            lines.append(f"{path}: expected an object ({{...}}), got {show(err.get('input'))}")
        elif kind == "flowtrain":
            lines.append(f"{path}: {err['msg']}")
        else:  # a pydantic check we did not wrap; keep its wording
            lines.append(f"{path}: {err['msg']}, got {show(err.get('input'))}")
    return lines


def error_locs(exc: ValidationError) -> list[tuple[Any, ...]]:
    return [tuple(e["loc"]) for e in exc.errors(include_url=False)]
