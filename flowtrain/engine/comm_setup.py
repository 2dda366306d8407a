"""How the engine's data-parallel ranks talk: the gradient reducer, the model broadcast at
the start, and the shared-memory channels (a mixin of ``FlowtrainEngine``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flowtrain.engine.reducer import BucketReducer
from flowtrain.zero import construct

if TYPE_CHECKING:
    from flowtrain.engine.buckets import GradBuckets
    from flowtrain.engine.strategy import Strategy
    from flowtrain.parallel.grid import ProcessGrid
    from flowtrain.plan.spec import TrainingSpec
    from flowtrain.plan.step_plan import StepPlan
    from flowtrain.zero.sharded import ZeroOptimizer


class EngineComm:
    # Set by FlowtrainEngine.__init__; declared for the checks of the methods below.
    peer: Any
    module: torch.nn.Module
    buckets: GradBuckets
    world_size: int
    dp_group: Any
    comm_dtype: torch.dtype
    stages: Any
    channel: Any
    zero: ZeroOptimizer | None
    strategy: Strategy
    spec: TrainingSpec
    stage3: Any
    grid: ProcessGrid | None
    model_parallel: bool
    transient: bool
    trainable: list[torch.nn.Parameter]
    plan: StepPlan
    reducer: Any
    _reducer_actor: Any
    _rank: Any
    _runtime: Any

    def _spawn_reducer(self) -> None:
        peer = self.peer
        reducer = BucketReducer(self.buckets, world_size=self.world_size, group=self.dp_group,
                                comm_dtype=self.comm_dtype,
                                predivide=self.spec.gradient_predivide,
                                prescale=self.spec.prescale_gradients, stages=self.stages,
                                channel=self.channel,
                                shards=self.zero.grad_shards if self.zero is not None and
                                self.zero.scattered else None,
                                # a bucket in the channel's arena is summed in place, whole
                                slices=self.zero.slices if self.zero is not None and
                                self.zero.sliced and not (self.channel is not None and
                                                          self.channel.arena_bytes) else None,
                                interrupt=(lambda: peer.interrupt) if peer is not None else None)
        self.reducer = self._runtime.spawn(reducer)  # a unique name: engines may be rebuilt
        self._reducer_actor = reducer

    def _broadcast_model(self) -> None:
        """Every rank starts from rank 0's weights and buffers, as DDP does."""
        if self.world_size == 1:
            return
        from flowtrain import peer_recovery

        # under --peer-recovery a replacement may be group rank 0: the source is a survivor
        src = self.grid.dp_ranks[0] if self.grid is not None else peer_recovery.state_source()
        peer = getattr(self, "peer", None) or peer_recovery.current()
        with torch.no_grad():
            for tensor in list(self.module.parameters()) + list(self.module.buffers()):
                if construct.is_partitioned(tensor):
                    continue  # zero.Init took rank 0's values when it partitioned it
                if peer is not None:
                    peer.broadcast(tensor.data, src, "the model broadcast to a replacement")
                else:
                    dist.broadcast(tensor.data, src=src, group=self.dp_group)

    def _open_channel(self, choice: str | None) -> Any:
        """The data channel the reduces go over (``flowtrain.shm.data_channel``)."""
        from flowtrain import shm

        if self._rank is None:
            from flowtrain.runtime.rank import current_rank

            self._rank = current_rank()
        slot = max(b.numel for b in self.plan.buckets) * \
            torch.empty((), dtype=self.comm_dtype).element_size()
        return shm.data_channel(choice, self._rank, world_size=self.world_size,
                                model_parallel=self.model_parallel, module=self.module,
                                largest_bucket_bytes=slot, arena_bytes=self._arena_bytes())

    def _open_param_channel(self) -> Any:
        """ZeRO on the shared-memory channel: a second channel for the parameters. With
        ``flowtrain.zero_shared_params`` it holds the host's one copy of them
        (``ZeroOptimizer.share_params``) and orders their writes and reads; otherwise, at stage
        3, it carries the parameter gathers, which the fetcher issues while the reducer's
        reduce-scatters are in flight (as they have a process group of their own on
        torch.distributed)."""
        if self.channel is None or self.zero is None or \
                any(s.device.type != "cpu" for s in self.zero.model_shards) or \
                any(f is not None and f.device.type != "cpu" for f in self.zero.flat_params):
            return None
        from flowtrain import comm, shm

        # A /dev/shm too small for either channel (open_channel's fallback) leaves each rank
        # its own copy of the parameters, and then stage 3's gathers to torch.distributed.
        if self.spec.shares_host_params(shm_channel=True):  # the channel is open here
            channel = shm.open_channel(self._rank, slot_bytes=64 + 64,
                                       timeout=comm.DEFAULT_TIMEOUT,
                                       shared_bytes=self.zero.shared_bytes(), fallback=True)
            if channel is not None:
                if self.stage3 is not None:
                    self.stage3.share(channel)
                else:
                    self.zero.share_params(channel)
                return channel
        if self.stage3 is None:
            return None
        elem = max(s.element_size() for s in self.zero.model_shards)
        largest = max(s.numel() for s in self.zero.model_shards) * elem
        gather = shm.open_channel(self._rank, slot_bytes=min(largest, 64 * 2**20) + 64,
                                  timeout=comm.DEFAULT_TIMEOUT, fallback=True)
        if gather is not None:
            self.stage3.fetcher_actor.channel = gather
        return gather

    def _arena_bytes(self) -> int:
        """The shared-memory arena the gradient buckets live in (0: none): buckets that last
        (data parallel and ZeRO stage 1, not the transient ones of stages 2-3) reduced in the
        gradients' own dtype. Room for every bucket of any order: each padded and aligned, one
        per parameter at most."""
        if not self.spec.host.shm_arena or self.transient or \
                any(p.dtype != self.comm_dtype for p in self.trainable):
            return 0
        elem = torch.empty((), dtype=self.comm_dtype).element_size()
        pad = self.strategy.bucket_pad
        return sum(p.numel() for p in self.trainable) * elem + \
            (64 + pad * elem) * (len(self.trainable) + 1)
