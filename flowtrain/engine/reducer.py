"""The BucketReducer actor: launches each full gradient bucket's all-reduce the moment it is
ready, in bucket order, while backward goes on; ``Flush`` waits for all of them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flowtrain import comm
from flowtrain.engine.buckets import GradBuckets
from flowtrain.engine.stages import BucketFull, BucketReduced, Stages
from flowtrain.engine.timing import completion_stamp, stamped_end
from flowtrain.plan import names
from flowtrain.runtime.actor import Actor, handler


@dataclass(frozen=True)
class BucketReady:
    index: int
    step: int
    # ZeRO stages 2-3: the bucket's transient buffer, handed over (None: buckets.flat[index])
    buffer: torch.Tensor | None = None
    # the micro-batch whose gradients these are, when every micro-batch reduces (the plan
    # names such a reduce by its micro-batch); None: once a step
    micro_batch: int | None = None


@dataclass(frozen=True)
class EndMicroBatch:
    """ZeRO stages 2-3 reduce every micro-batch: finish this one's reduce-scatters (every
    bucket was handed over) without the optimizer waiting for them."""

    step: int
    micro_batch: int | None = None


@dataclass(frozen=True)
class Flush:
    step: int
    micro_batch: int | None = None


@dataclass(frozen=True)
class ReduceReport:
    """What the reduces of one step did, for the throughput log and the span recorder."""

    spans: tuple[tuple[str, float, float], ...]  # (task name, launch time, done time)
    # --peer-recovery: why this step's reduces failed (a lost peer); None when they finished
    error: str | None = None


class StepInterrupted(Exception):
    """--peer-recovery: a newer generation of the group was announced while a reduce waited."""


class BucketReducer(Actor):
    """Reduces gradient buckets across the data-parallel group.

    Buckets launch strictly in index order, so every rank issues the same collectives in the same
    order even if a bucket completes early on one rank. Scaling follows DeepSpeed's rule: with
    ``prescale_gradients`` the bucket is divided by the world size before the sum; otherwise it
    is multiplied by 1/gradient_predivide_factor before and by predivide/world_size after.
    """

    mailbox_size = 4096

    def __init__(self, buckets: GradBuckets, *, world_size: int, comm_dtype: torch.dtype,
                 predivide: float = 1.0, prescale: bool = False, group: Any = None,
                 stages: Stages | None = None, timeout: float = comm.DEFAULT_TIMEOUT,
                 channel: Any = None, shards: list[torch.Tensor] | None = None,
                 slices: list[tuple[int, int]] | None = None, interrupt: Any = None) -> None:
        """``interrupt`` (--peer-recovery): a callable giving the asyncio.Event set when the
        group's membership changes; with it a failed or interrupted reduce does not fail the
        actor: ``Flush`` reports it (``ReduceReport.error``) and the engine drops the step."""
        self.buckets = buckets
        self.interrupt = interrupt
        self._error: str | None = None
        # ZeRO stages 2-3: reduce-scatter each bucket and add the result into this rank's
        # gradient shard instead of all-reducing it (the shards accumulate over micro-batches).
        self.shards = shards
        # ZeRO stage 1 (``slices``: this rank's (start, numel) of each bucket): reduce-scatter
        # into the rank's own slice of the bucket, the only part its optimizer steps on; the
        # rest of the bucket keeps this rank's local sums (DeepSpeed's stage 1 reduce-scatters
        # too). Half the traffic of an all-reduce.
        self.slices = slices
        self.on_reduced: Any = None  # called with a bucket index once its final reduce is done
        self._op = "all_reduce" if shards is None and slices is None else "reduce_scatter"
        self._shard_buffers: dict[int, torch.Tensor] = {}
        self.world_size = world_size
        self.comm_dtype = comm_dtype
        self.predivide = predivide
        self.prescale = prescale
        self.group = group
        self.stages = stages or Stages()
        self.timeout = timeout
        self.channel = channel  # a ShmChannel for ranks of one host, else torch.distributed
        self._next = 0
        self._ready: dict[int, torch.Tensor | None] = {}
        self._inflight: list[tuple[int, Any, torch.Tensor, float, Any, list[float]]] = []
        self._spans: list[tuple[str, float, float]] = []
        self._comm_buffers: dict[int, torch.Tensor] = {}
        self._step = 0
        self._micro_batch: int | None = None  # of the buckets now launching
        self._task_names: dict[int, str] = {}  # in-flight bucket -> its plan task name

    def use_buckets(self, buckets: GradBuckets) -> None:
        """Switches to a new bucket layout (after the gradient order was observed)."""
        self.buckets = buckets
        self._comm_buffers.clear()

    @handler
    async def ready(self, msg: BucketReady) -> None:
        if self.interrupt is None:
            return await self._take_ready(msg)
        if self._error is not None:
            return None  # the step is lost already: launch nothing more
        try:
            await self._take_ready(msg)
        except Exception as exc:  # noqa: BLE001 - reported by Flush; the step is dropped
            self._fail(exc)
        return None

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = f"{type(exc).__name__}: {exc}"[:500]

    async def _take_ready(self, msg: BucketReady) -> None:
        self._step = msg.step
        self._micro_batch = msg.micro_batch
        self._ready[msg.index] = msg.buffer
        while self._next in self._ready:
            await self._launch(self._next, self._ready.pop(self._next))
            self._next += 1
        if self.buckets.transient and not self.stages["after_reduce"]:
            await self._reap()

    async def _reap(self) -> None:
        """Finishes the reduces that are already done, oldest first, while backward goes on:
        their transient buffers go back to the pool now instead of at the micro-batch's end
        (so a step holds a few buckets' buffers, not every bucket's)."""
        done = 0
        for index, work, buffer, launched, source, stamp in self._inflight:
            finished = work.done() if self.channel is not None else work.is_completed()
            if not finished:
                break
            await self._await(index, work, buffer)
            self._finish(index, buffer)
            self.buckets.release(source)
            self._spans.append((self._task_names.pop(index), launched, stamped_end(stamp)))
            done += 1
        del self._inflight[:done]

    async def _await(self, index: int, work: Any, buffer: torch.Tensor) -> None:
        what = f"{self._op} of gradient bucket {index} ({buffer.numel()} x {buffer.dtype})"
        if self.channel is not None:
            try:
                with comm.waiting(what):
                    await asyncio.wait_for(asyncio.wrap_future(work), self.timeout)
            except TimeoutError:
                raise comm.CollectiveTimeout(f"{what} did not finish within "
                                             f"{self.timeout:g} s") from None
        elif self.interrupt is not None:
            await self._interruptible(comm.wait(work, what, self.timeout), what)
        else:
            await comm.wait(work, what, self.timeout)

    async def _interruptible(self, waiting: Any, what: str) -> None:
        """Awaits ``waiting`` unless the group's membership changes first (StepInterrupted):
        a collective with a lost rank may never finish on its own."""
        event = self.interrupt()
        task = asyncio.ensure_future(waiting)
        stop = asyncio.ensure_future(event.wait())
        try:
            done, _ = await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task in done:
            task.result()
            return
        task.cancel()
        # the abandoned wait ends with the backend's error later: retrieved, not logged
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise StepInterrupted(f"{what}: the group's membership changed (a rank was lost)")

    @handler
    async def end_micro_batch(self, msg: EndMicroBatch) -> None:
        self._step = msg.step
        self._micro_batch = msg.micro_batch
        await self._drain(final=False)

    @handler
    async def flush(self, msg: Flush) -> ReduceReport:
        self._step = msg.step
        self._micro_batch = msg.micro_batch
        if self.interrupt is None:
            await self._drain(final=True)
        else:
            if self._error is None:
                try:
                    await self._drain(final=True)
                except Exception as exc:  # noqa: BLE001 - reported; the step is dropped
                    self._fail(exc)
            if self._error is not None:
                self._inflight.clear()
                self._ready.clear()
                self._task_names.clear()
                self._next = 0
        report = ReduceReport(tuple(self._spans), self._error)
        self._spans.clear()
        self._error = None
        return report

    async def _drain(self, final: bool) -> None:
        # Buckets with a parameter that got no gradient this step never filled: reduce them now
        # (their missing gradients are zero), still in bucket order.
        while self._next < len(self.buckets.flat):
            await self._launch(self._next, self._ready.pop(self._next, None))
            self._next += 1
        arena = final and bool(getattr(self.channel, "arena_bytes", 0))
        for index, work, buffer, launched, source, stamp in self._inflight:
            await self._await(index, work, buffer)
            self._finish(index, buffer)
            if self.buckets.transient:
                self.buckets.release(source)
            self._spans.append((self._task_names.pop(index), launched, stamped_end(stamp)))
        if arena:
            # Peers copy their shares out of this rank's arena buckets until their reduces
            # end: nothing may write the reduced gradients (clipping, a stage) before that.
            self.channel.quiesce()
        for index, *_ in self._inflight if final else ():
            if self.on_reduced is not None:
                self.on_reduced(index)
            for ref in self.stages["after_reduce"]:
                reduced = self.shards[index] if self.shards is not None else \
                    self._own(index)
                await ref.ask(BucketReduced(index, reduced, self._step))
        self._inflight.clear()
        self._ready.clear()
        self._next = 0

    async def _launch(self, index: int, handed: torch.Tensor | None = None) -> None:
        grad = handed if handed is not None else (
            self.buckets.take(index) if self.buckets.transient else self.buckets.buffer(index))
        for ref in self.stages["bucket_full"]:
            await ref.ask(BucketFull(index, grad, self._step))
        if self.comm_dtype == grad.dtype:
            buffer = grad
        else:
            cached = self._comm_buffers.get(index)
            if cached is None:
                cached = self._comm_buffers[index] = torch.empty_like(grad, dtype=self.comm_dtype)
            cached.copy_(grad)
            buffer = cached
        pre = 1.0 / self.world_size if self.prescale else 1.0 / self.predivide
        if pre != 1.0:
            buffer.mul_(pre)
        self._task_names[index] = names.reduce(index, self._micro_batch)
        launched = time.perf_counter()
        if self.shards is not None:
            work, buffer = self._launch_scatter(index, self.shards[index], buffer)
        elif self.slices is not None:
            start, numel = self.slices[index]
            if self.channel is not None:
                # the channel sums out of its slots, so the result may land in the input
                out = buffer.narrow(0, start, numel)
                work = self.channel.reduce_scatter_async(buffer, out)
                buffer = out
            else:
                work, buffer = self._launch_scatter(index, buffer.narrow(0, start, numel),
                                                    buffer)
        elif self.channel is not None and buffer is grad:
            # the channel applies the after-sum scale (a bucket in its arena is read by the
            # peers until they are done, so this rank must not scale it afterwards)
            work = self.channel.all_reduce_async(buffer, scale=self._post_scale())
        elif self.channel is not None:
            work = self.channel.all_reduce_async(buffer)
        else:
            work = dist.all_reduce(buffer, group=self.group, async_op=True)
        self._inflight.append((index, work, buffer, launched, grad, completion_stamp(work)))

    def _launch_scatter(self, index: int, shard: torch.Tensor,
                        buffer: torch.Tensor) -> tuple[Any, torch.Tensor]:
        # into a scratch shard: the result is added to the accumulating gradient shard
        out = self._shard_buffers.get(index)
        if out is None:
            out = self._shard_buffers[index] = torch.empty(shard.numel(), dtype=buffer.dtype,
                                                           device=buffer.device)
        if self.channel is not None:
            return self.channel.reduce_scatter_async(buffer, out), out
        return comm.reduce_scatter_single(out, buffer, group=self.group, async_op=True), out

    def _own(self, index: int) -> torch.Tensor:
        """Bucket ``index``'s reduced gradients: all of it, or with ``slices`` this rank's."""
        grad = self.buckets.buffer(index)
        if self.slices is None:
            return grad
        start, numel = self.slices[index]
        return grad.narrow(0, start, numel)

    def _post_scale(self) -> float:
        return 1.0 if self.prescale else self.predivide / self.world_size

    def _finish(self, index: int, buffer: torch.Tensor) -> None:
        post = self._post_scale()
        if self.shards is not None:
            shard = self.shards[index]
            if post != 1.0:
                shard.add_(buffer.to(shard.device), alpha=post)
            else:
                shard.add_(buffer.to(shard.device))
            return
        if self.slices is not None:
            own = self._own(index)
            if buffer.data_ptr() != own.data_ptr() or buffer.dtype != own.dtype:
                own.copy_(buffer)
            if post != 1.0:
                own.mul_(post)
            return
        grad = self.buckets.buffer(index)
        if buffer is grad and self.channel is not None:
            return  # summed and scaled in place by the channel
        if buffer is not grad:
            grad.copy_(buffer)
        if post != 1.0:
            grad.mul_(post)

