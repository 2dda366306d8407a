"""What Hugging Face's Trainer puts in place of a DeepSpeed config's "auto" values: its
TrainingArguments' defaults, and the dotted config keys a TrainingArguments-like object sets
(the key -> argument pairs ``HfTrainerDeepSpeedConfig.trainer_config_process`` fills)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# TrainingArguments' defaults as the config keys they fill. warmup_num_steps is HF's
# max(1, warmup_steps): its Trainer keeps the filled value positive for newer DeepSpeed.
HF_DEFAULTS: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer.params.lr": 5e-5,
    "optimizer.params.betas": [0.9, 0.999],
    "optimizer.params.eps": 1e-8,
    "optimizer.params.weight_decay": 0.0,
    "scheduler.params.warmup_min_lr": 0.0,
    "scheduler.params.warmup_num_steps": 1,
    "fp16.enabled": False,
    "bf16.enabled": False,
}

# The attributes that mark an object as TrainingArguments-like (any one of them is enough).
_MARKERS = ("learning_rate", "per_device_train_batch_size", "max_grad_norm", "adam_beta1")


def is_training_arguments(obj: Any) -> bool:
    return not isinstance(obj, Mapping) and any(hasattr(obj, name) for name in _MARKERS)


def values_from_training_arguments(args: Any) -> dict[str, Any]:
    """The dotted config keys ``args`` (a TrainingArguments or any object with its attribute
    names) sets, as HF's Trainer maps them; attributes it lacks take no part."""
    out: dict[str, Any] = {}

    def take(key: str, *names: str) -> None:
        if all(hasattr(args, n) for n in names):
            values = [getattr(args, n) for n in names]
            out[key] = values[0] if len(values) == 1 else values

    take("train_micro_batch_size_per_gpu", "per_device_train_batch_size")
    take("gradient_accumulation_steps", "gradient_accumulation_steps")
    take("gradient_clipping", "max_grad_norm")
    take("optimizer.params.lr", "learning_rate")
    take("optimizer.params.betas", "adam_beta1", "adam_beta2")
    take("optimizer.params.eps", "adam_epsilon")
    take("optimizer.params.weight_decay", "weight_decay")
    take("scheduler.params.warmup_max_lr", "learning_rate")
    warmup = getattr(args, "warmup_steps", None)
    if isinstance(warmup, int) and not isinstance(warmup, bool):
        out["scheduler.params.warmup_num_steps"] = max(1, warmup)
    max_steps = getattr(args, "max_steps", None)
    if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps > 0:
        out["scheduler.params.total_num_steps"] = max_steps
    for precision in ("fp16", "bf16"):
        flags = [getattr(args, n) for n in (precision, f"{precision}_full_eval")
                 if isinstance(getattr(args, n, None), bool)]
        if flags:
            out[f"{precision}.enabled"] = any(flags)
    return out


def auto_values_of(given: Any) -> dict[str, Any]:
    """``auto_values`` as ``initialize`` takes it (a dict of dotted keys, a TrainingArguments-like
    object, or None) as a dict of dotted keys; anything else is a TypeError naming the
    argument."""
    if given is None:
        return {}
    if isinstance(given, Mapping):
        bad = [k for k in given if not isinstance(k, str)]
        if bad:
            raise TypeError(f"auto_values: keys are dotted config paths such as "
                            f"'optimizer.params.lr', got {bad[0]!r}")
        return dict(given)
    if is_training_arguments(given):
        return values_from_training_arguments(given)
    raise TypeError(f"auto_values: expected a dict of dotted config keys (e.g. "
                    f"{{'optimizer.params.lr': 3e-4}}) or a TrainingArguments-like object, got "
                    f"{type(given).__name__}")
