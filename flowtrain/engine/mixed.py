"""fp32 master weights for fp16/bf16 training: the optimizer steps fp32 copies whose gradients
are the reduced half-precision buckets, unscaled in one pass per bucket; and the flat layout of
parameters per bucket that lets a fused optimizer step a whole bucket in one kernel call."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cuda_numba import unscale_and_check
from flowtrain.engine.buckets import GradBuckets


class MasterWeights:
    """fp32 copies of the model's half-precision parameters.

    The master gradients mirror the bucket layout (one fp32 flat buffer per bucket, each master
    parameter's ``.grad`` a view into it), so moving reduced gradients over is one cast-and-copy
    per bucket and the loss-scale division rides along.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.model_params = list(params)
        self.master = [torch.nn.Parameter(p.detach().clone().float()) for p in self.model_params]
        self.flat: list[torch.Tensor] = []
        self.fused_copy = False
        self.optimizer: torch.optim.Optimizer | None = None

    def copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(master, model tensor) pairs a fused optimizer writes after each step."""
        return list(zip(self.master, (p.data for p in self.model_params)))

    def layout_grads(self, buckets: GradBuckets) -> None:
        """(Re)lays the master weights and their fp32 gradients out in the buckets' layout: one
        flat buffer of each per bucket, every master parameter and its ``.grad`` a view."""
        self.flat = []
        for bucket in buckets.plan:
            device = buckets.buffer(bucket.index).device
            weights = torch.empty(bucket.numel, dtype=torch.float32, device=device)
            flat = torch.zeros(bucket.numel, dtype=torch.float32, device=device)
            self.flat.append(flat)
            for slot in bucket.slots:
                master = self.master[slot.index]
                view = weights.narrow(0, slot.offset, slot.numel).view(slot.shape)
                view.copy_(master.detach())
                master.data = view
                master.grad = flat.narrow(0, slot.offset, slot.numel).view(slot.shape)
        if self.fused_copy and self.optimizer is not None:  # the copies moved with the layout
            point_optimizer_at(self.optimizer, [g["params"] for g in self.optimizer.param_groups],
                               self.copies())

    def load_grads(self, buckets: GradBuckets, loss_scale: float) -> bool:
        """master grad = reduced half grad / loss_scale, in one pass per bucket that also
        checks it: returns True when any gradient holds an inf or NaN."""
        overflow = False
        for master, half in zip(self.flat, buckets.buffers()):
            overflow |= unscale_and_check(half, master, 1.0 / loss_scale)
        return overflow

    def copy_to_model(self) -> None:
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.model_params], tuple(self.master))

    def replace_in_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Points the optimizer's parameter groups at the master copies instead of the model's
        half-precision parameters (as DeepSpeed's fp16 optimizer wrapper does)."""
        index = {id(p): i for i, p in enumerate(self.model_params)}
        groups = []
        for group in optimizer.param_groups:
            replaced = []
            for p in group["params"]:
                i = index.get(id(p))
                if i is None:
                    raise ValueError("the optimizer holds a parameter that is not a trainable "
                                     "parameter of the model")
                replaced.append(self.master[i])
            groups.append(replaced)
        self.fused_copy = point_optimizer_at(optimizer, groups, self.copies())
        self.optimizer = optimizer
        if optimizer.state:
            moved = {}
            for p, state in optimizer.state.items():
                i = index.get(id(p))
                moved[self.master[i] if i is not None else p] = state
            optimizer.state.clear()
            optimizer.state.update(moved)

    def state_dict(self) -> list[torch.Tensor]:
        return [m.detach().clone() for m in self.master]

    def load_state_dict(self, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != len(self.master):
            raise ValueError(f"checkpoint has {len(tensors)} master weights, the model has "
                             f"{len(self.master)} trainable parameters")
        with torch.no_grad():
            for m, t in zip(self.master, tensors):
                m.copy_(t)
        self.copy_to_model()


def lay_out_flat(buckets: GradBuckets, master: MasterWeights | None) -> None:
    """Re-homes every parameter as a view into one flat buffer per bucket, in the buckets'
    layout (and the master weights with it), so parameters, gradients and optimizer state of a
    bucket lie end to end and a fused optimizer steps the bucket in one kernel call. Values
    are unchanged; parameters that are not contiguous keep their own memory."""
    for bucket, grads in zip(buckets.plan, buckets.buffers()):
        weights = torch.empty(bucket.numel, dtype=grads.dtype, device=grads.device)
        for slot in bucket.slots:
            param = buckets.params[slot.index]
            if param.is_contiguous():
                view = weights.narrow(0, slot.offset, slot.numel).view(slot.shape)
                view.copy_(param.detach())
                param.data = view
    if master is not None:
        master.layout_grads(buckets)


def point_optimizer_at(optimizer: torch.optim.Optimizer, groups: Sequence[Sequence[torch.Tensor]],
                       copies: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Makes ``groups[i]`` the parameters of the optimizer's group i (fp32 master copies, or
    ZeRO's master shards). ``copies`` pairs each stepped tensor with the lower-precision model
    tensor it must be written to after a step; a fused optimizer writes them in its own pass
    (returns True), otherwise the caller copies them."""
    for group, params in zip(optimizer.param_groups, groups, strict=True):
        group["params"] = list(params)
    if not (copies and hasattr(optimizer, "write_model_copies")
            and all(model.is_contiguous() for _, model in copies)):
        return False
    optimizer.write_model_copies(copies)
    return True


def total_grad_norm(flats: Sequence[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all gradients together, computed per flat buffer then combined (the
    same reduction order torch.nn.utils.clip_grad_norm_ uses: per-tensor norms, then their norm)."""
    if not flats:
        return torch.zeros(())
    norms = torch._foreach_norm([f.float() if f.dtype != torch.float32 else f for f in flats], 2.0)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0)


def clip_(flats: Sequence[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scales gradients by min(1, max_norm / (norm + 1e-6)), as torch's clip_grad_norm_ does."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    torch._foreach_mul_(list(flats), coef)
