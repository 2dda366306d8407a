"""The pipeline-parallel engine: ``engine.train_batch(data_iter)`` / ``eval_batch``.

Each rank's ``PipeStage`` actor runs its stage's instruction list (``flowtrain.pipe.schedule``)
on one compute thread, handed the whole list at once: forward and backward, and between them
activations and gradients crossing stages as torch.distributed isend/irecv on a process group of
their own. Gradients of the stage's parameters go through the usual buckets and BucketReducer
over the data-parallel group; the optimizer step follows the last backward.

Point-to-point messages. gloo's send and receive have no future to await, and a thread started
per wait costs about a millisecond a message; a hop to the event loop and back between
instructions costs a few hundred microseconds on a busy host. So each incoming stream
(activations from the previous stage, gradients from the next) has one long-lived receiver
thread that waits blocking, with a timeout on every wait, and hands each message over through a
future the compute thread takes it from; sends are posted by the compute thread and a
long-lived sender thread waits on them (and keeps their tensors alive). At the start of a
schedule every receive it holds is queued, so a message's receive is posted as soon as the one
before it is in. A message is a header (micro-batch, then each tensor's dtype and shape) on one
tag and its tensors on another. Both ends remember the stream's last shapes: the receiver posts
the payload's receives with them at once, next to the header's, so the payload does not wait
for the header to arrive. When the shapes change (a smaller last micro-batch, eval after train)
the sender first sends placeholders of the old shapes to fill those receives, then the tensors;
the receiver reads the new shapes from the header and receives them. A failure leaves the
streams out of step, so the stage refuses further schedules.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import torch
import torch.distributed as dist

from flowtrain import comm
from flowtrain.engine.engine import FlowtrainEngine
from flowtrain.log import get_logger
from flowtrain.pipe.module import PipelineModule
from flowtrain.pipe.schedule import SCHEDULES, Op, stage_ops
from flowtrain.runtime.actor import Actor, handler

log = get_logger("flowtrain.pipe")

TAG_ACT, TAG_GRAD = 11, 12  # the headers of activations and of gradients
TAG_ACT_DATA, TAG_GRAD_DATA = 13, 14  # their tensors
HEADER = 64  # int64 slots: micro-batch, count, then per tensor dtype code, ndim, dims
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


Shapes = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


class PipelineChannelError(RuntimeError):
    """A pipeline message could not be sent or received: the peer stage died, or the stages'
    schedules disagree. Names the message, its micro-batch and the peer stage."""


@dataclass(frozen=True)
class RunSchedule:
    ops: tuple[Op, ...]
    batches: tuple[Any, ...]  # per micro-batch (inputs, labels); None on middle stages
    train: bool


@dataclass(frozen=True)
class ScheduleDone:
    losses: tuple[float, ...]  # the last stage's per-micro-batch losses


def _shapes(tensors: list[torch.Tensor]) -> Shapes:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def _encode(mb: int, shapes: Shapes) -> torch.Tensor:
    slots = [mb, len(shapes)]
    for dtype, dims in shapes:
        if dtype not in _DTYPES:
            raise ValueError(f"a pipeline stage cannot send a tensor of {dtype}; use one of "
                             f"{', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}")
        slots += [_DTYPES.index(dtype), len(dims), *dims]
    if len(slots) > HEADER:
        raise ValueError(f"pipeline stage output too complex to send: {len(shapes)} tensors of "
                         f"up to {max(len(d) for _, d in shapes)} dimensions")
    return torch.tensor(slots + [0] * (HEADER - len(slots)), dtype=torch.int64)


def _decode(header: torch.Tensor) -> tuple[int, Shapes]:
    slots = header.tolist()
    mb, count, i = int(slots[0]), int(slots[1]), 2
    shapes = []
    for _ in range(count):
        code, ndim = int(slots[i]), int(slots[i + 1])
        shapes.append((_DTYPES[code], tuple(int(d) for d in slots[i + 2:i + 2 + ndim])))
        i += 2 + ndim
    return mb, tuple(shapes)


Future = concurrent.futures.Future


def _settle(future: Future[Any], value: Any, error: BaseException | None) -> None:
    if not future.set_running_or_notify_cancel():
        return  # the schedule failed and gave up on it
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class _Receiver:
    """One incoming stream of a stage (activations from the previous stage, or gradients from
    the next) and its long-lived thread: it receives the stream's messages in order, each
    wait blocking with a timeout, and hands each message over through a future."""

    def __init__(self, group: Any, src: int, tags: tuple[int, int], device: torch.device,
                 timeout: float, name: str) -> None:
        self.group, self.src, self.tags = group, src, tags
        self.device, self.timeout = device, timeout
        self.shapes: Shapes | None = None  # of the stream's last message (its sender's too)
        self.failure: BaseException | None = None
        self.cancelled = 0  # queued receives of schedules up to this number are dropped
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def expect(self, run: int, mb: int, what: str) -> Future[list[torch.Tensor]]:
        """Queues the receive of micro-batch ``mb``'s message; the future gets its tensors."""
        future: Future[list[torch.Tensor]] = Future()
        self._jobs.put((run, mb, what, future))
        return future

    def close(self) -> None:
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            run, mb, what, future = job
            if run <= self.cancelled:
                continue
            value: list[torch.Tensor] | None = None
            error: BaseException | None = None
            if self.failure is not None:
                error = PipelineChannelError(f"{what}: not received, the stream failed before "
                                             f"({self.failure})")
            else:
                try:
                    value = self._receive(mb, what)
                except BaseException as exc:  # noqa: BLE001 - handed to the schedule
                    self.failure = error = exc
            _settle(future, value, error)

    def _post(self, shapes: Shapes, tag: int, what: str) -> list[tuple[Any, torch.Tensor]]:
        out = []
        for dtype, dims in shapes:
            t = torch.empty(dims, dtype=dtype, device=self.device)
            try:
                out.append((dist.irecv(t, self.src, group=self.group, tag=tag), t))
            except RuntimeError as exc:
                raise PipelineChannelError(f"{what} could not be received: that stage may "
                                           f"have died ({exc})") from None
        return out

    def _wait(self, posted: list[tuple[Any, torch.Tensor]], what: str, deadline: float) -> None:
        for work, _ in posted:
            try:
                comm.wait_blocking(work, f"receive of {what}", deadline - time.monotonic())
            except comm.CollectiveTimeout:
                raise comm.CollectiveTimeout(f"{what} did not arrive within {self.timeout:g} s; "
                                             f"that stage may be stuck or dead") from None
            except RuntimeError as exc:
                raise PipelineChannelError(f"{what} could not be received: that stage may "
                                           f"have died ({exc})") from None

    def _receive(self, mb: int, what: str) -> list[torch.Tensor]:
        deadline = time.monotonic() + self.timeout
        header_tag, data_tag = self.tags
        header = self._post(((torch.int64, (HEADER,)),), header_tag, what)
        # the tensors' receives go out with the header's, in the stream's last shapes
        posted = self._post(self.shapes or (), data_tag, what)
        self._wait(header, what, deadline)
        sent_mb, shapes = _decode(header[0][1])
        if sent_mb != mb:
            raise PipelineChannelError(f"{what}: micro-batch {sent_mb}'s message came instead; "
                                       f"the stages' schedules disagree")
        self._wait(posted, what, deadline)  # the tensors, or placeholders before new shapes
        if shapes != self.shapes:
            posted = self._post(shapes, data_tag, what)
            self._wait(posted, what, deadline)
            self.shapes = shapes
        return [t for _, t in posted]


