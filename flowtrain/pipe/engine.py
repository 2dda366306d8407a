"""The pipeline-parallel engine: ``engine.train_batch(data_iter)`` / ``eval_batch``.

Each rank's ``PipeStage`` actor (``flowtrain.pipe.stage``) runs its stage's instruction list
(``flowtrain.pipe.schedule``) on one compute thread, handed the whole list at once: forward and
backward (this engine's ``stage_forward`` / ``stage_backward``), and between them activations
and gradients crossing stages through the point-to-point streams of ``flowtrain.pipe.p2p``, on a
process group of their own. Gradients of the stage's parameters go through the usual buckets and
BucketReducer over the data-parallel group; the optimizer step follows the last backward.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from flowtrain import comm
from flowtrain.config import FlowtrainConfig
from flowtrain.engine.engine import FlowtrainEngine
from flowtrain.log import get_logger
from flowtrain.parallel.grid import ProcessGrid
from flowtrain.pipe.module import PipelineModule
from flowtrain.pipe.p2p import (  # noqa: F401 - the streams' names, importable here as before
    HEADER,
    TAG_ACT,
    TAG_ACT_DATA,
    TAG_GRAD,
    TAG_GRAD_DATA,
    PipelineChannelError,
    Receiver,
    Sender,
)
from flowtrain.pipe.stage import PipeStage, RunSchedule, ScheduleDone, tensors_of  # noqa: F401
from flowtrain.plan import names
from flowtrain.plan.schedule import stage_ops

log = get_logger("flowtrain.pipe")


class PipelineEngine(FlowtrainEngine):
    """FlowtrainEngine for a ``PipelineModule``: data parallel over its data-parallel group,
    pipeline stages driven by ``train_batch``. ``train_micro_batch_size_per_gpu`` is the size
    of a micro-batch; ``gradient_accumulation_steps`` is the number of micro-batches per step."""

    grid: ProcessGrid  # a pipeline engine always has one (its module's)
    module: PipelineModule

    def __init__(self, model: PipelineModule, optimizer: torch.optim.Optimizer,
                 config: FlowtrainConfig, **kwargs: Any) -> None:
        if not isinstance(model, PipelineModule):
            raise TypeError("PipelineEngine needs a flowtrain.pipe.PipelineModule")
        if model.virtual_stages != config.pipeline.virtual_stages:
            raise ValueError(f"the PipelineModule has {model.virtual_stages} model chunks per "
                             f"stage but pipeline.virtual_stages is "
                             f"{config.pipeline.virtual_stages}: cut it first (flowtrain."
                             f"initialize does), before its parameters go to the optimizer")
        super().__init__(model, optimizer, config, grid=model.grid, **kwargs)
        self.virtual_stages = model.virtual_stages
        self.num_stages = model.num_stages
        self.stage_id = model.stage_id
        self.schedule = self.plan.schedule  # checked when the engine planned its step
        if self.spec.recompute_interval and not model.activation_checkpoint_interval:
            model.activation_checkpoint_interval = self.spec.recompute_interval
        group = dist.new_group(ranks=list(range(dist.get_world_size()))) \
            if dist.is_initialized() and dist.get_world_size() > 1 else None
        self._p2p_group = group
        self._stage_actor = PipeStage(self, self.grid, self.device, group, comm.DEFAULT_TIMEOUT,
                                      virtual_stages=self.virtual_stages)
        self._stage_ref = self._runtime.spawn(self._stage_actor)
        self.agg_train_loss: torch.Tensor | None = None
        # each stage's first rank records its part of the plan (for simulate --compare)
        self._plan_pending = self._run_dir is not None and self.grid.dp_rank == 0 and \
            self.grid.tp_rank == 0
        self._chunk_census: dict[int, tuple[dict[str, Any], Any]] = {}

    # -- compute (on the stage actor's compute thread) --------------------------------------------

    def stage_forward(self, mb: int, x: Any, labels: Any, train: bool,
                      chunk: int | None = None) -> Any:
        """Micro-batch ``mb``'s forward on this stage (its model chunk ``chunk`` with the
        interleaved schedule); with labels (the model's last chunk), its loss. Called by the
        stage actor (``flowtrain.pipe.stage.PipeStage``)."""
        from flowtrain.profiling.census import OpCensus

        # the first training forward of each chunk takes the op census (the data-parallel
        # engine's), loss included
        census = OpCensus() if self._plan_pending and train and \
            (chunk or 0) not in self._chunk_census else None
        with self.timer.span("forward", names.forward(mb, chunk=chunk)), \
                torch.set_grad_enabled(train), \
                census if census is not None else contextlib.nullcontext():
            out = self.module(x, chunk=chunk or 0)
            result = out
            if labels is not None:
                if self.module.loss_fn is None:
                    raise ValueError("the last pipeline stage needs PipelineModule(loss_fn=...) "
                                     "to train or evaluate with labels")
                result = self.module.loss_fn(out, labels)
        if census is not None:
            self._chunk_census[chunk or 0] = (census.summary(), out)
            if len(self._chunk_census) == self.virtual_stages:
                self._record_stage_plan()
        return result

    def _record_stage_plan(self) -> None:
        """``stages/stage{s}.json`` in the run directory: this stage's parameters, forward FLOPs
        (matmuls and attention), its other ops (``OpCensus.summary()``) and output bytes of one
        micro-batch; rank 0 also writes ``plan.json`` (world size: all ranks). ``flowtrain
        simulate --compare`` rebuilds the pipeline's plan from them. With virtual stages, the
        figures are the sum over the stage's chunks (its output: the last chunk's), and
        ``chunks`` holds each chunk's layers, FLOPs and output bytes."""
        from pathlib import Path

        from flowtrain.engine.spans import write_plan
        from flowtrain.profiling.census import merge_summaries

        counted = [self._chunk_census[c] for c in range(self.virtual_stages)]
        self._chunk_census = {}
        census = merge_summaries([summary for summary, _ in counted])
        out = counted[-1][1]

        run_dir = self._run_dir
        if run_dir is None:  # _plan_pending is set only with one
            raise RuntimeError("a pipeline stage records its plan only in a launched run's "
                               "directory")
        self._plan_pending = False
        flops = float(census["matmul_flops"] + census["attention_flops"])
        record = {"v": 1, "stage": self.stage_id, "stages": self.num_stages,
                  "param_specs": [[n, list(shape), d, e] for n, shape, d, e in
                                  self._param_specs()],
                  "forward_flops_per_micro_batch": flops,
                  "forward_ops_per_micro_batch": census,
                  "output_bytes_per_micro_batch": _nbytes(out)}
        if self.virtual_stages > 1:
            record["chunks"] = [
                {"layers": list(span),
                 "forward_flops_per_micro_batch": float(summary["matmul_flops"] +
                                                        summary["attention_flops"]),
                 "output_bytes_per_micro_batch": _nbytes(chunk_out)}
                for span, (summary, chunk_out) in zip(self.module.chunk_ranges, counted)]
        try:
            stages = Path(run_dir) / "stages"
            stages.mkdir(parents=True, exist_ok=True)
            (stages / f"stage{self.stage_id}.json").write_text(json.dumps(record))
            if self.global_rank == 0:
                write_plan(run_dir, config=self.config.to_dict(),
                           world_size=dist.get_world_size() if dist.is_initialized() else 1,
                           param_specs=self._param_specs(), forward_flops_per_micro_batch=flops)
        except OSError as exc:
            log.warning("could not record the pipeline stage's plan", error=str(exc))

    def stage_backward(self, mb: int, out: Any, grad: Any, last: bool,
                       chunk: int | None = None) -> None:
        """Micro-batch ``mb``'s backward (of model chunk ``chunk``) from its output and the next
        chunk's gradients (None: ``out`` is the loss, on the model's last chunk). ``last``: the
        step's last backward, whose micro-step the optimizer step after the sends counts.
        Called by the stage actor."""
        name = names.backward(mb, chunk=chunk)
        if grad is None:
            scale = self.loss_scaler.loss_scale / self.spec.gradient_accumulation_steps
            self.backward_pass(lambda: (out.float() * scale).backward(), name)
        else:
            outs = [t for t in tensors_of(out) if t.requires_grad]
            grads = [g for t, g in zip(tensors_of(out), tensors_of(grad)) if t.requires_grad]
            self.backward_pass(lambda: torch.autograd.backward(outs, grads), name)
        if not last:
            # the boundary (the last backward) steps after the sends; with virtual stages a
            # micro-step is one chunk's backward, so the boundary stays the step's last one
            self.micro_steps += 1

    # -- the DeepSpeed surface ---------------------------------------------------------------------

    def _batches(self, data_iter: Iterator[Any] | None) -> tuple[Any, ...]:
        gas = self.spec.gradient_accumulation_steps
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
        # the step's instructions as the plan orders them (the simulator's plan is the same)
        ops = tuple(self.plan.instructions())
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
        schedule = "interleaved" if self.virtual_stages > 1 else "gpipe"
        gas = self.spec.gradient_accumulation_steps
        ops = tuple(op for op in stage_ops(schedule, self.stage_id, self.num_stages, gas,
                                           self.virtual_stages)
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


def _nbytes(out: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(out))


def apply_virtual_stages(model: PipelineModule, config: FlowtrainConfig) -> None:
    """Cuts ``model`` into the config's ``pipeline.virtual_stages`` chunks per stage (the
    interleaved schedule), or refuses a module cut into chunks for another schedule. Before
    the optimizer takes the module's parameters: the stage's layers change."""
    wanted = int(config.pipeline.virtual_stages)
    if model.virtual_stages > 1 and wanted != model.virtual_stages:
        raise ValueError(f"the PipelineModule has virtual_stages={model.virtual_stages}, but the "
                         f"config's pipeline.virtual_stages is {wanted} (schedule "
                         f"{config.pipeline.schedule!r}); set pipeline.schedule 'interleaved' "
                         f"and pipeline.virtual_stages {model.virtual_stages}")
    model.set_virtual_stages(wanted)
