"""DeepSpeed's ds_config.json as typed, validated pydantic models: ``load_config`` is the entry
point; ``unsupported_features`` says what the engine cannot run yet."""

from __future__ import annotations

from flowtrain.config.batch import BatchSizes, resolve_batch
from flowtrain.config.fields import ConfigError, ConfigWarning
from flowtrain.config.load import ConfigSource, load_config
from flowtrain.config.model import FlowtrainConfig
from flowtrain.config.params import AVAILABLE_OPTIMIZERS
from flowtrain.config.support import NEVER_SUPPORTED, SUPPORTED_FEATURES, unsupported_features

__all__ = [
    "AVAILABLE_OPTIMIZERS", "BatchSizes", "ConfigError", "ConfigSource", "ConfigWarning",
    "FlowtrainConfig", "NEVER_SUPPORTED", "SUPPORTED_FEATURES", "load_config", "resolve_batch",
    "unsupported_features",
]