class _Sender:
    """A stage's outgoing messages. ``send`` (on the compute thread) only checks and queues
    them: gloo writes a send's bytes into the socket inside isend when the peer's receive is
    already posted (as the receiver threads see to), a few hundred microseconds for a few
    hundred KiB, so a long-lived thread posts them, in order, and another waits on them, each
    with a timeout, holding their tensors until they are out."""

    def __init__(self, group: Any, device: torch.device, timeout: float, name: str) -> None:
        self.group, self.device, self.timeout = group, device, timeout
        self.shapes: dict[tuple[int, int], Shapes] = {}  # (peer, header tag): last message's
        self.failure: BaseException | None = None
        self._posts: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._waits: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._post, name=name, daemon=True),
                         threading.Thread(target=self._wait, name=f"{name}-wait", daemon=True)]
        for thread in self._threads:
            thread.start()

    def send(self, tensors: tuple[torch.Tensor, ...], dst: int, tags: tuple[int, int], mb: int,
             what: str) -> None:
        if self.failure is not None:
            raise PipelineChannelError(f"{what}: not sent, an earlier send failed "
                                       f"({self.failure})")
        header_tag, data_tag = tags
        out = [t.contiguous() for t in tensors]
        shapes = _shapes(out)
        # on the stage's device, like every tensor it sends (NCCL moves device memory only)
        messages = [(_encode(mb, shapes).to(self.device), header_tag)]
        last = self.shapes.get((dst, header_tag))
        if last is not None and last != shapes:
            # fill the receives the peer posted in the old shapes, then the new tensors
            messages += [(torch.empty(dims, dtype=dtype, device=self.device), data_tag)
                         for dtype, dims in last]
        messages += [(t, data_tag) for t in out]
        self.shapes[(dst, header_tag)] = shapes
        self._posts.put((messages, dst, what, time.monotonic() + self.timeout))

    def drain(self) -> Future[None]:
        """A future done once every send queued so far is out (the first failure if not)."""
        future: Future[None] = Future()
        self._posts.put(future)
        return future

    def close(self) -> None:
        self._posts.put(None)

    def _post(self) -> None:
        while (job := self._posts.get()) is not None:
            if isinstance(job, Future):
                self._waits.put(job)
                continue
            if self.failure is not None:
                continue
            messages, dst, what, deadline = job
            works = []
            try:
                for t, tag in messages:
                    works.append((dist.isend(t, dst, group=self.group, tag=tag), t))
            except RuntimeError as exc:
                self.failure = PipelineChannelError(f"{what} could not be sent: that stage "
                                                    f"may have died ({exc})")
            self._waits.put((works, what, deadline))
        self._waits.put(None)

    def _wait(self) -> None:
        while (job := self._waits.get()) is not None:
            if isinstance(job, Future):
                _settle(job, None, self.failure)
                continue
            if self.failure is not None:
                continue
            works, what, deadline = job
            try:
                for work, _ in works:
                    comm.wait_blocking(work, f"send of {what}", deadline - time.monotonic())
            except comm.CollectiveTimeout:
                self.failure = comm.CollectiveTimeout(
                    f"{what} was not taken within {self.timeout:g} s; that stage may be stuck "
                    f"or dead")
            except RuntimeError as exc:
                self.failure = PipelineChannelError(f"{what} could not be sent: that stage "
                                                    f"may have died ({exc})")


