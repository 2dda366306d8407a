"""Resolution of Hugging Face style ``"auto"`` values as HF's Trainer fills them: from explicit
values (``auto_values``), what the caller knows (model, world size, optimizer/scheduler passed
in, dataloader batch size, step count), and otherwise TrainingArguments' defaults. Every value
put in place of an "auto" is recorded with where it came from."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from flowtrain.config.fields import AUTO, show
from flowtrain.config.hf import HF_DEFAULTS
from flowtrain.config.params import canonical_optimizer, optimizer_defaults

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# Free-form sections whose "auto" values belong to someone else (apex, plugins), and keys where
# "auto" is a real value rather than a placeholder.
_NOT_PLACEHOLDERS = {("pipeline", "stages")}
_FREE_FORM = {"amp", "comet", "aio", "elasticity", "autotuning", "sparse_attention",
              "compression_training", "data_efficiency", "curriculum_learning", "eigenvalue",
              "progressive_layer_drop", "quantize_training", "weight_quantization", "nebula",
              "hybrid_engine", "timers", "torch_autocast", "compile"}


@dataclass(frozen=True)
class AutoContext:
    """What ``load_config`` was told about the run; ``values`` maps a dotted key path to the value
    an "auto" there should take (e.g. {"optimizer.params.lr": 3e-4, "bf16.enabled": True})."""

    world_size: int = 1
    model: torch.nn.Module | None = None
    optimizer_given: bool = False
    scheduler_given: bool = False
    micro_batch_size: int | None = None
    total_num_steps: int | None = None
    values: Mapping[str, Any] = field(default_factory=dict)
    # the training Dataset's length and the epochs to run over it: scheduler total_num_steps
    dataset_length: int | None = None
    epochs: float | None = None

    def hidden_size(self) -> int | None:
        """The model's hidden size as HF reads it: ``config.hidden_size``, else the largest of
        ``config.hidden_sizes``, else the same from ``config.text_config``."""
        conf = getattr(self.model, "config", None)
        for node in (conf, _get(conf, "text_config")):
            size = _get(node, "hidden_size")
            if isinstance(size, int) and size > 0:
                return size
            sizes = _get(node, "hidden_sizes")  # some vision models list one size per stage
            if isinstance(sizes, (list, tuple)) and sizes and \
                    all(isinstance(s, int) for s in sizes):
                return max(sizes)
        return None

    def model_dtype(self) -> torch.dtype | None:
        """The dtype of the model's first floating-point parameter, if any."""
        if self.model is None:
            return None
        return next((p.dtype for p in self.model.parameters() if p.is_floating_point()), None)


def _get(conf: Any, key: str) -> Any:
    if conf is None:
        return None
    return conf.get(key) if isinstance(conf, dict) else getattr(conf, key, None)


@dataclass
class AutoResult:
    problems: list[str] = field(default_factory=list)
    batch_auto: set[str] = field(default_factory=set)  # batch keys that were "auto"
    # Key paths whose "auto" could not be resolved; the value stays "auto", and the loader
    # drops the type error it causes, since the problem above already explains it.
    unresolved: set[str] = field(default_factory=set)
    # key path -> (value, where it came from), for each "auto" replaced by a value
    resolved: dict[str, tuple[Any, str]] = field(default_factory=dict)
    half_sections: set[str] = field(default_factory=set)  # fp16/bf16 enabled true or "auto"
    # scheduler total_num_steps is counted from the Dataset once the batch sizes are known
    # (the loader holds a placeholder until then): see steps_for_epochs
    steps_from_data: bool = False


