"""What Hugging Face's Trainer puts in place of a DeepSpeed config's "auto" values: its
TrainingArguments' defaults, the dotted config keys a TrainingArguments-like object sets (the
key -> argument pairs ``HfTrainerDeepSpeedConfig.trainer_config_process`` fills), and for the
Trainer route (``flowtrain.integrations.transformers``) the whole set it fills for a run and
the written values it refuses when they contradict the arguments."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flowtrain.config.fields import AUTO, ConfigError

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


# -- the Trainer route ----------------------------------------------------------------------

# What a Trainer runs when its arguments carry no config: data parallelism (ZeRO stage 0) with
# the batch, clipping and precision taken from the arguments, and HF's own optimizer and
# scheduler (the config has neither section).
DEFAULT_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": AUTO,
    "gradient_accumulation_steps": AUTO,
    "train_batch_size": AUTO,
    "gradient_clipping": AUTO,
    "fp16": {"enabled": AUTO},
    "bf16": {"enabled": AUTO},
    "zero_optimization": {"stage": 0},
}

# Config keys whose written value must equal what the arguments say (HF's Trainer refuses a
# mismatch rather than train with two different batch sizes or learning rates), with the
# arguments each comes from.
MUST_MATCH = {
    "train_micro_batch_size_per_gpu": "per_device_train_batch_size",
    "gradient_accumulation_steps": "gradient_accumulation_steps",
    "train_batch_size": "world size x per_device_train_batch_size x gradient_accumulation_steps",
    "gradient_clipping": "max_grad_norm",
    "optimizer.params.lr": "learning_rate",
    "optimizer.params.betas": "[adam_beta1, adam_beta2]",
    "optimizer.params.eps": "adam_epsilon",
    "optimizer.params.weight_decay": "weight_decay",
    "scheduler.params.warmup_max_lr": "learning_rate",
    "scheduler.params.total_num_steps": "max_steps (or the steps the epochs make)",
    "scheduler.params.warmup_num_steps": "warmup_steps",
    "fp16.enabled": "fp16 or fp16_full_eval",
    "bf16.enabled": "bf16 or bf16_full_eval",
}


def config_of(args: Any) -> str | dict[str, Any]:
    """The engine config ``args`` carries (a path or a dict), or ``DEFAULT_CONFIG``."""
    given = getattr(args, "flowtrain_config", None)
    if given is None and getattr(args, "deepspeed", None):
        raise ValueError(
            "transformers.TrainingArguments(deepspeed=...) hands the config to the deepspeed "
            "package through accelerate; for flowtrain's engine build the arguments with "
            "flowtrain.integrations.transformers.TrainingArguments(deepspeed=...) (same "
            "arguments)")
    if given is None:
        return json.loads(json.dumps(DEFAULT_CONFIG))
    if isinstance(given, Mapping):
        return dict(given)
    if isinstance(given, str) and given.lstrip().startswith("{"):
        # the config written inline, as HF's command line takes it (--deepspeed '{...}')
        try:
            inline = json.loads(given)
        except json.JSONDecodeError as exc:
            raise ConfigError([f"invalid JSON at column {exc.colno}: {exc.msg}"],
                              "TrainingArguments.deepspeed (an inline JSON config)") from None
        if isinstance(inline, dict):
            return inline
    if isinstance(given, (str, os.PathLike)):
        return os.fspath(given)
    raise TypeError(f"TrainingArguments.deepspeed: expected a config file path or a dict, got "
                    f"{type(given).__name__}")


def trainer_auto_values(args: Any, max_steps: int, world_size: int) -> dict[str, Any]:
    """The dotted config keys HF's Trainer fills from ``args`` for a run of ``max_steps``
    optimizer steps on ``world_size`` ranks (what ``initialize(auto_values=...)`` takes)."""
    values = values_from_training_arguments(args)
    values["train_batch_size"] = (world_size * args.per_device_train_batch_size
                                  * args.gradient_accumulation_steps)
    values["scheduler.params.warmup_min_lr"] = 0
    values["scheduler.params.total_num_steps"] = max_steps
    # HF keeps the filled warmup positive: DeepSpeed's WarmupLR (and flowtrain's) refuse 0
    values["scheduler.params.warmup_num_steps"] = max(1, args.get_warmup_steps(max_steps))
    return values


def read_raw(config: str | Mapping[str, Any]) -> dict[str, Any] | None:
    """The config as a dict, or None when the file cannot be read as JSON (``initialize``
    then reports what is wrong with it)."""
    if isinstance(config, Mapping):
        return dict(config)
    try:
        data = json.loads(Path(config).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _lookup(raw: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    """(found, value) of a dotted key; the ``bfloat16`` section stands for ``bf16``."""
    parts = dotted.split(".")
    if parts[0] == "bf16" and "bf16" not in raw:
        parts[0] = "bfloat16"
    node: Any = raw
    for part in parts:
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _same(written: Any, wanted: Any) -> bool:
    if isinstance(written, (list, tuple)) and isinstance(wanted, (list, tuple)):
        return len(written) == len(wanted) and all(_same(a, b) for a, b in zip(written, wanted))
    if isinstance(written, bool) or isinstance(wanted, bool):
        return isinstance(written, bool) and isinstance(wanted, bool) and written == wanted
    if isinstance(written, (int, float)) and isinstance(wanted, (int, float)):
        return float(written) == float(wanted)
    return bool(written == wanted)


def mismatches(raw: Mapping[str, Any], values: Mapping[str, Any]) -> list[str]:
    """One line per written (not "auto") config value that disagrees with the arguments."""
    out = []
    for key, names in MUST_MATCH.items():
        found, written = _lookup(raw, key)
        if not found or written is None or written == AUTO or key not in values:
            continue
        if not _same(written, values[key]):
            out.append(f"{key} is {written!r} in the config but the TrainingArguments "
                       f"({names}) give {values[key]!r}: write \"auto\" there, or make the two "
                       f"agree")
    return out


def check_against_arguments(config: str | Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """Raises ConfigError naming every written config value the arguments contradict."""
    raw = read_raw(config)
    problems = mismatches(raw, values) if raw is not None else []
    if problems:
        source = f"config file {config}" if isinstance(config, str) else "config dict"
        raise ConfigError(problems, f"{source} against the TrainingArguments")