class PipeStage(Actor):
    """Runs one stage's schedule for one batch. The whole instruction list runs on the
    stage's compute thread, handed over once per schedule: forward and backward, posting
    sends, and taking each received message from its receiver thread (a wait only when it
    has not arrived yet), with no hop back to the loop between instructions."""

    mailbox_size = 16

    def __init__(self, engine: PipelineEngine, group: Any, timeout: float) -> None:
        self.engine = engine
        self.group = group
        self.timeout = timeout
        self.limiter = anyio.CapacityLimiter(1)
        self._receivers: dict[int, _Receiver] = {}  # by source rank
        self._sender: _Sender | None = None
        self._runs = 0
        self._failed: str | None = None

    async def on_stop(self) -> None:
        for receiver in self._receivers.values():
            receiver.close()
        if self._sender is not None:
            self._sender.close()

    def _receiver(self, src: int, tags: tuple[int, int]) -> _Receiver:
        if src not in self._receivers:
            self._receivers[src] = _Receiver(self.group, src, tags, self.engine.device,
                                             self.timeout, f"flowtrain-pipe-recv-{src}")
        return self._receivers[src]

    def _send(self, tensors: tuple[torch.Tensor, ...], dst: int, tags: tuple[int, int], mb: int,
              what: str) -> None:
        if self._sender is None:
            self._sender = _Sender(self.group, self.engine.device, self.timeout,
                                   "flowtrain-pipe-send")
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
        grid = self.engine.grid
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
                waits[op.kind, op.mb] = self._receiver(prev, (TAG_ACT, TAG_ACT_DATA)).expect(
                    run, op.mb, names[op.kind].format(op.mb))
            elif op.kind == "recv_grad":
                waits[op.kind, op.mb] = self._receiver(nxt, (TAG_GRAD, TAG_GRAD_DATA)).expect(
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
        engine = self.engine
        last_stage = engine.grid.is_last_stage
        inputs: dict[int, Any] = {}
        outputs: dict[int, Any] = {}
        grads: dict[int, Any] = {}
        losses: list[float] = []
        spans = engine.timer.spans
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
                outputs[mb] = engine._stage_forward(mb, x, labels, msg.train)
                if last_stage and outputs[mb] is not None:
                    losses.append(float(outputs[mb].detach()))
                if not msg.train:
                    inputs.pop(mb, None)
                continue  # it records its own span
            elif op.kind == "send_act":
                out = outputs[mb] if msg.train else outputs.pop(mb)
                self._send(_detached(out), nxt, (TAG_ACT, TAG_ACT_DATA), mb,
                           names[op.kind].format(mb))
            elif op.kind == "recv_grad":
                got = self._result(waits.pop((op.kind, mb)), names[op.kind].format(mb), abort)
                grads[mb] = got[0] if len(got) == 1 else tuple(got)
            elif op.kind == "backward":
                if abort.is_set():
                    raise concurrent.futures.CancelledError("the schedule was cancelled")
                engine._stage_backward(mb, outputs.pop(mb), grads.pop(mb, None),
                                       i == last_backward)
                continue
            elif op.kind == "send_grad":
                x = inputs.pop(mb)
                self._send(_input_grads(x), prev, (TAG_GRAD, TAG_GRAD_DATA), mb,
                           names[op.kind].format(mb))
            spans.append((op.task_name, start, time.perf_counter()))
        if self._sender is not None:
            waits["drain"] = self._sender.drain()
            self._result(waits.pop("drain"), f"stage {engine.grid.pp_rank}'s sends", abort)
        return ScheduleDone(tuple(losses))


def _tensors(x: Any) -> tuple[torch.Tensor, ...]:
    return x if isinstance(x, tuple) else (x,)


def _detached(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach() for t in _tensors(x))


def _input_grads(x: Any) -> tuple[torch.Tensor, ...]:
    return tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                 for t in _tensors(x) if t.is_floating_point())


