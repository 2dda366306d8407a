"""The optimizer side of ZeRO stages 1-3: fp32 master shards stepped by the user's optimizer,
the global overflow flag and gradient norm (one scalar all-reduce), the post-step all-gather of
the buckets every rank keeps whole, and stage 3's partitioned parameter storage."""

from __future__ import annotations

import concurrent.futures
import math
import os
from collections.abc import Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from cuda_numba import unscale_and_check
from flowtrain import comm
from flowtrain.engine.buckets import GradBuckets
from flowtrain.engine.mixed import point_optimizer_at
from flowtrain.zero import construct
from flowtrain.zero.offload import Offloader, OffloadTarget
from flowtrain.zero.partition import Shard, flatten_params, padded_numel, shard_of


class ZeroOptimizer:
    """This rank's part of the model states under ZeRO stage 1, 2 or 3.

    Per bucket b of the plan: ``shards[b]`` (this rank's slice of the padded flat bucket),
    ``model_shards[b]`` (that slice of the model's parameters, model dtype), ``master[b]`` (the
    fp32 tensor the optimizer steps: ``model_shards[b]`` itself for fp32 models, an fp32 copy
    otherwise). Buckets every rank keeps whole (stages 1-2; stage 3's small resident
    parameters) have ``flat_params[b]``, the padded buffer the parameters are views of, which
    the post-step all-gather fills; stage 3's partitioned buckets keep only the shard
    (``flat_params[b]`` is None) and ``gather``/``release`` materialize the parameters around
    each use.

    Gradients: stage 1 all-reduces whole buckets and steps on this rank's slice; stages 2-3
    reduce-scatter each bucket every micro-batch and add the result into ``grad_shards[b]``
    (model dtype, the fp32 ``.grad`` itself for fp32 models). Mixed-precision master gradients
    exist only during the step, so the model states per rank are the ZeRO paper's.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], buckets: GradBuckets, *,
                 stage: int, world_size: int, rank: int, group: Any = None,
                 scattered: bool = False, sliced: bool = False, partitions: bool = False,
                 offload_optimizer: OffloadTarget | None = None,
                 offload_param: OffloadTarget | None = None, norm_over_world: bool = False,
                 tp: int = 1, mirrored: bool = False) -> None:
        self.params = list(params)
        self.buckets = buckets
        self.plan = buckets.plan
        self.stage = stage
        self.world_size = world_size
        self.rank = rank
        self.group = group
        # pipeline/tensor parallel: the other ranks' shards of other model parts count too
        self.norm_over_world = norm_over_world
        self.device = self.params[0].device
        # As the engine's strategy decides (flowtrain.engine.strategy, from the spec's
        # reduction): ``scattered``, the reducer reduce-scatters every micro-batch into this
        # rank's gradient shard; ``sliced``, gradient buckets stay whole and the reducer sums
        # only this rank's slice of each (the part it steps); ``partitions`` (ZeRO-3), a
        # partitioned bucket's parameters are held as this rank's shard. ``stage`` is the
        # record a checkpoint keeps.
        if scattered and sliced:
            raise ValueError("a ZeroOptimizer's gradients are scattered into a shard or kept "
                             "whole and sliced, not both")
        self.partitions = partitions
        self.scattered = scattered and world_size > 1
        self.partitioned = [partitions and world_size > 1 and b.partitioned for b in self.plan]
        self.sliced = sliced and world_size > 1
        self.shards: list[Shard] = [shard_of(b.numel, world_size, rank) for b in self.plan]
        # tensor parallel (``tp`` ranks): a parameter not split over the group is held alike by
        # all of them, so its share of the norm summed over the world counts 1/tp
        self.tp = tp
        self._replicated = self._replicated_runs() if tp > 1 else []
        param_device = self.device if offload_param is None else offload_param.device
        self.param_device = param_device
        self.flat_params, self.model_shards = self._lay_out_params(param_device)
        self.offloader = Offloader(offload_optimizer, self.device) \
            if offload_optimizer is not None else None
        master_device = self.offloader.device if self.offloader is not None else param_device
        self.master: list[torch.nn.Parameter] = []
        self.grad_shards: list[torch.Tensor] = []
        self.aliased = all(s.dtype == torch.float32 and s.device == master_device
                           for s in self.model_shards)
        for b, model_shard in enumerate(self.model_shards):
            if self.aliased:
                master = torch.nn.Parameter(model_shard)  # shares the parameters' memory
            else:
                master = torch.nn.Parameter(model_shard.detach().to(master_device,
                                                                    torch.float32).clone())
            self.master.append(master)
            if self.scattered:
                # accumulates over micro-batches; for fp32 it is the optimizer's .grad itself
                grad = torch.zeros(model_shard.numel(), dtype=model_shard.dtype,
                                   device=self.device)
                self.grad_shards.append(grad)
                if self.aliased:
                    master.grad = grad
            elif self.aliased:
                s = self.shards[b]  # stage 1 fp32: a view of the all-reduced bucket, no copy
                master.grad = buckets.buffer(b).narrow(0, s.start, s.numel)
        self._persistent_grads = self.aliased  # .grad is the bucket view or the grad shard
        # launch --peer-recovery: a mirror of the next rank's shard (flowtrain.zero.mirror)
        if mirrored and (self.scattered or offload_optimizer is not None or partitions):
            raise ValueError("a ZeRO shard mirror needs whole reduced gradients and the "
                             "optimizer on the compute device: stages 1-2 without "
                             "reduce-scatter or optimizer offload")
        self.mirrored = mirrored and world_size > 1
        self.mirror: Any = None
        self.fused_copy = False
        self.optimizer: torch.optim.Optimizer | None = None
        # the engine's shared-memory channel (ranks of one host, CPU): the after-step
        # all-gather goes through it instead of torch.distributed
        self.channel: Any = None
        # counts the collective writes to the model shards (steps, loads, publishes): with
        # host-shared parameters (``share_params``) a rank synchronizes before reading peers'
        # shards after one
        self.write_epoch = 0
        # host-shared parameters (``share_params``): the channel whose region holds them and
        # whose barriers order their writes and reads; stage 3's partitioned buckets there
        self.param_channel: Any = None
        self._param_timeout = comm.DEFAULT_TIMEOUT
        self.synced_epoch = 0  # the write epoch every rank's reads see since the last barrier
        self.shared: dict[int, torch.Tensor] = {}

    @property
    def slices(self) -> list[tuple[int, int]]:
        """This rank's (start, numel) in each bucket."""
        return [(s.start, s.numel) for s in self.shards]

    def _replicated_runs(self) -> list[tuple[int, int, int]]:
        """(bucket, start, length) runs of this rank's shards that hold parameters replicated
        over the tensor-parallel group (adjacent ones merged)."""
        runs: list[tuple[int, int, int]] = []
        for b, bucket in enumerate(self.plan):
            s = self.shards[b]
            for slot in bucket.slots:
                if getattr(self.params[slot.index], "tensor_parallel", False):
                    continue
                lo = max(slot.offset, s.start)
                hi = min(slot.offset + slot.numel, s.start + s.numel)
                if hi <= lo:
                    continue
                if runs and runs[-1][0] == b and runs[-1][1] + runs[-1][2] == lo - s.start:
                    runs[-1] = (b, runs[-1][1], runs[-1][2] + hi - lo)
                else:
                    runs.append((b, lo - s.start, hi - lo))
        return runs

    def _lay_out_params(self, param_device: torch.device,
                        ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
        whole = [b for b, part in zip(self.plan, self.partitioned) if not part]
        # parameters zero.Init partitioned: whole again where a bucket keeps them whole, and
        # otherwise gathered one at a time below, so the model is never whole on a rank
        construct.restore(self.params[slot.index] for b in whole for slot in b.slots)
        flats_whole = iter(flatten_params(self.params, whole, self.world_size))
        flats: list[torch.Tensor | None] = []
        shards: list[torch.Tensor] = []
        self._placeholders: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        with torch.no_grad():
            for b, bucket in enumerate(self.plan):
                s = self.shards[b]
                if not self.partitioned[b]:
                    flat = next(flats_whole)
                    flats.append(flat)
                    shards.append(flat.narrow(0, s.start, s.numel))
                    continue
                # stage 3: keep this rank's slice, drop the rest of every parameter
                first = self.params[bucket.slots[0].index]
                shard = torch.zeros(s.numel, dtype=first.dtype, device=param_device)
                for slot in bucket.slots:
                    param = self.params[slot.index]
                    lo, hi = max(slot.offset, s.start), min(slot.offset + slot.numel,
                                                           s.start + s.numel)
                    # every rank gathers a partitioned parameter, whether it keeps a piece
                    values = construct.full_flat(param) if construct.is_partitioned(param) \
                        else param.data.reshape(-1)
                    if lo < hi:
                        shard[lo - s.start:hi - s.start].copy_(
                            values[lo - slot.offset:hi - slot.offset])
                    construct.forget(param)
                    param.data = self._placeholder(first)
                flats.append(None)
                shards.append(shard.pin_memory() if _pin(param_device, self.device) else shard)
        return flats, shards

    def _placeholder(self, like: torch.Tensor) -> torch.Tensor:
        key = (like.dtype, like.device)
        if key not in self._placeholders:
            self._placeholders[key] = torch.empty(0, dtype=like.dtype, device=like.device)
        return self._placeholders[key]

    # -- stage 3: parameters around each use -----------------------------------------------------

    def start_gather(self, b: int, group: Any) -> tuple[Any, torch.Tensor]:
        """Launches the all-gather of partitioned bucket ``b`` into a new full buffer; returns
        (work, buffer). Runs on the ParamFetcher's thread."""
        shard = self.model_shards[b]
        full = torch.empty(self.shards[b].padded, dtype=shard.dtype, device=self.device)
        if shard.device != self.device:
            shard = shard.to(self.device, non_blocking=True)
        return comm.all_gather_single(full, shard, group=group, async_op=True), full

    def shared_layout(self) -> list[tuple[int, int, torch.dtype]]:
        """(bucket, byte offset, dtype) of each bucket's whole padded buffer in a host-shared
        region laid out by ``share_params``; the region's size is the last end."""
        out, at = [], 0
        for b, shard in enumerate(self.model_shards):
            out.append((b, at, shard.dtype))
            at += -(-self.shards[b].padded * shard.element_size() // 64) * 64
        return out

    def shared_bytes(self) -> int:
        layout = self.shared_layout()
        if not layout:
            return 0
        b, at, dtype = layout[-1]
        return at + self.shards[b].padded * torch.empty((), dtype=dtype).element_size()

    def share_params(self, channel: Any, timeout: float = comm.DEFAULT_TIMEOUT) -> None:
        """Moves the model's parameters into ``channel``'s shared region (``flowtrain.shm``),
        which every rank of this host maps: each bucket's whole padded buffer lies there once,
        and this rank's shard (and, for fp32 models, the master the optimizer steps in place)
        becomes its slice. The ranks' steps then write the host's one copy of the parameters:
        the buckets every rank keeps whole need no all-gather after the step (the model's
        parameters are views of the region), and stage 3 uses a partitioned bucket as a view
        of it (``shared``). Barriers order the writes and the reads: ``before_write`` before a
        step, and one where the all-gather was. Every rank must call it, with equal
        parameters (after the model broadcast)."""
        region = channel.shared_region()
        with torch.no_grad():
            for b, at, dtype in self.shared_layout():
                s = self.shards[b]
                nbytes = s.padded * torch.empty((), dtype=dtype).element_size()
                full = region[at:at + nbytes].view(dtype)
                mine = full.narrow(0, s.start, s.numel)
                mine.copy_(self.model_shards[b])
                # set_ keeps every holder of these tensors (the optimizer, a fused copy-out)
                where = (mine.untyped_storage(), mine.storage_offset(), mine.size(),
                         mine.stride())
                self.model_shards[b].set_(*where)
                if self.aliased:
                    self.master[b].set_(*where)
                if self.partitioned[b]:
                    self.shared[b] = full
                else:
                    self.flat_params[b] = full
                    self.attach(b, full)
        self.param_channel = channel
        self._param_timeout = timeout
        self.barrier("after moving the parameters into shared memory")
        self.synced_epoch = self.write_epoch

    def unshare_params(self) -> None:
        """The model's whole parameters back in this process's own memory (the engine is done:
        what a rank then does to its model stays its own)."""
        if self.param_channel is None:
            return
        with torch.no_grad():
            for b, full in enumerate(self.flat_params):
                if full is not None:
                    own = full.clone()
                    self.flat_params[b] = own
                    self.attach(b, own)
        self.param_channel = None

    def barrier(self, what: str) -> None:
        """Every rank of the host-shared parameters reaches this point (``what`` names it in
        the error of a rank that does not)."""
        future = self.param_channel.barrier_async()
        try:
            future.result(timeout=self._param_timeout)
        except concurrent.futures.TimeoutError:
            raise comm.CollectiveTimeout(f"ZeRO shared parameters: a rank did not reach the "
                                         f"barrier {what} within {self._param_timeout:g} s"
                                         ) from None

    def published(self) -> None:
        """Every rank's latest writes to the host-shared parameters visible before this rank
        reads a peer's slice (a barrier where a write came since the last one)."""
        if self.param_channel is not None and self.synced_epoch != self.write_epoch:
            self.barrier("before reading the parameters")
            self.synced_epoch = self.write_epoch

    def before_write(self) -> None:
        """Every rank done reading the host-shared parameters before the shards change (the
        optimizer step, a published modification); a no-op without them."""
        if self.param_channel is not None:
            self.barrier("before the parameter shards change")

    def attach(self, b: int, full: torch.Tensor) -> None:
        """Makes bucket ``b``'s parameters views of a gathered buffer (training thread)."""
        for slot in self.plan[b].slots:
            self.params[slot.index].data = full.narrow(0, slot.offset, slot.numel).view(slot.shape)

    def release(self, b: int) -> None:
        """Drops bucket ``b``'s gathered parameters: each becomes an empty placeholder."""
        for slot in self.plan[b].slots:
            param = self.params[slot.index]
            param.data = self._placeholder(param)

    def store_full(self, b: int, full: torch.Tensor) -> None:
        """Bucket ``b``'s whole padded values ``full`` (the same on every rank) become the
        model's: this rank's model shard takes its slice and the fp32 master shard follows, so
        the next step starts from them."""
        s = self.shards[b]
        with torch.no_grad():
            shard = self.model_shards[b]
            piece = full.narrow(0, s.start, s.numel)
            if shard.data_ptr() != piece.data_ptr():
                shard.copy_(piece)
            if not self.aliased:
                self.master[b].copy_(shard)
        self.write_epoch += 1

    def partitioned_numel(self, b: int) -> int:
        return self.plan[b].numel

    # -- the optimizer ---------------------------------------------------------------------------

    def replace_in_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Points the optimizer at this rank's master shards, so its state is 1/N of stage 0's.
        Buckets never mix parameter groups, so each group keeps its hyper-parameters and steps
        the shards of its own buckets."""
        if optimizer.state:
            raise ValueError("ZeRO needs an optimizer that has not stepped yet (its state "
                             "cannot be split into shards); build it fresh")
        held = [p for g in optimizer.param_groups for p in g["params"]]
        trainable = {id(p) for p in self.params}
        if any(id(p) not in trainable for p in held):
            raise ValueError("the optimizer holds a parameter that is not a trainable "
                             "parameter of the model")
        if len({id(p) for p in held}) != len(trainable):
            raise ValueError(f"ZeRO stage {self.stage} needs the optimizer to hold every "
                             f"trainable parameter of the model ({len(trainable)}); it holds "
                             f"{len({id(p) for p in held})}")
        groups = [[m for m, b in zip(self.master, self.plan) if b.group == g]
                  for g in range(len(optimizer.param_groups))]
        copies = [] if self.aliased or self.offloader is not None else \
            list(zip(self.master, self.model_shards))
        self.fused_copy = point_optimizer_at(optimizer, groups, copies)
        self.optimizer = optimizer
        if self.mirrored:
            from flowtrain.zero.mirror import ShardMirror

            self.mirror = ShardMirror(self, optimizer)

    def _stepped_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer ``replace_in_optimizer`` pointed at the master shards."""
        if self.optimizer is None:
            raise RuntimeError("this ZeroOptimizer has no optimizer yet: replace_in_optimizer "
                               "must be called before steps and checkpoints")
        return self.optimizer

    def step(self, *, loss_scale: float, fp16: bool, clip: float, need_norm: bool,
             ) -> tuple[bool, float | None]:
        """Takes the global norm of the (scaled) gradients (one all-reduce of a float64 sum of
        squares: an inf/NaN anywhere makes it non-finite), unscales and clips in one multiply
        (which a fused optimizer applies as it reads the reduced shards), steps the optimizer
        (shard by shard, overlapping copies, with CPU offload) and brings the model's
        parameters up to date. Returns (skipped, norm)."""
        sources = self._grad_sources()
        clipping = bool(clip and clip > 0)
        norm = None
        coef = 1.0 / loss_scale
        if fp16 or clipping or need_norm:
            norms = list(torch._foreach_norm(sources, 2.0, dtype=torch.float32)) if sources else []
            sumsq = torch.stack(norms).double().square().sum() if norms else \
                torch.zeros((), dtype=torch.float64, device=self.device)
            if self._replicated:
                views = [sources[b].narrow(0, start, n) for b, start, n in self._replicated]
                rep = torch.stack(torch._foreach_norm(views, 2.0, dtype=torch.float32))
                sumsq = sumsq - rep.double().square().sum() * (1.0 - 1.0 / self.tp)
            if self.norm_over_world:
                dist.all_reduce(sumsq)
            elif self.world_size > 1:
                dist.all_reduce(sumsq, group=self.group)
            total = float(sumsq) / (loss_scale * loss_scale)
            if fp16 and not math.isfinite(total):
                return True, None
            norm = math.sqrt(total)
            if clipping:
                coef *= min(1.0, clip / (norm + 1e-6))
        if self.offloader is not None:
            self.offloader.step(self, sources, coef)
        else:
            optimizer = self._stepped_optimizer()
            self._step_shards(optimizer, self.master, sources, coef, self._persistent_grads)
            if self.mirror is not None:  # the same step on the next rank's shard
                self.mirror.follow(optimizer)
                self._step_shards(self.mirror.optimizer, self.mirror.master,
                                  self.mirror.sources(self), coef, self._persistent_grads)
            if not self.aliased and not self.fused_copy:
                with torch.no_grad():
                    torch._foreach_copy_(self.model_shards, [m.detach() for m in self.master])
        self.write_epoch += 1
        self.all_gather()
        return False, norm

    @staticmethod
    def _step_shards(optimizer: torch.optim.Optimizer, masters: Sequence[torch.nn.Parameter],
                     sources: Sequence[torch.Tensor], coef: float, persistent: bool) -> None:
        """Steps ``optimizer`` over ``masters`` on the reduced gradients ``sources`` times
        ``coef``. flowtrain's fused optimizers read each shard's reduced gradient times coef
        themselves (read_grads_from): no pass writes or scales fp32 gradients."""
        fold = hasattr(optimizer, "read_grads_from")
        kept, pairs = [], []
        for master, src in zip(masters, sources):
            if not persistent:
                grad = torch.empty(src.shape, dtype=torch.float32, device=src.device)
                if fold:  # never written: it only gives the optimizer its layout
                    pairs.append((grad, src))
                else:  # the fp32 copy and the unscale/clip multiply in one pass per shard
                    unscale_and_check(src, grad, coef)
                master.grad = grad
            elif master.grad is None:  # kept since __init__
                raise RuntimeError("a ZeRO master shard has no gradient at the step")
            elif fold:
                pairs.append((master.grad, master.grad))
            else:
                kept.append(master.grad)
        if coef != 1.0 and kept:
            torch._foreach_mul_(kept, coef)
        if fold:
            cast(Any, optimizer).read_grads_from(pairs, coef)
        optimizer.step()
        if not persistent:
            for master in masters:
                master.grad = None

    def _grad_sources(self) -> list[torch.Tensor]:
        """Each bucket's reduced gradient slice for this rank (still loss-scaled)."""
        if self.scattered:
            return list(self.grad_shards)
        return [self.buckets.buffer(b).narrow(0, s.start, s.numel)
                for b, s in enumerate(self.shards)]

    def all_gather(self) -> None:
        """Every rank's updated slice to every rank, in place, for the buckets kept whole: one
        collective per bucket. Stage 3's partitioned buckets are gathered on use."""
        if self.world_size == 1:
            return
        if self.param_channel is not None:
            # each rank wrote its slice of the host's one copy: visible once all have
            self.barrier("after the parameter shards changed")
            self.synced_epoch = self.write_epoch
            return
        pairs = [(flat, shard) for flat, shard in zip(self.flat_params, self.model_shards)
                 if flat is not None]
        if self.channel is not None:
            for future in [self.channel.all_gather_async(f, s) for f, s in pairs]:
                future.result()
            return
        works = [comm.all_gather_single(flat, shard, group=self.group, async_op=True)
                 for flat, shard in pairs]
        for work in works:
            work.wait()

    def sync_model_from_master(self) -> None:
        """After master shards were loaded: model shards from them, then the all-gather."""
        if not self.aliased:
            with torch.no_grad():
                for m, s in zip(self.master, self.model_shards):
                    s.copy_(m.detach())
        self.write_epoch += 1
        self.all_gather()

    def zero_grads(self) -> None:
        for g in self.grad_shards:
            g.zero_()

    def reload_from_model(self) -> None:
        """Master shards from the (just loaded) model parameters."""
        if not self.aliased:
            with torch.no_grad():
                for m, s in zip(self.master, self.model_shards):
                    m.copy_(s)

    def full_flat(self, b: int) -> torch.Tensor:
        """Bucket ``b``'s whole padded parameter buffer (gathered now for a partitioned
        bucket; the caller must be on every rank)."""
        flat = self.flat_params[b]
        if flat is not None:
            return flat
        work, full = self.start_gather(b, self.group)
        work.wait()
        return full

    # -- checkpoints (same world size; flowtrain.engine checkpoints reshard) -----------------------

    def state_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "world_size": self.world_size, "rank": self.rank,
                "shards": [(s.start, s.numel, s.padded) for s in self.shards],
                "optimizer": self._stepped_optimizer().state_dict(),
                "master": None if self.aliased else [m.detach().clone() for m in self.master],
                "model_shards": [s.detach().clone() for s in self.model_shards]
                if self.partitions else None}

    def load_state_dict(self, state: dict[str, Any], load_optimizer: bool = True) -> None:
        layout = [(s.start, s.numel, s.padded) for s in self.shards]
        if [tuple(x) for x in state["shards"]] != layout:
            raise ValueError(f"the checkpoint's ZeRO shards of rank {self.rank} do not match "
                             f"this engine's bucket layout (reduce_bucket_size or the model "
                             f"changed)")
        if load_optimizer:
            self._stepped_optimizer().load_state_dict(state["optimizer"])
        with torch.no_grad():
            if state.get("model_shards") is not None:
                for s, t in zip(self.model_shards, state["model_shards"]):
                    s.copy_(t)
            if state["master"] is not None and not self.aliased:
                for m, t in zip(self.master, state["master"]):
                    m.copy_(t)
        self.sync_model_from_master()

    # -- memory ------------------------------------------------------------------------------------

    def memory_breakdown(self) -> dict[str, int]:
        def nbytes(ts: Any) -> int:
            return sum(t.numel() * t.element_size() for t in ts if t is not None)

        partitioned = nbytes(s for s, p in zip(self.model_shards, self.partitioned) if p)
        out = {"parameters": nbytes(self.flat_params) + partitioned,
               "gradient_buckets": self.buckets.pool_bytes if self.buckets.transient
               else nbytes(self.buckets.flat),
               "gradient_shards": 0 if self.aliased else nbytes(self.grad_shards),
               "master_weights": 0 if self.aliased else nbytes(self.master),
               "master_gradients": nbytes(m.grad for m in self.master
                                          if m.grad is not None and not self.scattered)}
        if self.aliased:
            if self.scattered:
                out["gradient_shards"] = nbytes(self.grad_shards)
            else:  # stage 1 fp32: views of the buckets, counted there
                out["master_gradients"] = 0
        if self.offloader is not None:
            out["offloaded"] = self.offloader.bytes(self)
        return out


def _pin(storage: torch.device, compute: torch.device) -> bool:
    return storage.type == "cpu" and compute.type == "cuda" and torch.cuda.is_available()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if torch.is_tensor(v))


def process_rss() -> int:
    try:
        import psutil

        return int(psutil.Process(os.getpid()).memory_info().rss)
    except ImportError:  # pragma: no cover - psutil is a dependency
        return 0


__all__ = ["ZeroOptimizer", "optimizer_state_bytes", "padded_numel", "process_rss"]
