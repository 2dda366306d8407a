"""Config sections other than ZeRO, with DeepSpeed's keys and defaults (precision, optimizer,
scheduler, checkpointing, profiling, parallelism, monitoring) plus the flowtrain-only section."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

from flowtrain.config.fields import Bool, Choice, Float, Int, Params, Section, Str, show

# JSON spellings of a dtype -> canonical short name; DeepSpeed takes both forms.
DTYPE_ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16",
                 "fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
DType = Annotated[str | None, Choice("fp32", "fp16", "bf16", aliases=DTYPE_ALIASES, optional=True)]


class FP16Config(Section):
    enabled: Bool = False
    auto_cast: Bool = False
    loss_scale: Annotated[float, Float(ge=0)] = 0.0  # 0 means dynamic loss scaling
    # the scale 2**power is held as an fp32 number, finite up to 2**127
    initial_scale_power: Annotated[int, Int(ge=0, le=127)] = 16
    loss_scale_window: Annotated[int, Int(ge=1)] = 1000
    hysteresis: Annotated[int, Int(ge=1)] = 2
    consecutive_hysteresis: Bool = False
    min_loss_scale: Annotated[float, Float(gt=0)] = 1.0
    fp16_master_weights_and_grads: Bool = False


class BF16Config(Section):
    enabled: Bool = False
    immediate_grad_update: Bool = True
    check_overflow: Bool = False


class AmpConfig(Section):
    """NVIDIA apex AMP. Accepted so configs parse; the remaining keys are apex's own."""

    model_config = Section.model_config | {"extra": "allow"}
    enabled: Bool = False


class OptimizerConfig(Section):
    type: Annotated[str, Str()]  # checked and canonicalised against the known names in params.py
    params: Params = Field(default_factory=dict)
    legacy_fusion: Bool = False


class SchedulerConfig(Section):
    type: Annotated[str, Choice("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle",
                                "LRRangeTest")]
    params: Params = Field(default_factory=dict)


class ActivationCheckpointingConfig(Section):
    partition_activations: Bool = False
    number_checkpoints: Annotated[int | None, Int(ge=1, optional=True)] = None
    contiguous_memory_optimization: Bool = False
    cpu_checkpointing: Bool = False
    synchronize_checkpoint_boundary: Bool = False
    profile: Bool = False


class FlopsProfilerConfig(Section):
    enabled: Bool = False
    recompute_fwd_factor: Annotated[float, Float(ge=0)] = 0.0
    profile_step: Annotated[int, Int(ge=1)] = 1
    module_depth: Annotated[int, Int(ge=-1)] = -1
    top_modules: Annotated[int, Int(ge=1)] = 1
    detailed: Bool = True
    output_file: Annotated[str | None, Str(optional=True)] = None


def _stages_check(value: Any) -> Any:
    if value == "auto":
        return value
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PydanticCustomError("flowtrain", "expected an integer > 0 or \"auto\", got {got}",
                                  {"got": show(value)})
    return value


class PipelineConfig(Section):
    # "auto": the stage count comes from the PipelineModule, as in DeepSpeed.
    stages: Annotated[int | str, BeforeValidator(_stages_check)] = "auto"
    # Not DeepSpeed keys: "enabled" is accepted for configs written that way (a PipelineModule
    # is what turns the pipeline on); "schedule" picks 1F1B (PipeDream-Flush), GPipe or
    # interleaved 1F1B (Megatron's virtual pipeline: "virtual_stages" model chunks per stage).
    enabled: Bool = True
    schedule: Annotated[str, Choice("1f1b", "gpipe", "interleaved")] = "1f1b"
    virtual_stages: Annotated[int, Int(ge=1)] = 1
    partition: Annotated[str, Str()] = "best"
    seed_layers: Bool = False
    activation_checkpoint_interval: Annotated[int, Int(ge=0)] = 0
    pipe_partitioned: Bool = True
    grad_partitioned: Bool = True
    use_reentrant: Bool = True


class TensorParallelConfig(Section):
    model_config = Section.model_config | {"extra": "allow"}  # AutoTP keeps growing options
    autotp_size: Annotated[int, Int(ge=0)] = 0
    tp_size: Annotated[int, Int(ge=1)] = 1
    tp_grain_size: Annotated[int, Int(ge=1)] = 1
    tp_overlap_comm: Bool = False
    keep_module_on_host: Bool = False


class ParallelWriteConfig(Section):
    pipeline_stage: Bool = False


