"""The optimizer side of ZeRO stages 1 and 2: fp32 master shards stepped by the user's optimizer,
the global overflow flag and gradient norm (one scalar all-reduce), and the post-step
all-gather of every bucket's parameters."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from flowtrain.engine.buckets import GradBuckets
from flowtrain.engine.mixed import point_optimizer_at
from flowtrain.zero.partition import Shard, flatten_params, shard_of

# torch >= 2.13 names the tensor collectives *_single; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ZeroOptimizer:
    """This rank's part of the optimizer under ZeRO stage 1 or 2.

    Per bucket: ``flat_params[i]`` (the model's parameters, padded), ``shards[i]`` (this rank's
    slice), ``master[i]`` (the fp32 tensor the optimizer steps: a view of the parameter slice
    for fp32 models, an fp32 copy for fp16/bf16) whose ``.grad`` is an fp32 shard buffer. With
    stage 2 the reducer reduce-scatters into ``grad_shards[i]`` (the fp32 ``.grad`` itself for
    fp32 models); with stage 1 the bucket is all-reduced and the shard copied out of it.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], buckets: GradBuckets, *,
                 stage: int, world_size: int, rank: int, group: Any = None,
                 reduce_scatter: bool = True) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroOptimizer implements stages 1 and 2, got {stage}")
        self.params = list(params)
        self.buckets = buckets
        self.stage = stage
        self.world_size = world_size
        self.rank = rank
        self.group = group
        self.flat_params = flatten_params(self.params, buckets.plan, world_size)
        self.shards: list[Shard] = [shard_of(b.numel, world_size, rank) for b in buckets.plan]
        self.model_shards = [flat.narrow(0, s.start, s.numel)
                             for flat, s in zip(self.flat_params, self.shards)]
        self.master: list[torch.nn.Parameter] = []
        self.grad_shards: list[torch.Tensor] = []
        self.aliased = all(f.dtype == torch.float32 for f in self.flat_params)
        for model_shard, grad_flat in zip(self.model_shards, buckets.flat):
            if model_shard.dtype == torch.float32:
                master = torch.nn.Parameter(model_shard)  # shares the parameters' memory
            else:
                master = torch.nn.Parameter(model_shard.detach().float().clone())
            master.grad = torch.zeros(model_shard.numel(), dtype=torch.float32,
                                      device=model_shard.device)
            self.master.append(master)
            if stage == 2:
                self.grad_shards.append(master.grad if grad_flat.dtype == torch.float32 else
                                        torch.zeros(model_shard.numel(), dtype=grad_flat.dtype,
                                                    device=grad_flat.device))
        # Stage 2 gradients arrive reduce-scattered only when a reducer runs (world size > 1);
        # zero_optimization.reduce_scatter false all-reduces and slices, as stage 1 does.
        self.scattered = stage == 2 and world_size > 1 and reduce_scatter
        self.fused_copy = False

    # -- the optimizer ---------------------------------------------------------------------------

    def replace_in_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Points the optimizer at this rank's master shards, so its state is 1/N of stage 0's.
        Several parameter groups are accepted only when they share every hyper-parameter (a
        shard mixes parameters of any group); they become one group."""
        if optimizer.state:
            raise ValueError("ZeRO needs an optimizer that has not stepped yet (its state "
                             "cannot be split into shards); build it fresh")
        groups = optimizer.param_groups
        settings = [{k: v for k, v in g.items() if k != "params"} for g in groups]
        if any(s != settings[0] for s in settings[1:]):
            differ = sorted({k for s in settings[1:] for k in s if s.get(k) != settings[0].get(k)})
            raise ValueError(f"ZeRO stage {self.stage}: parameter groups with different "
                             f"hyper-parameters ({', '.join(differ)}) are not supported yet "
                             f"with ZeRO; use one group, or stage 0")
        held = [p for g in groups for p in g["params"]]
        trainable = {id(p) for p in self.params}
        if any(id(p) not in trainable for p in held):
            raise ValueError("the optimizer holds a parameter that is not a trainable "
                             "parameter of the model")
        if len({id(p) for p in held}) != len(trainable):
            raise ValueError(f"ZeRO stage {self.stage} needs the optimizer to hold every "
                             f"trainable parameter of the model ({len(trainable)}); it holds "
                             f"{len({id(p) for p in held})}")
        del groups[1:]
        copies = [] if self.aliased else list(zip(self.master, self.model_shards))
        self.fused_copy = point_optimizer_at(optimizer, [self.master], copies)
        self.optimizer = optimizer

    def step(self, *, loss_scale: float, fp16: bool, clip: float, need_norm: bool,
             ) -> tuple[bool, float | None]:
        """Unscales the gradient shards, checks overflow and takes the global norm (one
        all-reduce of a float64 sum of squares: an inf/NaN anywhere makes it non-finite), clips,
        steps the optimizer and all-gathers the parameters. Returns (skipped, norm)."""
        grads = [m.grad for m in self.master]
        for i, grad in enumerate(grads):
            if self.scattered:
                src = self.grad_shards[i]
            else:
                s = self.shards[i]
                src = self.buckets.flat[i].narrow(0, s.start, s.numel)
            if src is not grad:
                grad.copy_(src)
        if loss_scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / loss_scale)
        clipping = bool(clip and clip > 0)
        norm = None
        if fp16 or clipping or need_norm:
            sumsq = torch.stack(torch._foreach_norm(grads, 2.0)).double().square().sum()
            if self.world_size > 1:
                dist.all_reduce(sumsq, group=self.group)
            total = float(sumsq)
            if fp16 and not math.isfinite(total):
                return True, None
            norm = math.sqrt(total)
            if clipping:
                coef = min(1.0, clip / (norm + 1e-6))
                if coef < 1.0:
                    torch._foreach_mul_(grads, coef)
        self.optimizer.step()
        if not self.aliased and not self.fused_copy:
            with torch.no_grad():
                torch._foreach_copy_(self.model_shards, [m.detach() for m in self.master])
        self.all_gather()
        return False, norm

    def all_gather(self) -> None:
        """Every rank's updated slice to every rank, in place: one collective per bucket."""
        if self.world_size == 1:
            return
        works = [_all_gather(flat, shard, group=self.group, async_op=True)
                 for flat, shard in zip(self.flat_params, self.model_shards)]
        for work in works:
            work.wait()

    def zero_grads(self) -> None:
        for m in self.master:
            m.grad.zero_()
        for g in self.grad_shards:
            g.zero_()

    def reload_from_model(self) -> None:
        """Master shards from the (just loaded) model parameters."""
        if not self.aliased:
            with torch.no_grad():
                for m, s in zip(self.master, self.model_shards):
                    m.copy_(s)

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "world_size": self.world_size, "rank": self.rank,
                "shards": [(s.start, s.numel, s.padded) for s in self.shards],
                "optimizer": self.optimizer.state_dict(),
                "master": None if self.aliased else [m.detach().clone() for m in self.master]}

    def load_state_dict(self, state: dict[str, Any], load_optimizer: bool = True) -> None:
        layout = [(s.start, s.numel, s.padded) for s in self.shards]
        if [tuple(x) for x in state["shards"]] != layout:
            raise ValueError(f"the checkpoint's ZeRO shards of rank {self.rank} do not match "
                             f"this engine's bucket layout (reduce_bucket_size or the model "
                             f"changed); resharding is not supported yet")
        if load_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        if state["master"] is not None and not self.aliased:
            with torch.no_grad():
                for m, t in zip(self.master, state["master"]):
                    m.copy_(t)
                for m, s in zip(self.master, self.model_shards):
                    s.copy_(m)
            self.all_gather()

    # -- memory ------------------------------------------------------------------------------------

    def memory_breakdown(self) -> dict[str, int]:
        def nbytes(ts: Any) -> int:
            return sum(t.numel() * t.element_size() for t in ts)

        out = {"parameters": nbytes(self.flat_params),
               "gradient_buckets": nbytes(self.buckets.flat),
               "gradient_shards": 0 if self.aliased or not self.grad_shards
               else nbytes(self.grad_shards),
               "master_weights": 0 if self.aliased else nbytes(self.master),
               "master_gradients": nbytes(m.grad for m in self.master)}
        if self.stage == 2 and self.aliased:
            out["gradient_shards"] = out["master_gradients"]  # the same memory, counted once
            out["master_gradients"] = 0
        return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v))


def process_rss() -> int:
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except ImportError:  # pragma: no cover - psutil is a dependency
        return 0
