"""The pipeline stage actor: ``PipeStage`` runs one stage's instruction list for one batch on
its compute thread, forward and backward on the pipeline engine (a ``StageCompute``) and
activations and gradients through the point-to-point streams (``flowtrain.pipe.p2p``)."""

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
from flowtrain.runtime.actor import Actor, handler


@dataclass(frozen=True)
class RunSchedule:
    ops: tuple[Op, ...]
    batches: tuple[Any, ...]  # per micro-batch (inputs, labels); None on middle stages
    train: bool


@dataclass(frozen=True)
class ScheduleDone:
    losses: tuple[float, ...]  # the last stage's per-micro-batch losses


class PipeStage(Actor):
    """Runs one stage's schedule for one batch. The whole instruction list runs on the
    stage's compute thread, handed over once per schedule: forward and backward, posting
    sends, and taking each received message from its receiver thread (a wait only when it
    has not arrived yet), with no hop back to the loop between instructions."""

    mailbox_size = 16

    def __init__(self, compute: StageCompute, grid: ProcessGrid, device: torch.device,
                 group: Any, timeout: float) -> None:
        self.compute = compute  # runs the forward and backward instructions
        self.grid = grid
        self.device = device  # where received tensors go and sent headers are made
        self.group = group  # the point-to-point process group
        self.timeout = timeout
        self.limiter = anyio.CapacityLimiter(1)
        self._receivers: dict[int, Receiver] = {}  # by source rank
        self._sender: Sender | None = None
        self._runs = 0
        self._failed: str | None = None

    async def on_stop(self) -> None:
        for receiver in self._receivers.values():
            receiver.close()
        if self._sender is not None:
            self._sender.close()

    def _receiver(self, src: int, tags: tuple[int, int]) -> Receiver:
        if src not in self._receivers:
            self._receivers[src] = Receiver(self.group, src, tags, self.device, self.timeout,
                                            f"flowtrain-pipe-recv-{src}")
        return self._receivers[src]

    def _send(self, tensors: tuple[torch.Tensor, ...], dst: int, tags: tuple[int, int], mb: int,
              what: str) -> None:
        if self._sender is None:
            self._sender = Sender(self.group, self.device, self.timeout, "flowtrain-pipe-send")
        self._sender.send(tensors, dst, tags, mb, what)

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
        prev = grid.stage_rank(s - 1) if not grid.is_first_stage else None
        nxt = grid.stage_rank(s + 1) if not grid.is_last_stage else None
        names = {"recv_act": f"activations of micro-batch {{}} from stage {s - 1} (rank {prev})",
                 "recv_grad": f"gradients of micro-batch {{}} from stage {s + 1} (rank {nxt})",
                 "send_act": f"activations of micro-batch {{}} to stage {s + 1} (rank {nxt})",
                 "send_grad": f"gradients of micro-batch {{}} to stage {s - 1} (rank {prev})"}
        # every receive of the schedule is queued now: each is posted as soon as the one
        # before it on its stream is in
        waits: dict[Any, Future[Any]] = {}
        for op in msg.ops:
            if op.kind == "recv_act":
                waits[op.kind, op.mb] = self._receiver(
                    _peer(prev, op.kind), (TAG_ACT, TAG_ACT_DATA)).expect(
                    run, op.mb, names[op.kind].format(op.mb))
            elif op.kind == "recv_grad":
                waits[op.kind, op.mb] = self._receiver(
                    _peer(nxt, op.kind), (TAG_GRAD, TAG_GRAD_DATA)).expect(
                    run, op.mb, names[op.kind].format(op.mb))
        abort = threading.Event()
        try:
            return await anyio.to_thread.run_sync(self._run, msg, names, prev, nxt, waits, abort,
                                                  limiter=self.limiter, abandon_on_cancel=True)
        except BaseException as exc:
            self._failed = f"{type(exc).__name__}: {exc}"
            abort.set()  # before the futures: a wait registered after this sees it
            for receiver in self._receivers.values():
                receiver.cancelled = run
            for future in list(waits.values()):
                future.cancel()
            raise

    def _run(self, msg: RunSchedule, names: dict[str, str], prev: int | None, nxt: int | None,
             waits: dict[Any, Future[Any]], abort: threading.Event) -> ScheduleDone:
        """On the compute thread: the schedule's instructions in order."""
        compute = self.compute
        last_stage = self.grid.is_last_stage
        inputs: dict[int, Any] = {}
        outputs: dict[int, Any] = {}
        grads: dict[int, Any] = {}
        losses: list[float] = []
        spans = compute.timer.spans
        last_backward = max((i for i, op in enumerate(msg.ops) if op.kind == "backward"),
                            default=-1)
        for i, op in enumerate(msg.ops):
            mb = op.mb
            start = time.perf_counter()
            if op.kind == "recv_act":
                got = self._result(waits.pop((op.kind, mb)), names[op.kind].format(mb), abort)
                if msg.train:
                    for t in got:
                        if t.is_floating_point():
                            t.requires_grad_(True)
                inputs[mb] = got[0] if len(got) == 1 else tuple(got)
            elif op.kind == "forward":
                if abort.is_set():
                    raise concurrent.futures.CancelledError("the schedule was cancelled")
                x = inputs[mb] if mb in inputs else msg.batches[mb][0]
                labels = msg.batches[mb][1] if last_stage else None
                outputs[mb] = compute.stage_forward(mb, x, labels, msg.train)
                if last_stage and outputs[mb] is not None:
                    losses.append(float(outputs[mb].detach()))
                if not msg.train:
                    inputs.pop(mb, None)
                continue  # it records its own span
            elif op.kind == "send_act":
                out = outputs[mb] if msg.train else outputs.pop(mb)
                self._send(_detached(out), _peer(nxt, op.kind), (TAG_ACT, TAG_ACT_DATA), mb,
                           names[op.kind].format(mb))
            elif op.kind == "recv_grad":
                got = self._result(waits.pop((op.kind, mb)), names[op.kind].format(mb), abort)
                grads[mb] = got[0] if len(got) == 1 else tuple(got)
            elif op.kind == "backward":
                if abort.is_set():
                    raise concurrent.futures.CancelledError("the schedule was cancelled")
                compute.stage_backward(mb, outputs.pop(mb), grads.pop(mb, None),
                                       i == last_backward)
                continue
            elif op.kind == "send_grad":
                x = inputs.pop(mb)
                self._send(_input_grads(x), _peer(prev, op.kind), (TAG_GRAD, TAG_GRAD_DATA), mb,
                           names[op.kind].format(mb))
            spans.append((op.task_name, start, time.perf_counter()))
        if self._sender is not None:
            waits["drain"] = self._sender.drain()
            self._result(waits.pop("drain"), f"stage {self.grid.pp_rank}'s sends", abort)
        return ScheduleDone(tuple(losses))


def _peer(rank: int | None, kind: str) -> int:
    """The neighbouring stage's rank that a ``kind`` instruction talks to: a schedule has no
    receive from, or send to, a stage before the first or after the last."""
    if rank is None:
        raise ValueError(f"a {kind} instruction on a stage with no neighbour on that side")
    return rank


def tensors_of(x: Any) -> tuple[torch.Tensor, ...]:
    """A stage's input or output as the tuple of tensors that crosses to the next stage."""
    return x if isinstance(x, tuple) else (x,)


def _detached(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach() for t in tensors_of(x))


def _input_grads(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                 for t in tensors_of(x) if t.is_floating_point())