class CheckpointConfig(Section):
    tag_validation: Annotated[str, Choice("Ignore", "Warn", "Fail")] = "Warn"
    load_universal: Bool = False
    use_node_local_storage: Bool = False
    parallel_write: ParallelWriteConfig = Field(default_factory=ParallelWriteConfig)
    # Not DeepSpeed keys (its engine knows no checkpoint directory of its own):
    # "save_dir", the directory the script saves into, which save_checkpoint() uses when
    # called without one; "auto_resume", initialize loads the latest complete checkpoint
    # there (a fresh start when there is none yet), so that a job restarted by `flowtrain
    # launch --max-restarts` resumes though its script never calls load_checkpoint;
    # "async_save", save_checkpoint returns once the state is copied to host memory and a
    # background thread writes it (still atomic: 'latest' moves after the write completes;
    # the host copy, kept from one save to the next, costs what this rank's part weighs).
    save_dir: Annotated[str | None, Str(optional=True)] = None
    auto_resume: Bool = False
    async_save: Bool = False


class DataTypesConfig(Section):
    grad_accum_dtype: DType = None


class TensorBoardConfig(Section):
    enabled: Bool = False
    output_path: Annotated[str, Str()] = ""
    job_name: Annotated[str, Str()] = "DeepSpeedJobName"


class WandbConfig(Section):
    enabled: Bool = False
    group: Annotated[str | None, Str(optional=True)] = None
    team: Annotated[str | None, Str(optional=True)] = None
    project: Annotated[str, Str()] = "deepspeed"


class CSVMonitorConfig(Section):
    enabled: Bool = False
    output_path: Annotated[str, Str()] = ""
    job_name: Annotated[str, Str()] = "DeepSpeedJobName"


class CometConfig(Section):
    model_config = Section.model_config | {"extra": "allow"}  # passed through to comet_ml
    enabled: Bool = False


class CommsLoggerConfig(Section):
    enabled: Bool = False
    verbose: Bool = False
    prof_all: Bool = True
    debug: Bool = False
    prof_ops: list[str] = Field(default_factory=list)


class FlowtrainSection(Section):
    """Settings only flowtrain has; DeepSpeed would ignore this section."""

    # Order in which gradient buckets are formed: as first seen in backward, or reverse
    # parameter order (DeepSpeed's choice, a good guess before the first backward).
    bucket_order: Annotated[str, Choice("observed", "reverse")] = "observed"
    # What carries gradient reduces: "shm" (shared memory, every rank on one host, CPU tensors)
    # or "torch" (gloo/NCCL); null picks shm when it can be used, torch otherwise.
    data_channel: Annotated[str | None, Choice("shm", "torch", optional=True)] = None
    # With the shm channel: the lasting gradient buckets live in its shared arena and are
    # reduced without a copy into a slot. Off by default: end to end it has cost CPU time so
    # far (benchmarks/dp_vs_ddp.py), though the reduce itself is faster.
    shm_arena: Bool = False
    # ZeRO 1-3 with the shm channel: the host's one copy of the parameters lives in shared
    # memory, each rank writing its own shard of it, so no all-gather follows the step and
    # stage 3 uses a bucket without gathering it. false gives each rank its own copy and the
    # all-gathers, as across hosts.
    zero_shared_params: Bool = True
    # Data parallel without ZeRO: an embedding tied to the output head has its gradient reduced
    # in two parts (the head's at once in backward, the lookup's rows exchanged after), so its
    # bucket need not wait for the end of backward (flowtrain/engine/embedding_rows.py). false
    # reduces it whole once backward is done, as torch DDP does.
    tied_embedding_rows: Bool = True
    # A model on the CPU: glibc's malloc serves every allocation from its heap and keeps memory
    # freed within a step for the next one (flowtrain/host_memory.py), at the cost of holding
    # the peak heap, unless MALLOC_* / GLIBC_TUNABLES or LD_PRELOAD chose otherwise.
    keep_freed_host_memory: Bool = True
    # Seconds between rank heartbeats; null keeps the launcher's environment setting.
    heartbeat_interval: Annotated[float | None, Float(gt=0, optional=True)] = None
    seed: Annotated[int | None, Int(ge=0, optional=True)] = None
    # Telemetry (flowtrain.telemetry): each rank publishes step records to the launcher's
    # coordinator (recorded in runs/<id>/telemetry.msgpack, shown by `flowtrain monitor`).
    telemetry: Bool = True
    # Most "step" records a rank publishes per second; faster steps are sampled, not queued.
    telemetry_hz: Annotated[float, Float(gt=0)] = 10.0
    # A "spans" record (the step's task timeline) every this many optimizer steps.
    telemetry_spans_every: Annotated[int, Int(ge=1)] = 10
