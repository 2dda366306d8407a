"""Mixed-precision helpers: loss scaling for fp16 and overflow checks."""

from __future__ import annotations

from flowtrain.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaleAtMinimum,
    LossScaler,
    StaticLossScaler,
    build_loss_scaler,
    has_inf_or_nan,
    unscale_,
)

__all__ = [
    "DynamicLossScaler",
    "LossScaleAtMinimum",
    "LossScaler",
    "StaticLossScaler",
    "build_loss_scaler",
    "has_inf_or_nan",
    "unscale_",
]
