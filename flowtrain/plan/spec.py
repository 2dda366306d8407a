"""The training spec: the one place where a config becomes decisions that both the engine
(which runs them) and the simulator (which prices them) follow.

``resolve(config, ...)`` turns a loaded ``FlowtrainConfig`` and the process grid into a frozen
``TrainingSpec``: the grid, the batch, the precision and its loss scale, ZeRO's stage and
offload, the gradient bucket size and how gradients are reduced (``GradientReduction``: the
collective and whether it runs after every micro-batch or once a step), clipping, logging,
checkpointing and flowtrain's own host choices. Every default that these decisions need is
defined here once; after ``resolve`` the engine reads the spec, never the config (which it
keeps only to record it beside checkpoints and plans). Changing a decision (``simulate``'s
what-ifs, the tuner) replaces fields of a spec (``TrainingSpec.replace``); the derived
decisions follow the fields, so a replaced spec is as consistent as a resolved one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from flowtrain.plan.buckets import BucketPlan, ParamSpec
from flowtrain.plan.schedule import SCHEDULES
from flowtrain.plan.stage3 import Stage3Uses
from flowtrain.plan.step_plan import StepPlan, build_step_plan
from flowtrain.plan.zero_stage import (
    STAGES,
    partitions_gradients,
    partitions_parameters,
    shards_optimizer,
)

if TYPE_CHECKING:
    from flowtrain.config.model import FlowtrainConfig
    from flowtrain.config.zero import ZeroConfig

# The gradient bucket when the config sets no reduce_bucket_size: DeepSpeed's default (5e8
# elements) would put a whole model in one bucket and leave nothing of the reduce to overlap
# with the backward.
DEFAULT_BUCKET_BYTES = 25 * 2**20

_T = TypeVar("_T", bound=str)
# the dtypes a spec names, by their torch names, and each precision's compute dtype
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
PRECISION_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

ReduceOp = Literal["all_reduce", "reduce_scatter"]
Precision = Literal["fp32", "bf16", "fp16"]
OffloadDevice = Literal["none", "cpu", "nvme"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16", "fp16")
OFFLOAD_DEVICES: tuple[OffloadDevice, ...] = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class GradientReduction:
    """How a data-parallel group reduces its gradients: ``op`` (None: one rank, nothing to
    reduce) and ``every_micro_batch`` (reduced after each micro-batch's backward into the rank's
    gradient shard, which ZeRO 2-3 keep instead of whole gradients; otherwise once a step, after
    the last micro-batch)."""

    op: ReduceOp | None
    every_micro_batch: bool


def decide_reduction(zero_stage: int, dp: int, *, reduce_scatter: bool = True,
                     pipeline_stages: int = 1, mirrored: bool = False) -> GradientReduction:
    """The reduction of ZeRO stage ``zero_stage`` over ``dp`` data-parallel ranks.

    - Stage 0 all-reduces whole buckets once a step.
    - Stage 1 reduce-scatters each bucket once a step into the rank's slice of it, the only
      part its optimizer steps (DeepSpeed's stage 1 does too); ``reduce_scatter`` false
      all-reduces instead.
    - Stage 2 keeps only a gradient shard, so it reduce-scatters after every micro-batch;
      ``reduce_scatter`` false all-reduces whole buckets once a step, as stage 1 does.
    - Stage 3 always reduce-scatters after every micro-batch (the same sums as an all-reduce
      at half its traffic; ``reduce_scatter`` false is not honoured; the engine warns).
    - ``mirrored`` (``launch --peer-recovery`` with stages 1-2: each rank also steps its
      neighbour's shard) needs whole gradients: all-reduce once a step.
    - With pipeline stages a stage accumulates its gradients over the step's micro-batches and
      reduces them once, after its last backward (Megatron's distributed optimizer; flowtrain's
      and DeepSpeed's pipeline engines refuse stages 2-3)."""
    if dp < 1:
        raise ValueError(f"data-parallel size must be at least 1, got {dp!r}")
    if dp == 1:
        return GradientReduction(None, False)
    op = reduce_op(zero_stage, reduce_scatter=reduce_scatter, mirrored=mirrored)
    return GradientReduction(op, partitions_gradients(zero_stage) and op == "reduce_scatter"
                             and pipeline_stages == 1)


def reduce_op(zero_stage: int, *, reduce_scatter: bool = True, mirrored: bool = False
              ) -> ReduceOp:
    """The collective ZeRO stage ``zero_stage`` reduces gradients with over several ranks
    (``decide_reduction`` says why)."""
    if zero_stage not in STAGES:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero_stage!r}")
    scatter = partitions_parameters(zero_stage) or (
        shards_optimizer(zero_stage) and reduce_scatter and not mirrored)
    return "reduce_scatter" if scatter else "all_reduce"


@dataclass(frozen=True)
class Stage3Policy:
    """ZeRO-3's parameter decisions (DeepSpeed's stage-3 keys): parameters of at most
    ``persistence_threshold`` elements stay gathered; gathers are launched up to
    ``prefetch_numel`` elements ahead of their use, with at most ``max_live_numel`` gathered at
    once, and a gathered unit used again within ``max_reuse_distance`` elements is kept."""

    persistence_threshold: int
    prefetch_numel: int
    max_live_numel: int
    max_reuse_distance: int

    @classmethod
    def of(cls, zero: ZeroConfig) -> Stage3Policy:
        return cls(zero.stage3_param_persistence_threshold, zero.stage3_prefetch_bucket_size,
                   zero.stage3_max_live_parameters, zero.stage3_max_reuse_distance)


@dataclass(frozen=True)
class LossScalePolicy:
    """fp16's loss scale (DeepSpeed's ``fp16`` keys): ``static`` above 0 is a fixed scale;
    otherwise the scale starts at 2**``initial_power``, doubles after ``window`` steps without
    an overflow and halves after ``hysteresis`` overflows (counted only when consecutive with
    ``consecutive_hysteresis``), never below ``min_scale``. ``auto_cast``: the forward runs
    under autocast to the half dtype (``fp16.auto_cast``, read for bf16 too)."""

    static: float
    initial_power: int
    window: int
    hysteresis: int
    consecutive_hysteresis: bool
    min_scale: float
    auto_cast: bool


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where and how checkpoints are written: ``save_dir`` (None: only where the caller says),
    ``auto_resume`` from its latest, ``async_save`` in the background, and ZeRO-3's
    ``gather_16bit_on_save`` (a whole 16-bit model file beside the shards)."""

    save_dir: str | None
    auto_resume: bool
    async_save: bool
    gather_16bit_on_save: bool


@dataclass(frozen=True)
class HostChoices:
    """flowtrain's own choices of how a host carries the run (the ``flowtrain`` section):
    bucket order (``"observed"`` or ``"reverse"``), the data channel (``"shm"``, ``"torch"``
    or None: shm where it can be used), buckets in the shm arena, a tied embedding's rows
    reduced apart, the data loader's seed, and telemetry (on, records a second, a spans
    record every so many steps)."""

    bucket_order: str
    data_channel: str | None
    shm_arena: bool
    tied_embedding_rows: bool
    seed: int
    telemetry: bool
    telemetry_hz: float
    telemetry_spans_every: int


def bucket_numel(zero: ZeroConfig, elem_size: int) -> int:
    """The gradient bucket's size in elements: the config's ``reduce_bucket_size`` when set;
    with ZeRO, which also gathers parameters bucket by bucket, the smaller of it and
    ``allgather_bucket_size`` where either is set; else ``DEFAULT_BUCKET_BYTES`` of parameters
    of ``elem_size`` bytes."""
    if elem_size < 1:
        raise ValueError(f"element size must be at least 1 byte, got {elem_size!r}")
    keys = ("reduce_bucket_size", "allgather_bucket_size") if shards_optimizer(zero.stage) else \
        ("reduce_bucket_size",)
    set_sizes = [int(getattr(zero, k)) for k in keys if k in zero.model_fields_set]
    if set_sizes:
        return min(set_sizes)
    return DEFAULT_BUCKET_BYTES // elem_size


@dataclass(frozen=True)
class TrainingSpec:
    """What a run does, decided once (``resolve``). ``dp`` x ``tp`` x ``pp`` is the grid
    (``virtual_stages`` model chunks per pipeline stage under the interleaved ``schedule``);
    ``reduce_scatter`` and ``mirrored`` are the inputs of ``reduction``, which is derived from
    the fields so that a replaced spec stays consistent."""

    dp: int
    tp: int
    pp: int
    virtual_stages: int
    schedule: str
    micro_batch_size: int
    gradient_accumulation_steps: int
    precision: Precision
    loss_scaling: bool  # fp16 with a dynamic loss scale
    comm_dtype: str  # the gradient reduce's dtype ("float32", "bfloat16", "float16")
    zero_stage: int
    reduce_scatter: bool
    mirrored: bool
    overlap_comm: bool
    bucket_numel: int
    offload_optimizer: OffloadDevice
    offload_params: OffloadDevice
    stage3: Stage3Policy
    zero_shared_params: bool  # flowtrain.zero_shared_params (``shares_host_params``)
    train_batch_size: int  # samples a step over the data-parallel group
    gradient_clipping: float  # the global norm gradients are clipped to; 0: no clipping
    gradient_predivide: float  # gradients divided by this before the reduce, the rest after
    prescale_gradients: bool  # divide by the group size before the reduce, not after
    offload_pin_memory: bool  # the offloaded optimizer's host buffers are pinned
    recompute_interval: int  # pipeline layers recomputed in groups of this many; 0: none
    steps_per_print: int  # log (and take the gradient norm) every this many steps; 0: never
    wall_clock_breakdown: bool  # the step's time broken down in each log line
    loss_scale: LossScalePolicy
    checkpoint: CheckpointPolicy
    host: HostChoices

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "virtual_stages", "micro_batch_size",
                     "gradient_accumulation_steps", "bucket_numel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainingSpec.{name} must be an integer >= 1, got {value!r}")
        if self.zero_stage not in STAGES:
            raise ValueError(f"TrainingSpec.zero_stage must be 0, 1, 2 or 3, got "
                             f"{self.zero_stage!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainingSpec.precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {self.precision!r}")
        for name in ("offload_optimizer", "offload_params"):
            if getattr(self, name) not in OFFLOAD_DEVICES:
                raise ValueError(f"TrainingSpec.{name} must be one of "
                                 f"{', '.join(OFFLOAD_DEVICES)}, got {getattr(self, name)!r}")

    @property
    def reduction(self) -> GradientReduction:
        return decide_reduction(self.zero_stage, self.dp, reduce_scatter=self.reduce_scatter,
                                pipeline_stages=self.pp, mirrored=self.mirrored)

    def shares_host_params(self, shm_channel: bool) -> bool:
        """Whether the ZeRO ranks of one host keep its one copy of the parameters in shared
        memory (``flowtrain.zero_shared_params``, ``ZeroOptimizer.share_params``): data
        parallel only, over the shared-memory data channel (``shm_channel``: every rank a CPU
        rank of one host, the channel open). Then nothing is all-gathered after the step, and a
        ZeRO-3 use is a view of the shared copy, not a gather."""
        return shards_optimizer(self.zero_stage) and self.dp > 1 and self.tp == 1 and \
            self.pp == 1 and self.zero_shared_params and shm_channel

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def compute_dtype(self) -> str:
        return PRECISION_DTYPE[self.precision]

    @property
    def comm_elem_size(self) -> int:
        return DTYPE_BYTES[self.comm_dtype]

    def replace(self, **changes: Any) -> TrainingSpec:
        """This spec with ``changes`` (field names) replaced, checked as a new one is."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"TrainingSpec has no field {', '.join(map(repr, unknown))}; "
                             f"fields: {', '.join(f.name for f in dataclasses.fields(self))}")
        return dataclasses.replace(self, **changes)


