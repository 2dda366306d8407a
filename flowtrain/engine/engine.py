"""The training engine with DeepSpeed's surface: ``engine(batch)``, ``backward(loss)``,
``step()``, checkpoints. Data parallel runs as actors: gradients land in flat buckets and the
BucketReducer reduces each bucket while backward goes on."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from flowtrain.config import FlowtrainConfig
from flowtrain.config.model import TORCH_DTYPES
from flowtrain.engine.bucket_order import BucketOrder
from flowtrain.engine.buckets import GradBuckets
from flowtrain.engine.comm_setup import (
    arena_bytes,
    broadcast_model,
    make_reducer,
    open_channel,
    open_param_channel,
)
from flowtrain.engine.dataloader import DistributedLoader
from flowtrain.engine.embedding_rows import EmbeddingRows, count_lookups, tied_embeddings
from flowtrain.engine.health import Health
from flowtrain.engine.mixed import MasterWeights, lay_out_flat
from flowtrain.engine.parts import EngineParts
from flowtrain.engine.peer import PeerRecovery
from flowtrain.engine.reducer import BucketReady, EndMicroBatch, Flush
from flowtrain.engine.stages import (
    BucketFull,
    BucketReduced,
    MicroBatchEnd,
    MicroBatchStart,
    Stages,
    StepDone,
)
from flowtrain.engine.strategy import param_groups, strategy_for
from flowtrain.engine.surface import EngineSurface
from flowtrain.engine.timing import StepTimer
from flowtrain.env import RUN_DIR
from flowtrain.log import get_logger
from flowtrain.parallel.grid import ProcessGrid
from flowtrain.peer_recovery import enabled as _peer_recovery_enabled
from flowtrain.plan import StepPlan, names
from flowtrain.plan.spec import engine_problem, plan_step, resolve
from flowtrain.precision import build_loss_scaler
from flowtrain.runtime.actor import Actor, ActorRef
from flowtrain.zero import construct

log = get_logger("flowtrain.engine")



class FlowtrainEngine(EngineSurface, PeerRecovery, torch.nn.Module):
    """Wraps a model for data-parallel training; made by ``flowtrain.initialize``."""

    # set by flowtrain.initialize: rank 0's flowtrain.profiling.EngineProfile, or None (the
    # profiler runs the engine, so the engine names it by its behaviour, not its module)
    flops_profiler: object | None

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 config: FlowtrainConfig, *, lr_scheduler: Any = None, training_data: Any = None,
                 collate_fn: Any = None, rank: Any = None,
                 grid: ProcessGrid | None = None) -> None:
        super().__init__()
        self.module = model
        self.config = config
        self._rank = rank
        # With pipeline or tensor parallelism (a flowtrain.parallel.ProcessGrid) gradients are
        # reduced over this rank's data-parallel group: world_size is that group's size.
        self.grid = grid
        self.dp_group = grid.dp_group if grid is not None else None
        self.model_parallel = grid is not None and (grid.shape.pp > 1 or grid.shape.tp > 1)
        on = dist.is_initialized()
        self.world_size = dist.get_world_size(self.dp_group) if on else 1
        self.global_rank = dist.get_rank() if on else 0
        self.dp_rank = dist.get_rank(self.dp_group) if on else 0
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.device = next(model.parameters()).device
        # the default bucket holds a fixed number of bytes of the parameters as the model
        # arrives, before they are cast to the training dtype
        arriving_elem = next((p.element_size() for p in model.parameters()), 4)
        self.spec = resolve(config, dp=self.world_size,
                            tp=grid.shape.tp if grid is not None else 1,
                            pp=grid.shape.pp if grid is not None else 1,
                            elem_size=arriving_elem,
                            mirrored=self.world_size > 1 and on and _peer_recovery_enabled())
        self.precision = self.spec.precision
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._global_grad_norm: float | None = None
        self._losses: list[torch.Tensor] = []
        self._no_sync = False
        self.stages = Stages()
        self.timer = StepTimer()

        model_dtype = TORCH_DTYPES[self.precision]
        if model_dtype != torch.float32:
            # zero.Init's partitions are cast as they are (the model never whole)
            construct.cast(model.parameters(), model_dtype)
            model.to(model_dtype)
        # (peer recovery's group is not formed yet: broadcast_model asks it of the launcher)
        broadcast_model(model, world_size=self.world_size, grid=grid, group=self.dp_group,
                        peer=None)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        if not self.trainable:
            raise ValueError("the model has no parameter with requires_grad=True; nothing to train")
        self._names = _param_names(model, self.trainable)

        self.zero = None  # a flowtrain.zero.ZeroOptimizer with ZeRO stages 1-3
        self.stage3 = None  # flowtrain.zero.stage3.Stage3Params: stage 3 on several ranks
        self.zero_stage = self.spec.zero_stage  # the record checkpoints and telemetry keep
        problem = engine_problem(self.spec)
        if problem is not None:
            raise ValueError(problem)
        # how the group holds its model states: replicated, or ZeRO's shards
        self.strategy = strategy_for(self.spec)
        # launch --peer-recovery with ZeRO-1/2: every rank also steps its neighbour's shard
        # (flowtrain.zero.mirror), which needs whole reduced gradients
        self._mirrored = self.spec.mirrored
        # Reduced every micro-batch (ZeRO 2-3 keeping a gradient shard, not whole gradients):
        # the buckets are transient, handed to the reducer as each micro-batch fills them.
        self.transient = self.spec.reduction.every_micro_batch
        self._handed: set[int] = set()
        self.master = MasterWeights(self.trainable) if self.strategy.master_weights else None
        if self.master is not None:
            self.master.replace_in_optimizer(optimizer)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = build_loss_scaler(self.spec.loss_scale,
                                             enabled=self.precision == "fp16")

        self.comm_dtype = getattr(torch, self.spec.comm_dtype)
        self.bucket_numel = self.spec.bucket_numel
        # what ZeRO and the health figures are built from
        self._parts = EngineParts(
            spec=self.spec, module=model, trainable=self.trainable,
            param_specs=self._param_specs(), grid=grid, dp_group=self.dp_group,
            world_size=self.world_size, dp_rank=self.dp_rank,
            model_parallel=self.model_parallel, spawn=self._spawn)
        self._groups = param_groups(optimizer, self.trainable) \
            if self.strategy.needs_groups() else None
        self.plan = self._make_plan(order=None)
        self.channel = None
        self._param_channel: Any = None
        # launch --peer-recovery: the group may lose and regain ranks without a restart
        self.peer = self._peer_group()
        self.step_dropped = False  # the last step() dropped its step (a rank was lost)
        if self.world_size > 1 and self.peer is None:
            # before the buckets: with the shared-memory channel they live in its arena; not
            # under peer recovery: shared memory would wait on a dead peer, gloo's connections
            # see it close
            self.channel = open_channel(
                self._rank_handle(), self.spec, self.plan, comm_dtype=self.comm_dtype,
                world_size=self.world_size, model_parallel=self.model_parallel, module=model,
                arena_bytes=arena_bytes(self.spec, self.trainable, comm_dtype=self.comm_dtype,
                                        bucket_pad=self.strategy.bucket_pad))
        self.buckets = self._make_buckets(self.plan)
        # the buckets re-cut in the order gradients arrive, where nothing fixes the layout
        self._order = BucketOrder(
            self.world_size > 1 and self.strategy.observes_bucket_order and
            not self.model_parallel and self.peer is None and
            self.spec.host.bucket_order == "observed")
        self.zero, self.stage3 = self.strategy.build(self._parts, self.buckets, optimizer)
        if self.zero is not None:
            if self.channel is not None and all(
                    f is None or f.device.type == "cpu" for f in self.zero.flat_params):
                self.zero.channel = self.channel
            self._param_channel = open_param_channel(self._rank_handle(), self.spec,
                                                     channel=self.channel, zero=self.zero,
                                                     stage3=self.stage3)
        self.reducer = None
        if self.world_size > 1:
            self._spawn_reducer()
        # a tied embedding's gradient reduced in two parts, so that its bucket need not wait
        # for the end of backward (flowtrain/engine/embedding_rows.py)
        self._rows: EmbeddingRows | None = None
        if self.world_size > 1 and self.strategy.splits_tied_rows and not self.model_parallel \
                and self.peer is None and self.spec.host.tied_embedding_rows:
            tied = tied_embeddings(model)
            if tied:
                self._rows = EmbeddingRows(tied, world_size=self.world_size,
                                           group=self.dp_group, device=self.device,
                                           channel=self.channel)

        # measured spans and the plan, for `flowtrain simulate --compare` (launched runs only)
        self._run_dir = os.environ.get(RUN_DIR) or None
        self._spans = None
        # the first forward counts its FLOPs (health figures; plan.json on rank 0 of a run)
        self._plan_pending = True
        self.health = Health(self._parts, self.zero)
        if self._run_dir is not None:
            from flowtrain.engine.spans import SpanRecorder

            try:
                self._spans = SpanRecorder(self._run_dir, self.global_rank)
            except OSError as exc:
                log.warning("cannot record spans in the run directory", error=str(exc))

        self.training_dataloader = None
        if training_data is not None:
            self.training_dataloader = DistributedLoader(
                training_data, batch_size=self.spec.micro_batch_size,
                rank=self.dp_rank, world_size=self.world_size, collate_fn=collate_fn,
                seed=self.spec.host.seed)

    # -- setup helpers --------------------------------------------------------------------------

    def _rank_handle(self) -> Any:
        """This process's flowtrain.runtime Rank (taken on first use)."""
        if self._rank is None:
            from flowtrain.runtime.rank import current_rank

            self._rank = current_rank()
        return self._rank

    @property
    def _runtime(self) -> Any:
        return self._rank_handle().runtime

    def _spawn_reducer(self) -> None:
        """Starts the gradient reducer over the current buckets and group (again after peer
        recovery re-forms the group)."""
        reducer = make_reducer(self.buckets, self.spec, world_size=self.world_size,
                               group=self.dp_group, comm_dtype=self.comm_dtype,
                               stages=self.stages, channel=self.channel, zero=self.zero,
                               peer=self.peer)
        self.reducer = self._runtime.spawn(reducer)  # a unique name: engines may be rebuilt
        self._reducer_actor = reducer

    def _broadcast_model(self) -> None:
        """Rank 0's weights and buffers to every rank of the (re-formed) group."""
        broadcast_model(self.module, world_size=self.world_size, grid=self.grid,
                        group=self.dp_group, peer=self.peer)

    def _spawn(self, actor: Actor) -> ActorRef[Any]:
        """Starts ``actor`` on this rank's runtime (the pieces ZeRO builds use it)."""
        return self._runtime.spawn(actor)

    def _reducer_ref(self) -> Any:
        """The gradient reducer, which an engine over several data-parallel ranks has."""
        if self.reducer is None:
            raise RuntimeError("a gradient bucket was handed over for a reduce, but this engine "
                               "has one data-parallel rank and no reducer")
        return self.reducer

    def _param_specs(self) -> list[tuple[str, tuple[int, ...], str, int]]:
        """(name, shape, dtype, element size) of each trainable parameter, taken once before
        ZeRO stage 3 replaces partitioned parameters with empty placeholders."""
        if getattr(self, "_specs", None) is None:
            self._specs = [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."),
                            p.element_size()) for name, p in zip(self._names, self.trainable)]
        return self._specs

    def _make_plan(self, order: list[int] | None) -> StepPlan:
        buckets = self.strategy.plan_buckets(self._parts, self._groups)
        return plan_step(self.spec, self._param_specs(), groups=self._groups, buckets=buckets,
                         order=order, stage=self._pipeline_stage())

    def _pipeline_stage(self) -> int:
        """This rank's pipeline stage (0 without a pipeline)."""
        return self.grid.pp_rank if self.grid is not None and self.spec.pp > 1 else 0

    def _use_bucket_order(self, order: list[int]) -> bool:
        """Rebuilds the buckets with the parameters in ``order``; False when they already are."""
        if order == self.bucket_layout():
            return False
        self.buckets.remove_hooks()
        self.plan = self._make_plan(order)
        self.buckets = self._make_buckets(self.plan)
        if self.reducer is not None:
            self._reducer_actor.use_buckets(self.buckets)
        return True

    def _make_buckets(self, plan: StepPlan) -> GradBuckets:
        allocate = self.channel.arena_allocator() \
            if self.channel is not None and self.channel.arena_bytes else None
        buckets = GradBuckets(self.trainable, plan.buckets,
                              pad_to=self.strategy.bucket_pad,
                              transient=self.transient, allocate=allocate)
        if self.world_size > 1:
            # the hooks count arrivals for the reducer; one data-parallel rank has none
            buckets.install_hooks()
        if self.strategy.flat_model:  # ZeRO lays parameters out flat itself
            lay_out_flat(buckets, self.master)
        return buckets

    # -- the DeepSpeed surface --------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._send_stage("micro_batch", MicroBatchStart(self.global_steps, self.micro_steps))
        mb = self.micro_steps % self.spec.gradient_accumulation_steps
        if self.stage3 is not None and torch.is_grad_enabled():
            self.stage3.start_micro_batch(mb)
        if self._plan_pending:
            return self._forward_counting_flops(args, kwargs, mb)
        with self.timer.span("forward", names.forward(mb)):
            return self._run_module(args, kwargs)

    def _run_module(self, args: Any, kwargs: Any) -> Any:
        if self.precision != "fp32" and self.spec.loss_scale.auto_cast:
            args, kwargs = _cast_floats((args, kwargs), TORCH_DTYPES[self.precision])
        if self._rows is None:
            return self.module(*args, **kwargs)
        # stages that see a bucket as it is reduced would see the tied weight's gradient
        # without its embedding rows: with them, the lookups run as usual
        self._rows.active = not (self.stages["bucket_full"] or self.stages["after_reduce"])
        try:
            return self.module(*args, **kwargs)
        finally:
            self._rows.active = False

    def _forward_counting_flops(self, args: Any, kwargs: Any, mb: int) -> Any:
        """The first forward counts its FLOPs and its other ops (``flowtrain.profiling.census``,
        FLOPs by torch.utils.flop_counter's formulas, attention taken whole): the health
        figures' MFU, and on rank 0 of a launched run the run directory's plan.json."""
        from flowtrain.engine.spans import write_plan
        from flowtrain.profiling.census import OpCensus

        self._plan_pending = False
        census = OpCensus()
        writes = self._run_dir is not None and self.global_rank == 0
        # the tied embeddings' lookups: the simulator prices the split of their gradient by them
        lookups = count_lookups(self.module if writes else None,
                                dict(zip(self._names, self.trainable)))
        with lookups as counted, census, self.timer.span("forward", names.forward(mb)):
            out = self._run_module(args, kwargs)
        summary = census.summary()
        self.health.forward_flops = summary["matmul_flops"] + summary["attention_flops"]
        if not writes:
            return out
        assert self._run_dir is not None
        try:
            config = self.config.to_dict()
            if self.world_size > 1:
                # what carried the reduces (an unset choice is decided by the host), so a plan
                # of this run lays out the collectives it ran
                config.setdefault("flowtrain", {})["data_channel"] = \
                    "shm" if self.channel is not None else "torch"
            write_plan(self._run_dir, config=config, world_size=self.world_size,
                       param_specs=self._param_specs(),
                       forward_flops_per_micro_batch=self.health.forward_flops,
                       forward_ops_per_micro_batch=summary,
                       tied_embeddings=[{"param": n, "lookups_per_micro_batch": c}
                                        for n, c in counted.items()])
        except OSError as exc:
            log.warning("could not write the run's plan.json", error=str(exc))
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this block do not reduce gradients (DDP's no_sync)."""
        problem = self.strategy.no_sync_problem()
        if problem is not None:
            raise RuntimeError(problem)
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def backward(self, loss: torch.Tensor, retain_graph: bool = False,
                 scale_wrt_gas: bool = True) -> torch.Tensor:
        """Scales the loss (loss scale, 1/gradient_accumulation_steps) and runs backward; on the
        accumulation boundary each full gradient bucket starts its all-reduce at once."""
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError(f"backward needs a scalar loss tensor, got {type(loss).__name__}"
                             f"{tuple(loss.shape) if torch.is_tensor(loss) else ''}")
        self._losses.append(loss.detach())
        scale = self.loss_scaler.loss_scale
        if scale_wrt_gas:
            scale = scale / self.spec.gradient_accumulation_steps
        self.backward_pass(lambda: (loss.float() * scale if scale != 1.0 else loss).backward(
            retain_graph=retain_graph))
        return loss

    def backward_pass(self, run: Any, name: str | None = None) -> None:
        """Runs ``run()`` (an autograd backward) with the gradient buckets wired: on the
        accumulation boundary (every micro-batch with ZeRO 2-3) each full bucket starts its
        reduce at once. Pipeline stages call it with their own backward."""
        if not self.buckets.views_intact():
            self.buckets.attach_views()  # the user cleared .grad (e.g. zero_grad(set_to_none))
        boundary = self.is_gradient_accumulation_boundary()
        reduce_now = (boundary or self.transient) and self.reducer is not None and \
            not self._no_sync
        self._handed.clear()
        mb = self.micro_steps % self.spec.gradient_accumulation_steps
        if self.stage3 is not None:
            self.stage3.start_backward()
        with self.buckets.watch(self._bucket_ready if reduce_now else None,
                                record_order=reduce_now and not self._order.settled), \
                self.timer.span("backward", name or names.backward(mb)):
            run()
        if self._rows is not None:
            self._rows.after_backward(reduces=reduce_now)
        if self.transient:
            # buckets that did not fill (unused parameters) go too, then the micro-batch ends
            for index in range(len(self.plan.buckets)):
                if index not in self._handed:
                    self._bucket_ready(index)
            if not boundary:
                self._reducer_ref().send_from_thread(
                    EndMicroBatch(self.global_steps, self._reduce_micro_batch()))
        if self.stage3 is not None:
            self.stage3.end_backward()
        self._send_stage("micro_batch", MicroBatchEnd(self.global_steps, self.micro_steps))

    def _reduce_micro_batch(self, micro_step: int | None = None) -> int | None:
        """The micro-batch a reduce belongs to when every micro-batch reduces (ZeRO 2-3 with
        accumulation: the plan names each micro-batch's reduce), else None (once a step)."""
        gas = self.spec.gradient_accumulation_steps
        if not self.transient or gas == 1:
            return None
        return (self.micro_steps if micro_step is None else micro_step) % gas

    def _bucket_ready(self, index: int) -> None:
        if not self.transient:
            self._reducer_ref().send_from_thread(BucketReady(index, self.global_steps))
            return
        self._handed.add(index)
        self._reducer_ref().send_from_thread(BucketReady(index, self.global_steps,
                                                         self.buckets.take(index),
                                                         self._reduce_micro_batch()))
        if self.stage3 is not None:
            self.stage3.backward_done(index)

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """Acts only at the accumulation boundary: waits for the gradient reduces, unscales,
        checks for overflow, clips, steps the optimizer and the LR scheduler."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return
        self.step_dropped = False
        reduced, error = self.reducer is not None and not self._no_sync, None
        if reduced:
            with self.timer.span("comm", names.COMM_WAIT):
                report = self.reducer.ask_from_thread(
                    Flush(self.global_steps, self._reduce_micro_batch(self.micro_steps - 1)))
                if self._rows is not None and report.error is None:
                    start, split = time.perf_counter(), self._rows.enabled
                    if self._rows.reduce():
                        # a span of its own inside comm/wait, as the step plan names it
                        self.timer.record_spans([(names.ROWS, start, time.perf_counter())])
                    if split and not self._rows.enabled:
                        self._order.observe_again(self.buckets, self.global_steps)
            self.timer.record_spans(report.spans)
            error = report.error
        verdict = self._peer_vote(reduced, error)
        if verdict is not None and not verdict.get("commit"):
            return  # dropped
        if not reduced and (self.stages["bucket_full"] or self.stages["after_reduce"]):
            # One rank has no reducer; the stages still see every bucket, in the same order.
            for index, grad in enumerate(self.buckets.buffers()):
                for ref in self.stages["bucket_full"]:
                    ref.ask_from_thread(BucketFull(index, grad, self.global_steps))
                for ref in self.stages["after_reduce"]:
                    ref.ask_from_thread(BucketReduced(index, grad, self.global_steps))
        if self.zero is not None:
            self.zero.before_write()  # host-shared parameters: every rank done reading them
        with self.timer.span("optimizer", names.OPTIMIZER_STEP):
            skipped = self._optimizer_step()
        if self.stage3 is not None:
            self.stage3.end_step()
            self.timer.record_spans(self.stage3.spans)
            self.stage3.spans.clear()
        if self._order.due(self.global_steps) and self.reducer is not None and not \
                self._no_sync and self._use_bucket_order(
                    self._order.settle(self.buckets, len(self.trainable))):
            log.debug("buckets rebuilt in observed gradient order",
                      buckets=len(self.plan.buckets))
        self.global_steps += 1
        self.global_samples += self.spec.train_batch_size
        loss = torch.stack(self._losses).float().mean().item() if self._losses else None
        self._losses.clear()
        lr = self.get_lr()[0] if self.get_lr() else 0.0
        self.timer.end_step()
        if self._spans is not None:
            self._spans.write_step(self.global_steps, *self.timer.last_step)
        self._send_stage("after_step", StepDone(self.global_steps, skipped, loss, lr,
                                                self._global_grad_norm,
                                                self.loss_scaler.loss_scale))
        every = self.spec.steps_per_print
        if self.global_rank == 0 and every and self.global_steps % every == 0:
            self._log_step(loss, lr, every)
        if verdict is not None and verdict.get("joined"):
            # replacement ranks enter the group after this committed step
            self._peer_reform(int(verdict["generation"]), list(verdict["members"]),
                              joined=list(verdict["joined"]))

    def _optimizer_step(self) -> bool:
        """The strategy's optimizer step, then what follows every step: the gradients zeroed,
        the scheduler moved past a step that was taken. Returns True when it was skipped (an
        fp16 overflow)."""
        outcome = self.strategy.optimizer_step(self, need_norm=self._logs_this_step())
        self._global_grad_norm = outcome.grad_norm
        if outcome.skipped:
            self.skipped_steps += 1
        self._zero_grads()
        if not outcome.skipped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return outcome.skipped

    def _logs_this_step(self) -> bool:
        """The step about to be taken is one steps_per_print logs (its norm is wanted)."""
        every = self.spec.steps_per_print
        return bool(every and (self.global_steps + 1) % every == 0)

    def _zero_grads(self) -> None:
        if self.channel is not None and self.channel.arena_bytes:
            self.channel.quiesce()  # peers may still be reading this rank's reduced buckets
        if self.zero is not None:
            self.zero.zero_grads()
        self.buckets.zero_()  # (the fp32 master gradients are overwritten whole each step)

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zeroes gradients in place (the buckets stay the gradients' memory)."""
        self._zero_grads()

    def _send_stage(self, point: str, message: Any) -> None:
        for ref in self.stages[point]:
            ref.send_from_thread(message)

    def add_stage(self, actor: Any, at: str, name: str | None = None) -> Any:
        """Wires a user actor into the step at ``at`` (see flowtrain.engine.stages); it is
        spawned on this rank's runtime and supervised like the built-in actors."""
        ref = self._runtime.spawn(actor, name)
        self.stages.add(ref, at)
        return ref

    def _log_step(self, loss: float | None, lr: float, every: int) -> None:
        breakdown = self.timer.breakdown(every)
        samples_per_s = (self.spec.train_batch_size / breakdown["step_s"]
                         if breakdown.get("step_s") else None)
        memory = self.memory_breakdown()
        health = self.health.figures(breakdown.get("step_s"), breakdown.get("comm_s"))
        # the console shows the few figures a person follows; the rank's file keeps them all
        log.info("step", console=True,
                 console_fields=("step", "loss", "lr", "samples_per_s", "step_s"),
                 step=self.global_steps, loss=loss, lr=lr,
                 loss_scale=self.loss_scaler.loss_scale, skipped=self.skipped_steps,
                 grad_norm=self._global_grad_norm, samples_per_s=samples_per_s,
                 model_state_mib=round(memory["total"] / 2**20, 1),
                 rss_mib=round(memory["process_rss"] / 2**20, 1),
                 **{k: (round(v, 4) if v is not None else None) for k, v in health.items()},
                 **({k: v for k, v in breakdown.items()} if self.spec.wall_clock_breakdown
                    else {"step_s": breakdown.get("step_s")}))

    def destroy(self) -> None:
        """Stops the engine's actors, removes its hooks and closes its data channel, so another
        engine can be built in the same process; then waits for a checkpoint still being
        written (which needs none of them) and raises its error, if it failed."""
        self.buckets.remove_hooks()
        if self._rows is not None:
            self._rows.restore()
            self._rows = None
        refs = ([self.reducer] if self.reducer is not None else []) + \
            [ref for point in self.stages.at.values() for ref in point]
        if self.stage3 is not None:
            self.stage3.remove_hooks()
            refs.append(self.stage3.fetcher)
            self.stage3 = None
        for ref in refs:
            self._runtime.stop_actor(ref.name)
        self.reducer = None
        if self._spans is not None:
            self._spans.close()
            self._spans = None
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        if self._param_channel is not None:
            if self.zero is not None:
                self.zero.unshare_params()
            self._param_channel.close()
            self._param_channel = None
        self.wait_for_checkpoint()


def _param_names(model: torch.nn.Module, params: list[torch.nn.Parameter]) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names.get(id(p), f"param{i}") for i, p in enumerate(params)]


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj
