"""DeepSpeed's LR schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest) with
its parameter names, defaults and per-step lr sequence, plus a factory for config blocks.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from flowtrain.log import get_logger

__all__ = [
    "VALID_SCHEDULERS",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]

WARMUP_TYPES = ("log", "linear")


def _unwrap(optimizer: Any) -> Optimizer:
    # Engines wrap the torch optimizer (fp16/ZeRO wrappers expose .optimizer), as in DeepSpeed.
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    raise TypeError(
        f"scheduler needs a torch.optim.Optimizer (or a wrapper with .optimizer), "
        f"got {type(optimizer).__name__}"
    )


def _per_group(optimizer: Optimizer, value: Any, name: str) -> list[Any]:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(
                f"{name} has {len(value)} values but the optimizer has {n} param groups; "
                f"give one value or exactly {n}"
            )
        return list(value)
    return [value] * n


def _check_warmup(warmup_num_steps: Any, warmup_type: Any) -> None:
    if (
        isinstance(warmup_num_steps, bool)
        or not isinstance(warmup_num_steps, int)
        or warmup_num_steps < 0
    ):
        # 0 is DeepSpeed's "no warmup", which its schedulers clamp to 2 steps as they do 1
        raise ValueError(f"warmup_num_steps must be an integer >= 0, got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {WARMUP_TYPES}, got {warmup_type!r}")


def _warmup_fraction(step_index: int, num_steps: int, warmup_type: str) -> float:
    """Progress through warmup in [0, 1) for step index < num_steps (num_steps >= 2)."""
    if warmup_type == "log":
        return math.log(step_index + 1) / math.log(num_steps)
    return step_index / num_steps


class _Schedule:
    """Shared mechanics: the step counter, writing lrs into param groups, state round trips.

    ``last_batch_iteration`` is the index of the last batch trained; -1 means not started, and
    construction at -1 writes the schedule's starting lr into the optimizer, as DeepSpeed does.
    """

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = _unwrap(optimizer)
        self.last_batch_iteration = int(last_batch_iteration)
        self._last_lr: list[float] | None = None

    def get_lr(self) -> list[float]:
        raise NotImplementedError

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError(
                f"{type(self).__name__}.get_last_lr() has no value yet: call step() first "
                f"(last_batch_iteration={self.last_batch_iteration})"
            )
        return list(self._last_lr)

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to the next batch index (or jump to ``last_batch_iteration``) and apply."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply_lr(self.get_lr())

    def _apply_lr(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            current = group["lr"]
            if isinstance(current, torch.Tensor):
                # Tensor lrs (capturable/compiled optimizers) are updated in place so graphs
                # that captured the tensor see the new value.
                current.fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [float(lr) for lr in lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "last_batch_iteration" not in state:
            raise ValueError(
                f"{type(self).__name__} state needs 'last_batch_iteration', "
                f"got keys {sorted(state)}"
            )
        self.last_batch_iteration = int(state["last_batch_iteration"])


class LRRangeTest(_Schedule):
    """lr = min_lr·(1 + step_rate·interval), interval = (i+1)/step_size, floored if staircase."""

    def __init__(
        self,
        optimizer: Any,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if lr_range_test_step_size <= 0:
            raise ValueError(
                f"lr_range_test_step_size must be > 0, got {lr_range_test_step_size!r}"
            )
        self.min_lrs = _per_group(self.optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = bool(lr_range_test_staircase)
        if self.last_batch_iteration == -1:
            self._apply_lr(self.min_lrs)

    def get_lr(self) -> list[float]:
        interval = float(self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        factor = 1 + self.step_rate * interval
        return [lr * factor for lr in self.min_lrs]


class OneCycle(_Schedule):
    """1Cycle: lr rises min→max over the first half-cycle, falls back over the second, then decays.

    With ``cycle_momentum`` and an optimizer that has ``betas``, beta1 cycles inversely between
    cycle_max_mom and cycle_min_mom. Like DeepSpeed, beta2 is set to 0.99 whenever the betas
    are written, and optimizers without ``betas`` (e.g. SGD) get no momentum cycling.
    """

    def __init__(
        self,
        optimizer: Any,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        if cycle_first_step_size <= 0:
            raise ValueError(f"cycle_first_step_size must be > 0, got {cycle_first_step_size!r}")
        self.first_step_size = float(cycle_first_step_size)
        self.second_step_size = (
            float(cycle_second_step_size)
            if cycle_second_step_size is not None
            else self.first_step_size
        )
        if self.second_step_size <= 0:
            raise ValueError(f"cycle_second_step_size must be > 0, got {cycle_second_step_size!r}")
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = cycle_first_stair_count or 0
        self.second_stair_count = (
            self.first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        )
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        # Decay runs only with both a step size and a rate; otherwise the end value is held.
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
        self.decay_mom_rate = decay_mom_rate
        self.cycle_min_mom = cycle_min_mom
        self.cycle_max_mom = cycle_max_mom
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in self.optimizer.defaults:
            get_logger("flowtrain.schedulers").warning(
                "OneCycle cycle_momentum disabled: the optimizer has no 'betas'",
                optimizer=type(self.optimizer).__name__,
            )
            self.cycle_momentum = False
        if self.last_batch_iteration == -1:
            self._apply_lr(self.min_lrs)
            if self.cycle_momentum:
                # DeepSpeed starts the betas at the cycle's lower momentum bound.
                self._apply_mom([cycle_min_mom] * len(self.optimizer.param_groups))

    def _scale_factor(self) -> float:
        batch = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            # Stairs are counted from the integer position in the cycle so that float error at a
            # half-cycle boundary cannot drop a whole stair.
            pos = batch % self.total_size
            if pos <= self.first_step_size:
                level = pos * stairs / self.first_step_size
            else:
                level = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(level) / stairs
        return scale

    def _decay_interval(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            s = self._scale_factor()
            return [lo + (hi - lo) * s for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_interval()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[float] | None:
        """beta1 per group for the current batch index; None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        n = len(self.optimizer.param_groups)
        if self.last_batch_iteration < self.total_size:
            s = self._scale_factor()
            return [self.cycle_max_mom - (self.cycle_max_mom - self.cycle_min_mom) * s] * n
        if self.skip_mom_decay:
            return [self.cycle_max_mom] * n
        return [self.cycle_max_mom * (1 + self.decay_mom_rate * self._decay_interval())] * n

    def _apply_mom(self, moms: Sequence[float]) -> None:
        for group, mom in zip(self.optimizer.param_groups, moms):
            group["betas"] = (mom, 0.99)

    def step(self, last_batch_iteration: int | None = None) -> None:
        super().step(last_batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            self._apply_mom(moms)


class WarmupLR(_Schedule):
    """lr rises from warmup_min_lr to warmup_max_lr over warmup_num_steps (log/linear), then holds.

    ``warmup_max_lr=None`` takes the optimizer's first param group lr.
    """

    def __init__(
        self,
        optimizer: Any,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_warmup(warmup_num_steps, warmup_type)
        if warmup_max_lr is None:
            warmup_max_lr = float(self.optimizer.param_groups[0]["lr"])
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "warmup_max_lr")
        # log(1) = 0 would divide by zero, so warmup is at least two steps (DeepSpeed's rule).
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        if self.last_batch_iteration == -1:
            self._apply_lr(self.min_lrs)

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(
                self.last_batch_iteration, self.warmup_num_steps, self.warmup_type
            )
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        g = self._gamma()
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )
        if total_num_steps < self.warmup_num_steps:
            get_logger("flowtrain.schedulers").warning(
                "WarmupDecayLR total_num_steps is less than warmup_num_steps",
                total_num_steps=total_num_steps,
                warmup_num_steps=self.warmup_num_steps,
            )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """lr = base_lr · ratio: warmup from warmup_min_ratio to 1, then cosine down to cos_min_ratio.

    base_lr is each param group's lr when the scheduler is built; it is kept in state_dict so
    a resumed scheduler does not mistake the already-scheduled lr for the base.
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ) -> None:
        super().__init__(optimizer, last_batch_iteration)
        _check_warmup(warmup_num_steps, warmup_type)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.org_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        if self.last_batch_iteration == -1:
            self._apply_lr(self.get_lr())

    def get_lr_ratio(self) -> float:
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            frac = _warmup_fraction(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        done = i - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        # Held at the floor once the cosine has run its course (no climb back up).
        progress = min(1.0, done / span)
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration, "org_lrs": list(self.org_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "org_lrs" in state:
            self.org_lrs = [float(lr) for lr in state["org_lrs"]]


_SCHEDULERS: dict[str, type[_Schedule]] = {
    "LRRangeTest": LRRangeTest,
    "OneCycle": OneCycle,
    "WarmupLR": WarmupLR,
    "WarmupDecayLR": WarmupDecayLR,
    "WarmupCosineLR": WarmupCosineLR,
}
VALID_SCHEDULERS: tuple[str, ...] = tuple(_SCHEDULERS)


def build_scheduler(
    type_name: str, optimizer: Any, params: dict[str, Any] | None = None
) -> _Schedule:
    """A scheduler from a DeepSpeed ``scheduler`` block: ``type`` (case-sensitive), ``params``."""
    cls = _SCHEDULERS.get(type_name)
    if cls is None:
        raise ValueError(
            f"unknown scheduler type {type_name!r}; valid types are {list(VALID_SCHEDULERS)}"
        )
    params = dict(params or {})
    signature = inspect.signature(cls.__init__)
    accepted = [name for name in signature.parameters if name not in ("self", "optimizer")]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown} for scheduler {type_name}; "
            f"valid parameters are {accepted}"
        )
    required = [
        name
        for name in accepted
        if signature.parameters[name].default is inspect.Parameter.empty and name not in params
    ]
    if required:
        raise ValueError(
            f"scheduler {type_name} needs parameter(s) {required}; got {sorted(params)}"
        )
    return cls(optimizer, **params)