def resolve(config: FlowtrainConfig, *, dp: int, tp: int = 1, pp: int = 1,
            elem_size: int, mirrored: bool = False) -> TrainingSpec:
    """The spec of training with ``config`` (loaded, its batch rule applied for ``dp`` ranks)
    on a grid of ``dp`` x ``tp`` x ``pp`` ranks, whose parameters are ``elem_size`` bytes each
    as the model arrives (the default bucket holds ``DEFAULT_BUCKET_BYTES`` of them);
    ``mirrored``: ``launch --peer-recovery`` keeps a neighbour's ZeRO shard too."""
    zero = config.zero_optimization
    pipe = config.pipeline
    fp16, ckpt, own = config.fp16, config.checkpoint, config.flowtrain
    v = int(pipe.virtual_stages or 1) if pp > 1 else 1
    schedule = str(pipe.schedule).lower() if pp > 1 else "1f1b"
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline.schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    return TrainingSpec(
        dp=dp, tp=tp, pp=pp, virtual_stages=v, schedule=schedule,
        micro_batch_size=config.micro_batch, gradient_accumulation_steps=config.grad_accum,
        precision=_choice(config.precision, PRECISIONS, "precision"),
        loss_scaling=config.dynamic_loss_scale,
        comm_dtype=str(config.communication_dtype).removeprefix("torch."),
        zero_stage=zero.stage, reduce_scatter=zero.reduce_scatter,
        mirrored=mirrored and shards_optimizer(zero.stage) and
        not partitions_parameters(zero.stage), overlap_comm=zero.overlap_comm,
        bucket_numel=bucket_numel(zero, elem_size),
        offload_optimizer=_choice(zero.offload_optimizer.device, OFFLOAD_DEVICES,
                                  "zero_optimization.offload_optimizer.device")
        if shards_optimizer(zero.stage) else "none",
        offload_params=_choice(zero.offload_param.device, OFFLOAD_DEVICES,
                               "zero_optimization.offload_param.device")
        if partitions_parameters(zero.stage) else "none",
        stage3=Stage3Policy.of(zero),
        zero_shared_params=bool(config.flowtrain.zero_shared_params),
        train_batch_size=config.global_batch,
        gradient_clipping=float(config.gradient_clipping or 0.0),
        gradient_predivide=float(config.gradient_predivide_factor),
        prescale_gradients=bool(config.prescale_gradients),
        offload_pin_memory=bool(zero.offload_optimizer.pin_memory),
        recompute_interval=int(pipe.activation_checkpoint_interval),
        steps_per_print=int(config.steps_per_print or 0),
        wall_clock_breakdown=bool(config.wall_clock_breakdown),
        loss_scale=LossScalePolicy(
            static=float(fp16.loss_scale), initial_power=fp16.initial_scale_power,
            window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
            consecutive_hysteresis=fp16.consecutive_hysteresis,
            min_scale=float(fp16.min_loss_scale), auto_cast=bool(fp16.auto_cast)),
        checkpoint=CheckpointPolicy(
            save_dir=ckpt.save_dir, auto_resume=bool(ckpt.auto_resume),
            async_save=bool(ckpt.async_save),
            gather_16bit_on_save=bool(zero.stage3_gather_16bit_weights_on_model_save)),
        host=HostChoices(
            bucket_order=own.bucket_order, data_channel=own.data_channel,
            shm_arena=bool(own.shm_arena), tied_embedding_rows=bool(own.tied_embedding_rows),
            seed=int(own.seed or 0), telemetry=bool(own.telemetry),
            telemetry_hz=float(own.telemetry_hz),
            telemetry_spans_every=int(own.telemetry_spans_every)))


