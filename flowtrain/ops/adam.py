"""``deepspeed.ops.adam``'s optimizers with DeepSpeed's constructor arguments, both stepping
with flowtrain's fused Adam kernel (``cuda_numba.optim.FusedAdam``: a Numba kernel for CPU
tensors and one for CUDA tensors), which is what a config's ``"Adam"``/``"AdamW"`` builds."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cuda_numba.optim import FusedAdam as _KernelAdam


def _no_amsgrad(cls: str, amsgrad: bool) -> None:
    if amsgrad:
        # DeepSpeed's own classes refuse it too
        raise ValueError(f"{cls}: amsgrad=True is not supported; pass amsgrad=False "
                         f"(or use torch.optim.Adam(amsgrad=True))")


class DeepSpeedCPUAdam(_KernelAdam):
    """DeepSpeed's CPU Adam: ``adamw_mode=True`` (the default) decays weights decoupled as
    AdamW does, False adds weight_decay * param to the gradient as Adam does."""

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3,
                 bias_correction: bool = True, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
                 adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _no_amsgrad("DeepSpeedCPUAdam", amsgrad)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         adamw=adamw_mode, bias_correction=bias_correction)


class FusedAdam(_KernelAdam):
    """DeepSpeed's FusedAdam: ``adam_w_mode=True`` (the default) is AdamW, False is Adam with
    L2 weight decay. ``set_grad_none`` is accepted; zero_grad sets gradients to None as
    torch.optim's does by default."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True) -> None:
        _no_amsgrad("FusedAdam", amsgrad)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         adamw=adam_w_mode, bias_correction=bias_correction)


__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
