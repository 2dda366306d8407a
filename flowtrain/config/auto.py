"""Resolution of Hugging Face style ``"auto"`` values from what the caller knows (model, world
size, optimizer/scheduler passed in, dataloader batch size, step count, explicit overrides)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from flowtrain.config.fields import AUTO, show
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

    def hidden_size(self) -> int | None:
        """The model's hidden size from a Hugging Face style ``config`` attribute, if any."""
        conf = getattr(self.model, "config", None)
        if conf is None:
            return None
        get = conf.get if isinstance(conf, dict) else (lambda k: getattr(conf, k, None))
        size = get("hidden_size")
        if isinstance(size, int) and size > 0:
            return size
        sizes = get("hidden_sizes")  # some vision models list one size per stage
        if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(s, int) for s in sizes):
            return max(sizes)
        return None


@dataclass
class AutoResult:
    problems: list[str] = field(default_factory=list)
    batch_auto: set[str] = field(default_factory=set)  # batch keys that were "auto"
    # Key paths whose "auto" could not be resolved; the value stays "auto", and the loader
    # drops the type error it causes, since the problem above already explains it.
    unresolved: set[str] = field(default_factory=set)


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
    return (f"set it in the config, or pass auto_values={{{path!r}: ...}} to load_config")


def resolve_auto(raw: dict[str, Any], ctx: AutoContext) -> AutoResult:
    """Replaces every "auto" in ``raw`` (a private copy) in place. Batch keys are removed instead,
    so that the batch rule derives them; what cannot be resolved goes to ``problems``."""
    result = AutoResult()
    paths = list(_auto_paths(raw))
    for path in paths:
        dotted = ".".join(path)
        parent = raw
        for part in path[:-1]:
            parent = parent[part]
        key = path[-1]
        if dotted in ctx.values:
            parent[key] = ctx.values[dotted]
            continue
        problem = _resolve_one(raw, path, parent, ctx, result)
        if problem:
            result.problems.append(problem)
            result.unresolved.add(dotted)
    return result


def _resolve_one(raw: dict[str, Any], path: tuple[str, ...], parent: dict[str, Any],
                 ctx: AutoContext, result: AutoResult) -> str | None:
    dotted = ".".join(path)
    key = path[-1]
    if len(path) == 1 and key in BATCH_KEYS:
        del parent[key]  # the batch rule fills it in, from micro_batch_size where needed
        result.batch_auto.add(key)
        return None
    if dotted == "gradient_clipping":
        parent[key] = 1.0
        return None
    if dotted in ("fp16.enabled", "bf16.enabled"):
        parent[key] = False  # half precision only when the caller asks for it
        return None
    if path[:2] == ("optimizer", "params"):
        return _optimizer_param(raw, parent, key, ctx)
    if path[:2] == ("scheduler", "params"):
        return _scheduler_param(raw, parent, key, ctx)
    if path[0] == "zero_optimization" and len(path) == 2:
        return _zero_param(parent, key, ctx)
    return f"{dotted} is 'auto' and flowtrain has no rule to work it out: {_how(dotted)}"


def _optimizer_param(raw: dict[str, Any], params: dict[str, Any], key: str,
                     ctx: AutoContext) -> str | None:
    if ctx.optimizer_given:
        del params[key]  # the optimizer passed in is used; the config's params are not
        return None
    name = raw["optimizer"].get("type")
    canon = canonical_optimizer(name) if isinstance(name, str) else None
    defaults = optimizer_defaults(canon) if canon else {}
    if key in defaults:
        params[key] = defaults[key]
        return None
    dotted = f"optimizer.params.{key}"
    return (f"{dotted} is 'auto' and flowtrain knows no default {key} for optimizer "
            f"{show(name)}: {_how(dotted)}")


def _optimizer_lr(raw: dict[str, Any]) -> Any:
    opt = raw.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    lr = params.get("lr") if isinstance(params, dict) else None
    return lr if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


def _scheduler_param(raw: dict[str, Any], params: dict[str, Any], key: str,
                     ctx: AutoContext) -> str | None:
    dotted = f"scheduler.params.{key}"
    if ctx.scheduler_given:
        del params[key]
        return None
    if key == "warmup_min_lr":
        params[key] = 0.0
    elif key == "warmup_num_steps":
        params[key] = 0
    elif key == "warmup_max_lr":
        lr = _optimizer_lr(raw)  # optimizer params are resolved first (they come first)
        if lr is None:
            return (f"{dotted} is 'auto', which means the optimizer's lr, but the config has no "
                    f"optimizer lr (an optimizer passed in is not read): {_how(dotted)}")
        params[key] = lr
    elif key == "total_num_steps":
        if ctx.total_num_steps is None:
            return (f"{dotted} is 'auto': pass total_num_steps=<number of optimizer steps> to "
                    f"load_config, or set it in the config")
        params[key] = ctx.total_num_steps
    else:
        return f"{dotted} is 'auto' and flowtrain has no rule to work it out: {_how(dotted)}"
    return None


# Hugging Face's rules, from the model's hidden size h.
_ZERO_FROM_HIDDEN = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def _zero_param(zero: dict[str, Any], key: str, ctx: AutoContext) -> str | None:
    dotted = f"zero_optimization.{key}"
    rule = _ZERO_FROM_HIDDEN.get(key)
    if rule is None:
        return f"{dotted} is 'auto' and flowtrain has no rule to work it out: {_how(dotted)}"
    hidden = ctx.hidden_size()
    if hidden is None:
        return (f"{dotted} is 'auto', which is computed from the model's hidden size: pass a "
                f"model whose .config has hidden_size, or {_how(dotted)}")
    zero[key] = rule(hidden)
    return None
