"""``FlowtrainConfig``: the whole ds_config.json as a typed, read-only model, with the derived
values the engine asks for (precision, loss scaling, gradient communication dtype)."""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import Field, PrivateAttr

from flowtrain.config.fields import Bool, Float, Int, Params, Section
from flowtrain.config.sections import (
    ActivationCheckpointingConfig,
    AmpConfig,
    BF16Config,
    CheckpointConfig,
    CometConfig,
    CommsLoggerConfig,
    CSVMonitorConfig,
    DataTypesConfig,
    DType,
    FlopsProfilerConfig,
    FlowtrainSection,
    FP16Config,
    OptimizerConfig,
    PipelineConfig,
    SchedulerConfig,
    TensorBoardConfig,
    TensorParallelConfig,
    WandbConfig,
)
from flowtrain.config.zero import ZeroConfig

MAX_COUNT = 2**31 - 1  # the largest batch size or step count a config may give
TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# DeepSpeed sections flowtrain accepts without reading their contents; support.py reports them
# as not supported when they are switched on.
OPAQUE_SECTIONS = (
    "aio", "elasticity", "autotuning", "sparse_attention", "compression_training",
    "data_efficiency", "curriculum_learning", "eigenvalue", "progressive_layer_drop",
    "quantize_training", "weight_quantization", "nebula", "hybrid_engine", "timers",
    "torch_autocast", "compile",
)
MONITOR_SECTIONS = ("tensorboard", "wandb", "csv_monitor", "comet", "comms_logger")


class FlowtrainConfig(Section):
    """A validated config. Batch sizes are all set once ``load_config`` has applied the batch
    rule; ``dp_world_size`` is the data-parallel world size they were checked against."""

    # at most 2**31 - 1: samples and steps are counted and indexed as 32-bit integers
    train_batch_size: Annotated[int | None, Int(ge=1, le=MAX_COUNT, optional=True)] = None
    train_micro_batch_size_per_gpu: Annotated[int | None,
                                              Int(ge=1, le=MAX_COUNT, optional=True)] = None
    gradient_accumulation_steps: Annotated[int | None,
                                           Int(ge=1, le=MAX_COUNT, optional=True)] = None
    # DeepSpeed's default became 1.0 in 2026 (PR #8068); it was 0.0 (off) before.
    gradient_clipping: Annotated[float, Float(ge=0)] = 1.0
    # DeepSpeed's code default is null since late 2024; its docs (and flowtrain's log line) say 10.
    steps_per_print: Annotated[int | None, Int(ge=1, optional=True)] = 10
    wall_clock_breakdown: Bool = False
    memory_breakdown: Bool = False
    prescale_gradients: Bool = False
    gradient_predivide_factor: Annotated[float, Float(gt=0)] = 1.0
    communication_data_type: DType = None
    seq_parallel_communication_data_type: DType = "fp32"
    dump_state: Bool = False
    sparse_gradients: Bool = False
    disable_allgather: Bool = False
    dataloader_drop_last: Bool = False
    zero_allow_untested_optimizer: Bool = False
    zero_force_ds_cpu_optimizer: Bool = True

    fp16: FP16Config = Field(default_factory=FP16Config)
    bf16: BF16Config = Field(default_factory=BF16Config)
    amp: AmpConfig = Field(default_factory=AmpConfig)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig)
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig)
    flowtrain: FlowtrainSection = Field(default_factory=FlowtrainSection)

    aio: Params | None = None
    elasticity: Params | None = None
    autotuning: Params | None = None
    sparse_attention: Params | None = None
    compression_training: Params | None = None
    data_efficiency: Params | None = None
    curriculum_learning: Params | None = None
    eigenvalue: Params | None = None
    progressive_layer_drop: Params | None = None
    quantize_training: Params | None = None
    weight_quantization: Params | None = None
    nebula: Params | None = None
    hybrid_engine: Params | None = None
    timers: Params | None = None
    torch_autocast: Params | None = None
    compile: Params | None = None

    _dp_world_size: int = PrivateAttr(default=1)
    _auto_resolved: dict[str, tuple[Any, str]] = PrivateAttr(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        # What each "auto" resolved to records how the config was loaded; a config reloaded
        # from its own to_dict() has no "auto" left and is still the same config.
        if not isinstance(other, FlowtrainConfig):
            return NotImplemented
        return self.__dict__ == other.__dict__ and self._dp_world_size == other._dp_world_size

    @property
    def auto_resolved(self) -> dict[str, tuple[Any, str]]:
        """Each key that was "auto" in the config: (the value it took, where that came from)."""
        return self._auto_resolved

    @property
    def dp_world_size(self) -> int:
        return self._dp_world_size

    @property
    def global_batch(self) -> int:
        """``train_batch_size``, which ``load_config``'s batch rule always sets."""
        return _resolved(self.train_batch_size, "train_batch_size")

    @property
    def micro_batch(self) -> int:
        """``train_micro_batch_size_per_gpu``, which ``load_config``'s batch rule always sets."""
        return _resolved(self.train_micro_batch_size_per_gpu, "train_micro_batch_size_per_gpu")

    @property
    def grad_accum(self) -> int:
        """``gradient_accumulation_steps``, which ``load_config``'s batch rule always sets."""
        return _resolved(self.gradient_accumulation_steps, "gradient_accumulation_steps")

    @property
    def precision(self) -> str:
        """Training precision: "fp16", "bf16" or "fp32"."""
        if self.fp16.enabled:
            return "fp16"
        if self.bf16.enabled:
            return "bf16"
        return "fp32"

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.precision]

    @property
    def dynamic_loss_scale(self) -> bool:
        """fp16 with ``loss_scale`` 0; bf16 and fp32 never scale the loss."""
        return self.fp16.enabled and self.fp16.loss_scale == 0

    @property
    def communication_dtype(self) -> torch.dtype:
        """Dtype of gradient all-reduce: communication_data_type if set, else the precision's."""
        if self.communication_data_type is not None:
            return TORCH_DTYPES[self.communication_data_type]
        return self.dtype

    @property
    def grad_accum_dtype(self) -> torch.dtype:
        name = self.data_types.grad_accum_dtype
        return TORCH_DTYPES[name] if name is not None else self.dtype

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as JSON-ready data; ``load_config`` reads it back unchanged.
        Opaque sections that were not given are left out."""
        data = self.model_dump(mode="json")
        for name in OPAQUE_SECTIONS + ("optimizer", "scheduler"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


def _resolved(value: int | None, key: str) -> int:
    # The fields are optional only until the batch rule has run; a config that reaches the
    # engine or the simulator without it was not built by load_config.
    if value is None:
        raise ValueError(f"{key} is not set: build the config with load_config, which applies "
                         "the batch rule")
    return value
