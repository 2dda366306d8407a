"""How the engine's data-parallel ranks talk: the gradient reducer, the model broadcast at
the start, and the shared-memory channels. Each function takes what it reads as arguments;
the engine calls them as it builds (and peer recovery as it rebuilds) its group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flowtrain.engine.reducer import BucketReducer
from flowtrain.zero import construct

if TYPE_CHECKING:
    from flowtrain.engine.buckets import GradBuckets
    from flowtrain.engine.stages import Stages
    from flowtrain.parallel.grid import ProcessGrid
    from flowtrain.peer_recovery import PeerGroup
    from flowtrain.plan.spec import TrainingSpec
    from flowtrain.plan.step_plan import StepPlan
    from flowtrain.shm import ShmChannel
    from flowtrain.zero.sharded import ZeroOptimizer
    from flowtrain.zero.stage3 import Stage3Params


def make_reducer(buckets: GradBuckets, spec: TrainingSpec, *, world_size: int, group: Any,
                 comm_dtype: torch.dtype, stages: Stages, channel: ShmChannel | None,
                 zero: ZeroOptimizer | None, peer: PeerGroup | None) -> BucketReducer:
    """The actor that reduces ``buckets`` over the data-parallel ``group``: into ZeRO's
    gradient shards where they are scattered, summing only this rank's slices where they are
    sliced (except a bucket in the channel's arena, summed in place, whole)."""
    return BucketReducer(buckets, world_size=world_size, group=group, comm_dtype=comm_dtype,
                         predivide=spec.gradient_predivide, prescale=spec.prescale_gradients,
                         stages=stages, channel=channel,
                         shards=zero.grad_shards if zero is not None and zero.scattered
                         else None,
                         slices=zero.slices if zero is not None and zero.sliced and
                         not (channel is not None and channel.arena_bytes) else None,
                         interrupt=(lambda: peer.interrupt) if peer is not None else None)


def broadcast_model(module: torch.nn.Module, *, world_size: int, grid: ProcessGrid | None,
                    group: Any, peer: PeerGroup | None) -> None:
    """Every rank starts from rank 0's weights and buffers, as DDP does."""
    if world_size == 1:
        return
    from flowtrain import peer_recovery

    # under --peer-recovery a replacement may be group rank 0: the source is a survivor
    src = grid.dp_ranks[0] if grid is not None else peer_recovery.state_source()
    peer = peer or peer_recovery.current()
    with torch.no_grad():
        for tensor in list(module.parameters()) + list(module.buffers()):
            if construct.is_partitioned(tensor):
                continue  # zero.Init took rank 0's values when it partitioned it
            if peer is not None:
                peer.broadcast(tensor.data, src, "the model broadcast to a replacement")
            else:
                dist.broadcast(tensor.data, src=src, group=group)


def open_channel(rank: Any, spec: TrainingSpec, plan: StepPlan, *, comm_dtype: torch.dtype,
                 world_size: int, model_parallel: bool, module: torch.nn.Module,
                 arena_bytes: int) -> ShmChannel | None:
    """The data channel the reduces go over (``flowtrain.shm.data_channel``): the spec's
    choice, slots as large as the plan's largest bucket."""
    from flowtrain import shm

    slot = max(b.numel for b in plan.buckets) * torch.empty((), dtype=comm_dtype).element_size()
    return shm.data_channel(spec.host.data_channel, rank, world_size=world_size,
                            model_parallel=model_parallel, module=module,
                            largest_bucket_bytes=slot, arena_bytes=arena_bytes)


def open_param_channel(rank: Any, spec: TrainingSpec, *, channel: ShmChannel | None,
                       zero: ZeroOptimizer, stage3: Stage3Params | None) -> ShmChannel | None:
    """ZeRO on the shared-memory channel: a second channel for the parameters. With
    ``flowtrain.zero_shared_params`` it holds the host's one copy of them
    (``ZeroOptimizer.share_params``) and orders their writes and reads; otherwise, at stage
    3, it carries the parameter gathers, which the fetcher issues while the reducer's
    reduce-scatters are in flight (as they have a process group of their own on
    torch.distributed)."""
    if channel is None or any(s.device.type != "cpu" for s in zero.model_shards) or \
            any(f is not None and f.device.type != "cpu" for f in zero.flat_params):
        return None
    from flowtrain import comm, shm

    # A /dev/shm too small for either channel (open_channel's fallback) leaves each rank
    # its own copy of the parameters, and then stage 3's gathers to torch.distributed.
    if spec.shares_host_params(shm_channel=True):  # the channel is open here
        shared = shm.open_channel(rank, slot_bytes=64 + 64, timeout=comm.DEFAULT_TIMEOUT,
                                  shared_bytes=zero.shared_bytes(), fallback=True)
        if shared is not None:
            if stage3 is not None:
                stage3.share(shared)
            else:
                zero.share_params(shared)
            return shared
    if stage3 is None:
        return None
    elem = max(s.element_size() for s in zero.model_shards)
    largest = max(s.numel() for s in zero.model_shards) * elem
    gather = shm.open_channel(rank, slot_bytes=min(largest, 64 * 2**20) + 64,
                              timeout=comm.DEFAULT_TIMEOUT, fallback=True)
    if gather is not None:
        stage3.fetcher_actor.channel = gather
    return gather


def arena_bytes(spec: TrainingSpec, trainable: list[torch.nn.Parameter], *,
                comm_dtype: torch.dtype, bucket_pad: int) -> int:
    """The shared-memory arena the gradient buckets live in (0: none): buckets that last
    (data parallel and ZeRO stage 1, not the transient ones of stages 2-3) reduced in the
    gradients' own dtype. Room for every bucket of any order: each padded (to a multiple of
    ``bucket_pad``) and aligned, one per parameter at most."""
    if not spec.host.shm_arena or spec.reduction.every_micro_batch or \
            any(p.dtype != comm_dtype for p in trainable):
        return 0
    elem = torch.empty((), dtype=comm_dtype).element_size()
    return sum(p.numel() for p in trainable) * elem + \
        (64 + bucket_pad * elem) * (len(trainable) + 1)
