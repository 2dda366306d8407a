"""Loss scaling for fp16 training: DeepSpeed's dynamic scaler rules, a static scaler, and the
no-op scaler used for bf16/fp32, plus fused overflow detection and in-place unscaling.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from flowtrain.log import get_logger

if TYPE_CHECKING:
    from flowtrain.plan.spec import LossScalePolicy

__all__ = [
    "DynamicLossScaler",
    "LossScaleAtMinimum",
    "LossScaler",
    "StaticLossScaler",
    "build_loss_scaler",
    "has_inf_or_nan",
    "unscale_",
]


def _logger() -> Any:
    # Fetched per call: get_logger configures logging on first use, which importing must not do.
    return get_logger("flowtrain.precision.loss_scaler")


class LossScaleAtMinimum(RuntimeError):
    """An overflow arrived while the dynamic loss scale already sat at min_loss_scale."""


def _is_rank_zero() -> bool:
    # Overflow lines are identical on every data-parallel rank; only rank 0 logs them at INFO.
    return os.environ.get("RANK", "0") == "0"


class LossScaler:
    """Interface: ``loss_scale``, ``update(overflow)``, ``state_dict``, ``load_state_dict``."""

    dynamic: bool = False

    @property
    def loss_scale(self) -> float:
        raise NotImplementedError

    def scale_loss(self, loss: Tensor) -> Tensor:
        """The loss multiplied by the current scale (call backward on the result)."""
        return loss * self.loss_scale

    def update(self, overflow: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


class StaticLossScaler(LossScaler):
    """A fixed scale: fp16 with ``loss_scale > 0``, or 1.0 (no scaling) for bf16/fp32."""

    def __init__(self, scale: float = 1.0) -> None:
        scale = float(scale)
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"static loss scale must be a finite number > 0, got {scale!r}")
        self._scale = scale

    @property
    def loss_scale(self) -> float:
        return self._scale

    def update(self, overflow: bool) -> None:
        # A static scale never moves; the engine still skips the step on overflow.
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"cur_scale": self._scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["cur_scale"])

    def __repr__(self) -> str:
        return f"StaticLossScaler(scale={self._scale})"


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _positive_finite(name: str, value: Any) -> float:
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}") from None
    if not math.isfinite(as_float) or as_float <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return as_float


class DynamicLossScaler(LossScaler):
    """DeepSpeed's dynamic loss scaler (``fp16.loss_scale == 0``).

    On overflow the scale is divided by ``scale_factor`` (never below ``min_loss_scale``), but
    only once ``hysteresis`` overflows have been absorbed; after ``loss_scale_window`` steps
    without an overflow the scale is multiplied by ``scale_factor`` (no upper cap) and the
    hysteresis budget is refilled. An overflow at ``min_loss_scale`` raises LossScaleAtMinimum.
    """

    dynamic = True

    # No defaults: DeepSpeed's (the config schema's, flowtrain.config.sections.FP16Config) are
    # decided once, by the training spec's LossScalePolicy.
    def __init__(
        self,
        *,
        initial_scale_power: int,
        loss_scale_window: int,
        hysteresis: int,
        consecutive_hysteresis: bool,
        min_loss_scale: float,
        scale_factor: float = 2.0,
    ) -> None:
        if isinstance(initial_scale_power, bool) or not isinstance(initial_scale_power, int):
            raise ValueError(f"initial_scale_power must be an integer, got {initial_scale_power!r}")
        self.loss_scale_window = _positive_int("loss_scale_window", loss_scale_window)
        self.hysteresis = _positive_int("hysteresis", hysteresis)
        self.min_loss_scale = _positive_finite("min_loss_scale", min_loss_scale)
        self.scale_factor = _positive_finite("scale_factor", scale_factor)
        if self.scale_factor <= 1.0:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor!r}")
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.cur_scale = float(2.0**initial_scale_power)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.hysteresis

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update(self, overflow: bool) -> None:
        """Advance one optimizer step; ``overflow`` says whether any gradient was inf/NaN."""
        if overflow:
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_loss_scale:
                    # Raised before any counter moves, so the state is exactly as DeepSpeed's.
                    raise LossScaleAtMinimum(
                        f"gradients overflowed with the loss scale already at min_loss_scale="
                        f"{self.min_loss_scale:g} (step {self.cur_iter}); the scale cannot be "
                        "reduced further. Train in bf16 instead of fp16, or set a lower "
                        "fp16.min_loss_scale (a value > 0, e.g. 0.0001)."
                    )
                new_scale = max(self.cur_scale / self.scale_factor, self.min_loss_scale)
                self._log_overflow(new_scale, self.cur_hysteresis)
                self.cur_scale = new_scale
            else:
                self._log_overflow(self.cur_scale, self.cur_hysteresis - 1)
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.loss_scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def _log_overflow(self, new_scale: float, hysteresis_left: int) -> None:
        log = _logger()
        emit = log.info if _is_rank_zero() else log.debug
        emit(
            "fp16 gradient overflow; skipping step",
            attempted_loss_scale=self.cur_scale,
            new_loss_scale=new_scale,
            hysteresis_left=hysteresis_left,
            step=self.cur_iter,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
            "hysteresis": self.hysteresis,
            "loss_scale_window": self.loss_scale_window,
            "min_loss_scale": self.min_loss_scale,
            "scale_factor": self.scale_factor,
            "consecutive_hysteresis": self.consecutive_hysteresis,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in ("cur_scale", "cur_iter", "last_overflow_iter") if k not in state]
        if missing:
            raise ValueError(
                f"loss scaler state is missing {missing}; expected a dict from "
                f"DynamicLossScaler.state_dict(), got keys {sorted(state)}"
            )
        self.cur_scale = float(state["cur_scale"])
        self.cur_iter = int(state["cur_iter"])
        self.last_overflow_iter = int(state["last_overflow_iter"])
        # Configuration keys are optional so a bare counter dict can be restored too.
        self.hysteresis = int(state.get("hysteresis", self.hysteresis))
        self.cur_hysteresis = int(state.get("cur_hysteresis", self.hysteresis))
        self.loss_scale_window = int(state.get("loss_scale_window", self.loss_scale_window))
        self.min_loss_scale = float(state.get("min_loss_scale", self.min_loss_scale))
        self.scale_factor = float(state.get("scale_factor", self.scale_factor))
        self.consecutive_hysteresis = bool(
            state.get("consecutive_hysteresis", self.consecutive_hysteresis)
        )

    def __repr__(self) -> str:
        return (
            f"DynamicLossScaler(scale={self.cur_scale}, iter={self.cur_iter}, "
            f"hysteresis={self.cur_hysteresis}/{self.hysteresis}, "
            f"window={self.loss_scale_window}, min={self.min_loss_scale})"
        )


def build_loss_scaler(policy: LossScalePolicy, *, enabled: bool) -> LossScaler:
    """The scaler ``policy`` decides (``flowtrain.plan.spec.LossScalePolicy``, resolved from
    the config's ``fp16`` block with DeepSpeed's key names and defaults).

    ``enabled=False`` (bf16/fp32 training) gives a no-op scale of 1.0; a ``static`` scale of 0
    selects dynamic scaling; above 0 it is the fixed scale.
    """
    if not enabled:
        return StaticLossScaler(1.0)
    static = policy.static
    if not math.isfinite(static) or static < 0:
        raise ValueError(
            f"fp16.loss_scale must be 0 (dynamic) or a finite number > 0, got {static!r}"
        )
    if static > 0:
        return StaticLossScaler(static)
    return DynamicLossScaler(
        initial_scale_power=policy.initial_power,
        loss_scale_window=policy.window,
        hysteresis=policy.hysteresis,
        consecutive_hysteresis=policy.consecutive_hysteresis,
        min_loss_scale=policy.min_scale,
    )


def _dense(t: Tensor) -> Tensor:
    return t.coalesce().values() if t.is_sparse else t


def has_inf_or_nan(tensors: Iterable[Tensor | None]) -> bool:
    """True when any element of any tensor is inf, -inf or NaN.

    Per (device, dtype) group one fused max-abs reduction runs (inf for inf, NaN for NaN);
    the per-tensor results are gathered into one flag, so the host waits exactly once.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        if t is None:
            continue
        t = _dense(t)
        if t.numel() == 0:
            continue  # the max-abs norm of an empty tensor is undefined, and it holds no NaN
        if not (t.is_floating_point() or t.is_complex()):
            continue  # integer tensors cannot hold inf/NaN
        groups.setdefault((t.device, t.dtype), []).append(t)
    if not groups:
        return False
    flags: list[Tensor] = []
    target: torch.device | None = None
    for (device, _dtype), group in groups.items():
        norms = torch._foreach_norm(group, float("inf"))
        bad = torch.logical_not(torch.isfinite(torch.stack([n.float() for n in norms])).all())
        if target is None:
            target = device
        flags.append(bad.to(target, non_blocking=True))
    return bool(torch.stack(flags).any().item())


def unscale_(tensors: Sequence[Tensor | None] | Iterable[Tensor | None], scale: float) -> None:
    """Divides every tensor by ``scale`` in place with one foreach multiply per call."""
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"unscale_ needs a finite scale > 0, got {scale!r}")
    present = [t for t in tensors if t is not None]
    if not present or scale == 1.0:
        return
    torch._foreach_mul_(present, 1.0 / scale)