def engine_problem(spec: TrainingSpec) -> str | None:
    """Why flowtrain's engine cannot run ``spec``, or None. ZeRO stages 2-3 keep a shard of
    each gradient, which a pipeline stage's accumulation over the step's micro-batches and a
    tensor-parallel split do not fit yet (the simulator still prices such layouts, as
    Megatron and FSDP run them)."""
    stage = spec.zero_stage
    if partitions_gradients(stage) and spec.pp > 1:
        return (f"zero_optimization.stage {stage} with a {spec.pp}-stage PipelineModule: ZeRO "
                f"stages 2 and 3 partition gradients, which pipeline stages accumulate across "
                f"micro-batches; use stage 0 or 1")
    if partitions_gradients(stage) and spec.tp > 1:
        return (f"zero_optimization.stage {stage} with tensor_parallel.tp_size {spec.tp}: ZeRO "
                f"stages 2 and 3 with tensor parallelism are not supported yet; use stage 0 "
                f"or 1")
    return None


def plan_step(spec: TrainingSpec, params: Sequence[ParamSpec], *, stage: int = 0,
              buckets: Sequence[BucketPlan] | None = None, groups: Sequence[int] | None = None,
              order: Sequence[int] | None = None, forward_flops: float = 0.0,
              chunk_flops: Sequence[float] | None = None,
              stage3: tuple[Stage3Uses, Sequence[int]] | None = None,
              rows_bytes: int | None = None) -> StepPlan:
    """The step plan (``flowtrain.plan.step_plan``) of a rank of pipeline stage ``stage`` that
    trains ``params`` as ``spec`` decides: its data-parallel group, batch, buckets, reduction
    and pipeline schedule. The other arguments are ``build_step_plan``'s."""
    return build_step_plan(
        params, world_size=spec.dp, gradient_accumulation_steps=spec.gradient_accumulation_steps,
        micro_batch_size=spec.micro_batch_size, bucket_numel=spec.bucket_numel,
        comm_dtype=spec.comm_dtype, comm_elem_size=spec.comm_elem_size, order=order,
        forward_flops=forward_flops, groups=groups, buckets=buckets,
        reduce_every_micro_batch=spec.reduction.every_micro_batch, stage=stage,
        stages=spec.pp, schedule=spec.schedule, virtual_stages=spec.virtual_stages,
        chunk_flops=chunk_flops, stage3=stage3, rows_bytes=rows_bytes)


def _choice(value: str, allowed: tuple[_T, ...], what: str) -> _T:
    for choice in allowed:
        if value == choice:
            return choice
    raise ValueError(f"{what} must be one of {', '.join(allowed)}, got {value!r}")