class PipelineEngine(FlowtrainEngine):
    """FlowtrainEngine for a ``PipelineModule``: data parallel over its data-parallel group,
    pipeline stages driven by ``train_batch``. ``train_micro_batch_size_per_gpu`` is the size
    of a micro-batch; ``gradient_accumulation_steps`` is the number of micro-batches per step."""

    def __init__(self, model: PipelineModule, optimizer: torch.optim.Optimizer, config: Any,
                 **kwargs: Any) -> None:
        if not isinstance(model, PipelineModule):
            raise TypeError("PipelineEngine needs a flowtrain.pipe.PipelineModule")
        super().__init__(model, optimizer, config, grid=model.grid, **kwargs)
        self.num_stages = model.num_stages
        self.stage_id = model.stage_id
        self.schedule = str(getattr(config.pipeline, "schedule", "1f1b")).lower()
        if self.schedule not in SCHEDULES:
            raise ValueError(f"pipeline.schedule {self.schedule!r}: choose one of "
                             f"{', '.join(SCHEDULES)}")
        if config.pipeline.activation_checkpoint_interval and \
                not model.activation_checkpoint_interval:
            model.activation_checkpoint_interval = config.pipeline.activation_checkpoint_interval
        group = dist.new_group(ranks=list(range(dist.get_world_size()))) \
            if dist.is_initialized() and dist.get_world_size() > 1 else None
        self._p2p_group = group
        self._stage_actor = PipeStage(self, group, comm.DEFAULT_TIMEOUT)
        self._stage_ref = self._runtime.spawn(self._stage_actor)
        self.agg_train_loss: torch.Tensor | None = None
        # each stage's first rank records its part of the plan (for simulate --compare)
        self._plan_pending = self._run_dir is not None and self.grid.dp_rank == 0 and \
            self.grid.tp_rank == 0

    # -- compute (on the stage actor's compute thread) --------------------------------------------

    def _stage_forward(self, mb: int, x: Any, labels: Any, train: bool) -> Any:
        from flowtrain.profiling.census import OpCensus

        # the first training forward takes the op census (the data-parallel engine's), loss included
        census = OpCensus() if self._plan_pending and train else None
        with self.timer.span("forward", f"forward/mb{mb}"), torch.set_grad_enabled(train), \
                census if census is not None else contextlib.nullcontext():
            out = self.module(x)
            result = out
            if self.grid.is_last_stage and labels is not None:
                if self.module.loss_fn is None:
                    raise ValueError("the last pipeline stage needs PipelineModule(loss_fn=...) "
                                     "to train or evaluate with labels")
                result = self.module.loss_fn(out, labels)
        if census is not None:
            self._record_stage_plan(census.summary(), out)
        return result

    def _record_stage_plan(self, census: dict[str, Any], out: Any) -> None:
        """``stages/stage{s}.json`` in the run directory: this stage's parameters, forward FLOPs
        (matmuls and attention), its other ops (``OpCensus.summary()``) and output bytes of one
        micro-batch; rank 0 also writes ``plan.json`` (world size: all ranks). ``flowtrain
        simulate --compare`` rebuilds the pipeline's plan from them."""
        from pathlib import Path

        from flowtrain.engine.spans import write_plan

        self._plan_pending = False
        flops = float(census["matmul_flops"] + census["attention_flops"])
        record = {"v": 1, "stage": self.stage_id, "stages": self.num_stages,
                  "param_specs": [[n, list(shape), d, e] for n, shape, d, e in
                                  self._param_specs()],
                  "forward_flops_per_micro_batch": flops,
                  "forward_ops_per_micro_batch": census,
                  "output_bytes_per_micro_batch": sum(t.numel() * t.element_size()
                                                      for t in _tensors(out))}
        try:
            stages = Path(self._run_dir) / "stages"
            stages.mkdir(parents=True, exist_ok=True)
            (stages / f"stage{self.stage_id}.json").write_text(json.dumps(record))
            if self.global_rank == 0:
                write_plan(self._run_dir, config=self.config.to_dict(),
                           world_size=dist.get_world_size() if dist.is_initialized() else 1,
                           param_specs=self._param_specs(), forward_flops_per_micro_batch=flops)
        except OSError as exc:
            log.warning("could not record the pipeline stage's plan", error=str(exc))

    def _stage_backward(self, mb: int, out: Any, grad: Any, last: bool) -> None:
        if self.grid.is_last_stage:
            scale = self.loss_scaler.loss_scale / self.config.gradient_accumulation_steps
            self.backward_pass(lambda: (out.float() * scale).backward(), f"backward/mb{mb}")
        else:
            outs = [t for t in _tensors(out) if t.requires_grad]
            grads = [g for t, g in zip(_tensors(out), _tensors(grad)) if t.requires_grad]
            self.backward_pass(lambda: torch.autograd.backward(outs, grads), f"backward/mb{mb}")
        if not last:
            self.micro_steps += 1  # the boundary (the last backward) steps after the sends

    # -- the DeepSpeed surface ---------------------------------------------------------------------

    def _batches(self, data_iter: Iterator[Any] | None) -> tuple[Any, ...]:
        gas = self.config.gradient_accumulation_steps
        if not (self.grid.is_first_stage or self.grid.is_last_stage):
            return (None,) * gas
        if data_iter is None:
            raise ValueError("the first and last pipeline stages need a data_iter yielding "
                             "(inputs, labels) micro-batches")
        out = []
        for i in range(gas):
            try:
                batch = next(data_iter)
            except StopIteration:
                raise ValueError(f"data_iter ran out after {i} of {gas} micro-batches "
                                 f"(gradient_accumulation_steps)") from None
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ValueError(f"data_iter must yield (inputs, labels) pairs, got "
                                 f"{type(batch).__name__}")
            out.append((batch[0], batch[1]))
        return tuple(out)

    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """One optimizer step over gradient_accumulation_steps micro-batches; returns the
        mean loss (on every stage)."""
        if not self.module.training:
            self.module.train()
        ops = tuple(stage_ops(self.schedule, self.stage_id, self.num_stages,
                              self.config.gradient_accumulation_steps))
        done = self._stage_ref.ask_from_thread(RunSchedule(ops, self._batches(data_iter), True),
                                               timeout=comm.DEFAULT_TIMEOUT)
        loss = self._pipeline_loss(done.losses)
        self._losses = [loss]
        self.step()
        self.agg_train_loss = loss
        return loss

    def eval_batch(self, data_iter: Iterator[Any] | None = None,
                   compute_loss: bool = True) -> torch.Tensor:
        """Forward only over gradient_accumulation_steps micro-batches; the mean loss."""
        ops = tuple(op for op in stage_ops("gpipe", self.stage_id, self.num_stages,
                                           self.config.gradient_accumulation_steps)
                    if op.kind in ("recv_act", "forward", "send_act"))
        was = self.module.training
        self.module.eval()
        try:
            done = self._stage_ref.ask_from_thread(
                RunSchedule(ops, self._batches(data_iter), False), timeout=comm.DEFAULT_TIMEOUT)
        finally:
            self.module.train(was)
        return self._pipeline_loss(done.losses)

    def _pipeline_loss(self, losses: tuple[float, ...]) -> torch.Tensor:
        value = torch.tensor([sum(losses) / len(losses) if losses else 0.0], dtype=torch.float32)
        if self.num_stages > 1:
            dist.broadcast(value, src=self.grid.stage_rank(self.num_stages - 1),
                           group=self.grid.pp_group)
        return value[0]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline engine trains with engine.train_batch(data_iter) and "
                           "evaluates with engine.eval_batch(data_iter), not engine(batch)")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a pipeline engine runs backward inside engine.train_batch()")

    def destroy(self) -> None:
        self._runtime.stop_actor(self._stage_ref.name)
        super().destroy()
