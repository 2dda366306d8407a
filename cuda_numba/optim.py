"""torch.optim.Optimizer front-ends over the fused kernels: FusedAdam (Adam/AdamW), FusedLion,
FusedSGD; state keys match torch's so state_dicts load both ways. One kernel call per param.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import ops


class _Fused(torch.optim.Optimizer):
    """The loop every fused optimizer shares: closure, groups, params with a grad; subclasses
    update one parameter in ``_update``."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, _grad(type(self).__name__, p), self.state[p], group)
        return loss

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                group: dict[str, Any]) -> None:
        raise NotImplementedError


def _grad(opt: str, p: torch.Tensor) -> torch.Tensor:
    g = p.grad
    if g is None:  # the step passes only parameters that have a grad
        raise RuntimeError(f"{opt}: param of shape {tuple(p.shape)} has no grad")
    if g.is_sparse:
        raise RuntimeError(f"{opt}: param of shape {tuple(p.shape)} has a sparse grad; "
                           "only dense grads are supported")
    return g if g.is_contiguous() else g.contiguous()


class FusedAdam(_Fused):
    """Adam (adamw=False, L2 penalty in the grad) or AdamW (decoupled weight decay)."""

    def __init__(self, params: Iterable, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw: bool = True, bias_correction: bool = True):
        if lr < 0.0:
            raise ValueError(f"FusedAdam: lr is {lr}; expected >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"FusedAdam: betas are {betas}; expected each in [0, 1)")
        if eps < 0.0:
            raise ValueError(f"FusedAdam: eps is {eps}; expected >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay, adamw=adamw,
                                      bias_correction=bias_correction))
        self._model_copies: dict[torch.Tensor, torch.Tensor] = {}

    def write_model_copies(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """For mixed precision: after each step, write every (fp32 param -> fp16/bf16 model
        tensor) pair's rounded new value in the same pass as the update."""
        self._model_copies = dict(pairs)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # a torch Adam/AdamW state_dict has no adamw/bias_correction keys: keep ours
        for group in self.param_groups:
            for k in ("adamw", "bias_correction"):
                group.setdefault(k, self.defaults[k])

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                group: dict[str, Any]) -> None:
        if len(state) == 0:
            # torch keeps step as a float32 CPU tensor; so do we, for state_dict parity
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        state["step"] += 1
        ops.adam_step(p, grad, state["exp_avg"], state["exp_avg_sq"], lr=group["lr"],
                      betas=group["betas"], eps=group["eps"],
                      weight_decay=group["weight_decay"], step=int(state["step"].item()),
                      adamw=group["adamw"], bias_correction=group["bias_correction"],
                      model_out=self._model_copies.get(p))


class FusedLion(_Fused):
    """Lion (sign of an interpolated momentum, decoupled weight decay)."""

    def __init__(self, params: Iterable, lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr < 0.0:
            raise ValueError(f"FusedLion: lr is {lr}; expected >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                group: dict[str, Any]) -> None:
        if len(state) == 0:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.contiguous_format)
        ops.lion_step(p, grad, state["exp_avg"], lr=group["lr"], betas=group["betas"],
                      weight_decay=group["weight_decay"])


class FusedSGD(_Fused):
    """SGD with optional momentum, dampening, Nesterov and weight decay (torch.optim.SGD)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"FusedSGD: nesterov needs momentum > 0 and dampening 0, got "
                             f"momentum={momentum}, dampening={dampening}")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                group: dict[str, Any]) -> None:
        buf = state.get("momentum_buffer")
        first = buf is None and group["momentum"] != 0
        if first:
            buf = state["momentum_buffer"] = torch.empty_like(
                p, memory_format=torch.contiguous_format)
        ops.sgd_step(p, grad, buf, lr=group["lr"], momentum=group["momentum"],
                     dampening=group["dampening"], weight_decay=group["weight_decay"],
                     nesterov=group["nesterov"], first_step=first)
