"""The pipeline-parallel engine: ``engine.train_batch(data_iter)`` / ``eval_batch``.

Each rank's ``PipeStage`` actor runs its stage's instruction list (``flowtrain.pipe.schedule``):
activation and gradient sends and receives are awaited on the event loop (torch.distributed
isend/irecv on a process group of their own), forward and backward run on one compute thread
handed work by the actor. Gradients of the stage's parameters go through the usual buckets and
BucketReducer over the data-parallel group; the optimizer step follows the last backward.
"""

from __future__ import annotations

import contextlib
import json
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

TAG_ACT, TAG_GRAD = 11, 12
HEADER = 64  # int64 slots: count, then per tensor dtype code, ndim, dims
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]


@dataclass(frozen=True)
class RunSchedule:
    ops: tuple[Op, ...]
    batches: tuple[Any, ...]  # per micro-batch (inputs, labels); None on middle stages
    train: bool


@dataclass(frozen=True)
class ScheduleDone:
    losses: tuple[float, ...]  # the last stage's per-micro-batch losses


class PipeStage(Actor):
    """Runs one stage's schedule for one batch."""

    mailbox_size = 16

    def __init__(self, engine: PipelineEngine, group: Any, timeout: float) -> None:
        self.engine = engine
        self.group = group
        self.timeout = timeout
        self.limiter = anyio.CapacityLimiter(1)

    async def _compute(self, fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    @handler
    async def run(self, msg: RunSchedule) -> ScheduleDone:
        engine = self.engine
        grid = engine.grid
        prev = grid.stage_rank(grid.pp_rank - 1) if not grid.is_first_stage else None
        nxt = grid.stage_rank(grid.pp_rank + 1) if not grid.is_last_stage else None
        inputs: dict[int, Any] = {}
        outputs: dict[int, Any] = {}
        grads: dict[int, Any] = {}
        sends: list[tuple[Any, Any, str]] = []
        losses: list[float] = []
        spans = engine.timer.spans
        for op in msg.ops:
            mb = op.mb
            start = time.perf_counter()
            if op.kind == "recv_act":
                inputs[mb] = await self._recv(prev, TAG_ACT, f"activations of micro-batch {mb} "
                                              f"from stage {grid.pp_rank - 1}", msg.train)
            elif op.kind == "forward":
                x = inputs[mb] if mb in inputs else msg.batches[mb][0]
                labels = msg.batches[mb][1] if grid.is_last_stage else None
                outputs[mb] = await self._compute(engine._stage_forward, mb, x, labels,
                                                  msg.train)
                if grid.is_last_stage and outputs[mb] is not None:
                    losses.append(float(outputs[mb].detach()))
                if not msg.train:
                    inputs.pop(mb, None)
                continue  # the compute thread records its own span
            elif op.kind == "send_act":
                out = outputs[mb] if msg.train else outputs.pop(mb)
                sends += self._send(_detached(out), nxt, TAG_ACT, f"activations of "
                                    f"micro-batch {mb} to stage {grid.pp_rank + 1}")
            elif op.kind == "recv_grad":
                grads[mb] = await self._recv(nxt, TAG_GRAD, f"gradients of micro-batch {mb} "
                                             f"from stage {grid.pp_rank + 1}", False)
            elif op.kind == "backward":
                await self._compute(engine._stage_backward, mb, outputs.pop(mb),
                                    grads.pop(mb, None), _last_backward(msg.ops, op))
                continue
            elif op.kind == "send_grad":
                x = inputs.pop(mb)
                sends += self._send(_input_grads(x), prev, TAG_GRAD, f"gradients of "
                                    f"micro-batch {mb} to stage {grid.pp_rank - 1}")
            spans.append((op.task_name, start, time.perf_counter()))
        for work, _keep, what in sends:
            await comm.wait(work, what, self.timeout)
        return ScheduleDone(tuple(losses))

    def _send(self, tensors: tuple[torch.Tensor, ...], dst: int, tag: int,
              what: str) -> list[tuple[Any, Any, str]]:
        header = torch.zeros(HEADER, dtype=torch.int64)
        header[0] = len(tensors)
        i = 1
        for t in tensors:
            dims = list(t.shape)
            if i + 2 + len(dims) > HEADER:
                raise ValueError(f"pipeline stage output too complex to send: {len(tensors)} "
                                 f"tensors of up to {len(dims)} dimensions")
            header[i], header[i + 1] = _DTYPES.index(t.dtype), len(dims)
            header[i + 2:i + 2 + len(dims)] = torch.tensor(dims, dtype=torch.int64)
            i += 2 + len(dims)
        works = [(dist.isend(header, dst, group=self.group, tag=tag), header, what)]
        for t in tensors:
            t = t.contiguous()
            works.append((dist.isend(t, dst, group=self.group, tag=tag), t, what))
        return works

    async def _recv(self, src: int, tag: int, what: str, requires_grad: bool) -> Any:
        header = torch.empty(HEADER, dtype=torch.int64)
        await comm.wait(dist.irecv(header, src, group=self.group, tag=tag), what, self.timeout)
        count, i, out = int(header[0]), 1, []
        for _ in range(count):
            dtype, ndim = _DTYPES[int(header[i])], int(header[i + 1])
            shape = [int(d) for d in header[i + 2:i + 2 + ndim]]
            i += 2 + ndim
            t = torch.empty(shape, dtype=dtype, device=self.engine.device)
            await comm.wait(dist.irecv(t, src, group=self.group, tag=tag), what, self.timeout)
            if requires_grad and t.is_floating_point():
                t.requires_grad_(True)
            out.append(t)
        return out[0] if count == 1 else tuple(out)


def _last_backward(ops: tuple[Op, ...], op: Op) -> bool:
    return op is [o for o in ops if o.kind == "backward"][-1]


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
        from torch.utils.flop_counter import FlopCounterMode

        counter = FlopCounterMode(display=False) if self._plan_pending and train else None
        with self.timer.span("forward", f"forward/mb{mb}"), torch.set_grad_enabled(train), \
                counter if counter is not None else contextlib.nullcontext():
            out = self.module(x)
            result = out
            if self.grid.is_last_stage and labels is not None:
                if self.module.loss_fn is None:
                    raise ValueError("the last pipeline stage needs PipelineModule(loss_fn=...) "
                                     "to train or evaluate with labels")
                result = self.module.loss_fn(out, labels)
        if counter is not None:
            self._record_stage_plan(float(counter.get_total_flops()), out)
        return result

    def _record_stage_plan(self, flops: float, out: Any) -> None:
        """``stages/stage{s}.json`` in the run directory: this stage's parameters, forward FLOPs
        and output bytes of one micro-batch; rank 0 also writes ``plan.json`` (world size: all
        ranks). ``flowtrain simulate --compare`` rebuilds the pipeline's plan from them."""
        from pathlib import Path

        from flowtrain.engine.spans import write_plan

        self._plan_pending = False
        record = {"v": 1, "stage": self.stage_id, "stages": self.num_stages,
                  "param_specs": [[n, list(shape), d, e] for n, shape, d, e in
                                  self._param_specs()],
                  "forward_flops_per_micro_batch": flops,
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
