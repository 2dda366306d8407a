"""Optimizer and scheduler ``type`` names and the ``params`` each type takes: checked for the
optimizers flowtrain has and for every DeepSpeed scheduler, with DeepSpeed's scheduler defaults."""

from __future__ import annotations

import inspect
from typing import Annotated, Any

import torch
from pydantic import BaseModel, BeforeValidator, ValidationError
from pydantic_core import PydanticCustomError

from flowtrain.config.explain import explain, suggestion
from flowtrain.config.fields import Bool, Choice, Float, Int, Section, show

# DeepSpeed's optimizer names (matched case-insensitively), canonical spelling.
DEEPSPEED_OPTIMIZERS = ("Adam", "AdamW", "SGD", "Lion", "Lamb", "Adagrad", "OneBitAdam",
                        "OneBitLamb", "ZeroOneAdam", "Muon")
# Optimizers flowtrain can build today; later work adds names here (see support.py).
AVAILABLE_OPTIMIZERS: list[str] = ["Adam", "AdamW", "SGD", "Lion"]


def canonical_optimizer(name: str) -> str | None:
    """DeepSpeed's spelling of an optimizer type, or torch.optim's (DeepSpeed falls back to any
    torch.optim class by name); None when neither knows it."""
    for known in DEEPSPEED_OPTIMIZERS:
        if known.lower() == name.lower():
            return known
    cls = getattr(torch.optim, name, None)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
        return name
    return None


def optimizer_type_problem(name: str) -> str:
    names = list(DEEPSPEED_OPTIMIZERS)
    best = suggestion(name, names)
    hint = f"; did you mean {best}?" if best else ""
    return (f"optimizer.type: unknown optimizer {show(name)}{hint} "
            f"(DeepSpeed names: {', '.join(names)}, or a torch.optim class name)")


def _betas_check(value: Any) -> list[float]:
    ok = (isinstance(value, (list, tuple)) and len(value) == 2
          and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                  for b in value))
    if not ok:
        raise PydanticCustomError("flowtrain", "expected a list of two numbers in [0, 1), got "
                                  "{got}", {"got": show(value)})
    return [float(b) for b in value]


Betas = Annotated[list[float], BeforeValidator(_betas_check)]


class AdamParams(Section):
    lr: Annotated[float, Float(ge=0)] = 1e-3
    betas: Betas = [0.9, 0.999]
    eps: Annotated[float, Float(gt=0)] = 1e-8
    weight_decay: Annotated[float, Float(ge=0)] = 0.0
    amsgrad: Bool = False
    bias_correction: Bool = True
    adam_w_mode: Bool = True
    torch_adam: Bool = False


class SGDParams(Section):
    lr: Annotated[float, Float(ge=0)] = 1e-3
    momentum: Annotated[float, Float(ge=0)] = 0.0
    dampening: Annotated[float, Float(ge=0)] = 0.0
    weight_decay: Annotated[float, Float(ge=0)] = 0.0
    nesterov: Bool = False


class LionParams(Section):
    lr: Annotated[float, Float(ge=0)] = 1e-4
    betas: Betas = [0.9, 0.99]
    weight_decay: Annotated[float, Float(ge=0)] = 0.0


OPTIMIZER_PARAMS: dict[str, type[BaseModel]] = {
    "Adam": AdamParams, "AdamW": AdamParams, "SGD": SGDParams, "Lion": LionParams,
}

# Lion is not in torch.optim; these are the Lion paper's recommended defaults.
_LION_DEFAULTS = {"lr": 1e-4, "betas": [0.9, 0.99], "weight_decay": 0.0}


def optimizer_defaults(name: str) -> dict[str, Any]:
    """The defaults used for "auto" optimizer params: torch.optim's own for that class."""
    if name == "Lion":
        return dict(_LION_DEFAULTS)
    cls = getattr(torch.optim, name, None)
    if cls is None:
        return {}
    out: dict[str, Any] = {}
    for p in inspect.signature(cls.__init__).parameters.values():
        if p.default is not inspect.Parameter.empty and p.default is not None:
            value = p.default
            if isinstance(value, torch.Tensor):
                value = value.item()
            out[p.name] = list(value) if isinstance(value, tuple) else value
    return out


WarmupType = Annotated[str, Choice("log", "linear")]


class WarmupLRParams(Section):
    warmup_min_lr: Annotated[float, Float(ge=0)] = 0.0
    warmup_max_lr: Annotated[float, Float(ge=0)] = 0.001
    warmup_num_steps: Annotated[int, Int(ge=0)] = 1000
    warmup_type: WarmupType = "log"
    last_batch_iteration: Annotated[int, Int(ge=-1)] = -1


class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: Annotated[int, Int(ge=1)]


class WarmupCosineLRParams(Section):
    total_num_steps: Annotated[int, Int(ge=1)]
    warmup_min_ratio: Annotated[float, Float(ge=0)] = 0.0
    warmup_num_steps: Annotated[int, Int(ge=0)] = 1000
    cos_min_ratio: Annotated[float, Float(ge=0)] = 0.0001
    warmup_type: WarmupType = "log"
    last_batch_iteration: Annotated[int, Int(ge=-1)] = -1


class OneCycleParams(Section):
    cycle_min_lr: Annotated[float, Float(ge=0)]
    cycle_max_lr: Annotated[float, Float(ge=0)]
    decay_lr_rate: Annotated[float, Float(ge=0)] = 0.0
    cycle_first_step_size: Annotated[int, Int(ge=1)] = 2000
    cycle_second_step_size: Annotated[int | None, Int(ge=1, optional=True)] = None
    cycle_first_stair_count: Annotated[int, Int(ge=0)] = 0
    cycle_second_stair_count: Annotated[int | None, Int(ge=0, optional=True)] = None
    decay_step_size: Annotated[int, Int(ge=0)] = 0
    cycle_momentum: Bool = True
    cycle_min_mom: Annotated[float, Float(ge=0)] = 0.8
    cycle_max_mom: Annotated[float, Float(ge=0)] = 0.9
    decay_mom_rate: Annotated[float, Float(ge=0)] = 0.0
    last_batch_iteration: Annotated[int, Int(ge=-1)] = -1


class LRRangeTestParams(Section):
    lr_range_test_min_lr: Annotated[float, Float(ge=0)] = 0.001
    lr_range_test_step_size: Annotated[int, Int(ge=1)] = 2000
    lr_range_test_step_rate: Annotated[float, Float(ge=0)] = 1.0
    lr_range_test_staircase: Bool = False
    last_batch_iteration: Annotated[int, Int(ge=-1)] = -1


SCHEDULER_PARAMS: dict[str, type[BaseModel]] = {
    "WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams, "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}


def check_params(schema: type[BaseModel], params: dict[str, Any],
                 prefix: str) -> tuple[dict[str, Any] | None, list[str]]:
    """Validates ``params`` against ``schema``: (params with defaults filled in, problems)."""
    try:
        model = schema.model_validate(params)
    except ValidationError as exc:
        return None, explain(exc, schema, prefix)
    return model.model_dump(), []
