"""Optimizers from a DeepSpeed ``optimizer`` config block (Adam, AdamW, SGD, Lion), with DeepSpeed's
Adam semantics, and a foreach Lion for torch builds that do not ship one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["VALID_OPTIMIZERS", "Lion", "build_optimizer"]

VALID_OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "sgd", "lion")

# DeepSpeed's "Adam" is FusedAdam with adam_w_mode=True unless the config opts out, i.e.
# decoupled (AdamW) weight decay; "AdamW" is decoupled whatever adam_w_mode says.
ADAM_W_MODE_DEFAULT = True
# FusedAdam's own default; torch.optim.AdamW's is 0.01 and applies only with torch_adam.
_FUSED_ADAM_WEIGHT_DECAY = 0.0

_ADAM_KEYS = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "bias_correction",
    "torch_adam",
    "adam_w_mode",
)
_SGD_KEYS = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")
_LION_KEYS = ("lr", "betas", "weight_decay")


def _group_by_device_dtype(
    *lists: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[list[Tensor]]]:
    # Foreach kernels need one device and dtype per call; the first list decides the key.
    groups: dict[tuple[torch.device, torch.dtype], list[list[Tensor]]] = {}
    for items in zip(*lists):
        key = (items[0].device, items[0].dtype)
        bucket = groups.setdefault(key, [[] for _ in lists])
        for dst, t in zip(bucket, items):
            dst.append(t)
    return groups


class Lion(Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    Per step: c = β1·m + (1−β1)·g;  θ ← θ − lr·(sign(c) + wd·θ);  m ← β2·m + (1−β2)·g.
    Defaults follow DeepSpeed's FusedLion (lr 1e-3, betas (0.9, 0.999), weight_decay 0); the
    paper suggests betas (0.9, 0.99).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Lion lr must be >= 0, got {lr!r}")
        pair = tuple(betas)  # JSON configs give lists
        if len(pair) != 2 or not all(0.0 <= b < 1.0 for b in pair):
            raise ValueError(f"Lion betas must be two numbers in [0, 1), got {pair!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Lion weight_decay must be >= 0, got {weight_decay!r}")
        super().__init__(params, dict(lr=lr, betas=pair, weight_decay=weight_decay))

    # torch.optim.Optimizer.step's two forms: no closure returns None, a closure its loss
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, moms = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        "Lion does not support sparse gradients; use dense gradients"
                    )
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                params.append(p)
                grads.append(p.grad)
                moms.append(state["exp_avg"])
            if not params:
                continue
            lr = float(group["lr"])
            beta1, beta2 = group["betas"]
            wd = group["weight_decay"]
            for ps, gs, ms in _group_by_device_dtype(params, grads, moms).values():
                # c = β1·m + (1−β1)·g, then its sign is the update direction.
                update = torch._foreach_mul(ms, beta1)
                torch._foreach_add_(update, gs, alpha=1 - beta1)
                torch._foreach_sign_(update)
                if wd != 0:
                    # Decoupled decay: θ − lr·wd·θ, applied with the sign step below.
                    torch._foreach_mul_(ps, 1 - lr * wd)
                torch._foreach_add_(ps, update, alpha=-lr)
                # The momentum uses the second beta, after the parameter update.
                torch._foreach_mul_(ms, beta2)
                torch._foreach_add_(ms, gs, alpha=1 - beta2)
        return loss


def _check_keys(name: str, config_params: dict[str, Any], valid: tuple[str, ...]) -> None:
    if "max_grad_norm" in config_params:
        raise ValueError(
            f"optimizer {name!r} params contain 'max_grad_norm', which is not an optimizer "
            "parameter; remove it and set the top-level 'gradient_clipping' key instead "
            f'(e.g. "gradient_clipping": {config_params["max_grad_norm"]})'
        )
    unknown = sorted(set(config_params) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown} for optimizer {name!r}; "
            f"valid parameters are {list(valid)}"
        )


def _betas(kwargs: dict[str, Any]) -> None:
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])


def _build_adam(name: str, params: Any, cfg: dict[str, Any]) -> Optimizer:
    torch_adam = bool(cfg.pop("torch_adam", False))
    adam_w_mode = bool(cfg.pop("adam_w_mode", ADAM_W_MODE_DEFAULT))
    decoupled = name == "adamw" or adam_w_mode
    bias_correction = bool(cfg.pop("bias_correction", True))
    _betas(cfg)
    if torch_adam or cfg.get("amsgrad"):
        if not bias_correction:
            raise ValueError(
                f"optimizer {name!r}: bias_correction=False needs flowtrain's fused Adam; "
                "remove torch_adam/amsgrad or set bias_correction to true")
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(params, **cfg)
    # Without torch_adam DeepSpeed builds FusedAdam, whose weight_decay default is 0 for both
    # modes (torch.optim.AdamW would silently add 0.01). flowtrain's fused Adam is the Numba
    # kernel: one pass over each parameter, on CPU or GPU.
    from cuda_numba.optim import FusedAdam

    cfg.setdefault("weight_decay", _FUSED_ADAM_WEIGHT_DECAY)
    cfg.pop("amsgrad", None)
    return FusedAdam(params, adamw=decoupled, bias_correction=bias_correction, **cfg)


def build_optimizer(
    type_name: str, params: Any, config_params: dict[str, Any] | None = None
) -> Optimizer:
    """A torch optimizer for a DeepSpeed ``{"type": ..., "params": {...}}`` block.

    Names are case-insensitive. ``Adam`` means decoupled weight decay (torch AdamW) unless
    ``adam_w_mode: false``; ``AdamW`` is always decoupled; ``torch_adam`` is accepted.
    """
    if not isinstance(type_name, str) or type_name.lower() not in VALID_OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer type {type_name!r}; valid types are "
            f"{['Adam', 'AdamW', 'SGD', 'Lion']} (case-insensitive)"
        )
    name = type_name.lower()
    cfg = dict(config_params or {})
    if name in ("adam", "adamw"):
        _check_keys(name, cfg, _ADAM_KEYS)
        return _build_adam(name, params, cfg)
    if name == "sgd":
        _check_keys(name, cfg, _SGD_KEYS)
        return torch.optim.SGD(params, **cfg)
    _check_keys(name, cfg, _LION_KEYS)
    _betas(cfg)
    return Lion(params, **cfg)
