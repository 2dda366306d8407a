"""torch.optim.Optimizer front-ends over the fused kernels: FusedAdam (Adam/AdamW), FusedLion,
FusedSGD; state keys match torch's so state_dicts load both ways. The state is laid out flat
(``cuda_numba.flat``), so parameters that lie end to end in memory with their gradients (an
engine bucket, a ZeRO shard) are stepped by one kernel call; any others one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from . import flat, ops


class _Fused(torch.optim.Optimizer):
    """The loop every fused optimizer shares: closure, groups, a plan of runs per group;
    subclasses name their state (``_state_keys``, ``_tags``) and step one run (``_update``)."""

    def __init__(self, params: Iterable, defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self._model_copies: dict[torch.Tensor, torch.Tensor] = {}
        self._plans: dict[int, flat.GroupPlan] = {}
        self._sources: list[tuple[int, int, torch.Tensor, torch.Tensor]] | None = None
        self._scale = 1.0

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("_model_copies", {})
        self._plans = {}
        self._sources, self._scale = None, 1.0

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._plans = {}  # the loaded state is laid out afresh at the next step

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self.__dict__.setdefault("_plans", {})

    def write_model_copies(self, pairs: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """For mixed precision: after each step, write every (fp32 param -> fp16/bf16 model
        tensor) pair's rounded new value in the same pass as the update."""
        self._model_copies = dict(pairs)
        self._plans = {}

    def read_grads_from(self, sources: Iterable[tuple[torch.Tensor, torch.Tensor]],
                        scale: float) -> None:
        """For the next step only: each (flat gradient buffer that parameters' ``.grad`` are
        views of, buffer of the same layout and length) pair makes the step read a gradient
        lying in the first from the same elements of the second, multiplied by ``scale``.
        A mixed-precision engine hands its reduced fp16/bf16 buckets this way, so the
        loss-scale division and the clipping ride in the update and the fp32 gradients are
        never written (DeepSpeed's fp16 optimizer passes its fused Adam one combined scale
        the same way)."""
        pairs = []
        for buffer, source in sources:
            if source.numel() != buffer.numel() or not (buffer.is_contiguous()
                                                        and source.is_contiguous()):
                raise ValueError(f"{type(self).__name__}.read_grads_from: a source of "
                                 f"{source.numel()} elements for a buffer of {buffer.numel()}; "
                                 f"both must be contiguous and of one length")
            pairs.append((buffer.data_ptr(), buffer.numel() * buffer.element_size(), buffer,
                          source))
        self._sources, self._scale = pairs, float(scale)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            for index, group in enumerate(self.param_groups):
                plan = self._plan(index, group)
                if not self._step_group(plan, group):
                    # a gradient moved without the layout key noticing: plan from scratch
                    self._step_group(self._plan(index, group, force=True), group)
        finally:
            self._sources, self._scale = None, 1.0
        return loss

    def _source_of(self, grad: torch.Tensor) -> torch.Tensor:
        """The elements of ``read_grads_from``'s sources that stand for ``grad``: a view where
        it lies in one buffer; where a run crosses from one buffer into the next (two buffers
        that happen to lie end to end), its pieces joined in a copy."""
        assert self._sources is not None
        pieces = []
        ptr, end = grad.data_ptr(), grad.data_ptr() + grad.numel() * grad.element_size()
        while ptr < end:
            for start, nbytes, buffer, source in self._sources:
                if start <= ptr < start + nbytes:
                    size = buffer.element_size()
                    count = (min(end, start + nbytes) - ptr) // size
                    pieces.append(source.narrow(0, (ptr - start) // size, count))
                    ptr += count * size
                    break
            else:
                raise RuntimeError(f"{type(self).__name__}: a gradient of {grad.numel()} "
                                   f"elements lies outside the buffers read_grads_from was "
                                   f"given")
        joined = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return joined.view(grad.shape)

    def _plan(self, index: int, group: dict[str, Any], force: bool = False) -> flat.GroupPlan:
        key = flat.layout_key(group["params"])
        plan = self._plans.get(index)
        if plan is not None and plan.key == key and not force:
            return plan
        live = []
        for p in group["params"]:
            if p.grad is not None:
                _check_grad(type(self).__name__, p)
                live.append(p)
        live = flat.memory_order(live)
        members = tuple(id(p) for p in live)
        # Gradients that move every step (a loop that frees them) change the key but not the
        # parameters: their state is laid out already, so only the runs are planned again.
        laid_out = plan is not None and plan.members == members
        plan = flat.GroupPlan(key, [], members, plan.steps if laid_out and plan else None)
        tags = self._tags(live, group, plan)
        keys = self._state_keys(group)
        if not laid_out:
            flat.flatten_state(self.state, live, keys)
        plan.runs = flat.plan_runs(live, self.state, keys, tags, self._model_copies)
        self._plans[index] = plan
        return plan

    def _step_group(self, plan: flat.GroupPlan, group: dict[str, Any]) -> bool:
        """Steps every run of the plan; False (nothing stepped) when a gradient view no
        longer fits, which only a stale plan can cause."""
        grads = [run.grad() for run in plan.runs]
        if any(g is None for g in grads):
            return False
        sources = self._sources
        for run, grad in zip(plan.runs, grads):
            assert grad is not None
            if sources is None:
                self._update(run, grad, group, 1.0)
            else:
                self._update(run, self._source_of(grad), group, self._scale)
        if plan.steps is not None:
            plan.steps.add_(1)
        return True

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        raise NotImplementedError

    def _tags(self, params: Sequence[torch.Tensor], group: dict[str, Any],
              plan: flat.GroupPlan) -> list[Any]:
        """Per parameter, the value a run must share (None: nothing)."""
        return [None] * len(params)

    def _update(self, run: flat.Run, grad: torch.Tensor, group: dict[str, Any],
                inv_scale: float) -> None:
        """Steps one run with ``grad`` x ``inv_scale`` as its gradient."""
        raise NotImplementedError


def _check_grad(opt: str, p: torch.Tensor) -> None:
    g = p.grad
    if g is not None and g.is_sparse:
        raise RuntimeError(f"{opt}: param of shape {tuple(p.shape)} has a sparse grad; "
                           "only dense grads are supported")


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

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        # a torch Adam/AdamW state_dict has no adamw/bias_correction keys: keep ours
        for group in self.param_groups:
            for k in ("adamw", "bias_correction"):
                group.setdefault(k, self.defaults[k])

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def _tags(self, params: Sequence[torch.Tensor], group: dict[str, Any],
              plan: flat.GroupPlan) -> list[Any]:
        # torch keeps step as a float32 CPU tensor per parameter; so do we (views of one flat
        # tensor), for state_dict parity. A run's members share one count, its tag.
        if plan.steps is None:
            plan.steps, counts = flat.flatten_steps(self.state, params)
            return counts
        return [int(c) for c in plan.steps.tolist()]

    def _update(self, run: flat.Run, grad: torch.Tensor, group: dict[str, Any],
                inv_scale: float) -> None:
        run.tag += 1
        ops.adam_step(run.param, grad, run.state["exp_avg"], run.state["exp_avg_sq"],
                      lr=group["lr"], betas=group["betas"], eps=group["eps"],
                      weight_decay=group["weight_decay"], step=run.tag, adamw=group["adamw"],
                      bias_correction=group["bias_correction"], inv_scale=inv_scale,
                      model_out=run.model_out)


class FusedLion(_Fused):
    """Lion (sign of an interpolated momentum, decoupled weight decay)."""

    def __init__(self, params: Iterable, lr: float = 1e-4,
                 betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr < 0.0:
            raise ValueError(f"FusedLion: lr is {lr}; expected >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("exp_avg",)

    def _update(self, run: flat.Run, grad: torch.Tensor, group: dict[str, Any],
                inv_scale: float) -> None:
        ops.lion_step(run.param, grad, run.state["exp_avg"], lr=group["lr"],
                      betas=group["betas"], weight_decay=group["weight_decay"],
                      inv_scale=inv_scale, model_out=run.model_out)


class FusedSGD(_Fused):
    """SGD with optional momentum, dampening, Nesterov and weight decay (torch.optim.SGD)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"FusedSGD: nesterov needs momentum > 0 and dampening 0, got "
                             f"momentum={momentum}, dampening={dampening}")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _tags(self, params: Sequence[torch.Tensor], group: dict[str, Any],
              plan: flat.GroupPlan) -> list[Any]:
        # torch seeds the momentum buffer with the first gradient: whether this is a
        # parameter's first momentum step is known before its (zeroed) buffer is laid out
        return [group["momentum"] != 0 and self.state[p].get("momentum_buffer") is None
                for p in params]

    def _update(self, run: flat.Run, grad: torch.Tensor, group: dict[str, Any],
                inv_scale: float) -> None:
        ops.sgd_step(run.param, grad, run.state.get("momentum_buffer"), lr=group["lr"],
                     momentum=group["momentum"], dampening=group["dampening"],
                     weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                     first_step=run.tag, inv_scale=inv_scale, model_out=run.model_out)
        run.tag = False
