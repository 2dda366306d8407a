"""Hugging Face's Trainer on flowtrain's engine, in one import::

    from flowtrain.integrations.transformers import Trainer, TrainingArguments

``TrainingArguments(deepspeed="ds_config.json")`` (a path or a dict) is the engine's config;
its "auto" values are filled from the arguments as HF's Trainer fills them for DeepSpeed
(``flowtrain.config.hf.trainer_auto_values``)."""

from __future__ import annotations

from flowtrain.integrations.transformers.arguments import TrainingArguments
from flowtrain.integrations.transformers.trainer import Trainer

__all__ = ["Trainer", "TrainingArguments"]
