"""ZeRO stage 3: each module's parameters exist whole only around its use.

The ``ParamFetcher`` actor owns the parameter all-gathers (on a process group of their own, so
they never interleave with the gradient reduces). ``Stage3Params`` hooks every module that owns
partitioned parameters: before the module runs (forward, and backward through a hook on its
outputs' gradients) it asks the fetcher for the module's buckets, plus a prefetch window of the
buckets the observed order says come next; after forward the buckets are released unless they
are used again within ``stage3_max_reuse_distance`` elements, and after backward once their
gradients have landed. Small parameters (``stage3_param_persistence_threshold``) never leave.

Ranks of one host on the CPU (the shared-memory channel) keep the host's one copy of the
parameters in shared memory instead (``ZeroOptimizer.share_params``): each rank still owns and
steps only its shard, but using a bucket is a view of the shared buffer, with a barrier before
a step writes the shards and before the first use after one, in place of the gathers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flowtrain import comm
from flowtrain.engine.timing import completion_stamp, stamped_end
from flowtrain.log import get_logger
from flowtrain.plan import names
from flowtrain.plan.stage3 import prefetch_window, reused_soon
from flowtrain.runtime.actor import Actor, handler

if TYPE_CHECKING:
    from flowtrain.zero.sharded import ZeroOptimizer

log = get_logger("flowtrain.zero")


@dataclass(frozen=True)
class Gather:
    need: tuple[int, ...]  # buckets needed now, in this order
    prefetch: tuple[int, ...] = ()  # buckets to start gathering for the coming uses
    # the use that needs them (the plan names a gather by the pass and micro-batch it serves)
    direction: str = "fwd"
    micro_batch: int = 0


@dataclass(frozen=True)
class Gathered:
    buffers: tuple[torch.Tensor, ...]  # the full padded buffers of ``need``
    spans: tuple[tuple[str, float, float], ...] = ()


@dataclass(frozen=True)
class Discard:
    """Drop every prefetched buffer (the optimizer step made them stale)."""


class ParamFetcher(Actor):
    """Launches and awaits the all-gathers of partitioned parameter buckets, in the order asked
    (the same on every rank), keeping prefetched buffers until they are needed."""

    mailbox_size = 1024

    def __init__(self, zero: ZeroOptimizer, group: Any, timeout: float = comm.DEFAULT_TIMEOUT
                 ) -> None:
        self.zero = zero
        self.group = group
        self.timeout = timeout
        self._inflight: dict[int, tuple[Any, torch.Tensor, float, list[float]]] = {}
        self.gathered_numel = 0  # elements gathered so far (for tests and the throughput log)
        # a shared-memory channel of the gathers' own (ranks of one host, CPU), used instead
        # of the group: only this actor issues on it, in the same order on every rank
        self.channel: Any = None

    def _start(self, b: int) -> None:
        if b not in self._inflight:
            if self.channel is not None:
                shard = self.zero.model_shards[b]
                full = torch.empty(self.zero.shards[b].padded, dtype=shard.dtype)
                work: Any = self.channel.all_gather_async(full, shard)
            else:
                work, full = self.zero.start_gather(b, self.group)
            self._inflight[b] = (work, full, time.perf_counter(), completion_stamp(work))
            self.gathered_numel += full.numel()

    async def _wait(self, work: Any, what: str) -> None:
        if not isinstance(work, concurrent.futures.Future):
            await comm.wait(work, what, self.timeout)
            return
        try:
            with comm.waiting(what):
                await asyncio.wait_for(asyncio.wrap_future(work), self.timeout)
        except TimeoutError:
            raise comm.CollectiveTimeout(f"{what} did not finish within {self.timeout:g} s") \
                from None

    @handler
    async def gather(self, msg: Gather) -> Gathered:
        for b in msg.need + msg.prefetch:
            self._start(b)
        out, spans = [], []
        for b in msg.need:
            work, full, launched, stamp = self._inflight.pop(b)
            await self._wait(work, f"ZeRO-3 all-gather of parameter bucket {b} "
                                   f"({full.numel()} x {full.dtype})")
            spans.append((names.gather(b, msg.direction, msg.micro_batch), launched,
                          stamped_end(stamp)))
            out.append(full)
        return Gathered(tuple(out), tuple(spans))

    @handler
    async def discard(self, msg: Discard) -> None:
        for b, (work, _full, *_) in list(self._inflight.items()):
            await self._wait(work, f"ZeRO-3 all-gather of parameter bucket {b} (prefetched, "
                                   f"unused)")
        self._inflight.clear()


class Stage3Params:
    """The training thread's side of stage 3: module hooks, the observed use order (recorded
    over the first training micro-batch), prefetch and release decisions."""

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter],
                 zero: ZeroOptimizer,
                 fetcher: Any, *, prefetch_numel: int, max_live_numel: int,
                 max_reuse_distance: int, timeout: float = comm.DEFAULT_TIMEOUT) -> None:
        self.zero = zero
        self.fetcher = fetcher
        self.fetcher_actor: Any = None  # the ParamFetcher itself (its counters)
        self.prefetch_numel = prefetch_numel
        self.max_live_numel = max_live_numel
        self.max_reuse_distance = max_reuse_distance
        self.timeout = timeout
        self.live: dict[int, torch.Tensor] = {}
        self.requested: set[int] = set()
        self.trace: list[int] | None = None  # bucket uses of one training micro-batch
        self._recording: list[int] | None = None
        self._pos = 0
        self._in_micro_batch = False
        self._keep: set[int] = set()  # kept after forward: backward needs them, no hook saw it
        self._direction = "fwd"  # the pass now running, and its micro-batch
        self._micro_batch = 0
        self.spans: list[tuple[str, float, float]] = []
        self._numel = [b.numel for b in zero.plan]
        index = {id(p): i for i, p in enumerate(params)}
        bucket_of = {s.index: b.index for b in zero.plan for s in b.slots}
        self._handles: list[Any] = []
        for mod in module.modules():
            units = sorted({bucket_of[index[id(p)]] for p in mod._parameters.values()
                            if p is not None and id(p) in index
                            and zero.partitioned[bucket_of[index[id(p)]]]})
            if units:
                self._handles.append(mod.register_forward_pre_hook(self._pre_hook(tuple(units))))
                self._handles.append(mod.register_forward_hook(self._post_hook(tuple(units))))

    # -- hooks ---------------------------------------------------------------------------------

    def _pre_hook(self, units: tuple[int, ...]) -> Any:
        def hook(_module: Any, _inputs: Any) -> None:
            self.use(units)
        return hook

    def _post_hook(self, units: tuple[int, ...]) -> Any:
        def hook(_module: Any, _inputs: Any, output: Any) -> None:
            hooked = False
            if torch.is_grad_enabled():
                fired = [False]

                def before_backward(grad: torch.Tensor) -> torch.Tensor:
                    if not fired[0]:
                        fired[0] = True
                        self.use(units)
                    return grad

                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(before_backward)
                        hooked = True
                if not hooked:
                    self._keep.update(units)
            for b in units:
                if b not in self._keep and not self._reused_soon(b):
                    self._release(b)
        return hook

    # -- use, prefetch, release ------------------------------------------------------------------

    def share(self, channel: Any) -> None:
        """Host-shared parameters from here on: every bucket moves into ``channel``'s shared
        region (``ZeroOptimizer.share_params``); every rank must call it."""
        self.release_all()
        self.zero.share_params(channel, self.timeout)

    def use(self, units: tuple[int, ...]) -> None:
        if self._recording is not None:
            self._recording.extend(units)
        if self.zero.param_channel is not None:
            self.zero.published()
            for b in units:
                if b not in self.live:
                    full = self.zero.shared[b]
                    self.zero.attach(b, full)
                    self.live[b] = full
            return
        prefetch = self._advance_and_prefetch(units) if self._in_micro_batch else ()
        need = tuple(b for b in units if b not in self.live)
        if not need and not prefetch:
            return
        reply = self.fetcher.ask_from_thread(
            Gather(need, tuple(prefetch), self._direction, self._micro_batch),
            timeout=self.timeout)
        self.spans.extend(reply.spans)
        for b, full in zip(need, reply.buffers):
            self.zero.attach(b, full)
            self.live[b] = full
            self.requested.discard(b)
        self.requested.update(prefetch)

    def _advance_and_prefetch(self, units: tuple[int, ...]) -> list[int]:
        trace = self.trace
        if trace is None:
            return []
        for b in units:
            if self._pos < len(trace) and trace[self._pos] == b:
                self._pos += 1
                continue
            try:
                self._pos = trace.index(b, self._pos) + 1
            except ValueError:  # the order changed: no prefetch for the rest of this pass
                log.debug("module order differs from the recorded one; prefetch off",
                          bucket=b, position=self._pos)
                self._pos = len(trace)
                return []
        in_use = sum(self._numel[b] for b in self.live) + \
            sum(self._numel[b] for b in self.requested)
        return prefetch_window(trace[self._pos:], self._numel,
                               skip=self.live.keys() | self.requested | set(units),
                               in_use=in_use, prefetch_numel=self.prefetch_numel,
                               max_live_numel=self.max_live_numel)

    def _reused_soon(self, b: int) -> bool:
        """Whether bucket b comes back within max_reuse_distance elements of other uses."""
        trace = self.trace
        if trace is None or not self._in_micro_batch:
            return False
        return reused_soon(trace[self._pos:], b, self._numel,
                           live_numel=sum(self._numel[u] for u in self.live),
                           max_live_numel=self.max_live_numel,
                           max_reuse_distance=self.max_reuse_distance)

    def _release(self, b: int) -> None:
        if self.live.pop(b, None) is not None:
            self.zero.release(b)

    def backward_done(self, b: int) -> None:
        """Bucket b's gradients have all landed: its parameters are not needed any more."""
        if self.zero.partitioned[b]:
            self._keep.discard(b)
            self._release(b)

    # -- micro-batches and steps -------------------------------------------------------------------

    def start_micro_batch(self, micro_batch: int = 0) -> None:
        """A training forward of micro-batch ``micro_batch`` (of the step) begins (the engine's
        forward with grad enabled)."""
        self._in_micro_batch = True
        self._pos = 0
        self._direction, self._micro_batch = "fwd", micro_batch
        if self.trace is None and self._recording is None:
            self._recording = []

    def start_backward(self) -> None:
        """The micro-batch's backward begins: the gathers from here on serve it."""
        self._direction = "bwd"

    def end_backward(self) -> None:
        """Backward is over: whatever is still gathered goes, and the first pass's order becomes
        the prefetch trace."""
        for b in list(self.live):
            self._release(b)
        self._keep.clear()
        self._in_micro_batch = False
        if self._recording is not None:
            self.trace, self._recording = self._recording, None

    def end_step(self) -> None:
        """The optimizer changed the shards: every gathered or prefetched copy is stale."""
        for b in list(self.live):
            self._release(b)
        if self.requested:
            self.fetcher.ask_from_thread(Discard(), timeout=self.timeout)
            self.requested.clear()
        self._in_micro_batch = False

    def gather_all(self) -> None:
        """Every partitioned bucket gathered (for saving or inspecting the whole model); every
        rank must call it."""
        self.gather_buckets(range(len(self.zero.partitioned)))

    def gather_buckets(self, buckets: Any) -> list[int]:
        """The partitioned ones of ``buckets`` that are not gathered yet, gathered (every rank
        must call it with the same buckets); returns them, for ``release_buckets``."""
        need = tuple(b for b in buckets if self.zero.partitioned[b] and b not in self.live)
        if need and self.zero.param_channel is not None:
            # a private copy: changes made inside GatheredParameters reach the shards only
            # when published, by the modifier rank's values
            self.zero.published()
            for b in need:
                full = self.zero.shared[b].clone()
                self.zero.attach(b, full)
                self.live[b] = full
            return list(need)
        if need:
            reply = self.fetcher.ask_from_thread(Gather(need), timeout=self.timeout)
            for b, full in zip(need, reply.buffers):
                self.zero.attach(b, full)
                self.live[b] = full
        return list(need)

    def release_all(self) -> None:
        for b in list(self.live):
            self._release(b)

    def release_buckets(self, buckets: Any) -> None:
        for b in buckets:
            self._release(b)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _tensors(obj: Any) -> list[torch.Tensor]:
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []
