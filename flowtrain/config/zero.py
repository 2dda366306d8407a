"""The ``zero_optimization`` section and its offload subsections, with DeepSpeed's defaults.
Bucket sizes are element counts, not bytes, as in DeepSpeed."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from flowtrain.config.fields import Bool, Choice, Float, Int, NoneIsDefault, Section, Str

OffloadDevice = Choice("none", "cpu", "nvme")


class OffloadOptimizerConfig(Section):
    device: OffloadDevice = "none"
    nvme_path: Str(optional=True) = None
    buffer_count: Int(ge=0) = 4
    pin_memory: Bool = True
    pipeline_read: Bool = False
    pipeline_write: Bool = False
    fast_init: Bool = False
    ratio: Float(ge=0, le=1) = 1.0


class OffloadParamConfig(Section):
    device: OffloadDevice = "none"
    nvme_path: Str(optional=True) = None
    buffer_count: Int(ge=0) = 5
    buffer_size: Int(ge=0) = 100_000_000
    max_in_cpu: Int(ge=0) = 1_000_000_000
    pin_memory: Bool = True


class ZeroConfig(Section):
    stage: Int(ge=0, le=3) = 0
    contiguous_gradients: Bool = True
    reduce_scatter: Bool = True
    reduce_bucket_size: Int(ge=1) = 500_000_000
    use_multi_rank_bucket_allreduce: Bool = True
    allgather_partitions: Bool = True
    allgather_bucket_size: Int(ge=1) = 500_000_000
    # null in DeepSpeed means "on for stage 3 only"; resolved below so readers see a bool.
    overlap_comm: Bool = False
    load_from_fp32_weights: Bool = True
    elastic_checkpoint: Bool = False
    offload_param: Annotated[OffloadParamConfig, NoneIsDefault] = Field(
        default_factory=OffloadParamConfig)
    offload_optimizer: Annotated[OffloadOptimizerConfig, NoneIsDefault] = Field(
        default_factory=OffloadOptimizerConfig)
    sub_group_size: Int(ge=1) = 1_000_000_000
    stage3_prefetch_bucket_size: Int(ge=0) = 50_000_000
    stage3_param_persistence_threshold: Int(ge=0) = 100_000
    stage3_model_persistence_threshold: Int(ge=0) = 2**63 - 1
    stage3_max_live_parameters: Int(ge=0) = 1_000_000_000
    stage3_max_reuse_distance: Int(ge=0) = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: Bool = False
    stage3_module_granularity_threshold: Int(ge=0) = 0
    use_all_reduce_for_fetch_params: Bool = False
    ignore_unused_parameters: Bool = True
    legacy_stage1: Bool = False
    round_robin_gradients: Bool = False
    zero_hpz_partition_size: Int(ge=1) = 1
    zero_quantized_weights: Bool = False
    zero_quantized_nontrainable_weights: Bool = False
    zero_quantized_gradients: Bool = False
    mics_shard_size: Int(ge=-1) = -1
    mics_hierarchical_params_gather: Bool = False
    memory_efficient_linear: Bool = True
    pipeline_loading_checkpoint: Bool = False
    override_module_apply: Bool = True
    log_trace_cache_warnings: Bool = False

    @model_validator(mode="before")
    @classmethod
    def _default_overlap_comm(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("overlap_comm") is None:
            stage = data.get("stage", 0)
            data = {**data, "overlap_comm": stage == 3}
        return data

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer.device != "none"

    @property
    def offloads_params(self) -> bool:
        return self.offload_param.device != "none"
