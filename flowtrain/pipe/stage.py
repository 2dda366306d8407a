"""The pipeline stage actor: ``PipeStage`` runs one stage's instruction list for one batch on
its compute thread, forward and backward on the pipeline engine (a ``StageCompute``) and
activations and gradients through the point-to-point streams (``flowtrain.pipe.p2p``). With the
interleaved schedule each instruction names the stage's model chunk it belongs to: activations
and gradients are kept per (chunk, micro-batch), and the model's chunk c * p + s hands over to
chunk c * p + s + 1, on the next stage or, from the last stage, on the first."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch

from flowtrain import comm
from flowtrain.engine.parts import StageCompute
from flowtrain.log import get_logger
from flowtrain.parallel.grid import ProcessGrid
from flowtrain.pipe.p2p import (
    TAG_ACT,
    TAG_ACT_DATA,
    TAG_GRAD,
    TAG_GRAD_DATA,
    Future,
    PipelineChannelError,
    Receiver,
    Sender,
)
from flowtrain.pipe.schedule import Op
from flowtrain.plan.schedule import handover
from flowtrain.runtime.actor import Actor, handler

log = get_logger("flowtrain.pipe")
CHANNEL_JOIN_S = 5.0  # how long stopping a stage waits for each channel's threads


@dataclass(frozen=True)
class RunSchedule:
    ops: tuple[Op, ...]
    batches: tuple[Any, ...]  # per micro-batch (inputs, labels); None on middle stages
    train: bool


@dataclass(frozen=True)
class ScheduleDone:
    losses: tuple[float, ...]  # the last stage's per-micro-batch losses


_TAGS = {"recv_act": (TAG_ACT, TAG_ACT_DATA), "send_act": (TAG_ACT, TAG_ACT_DATA),
         "recv_grad": (TAG_GRAD, TAG_GRAD_DATA), "send_grad": (TAG_GRAD, TAG_GRAD_DATA)}
_WHAT = {"recv_act": "activations of micro-batch {mb}{chunk} from stage {peer} (rank {rank})",
         "recv_grad": "gradients of micro-batch {mb}{chunk} from stage {peer} (rank {rank})",
         "send_act": "activations of micro-batch {mb}{chunk} to stage {peer} (rank {rank})",
         "send_grad": "gradients of micro-batch {mb}{chunk} to stage {peer} (rank {rank})"}


class PipeStage(Actor):
    """Runs one stage's schedule for one batch. The whole instruction list runs on the
    stage's compute thread, handed over once per schedule: forward and backward, posting
    sends, and taking each received message from its receiver thread (a wait only when it
    has not arrived yet), with no hop back to the loop between instructions."""

    mailbox_size = 16

    def __init__(self, compute: StageCompute, grid: ProcessGrid, device: torch.device,
                 group: Any, timeout: float, virtual_stages: int = 1) -> None:
        self.compute = compute  # runs the forward and backward instructions
        self.grid = grid
        self.device = device  # where received tensors go and sent headers are made
        self.group = group  # the point-to-point process group
        self.timeout = timeout
        self.virtual_stages = virtual_stages  # model chunks per stage
        self.limiter = anyio.CapacityLimiter(1)
        self._receivers: dict[tuple[int, int], Receiver] = {}  # by source rank, header tag
        self._sender: Sender | None = None
        self._runs = 0
        self._failed: str | None = None

    async def on_stop(self) -> None:
        channels: list[Receiver | Sender] = list(self._receivers.values())
        if self._sender is not None:
            channels.append(self._sender)
        for channel in channels:
            channel.close()
        # the threads end before the interpreter does (see Receiver.join); off the loop, as
        # a last send may still be waiting for its peer, and bounded: a dead peer's send
        # never completes
        left = await anyio.to_thread.run_sync(
            lambda: [c for c in channels if not c.join(min(CHANNEL_JOIN_S, self.timeout))])
        if left:
            log.warning("pipeline channel threads still running at stop", count=len(left))

    def _receiver(self, src: int, tags: tuple[int, int]) -> Receiver:
        # one stream per peer and direction: with interleaving on two stages, activations and
        # gradients both come from the other stage
        key = (src, tags[0])
        if key not in self._receivers:
            self._receivers[key] = Receiver(self.group, src, tags, self.device, self.timeout,
                                            f"flowtrain-pipe-recv-{src}-{tags[0]}")
        return self._receivers[key]

    def _peer(self, op: Op) -> tuple[int, str]:
        """The rank a point-to-point instruction talks to, and the message's description.
        Interleaved, the last stage's chunk hands over to the first stage's next chunk."""
        peer, _ = handover(op.kind, self.grid.pp_rank, self.grid.shape.pp, op.chunk)
        rank = self.grid.stage_rank(peer)
        chunk = "" if op.chunk is None else f" (chunk {op.chunk})"
        return rank, _WHAT[op.kind].format(mb=op.mb, chunk=chunk, peer=peer, rank=rank)

    def _send(self, tensors: tuple[torch.Tensor, ...], op: Op) -> None:
        if self._sender is None:
            self._sender = Sender(self.group, self.device, self.timeout, "flowtrain-pipe-send")
        dst, what = self._peer(op)
        # the message names the chunk that takes it (across the ring's wrap, the next or
        # previous one), which its receiver checks
        _, chunk = handover(op.kind, self.grid.pp_rank, self.grid.shape.pp, op.chunk)
        self._sender.send(tensors, dst, _TAGS[op.kind], op.mb, what, chunk)

    def _result(self, future: Future[Any], what: str, abort: threading.Event) -> Any:
        # the helper threads' own waits time out first; this only guards a lost answer
        if abort.is_set():
            raise concurrent.futures.CancelledError(f"{what}: the schedule was cancelled")
        try:
            return future.result(timeout=self.timeout + 60.0)
        except concurrent.futures.TimeoutError:
            raise comm.CollectiveTimeout(f"{what} was not delivered within "
                                         f"{self.timeout + 60:g} s") from None

    @handler
    async def run(self, msg: RunSchedule) -> ScheduleDone:
        grid = self.grid
        s = grid.pp_rank
        if self._failed is not None:
            raise PipelineChannelError(
                f"pipeline stage {s} cannot run another schedule: an earlier one failed "
                f"({self._failed}), which leaves its messages out of step with the other "
                f"stages; start a new engine")
        self._runs += 1
        run = self._runs
        # every receive of the schedule is queued now: each is posted as soon as the one
        # before it on its stream is in
        waits: dict[Any, Future[Any]] = {}
        whats: dict[Any, str] = {}
        for op in msg.ops:
            if op.kind in ("recv_act", "recv_grad"):
                src, what = self._peer(op)
                key = (op.kind, op.chunk, op.mb)
                whats[key] = what
                waits[key] = self._receiver(src, _TAGS[op.kind]).expect(run, op.mb, what,
                                                                         op.chunk)
        abort = threading.Event()
        try:
            return await anyio.to_thread.run_sync(self._run, msg, whats, waits, abort,
                                                  limiter=self.limiter, abandon_on_cancel=True)
        except BaseException as exc:
            self._failed = f"{type(exc).__name__}: {exc}"
            abort.set()  # before the futures: a wait registered after this sees it
            for receiver in self._receivers.values():
                receiver.cancelled = run
            for future in list(waits.values()):
                future.cancel()
            raise

    def _run(self, msg: RunSchedule, whats: dict[Any, str], waits: dict[Any, Future[Any]],
             abort: threading.Event) -> ScheduleDone:
        """On the compute thread: the schedule's instructions in order."""
        compute = self.compute
        # the chunk that ends the model computes the loss: the last stage's last chunk
        loss_chunk = self.virtual_stages - 1 if self.grid.is_last_stage else -1
        # activations, outputs and gradients by (chunk, micro-batch)
        inputs: dict[Any, Any] = {}
        outputs: dict[Any, Any] = {}
        grads: dict[Any, Any] = {}
        losses: list[float] = []
        spans = compute.timer.spans
        last_backward = max((i for i, op in enumerate(msg.ops) if op.kind == "backward"),
                            default=-1)
        for i, op in enumerate(msg.ops):
            mb, at = op.mb, (op.chunk, op.mb)
            start = time.perf_counter()
            if op.kind == "recv_act":
                key = (op.kind, op.chunk, mb)
                got = self._result(waits.pop(key), whats[key], abort)
                if msg.train:
                    for t in got:
                        if t.is_floating_point():
                            t.requires_grad_(True)
                inputs[at] = got[0] if len(got) == 1 else tuple(got)
            elif op.kind == "forward":
                if abort.is_set():
                    raise concurrent.futures.CancelledError("the schedule was cancelled")
                x = inputs[at] if at in inputs else msg.batches[mb][0]
                loss_here = (op.chunk or 0) == loss_chunk
                labels = msg.batches[mb][1] if loss_here else None
                outputs[at] = compute.stage_forward(mb, x, labels, msg.train, op.chunk)
                if loss_here and outputs[at] is not None:
                    losses.append(float(outputs[at].detach()))
                if not msg.train:
                    inputs.pop(at, None)
                continue  # it records its own span
            elif op.kind == "send_act":
                out = outputs[at] if msg.train else outputs.pop(at)
                self._send(_detached(out), op)
            elif op.kind == "recv_grad":
                key = (op.kind, op.chunk, mb)
                got = self._result(waits.pop(key), whats[key], abort)
                grads[at] = got[0] if len(got) == 1 else tuple(got)
            elif op.kind == "backward":
                if abort.is_set():
                    raise concurrent.futures.CancelledError("the schedule was cancelled")
                compute.stage_backward(mb, outputs.pop(at), grads.pop(at, None),
                                       i == last_backward, op.chunk)
                continue
            elif op.kind == "send_grad":
                x = inputs.pop(at)
                self._send(_input_grads(x), op)
            spans.append((op.task_name, start, time.perf_counter()))
        if self._sender is not None:
            waits["drain"] = self._sender.drain()
            self._result(waits.pop("drain"), f"stage {self.grid.pp_rank}'s sends", abort)
        return ScheduleDone(tuple(losses))


def tensors_of(x: Any) -> tuple[torch.Tensor, ...]:
    """A stage's input or output as the tuple of tensors that crosses to the next stage."""
    return x if isinstance(x, tuple) else (x,)


def _detached(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach() for t in tensors_of(x))


def _input_grads(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                 for t in tensors_of(x) if t.is_floating_point())