def _auto_paths(node: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(node, dict):
        for key, value in node.items():
            sub = path + (str(key),)
            if len(sub) == 1 and sub[0] in _FREE_FORM:
                continue
            if value == AUTO and sub not in _NOT_PLACEHOLDERS:
                yield sub
            else:
                yield from _auto_paths(value, sub)


def _how(path: str) -> str:
    return (f"set it in the config, or pass auto_values={{{path!r}: ...}} to flowtrain.initialize "
            f"(or load_config)")


_HF = "Hugging Face TrainingArguments default"


def resolve_auto(raw: dict[str, Any], ctx: AutoContext) -> AutoResult:
    """Replaces every "auto" in ``raw`` (a private copy) in place. Batch keys the batch rule can
    derive are removed instead; what cannot be resolved goes to ``problems``."""
    result = AutoResult()
    # read before any "auto" is replaced: the precision rule compares the two sections as written
    result.half_sections = {name for name in ("fp16", "bf16") if isinstance(raw.get(name), dict)
                            and raw[name].get("enabled") in (True, AUTO)}
    paths = list(_auto_paths(raw))
    for path in paths:
        dotted = ".".join(path)
        parent = raw
        for part in path[:-1]:
            parent = parent[part]
        if dotted in ctx.values:
            _set(result, parent, path, ctx.values[dotted], "auto_values")
            continue
        problem = _resolve_one(raw, path, parent, ctx, result)
        if problem:
            result.problems.append(problem)
            result.unresolved.add(dotted)
    return result


def _set(result: AutoResult, parent: dict[str, Any], path: tuple[str, ...], value: Any,
         source: str) -> None:
    parent[path[-1]] = value
    result.resolved[".".join(path)] = (value, source)


def _resolve_one(raw: dict[str, Any], path: tuple[str, ...], parent: dict[str, Any],
                 ctx: AutoContext, result: AutoResult) -> str | None:
    dotted = ".".join(path)
    key = path[-1]
    if len(path) == 1 and key in BATCH_KEYS:
        _batch_key(raw, path, ctx, result)
        return None
    if dotted == "gradient_clipping":
        _set(result, parent, path, HF_DEFAULTS[dotted], _HF)
        return None
    if dotted in ("fp16.enabled", "bf16.enabled"):
        value, source = _precision(path[0], ctx, result.half_sections)
        _set(result, parent, path, value, source)
        return None
    if path[:2] == ("optimizer", "params"):
        return _optimizer_param(raw, parent, path, ctx, result)
    if path[:2] == ("scheduler", "params"):
        return _scheduler_param(raw, parent, path, ctx, result)
    if path[0] == "zero_optimization" and len(path) == 2:
        return _zero_param(parent, path, ctx, result)
    return f"{dotted} is 'auto' and flowtrain has no rule to work it out: {_how(dotted)}"


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _batch_key(raw: dict[str, Any], path: tuple[str, ...], ctx: AutoContext,
               result: AutoResult) -> None:
    """HF fills the micro batch and accumulation from TrainingArguments; the global batch
    follows from them. Where the config gives train_batch_size as a number, the keys left are
    derived from it by DeepSpeed's batch rule instead."""
    key = path[0]
    fixed_total = _number(raw.get("train_batch_size"))
    if key == "train_micro_batch_size_per_gpu" and ctx.micro_batch_size is None \
            and not fixed_total:
        _set(result, raw, path, HF_DEFAULTS[key], _HF)
    elif key == "gradient_accumulation_steps" and not fixed_total:
        _set(result, raw, path, HF_DEFAULTS[key], _HF)
    else:
        del raw[key]  # the batch rule fills it in, from the dataloader's batch size where given
    result.batch_auto.add(key)


def _precision(section: str, ctx: AutoContext, half_sections: set[str]) -> tuple[bool, str]:
    """fp16/bf16 "enabled": the model's own half dtype if it has one; else on when this is the
    config's only half-precision section (a config that names bf16 alone is written to train in
    bf16); else TrainingArguments' default, off."""
    dtype = ctx.model_dtype()
    if dtype in (torch.float16, torch.bfloat16):
        mine = torch.float16 if section == "fp16" else torch.bfloat16
        return dtype == mine, f"the model's parameters are {dtype}"
    if half_sections == {section}:
        return True, "the config's only half-precision section"
    return HF_DEFAULTS[f"{section}.enabled"], _HF


def _optimizer_param(raw: dict[str, Any], params: dict[str, Any], path: tuple[str, ...],
                     ctx: AutoContext, result: AutoResult) -> str | None:
    key = path[-1]
    if ctx.optimizer_given:
        del params[key]  # the optimizer passed in is used; the config's params are not
        return None
    dotted = ".".join(path)
    if dotted in HF_DEFAULTS:
        _set(result, params, path, HF_DEFAULTS[dotted], _HF)
        return None
    name = raw["optimizer"].get("type")
    canon = canonical_optimizer(name) if isinstance(name, str) else None
    defaults = optimizer_defaults(canon) if canon else {}
    if key in defaults:
        _set(result, params, path, defaults[key], f"torch.optim.{canon}'s default")
        return None
    return (f"{dotted} is 'auto' and flowtrain knows no default {key} for optimizer "
            f"{show(name)}: {_how(dotted)}")


def _optimizer_lr(raw: dict[str, Any]) -> Any:
    opt = raw.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    lr = params.get("lr") if isinstance(params, dict) else None
    return lr if _number(lr) else None


def _scheduler_param(raw: dict[str, Any], params: dict[str, Any], path: tuple[str, ...],
                     ctx: AutoContext, result: AutoResult) -> str | None:
    key = path[-1]
    dotted = ".".join(path)
    if ctx.scheduler_given:
        del params[key]
        return None
    if dotted in HF_DEFAULTS:
        _set(result, params, path, HF_DEFAULTS[dotted], _HF)
    elif key == "warmup_max_lr":
        # HF fills it with the learning rate: the one given for the optimizer, else the
        # config's (optimizer params are resolved first: they come first), else HF's default
        lr = ctx.values.get("optimizer.params.lr")
        if lr is not None:
            _set(result, params, path, lr, "auto_values' optimizer.params.lr")
        elif _optimizer_lr(raw) is not None:
            _set(result, params, path, _optimizer_lr(raw), "the config's optimizer lr")
        else:
            _set(result, params, path, HF_DEFAULTS["optimizer.params.lr"], _HF)
    elif key == "total_num_steps":
        if ctx.total_num_steps is not None:
            _set(result, params, path, ctx.total_num_steps, "total_num_steps")
        elif ctx.dataset_length is not None and ctx.epochs is not None:
            params[key] = 1  # a valid placeholder; load_config counts the steps later
            result.steps_from_data = True
        elif ctx.dataset_length is not None:
            return (f"{dotted} is 'auto': the training Dataset ({ctx.dataset_length} samples) "
                    f"gives the optimizer steps of one epoch, but not how many epochs: pass "
                    f"auto_values={{'num_train_epochs': <epochs>}} or {{{dotted!r}: <number "
                    f"of optimizer steps>}} (or a TrainingArguments-like object with "
                    f"num_train_epochs or max_steps) to flowtrain.initialize, or set it in the "
                    f"config")
        else:
            return (f"{dotted} is 'auto': pass auto_values={{{dotted!r}: <number of optimizer "
                    f"steps>}} (or a TrainingArguments-like object with max_steps), or "
                    f"training_data= a Dataset with a length and auto_values="
                    f"{{'num_train_epochs': <epochs>}}, to flowtrain.initialize; or "
                    f"total_num_steps= to load_config; or set it in the config")
    else:
        return f"{dotted} is 'auto' and flowtrain has no rule to work it out: {_how(dotted)}"
    return None


# Hugging Face's rules, from the model's hidden size h.
_ZERO_FROM_HIDDEN = {
    "reduce_bucket_size": (lambda h: h * h, "h*h"),
    "stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), "int(0.9*h*h)"),
    "stage3_param_persistence_threshold": (lambda h: 10 * h, "10*h"),
}


def _zero_param(zero: dict[str, Any], path: tuple[str, ...], ctx: AutoContext,
                result: AutoResult) -> str | None:
    dotted = ".".join(path)
    rule = _ZERO_FROM_HIDDEN.get(path[-1])
    if rule is None:
        return f"{dotted} is 'auto' and flowtrain has no rule to work it out: {_how(dotted)}"
    hidden = ctx.hidden_size()
    if hidden is None:
        return (f"{dotted} is 'auto', which is computed from the model's hidden size: pass a "
                f"model whose .config has hidden_size, or {_how(dotted)}")
    fill, formula = rule
    _set(result, zero, path, fill(hidden), f"{formula} with the model's hidden size h={hidden}")
    return None


def steps_for_epochs(length: int, epochs: float, micro_batch: int, grad_accum: int,
                     world_size: int, drop_last: bool = False) -> tuple[int, int]:
    """(optimizer steps in ``epochs`` epochs, steps in one) over a Dataset of ``length``
    samples as the engine's loader serves it: split across ``world_size`` ranks (padded to
    equal shares unless ``drop_last``), in micro-batches, ``grad_accum`` to a step; a partial
    epoch counts up, as HF's Trainer counts ``num_train_epochs``."""
    share = length // world_size if drop_last else -(-length // world_size)
    micro_batches = share // micro_batch if drop_last else -(-share // micro_batch)
    per_epoch = max(1, micro_batches // grad_accum)
    return max(1, math.ceil(epochs * per_epoch)), per_epoch
