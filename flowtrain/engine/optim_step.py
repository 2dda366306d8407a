"""The optimizer step as each strategy takes it (``Strategy.optimizer_step``): the overflow
check, the gradient norm and clipping, and the step itself, through ZeRO's sharded optimizer
(``sharded_step``) or over the whole model (``replicated_step``: a fused optimizer that reads
the reduced half-precision buckets, or fp32 gradients). A step reads and writes only what
``StepStates`` names of the engine; the engine counts skipped steps, zeroes the gradients and
moves the learning-rate scheduler after it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from flowtrain.engine.mixed import clip_, total_grad_norm
from flowtrain.precision import has_inf_or_nan

if TYPE_CHECKING:
    from flowtrain.engine.buckets import GradBuckets
    from flowtrain.engine.mixed import MasterWeights
    from flowtrain.parallel.grid import ProcessGrid
    from flowtrain.plan.spec import TrainingSpec
    from flowtrain.precision.loss_scaler import LossScaler
    from flowtrain.zero.sharded import ZeroOptimizer


@dataclass(frozen=True)
class StepOutcome:
    """What a step did: ``skipped`` (an fp16 overflow: the update was not applied) and the
    global gradient norm where it was taken (clipping or a logged step wants it), else None."""

    skipped: bool
    grad_norm: float | None


class StepStates(Protocol):
    """What an optimizer step reads of an engine (``FlowtrainEngine`` is one)."""

    @property
    def spec(self) -> TrainingSpec: ...
    @property
    def zero(self) -> ZeroOptimizer | None: ...
    @property
    def master(self) -> MasterWeights | None: ...
    @property
    def buckets(self) -> GradBuckets: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def loss_scaler(self) -> LossScaler: ...
    @property
    def model_parallel(self) -> bool: ...
    @property
    def world_size(self) -> int: ...
    @property
    def grid(self) -> ProcessGrid | None: ...
    @property
    def trainable(self) -> list[torch.nn.Parameter]: ...


def replicated_step(e: StepStates, need_norm: bool) -> StepOutcome:
    """The step of a rank that holds the whole model (``Replicated``)."""
    if e.master is not None and not e.model_parallel and hasattr(e.optimizer, "read_grads_from"):
        return _folded_step(e, e.master, need_norm)
    fp16 = e.spec.precision == "fp16"
    if e.master is not None:  # unscaled and checked in one pass per bucket
        bad = e.master.load_grads(e.buckets, e.loss_scaler.loss_scale)
        overflow, grads = fp16 and bad, e.master.flat
    else:
        grads = e.buckets.buffers()
        overflow = fp16 and has_inf_or_nan(grads)
    if e.model_parallel and fp16:
        overflow = _across_model(e, float(overflow), dist.ReduceOp.MAX) > 0
    e.loss_scaler.update(overflow)
    if overflow:
        return StepOutcome(True, None)
    clip = e.spec.gradient_clipping
    grad_norm = None
    if clip > 0 or need_norm:
        # The norm costs a pass over every gradient: only when clipping or logging needs it.
        if e.model_parallel:  # every stage's and tensor slice's gradients count
            norm = torch.tensor(_across_model(e, _local_sumsq(e))) ** 0.5
        else:
            norm = total_grad_norm(grads)
        grad_norm = float(norm)
        if clip > 0:
            clip_(grads, norm, clip)
    e.optimizer.step()
    if e.master is not None and not e.master.fused_copy:
        e.master.copy_to_model()  # the optimizer did not write the model's copy in its pass
    return StepOutcome(False, grad_norm)


def _folded_step(e: StepStates, master: MasterWeights, need_norm: bool) -> StepOutcome:
    """The mixed-precision step with a fused optimizer (flowtrain's Adam, Lion, SGD): the
    loss-scale division and the clipping are one factor the optimizer applies as it reads
    the reduced fp16/bf16 buckets, so no pass writes fp32 gradients or scales them. One
    read-only pass over the buckets gives the norm, which is not finite exactly when a
    gradient holds an inf or NaN (fp16's overflow check); bf16 skips it unless clipping
    or logging wants the norm."""
    from cuda_numba.ops import l2_norm

    halves = e.buckets.buffers()
    inv = 1.0 / e.loss_scaler.loss_scale
    fp16 = e.spec.precision == "fp16"
    clip = e.spec.gradient_clipping
    wants_norm = clip > 0 or need_norm
    norm = float(l2_norm(halves)) * inv if fp16 or wants_norm else 0.0
    overflow = fp16 and not math.isfinite(norm)
    e.loss_scaler.update(overflow)
    if overflow:
        return StepOutcome(True, None)
    scale = inv
    if clip > 0:  # torch's clip_grad_norm_ factor
        scale *= min(1.0, clip / (norm + 1e-6))
    optimizer: Any = e.optimizer  # a cuda_numba fused optimizer (replicated_step)
    optimizer.read_grads_from(zip(master.flat, halves), scale)
    e.optimizer.step()
    if not master.fused_copy:
        master.copy_to_model()
    return StepOutcome(False, norm if wants_norm else None)


def sharded_step(e: StepStates, need_norm: bool) -> StepOutcome:
    """The step of a rank that holds a shard of the optimizer states (``ShardedOptimizer``,
    ``ShardedParameters``): ZeRO's optimizer checks, clips and steps its shard."""
    if e.zero is None:
        raise RuntimeError("a ZeRO optimizer step on an engine built without ZeRO")
    skipped, norm = e.zero.step(loss_scale=e.loss_scaler.loss_scale,
                                fp16=e.spec.precision == "fp16",
                                clip=e.spec.gradient_clipping, need_norm=need_norm)
    e.loss_scaler.update(skipped)
    return StepOutcome(skipped, norm)


def _local_sumsq(e: StepStates) -> float:
    """This rank's share of the squared gradient norm: parameters split across the
    tensor-parallel group count whole, replicated ones 1/tp (every tp rank holds them)."""
    tp = e.grid.shape.tp if e.grid is not None else 1
    stepped = e.master.master if e.master is not None else e.trainable
    total = 0.0
    for param, tensor in zip(e.trainable, stepped):
        if tensor.grad is None:
            continue
        sq = float(tensor.grad.detach().float().square().sum())
        total += sq if getattr(param, "tensor_parallel", False) else sq / tp
    return total


def _across_model(e: StepStates, value: float, op: Any = None) -> float:
    """``value`` reduced (sum, or ``op``) over every rank: with pipeline or tensor
    parallelism each holds a different part of the model (data-parallel copies add the
    same reduced gradients: divided out)."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    if op is None or op == dist.ReduceOp.SUM:
        t /= e.world_size
    return float(t)
