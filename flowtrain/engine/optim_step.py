"""The optimizer step of ``FlowtrainEngine`` (a mixin): the overflow check, the gradient norm
and clipping, and the step itself, through ZeRO's sharded optimizer, through a fused optimizer
that reads the reduced half-precision buckets, or over fp32 gradients."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flowtrain.engine.mixed import clip_, total_grad_norm
from flowtrain.precision import has_inf_or_nan

if TYPE_CHECKING:
    from flowtrain.engine.buckets import GradBuckets
    from flowtrain.engine.mixed import MasterWeights
    from flowtrain.engine.surface import LRScheduler
    from flowtrain.parallel.grid import ProcessGrid
    from flowtrain.plan.spec import TrainingSpec
    from flowtrain.precision.loss_scaler import LossScaler
    from flowtrain.zero.sharded import ZeroOptimizer


class OptimizerStep:
    # Set by FlowtrainEngine.__init__; declared for the checks of the methods below.
    zero: ZeroOptimizer | None
    master: MasterWeights | None
    model_parallel: bool
    optimizer: torch.optim.Optimizer
    buckets: GradBuckets
    loss_scaler: LossScaler
    precision: str
    spec: TrainingSpec
    global_steps: int
    skipped_steps: int
    lr_scheduler: LRScheduler | None
    world_size: int
    grid: ProcessGrid | None
    trainable: list[torch.nn.Parameter]
    _global_grad_norm: float | None
    # a method of the engine (an annotation only: a stub here would shadow it)
    _zero_grads: Callable[[], None]

    def _optimizer_step(self) -> bool:
        if self.zero is not None:
            return self._zero_step()
        if self.master is not None and not self.model_parallel and \
                hasattr(self.optimizer, "read_grads_from"):
            return self._folded_step()
        if self.master is not None:  # unscaled and checked in one pass per bucket
            bad = self.master.load_grads(self.buckets, self.loss_scaler.loss_scale)
            overflow, grads = self.precision == "fp16" and bad, self.master.flat
        else:
            grads = self.buckets.buffers()
            overflow = self.precision == "fp16" and has_inf_or_nan(grads)
        if self.model_parallel and self.precision == "fp16":
            overflow = self._across_model(float(overflow), dist.ReduceOp.MAX) > 0
        self.loss_scaler.update(overflow)
        if overflow:
            return self._skip()
        clip = self.spec.gradient_clipping
        printing = self._logs_this_step()
        if (clip and clip > 0) or printing:
            # The norm costs a pass over every gradient: only when clipping or logging needs it.
            if self.model_parallel:  # every stage's and tensor slice's gradients count
                norm = torch.tensor(self._across_model(self._local_sumsq())) ** 0.5
            else:
                norm = total_grad_norm(grads)
            self._global_grad_norm = float(norm)
            if clip and clip > 0:
                clip_(grads, norm, clip)
        else:
            self._global_grad_norm = None
        self.optimizer.step()
        return self._after_update()

    def _folded_step(self) -> bool:
        """The mixed-precision step with a fused optimizer (flowtrain's Adam, Lion, SGD): the
        loss-scale division and the clipping are one factor the optimizer applies as it reads
        the reduced fp16/bf16 buckets, so no pass writes fp32 gradients or scales them. One
        read-only pass over the buckets gives the norm, which is not finite exactly when a
        gradient holds an inf or NaN (fp16's overflow check); bf16 skips it unless clipping
        or logging wants the norm."""
        from cuda_numba.ops import l2_norm

        assert self.master is not None
        halves = self.buckets.buffers()
        inv = 1.0 / self.loss_scaler.loss_scale
        fp16 = self.precision == "fp16"
        clip = self.spec.gradient_clipping
        printing = self._logs_this_step()
        wants_norm = bool(clip and clip > 0) or printing
        norm = float(l2_norm(halves)) * inv if fp16 or wants_norm else 0.0
        overflow = fp16 and not math.isfinite(norm)
        self.loss_scaler.update(overflow)
        if overflow:
            return self._skip()
        scale = inv
        self._global_grad_norm = norm if wants_norm else None
        if clip and clip > 0:  # torch's clip_grad_norm_ factor
            scale *= min(1.0, clip / (norm + 1e-6))
        optimizer: Any = self.optimizer  # a cuda_numba fused optimizer (_optimizer_step)
        optimizer.read_grads_from(zip(self.master.flat, halves), scale)
        self.optimizer.step()
        return self._after_update()

    def _logs_this_step(self) -> bool:
        """The step about to be taken is one steps_per_print logs (its norm is wanted)."""
        every = self.spec.steps_per_print
        return bool(every and (self.global_steps + 1) % every == 0)

    def _skip(self) -> bool:
        """An fp16 overflow: the step is skipped, its gradients dropped. Returns True."""
        self.skipped_steps += 1
        self._global_grad_norm = None
        self._zero_grads()
        return True

    def _after_update(self) -> bool:
        """What follows a step the optimizer took: the model's copy where the optimizer did not
        write it in its pass, the gradients zeroed, the scheduler moved. Returns False (not
        skipped)."""
        if self.master is not None and not self.master.fused_copy:
            self.master.copy_to_model()
        self._zero_grads()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return False

    def _local_sumsq(self) -> float:
        """This rank's share of the squared gradient norm: parameters split across the
        tensor-parallel group count whole, replicated ones 1/tp (every tp rank holds them)."""
        tp = self.grid.shape.tp if self.grid is not None else 1
        stepped = self.master.master if self.master is not None else self.trainable
        total = 0.0
        for param, tensor in zip(self.trainable, stepped):
            if tensor.grad is None:
                continue
            sq = float(tensor.grad.detach().float().square().sum())
            total += sq if getattr(param, "tensor_parallel", False) else sq / tp
        return total

    def _across_model(self, value: float, op: Any = None) -> float:
        """``value`` reduced (sum, or ``op``) over every rank: with pipeline or tensor
        parallelism each holds a different part of the model (data-parallel copies add the
        same reduced gradients: divided out)."""
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        if op is None or op == dist.ReduceOp.SUM:
            t /= self.world_size
        return float(t)

    def _zero_step(self) -> bool:
        clip = self.spec.gradient_clipping
        printing = self._logs_this_step()
        fp16 = self.precision == "fp16"
        if self.zero is None:
            raise RuntimeError("a ZeRO optimizer step on an engine built without ZeRO")
        skipped, norm = self.zero.step(loss_scale=self.loss_scaler.loss_scale, fp16=fp16,
                                       clip=clip, need_norm=printing)
        self.loss_scaler.update(skipped)
        self._global_grad_norm = norm
        if skipped:
            self.skipped_steps += 1
        self._zero_grads()
        if not skipped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return skipped
