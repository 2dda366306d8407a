"""The ``zero_optimization`` section and its offload subsections, with DeepSpeed's defaults.
Bucket sizes are element counts, not bytes, as in DeepSpeed. ``check_zero`` finds keys that
contradict each other (or that ZeRO ignores at the configured stage); ``legacy_offload_conflicts``
does the same for the deprecated ``cpu_offload``/``cpu_offload_param`` flags before they are
rewritten."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from flowtrain.config.fields import Bool, Choice, Float, Int, NoneIsDefault, Section, Str, show
from flowtrain.plan.zero_stage import partitions_gradients, partitions_parameters, shards_optimizer

OffloadDevice = Annotated[str, Choice("none", "cpu", "nvme")]

_SUB_GROUP_DEFAULT = 1_000_000_000


def _sub_group_not_zero(value: Any) -> Any:
    # DeepSpeed accepts 0 (ge=0), but stage3.py's _create_fp16_sub_groups then closes a sub-group
    # after every parameter (its running size is always >= 0), so the optimizer steps one
    # parameter at a time. Nobody means that: 0 is written for "no tiling", which is the opposite.
    # flowtrain keeps refusing 0 (its type is an integer > 0) and says why.
    if value == 0 and not isinstance(value, bool):
        raise PydanticCustomError(
            "flowtrain", "expected an integer > 0, got {got} (0 does not switch sub-groups off: "
            "DeepSpeed would give every parameter a sub-group of its own and step them one by "
            "one; for one big sub-group keep a large size such as the default {default})",
            {"got": show(value), "default": _SUB_GROUP_DEFAULT})
    return value


SubGroupSize = Annotated[int, Int(ge=1), BeforeValidator(_sub_group_not_zero)]


class OffloadOptimizerConfig(Section):
    device: OffloadDevice = "none"
    nvme_path: Annotated[str | None, Str(optional=True)] = None
    buffer_count: Annotated[int, Int(ge=0)] = 4
    pin_memory: Bool = True
    pipeline_read: Bool = False
    pipeline_write: Bool = False
    fast_init: Bool = False
    ratio: Annotated[float, Float(ge=0, le=1)] = 1.0


class OffloadParamConfig(Section):
    device: OffloadDevice = "none"
    nvme_path: Annotated[str | None, Str(optional=True)] = None
    buffer_count: Annotated[int, Int(ge=0)] = 5
    buffer_size: Annotated[int, Int(ge=0)] = 100_000_000
    max_in_cpu: Annotated[int, Int(ge=0)] = 1_000_000_000
    pin_memory: Bool = True


class ZeroConfig(Section):
    stage: Annotated[int, Int(ge=0, le=3)] = 0
    contiguous_gradients: Bool = True
    reduce_scatter: Bool = True
    reduce_bucket_size: Annotated[int, Int(ge=1)] = 500_000_000
    use_multi_rank_bucket_allreduce: Bool = True
    allgather_partitions: Bool = True
    allgather_bucket_size: Annotated[int, Int(ge=1)] = 500_000_000
    # null in DeepSpeed means "on for stage 3 only"; resolved below so readers see a bool.
    overlap_comm: Bool = False
    load_from_fp32_weights: Bool = True
    elastic_checkpoint: Bool = False
    offload_param: Annotated[OffloadParamConfig, NoneIsDefault] = Field(
        default_factory=OffloadParamConfig)
    offload_optimizer: Annotated[OffloadOptimizerConfig, NoneIsDefault] = Field(
        default_factory=OffloadOptimizerConfig)
    sub_group_size: SubGroupSize = _SUB_GROUP_DEFAULT
    stage3_prefetch_bucket_size: Annotated[int, Int(ge=0)] = 50_000_000
    stage3_param_persistence_threshold: Annotated[int, Int(ge=0)] = 100_000
    stage3_model_persistence_threshold: Annotated[int, Int(ge=0)] = 2**63 - 1
    stage3_max_live_parameters: Annotated[int, Int(ge=0)] = 1_000_000_000
    stage3_max_reuse_distance: Annotated[int, Int(ge=0)] = 1_000_000_000
    stage3_gather_16bit_weights_on_model_save: Bool = False
    stage3_module_granularity_threshold: Annotated[int, Int(ge=0)] = 0
    use_all_reduce_for_fetch_params: Bool = False
    ignore_unused_parameters: Bool = True
    legacy_stage1: Bool = False
    round_robin_gradients: Bool = False
    zero_hpz_partition_size: Annotated[int, Int(ge=1)] = 1
    zero_quantized_weights: Bool = False
    zero_quantized_nontrainable_weights: Bool = False
    zero_quantized_gradients: Bool = False
    mics_shard_size: Annotated[int, Int(ge=-1)] = -1
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
            # a stage not yet an integer ("auto", left to the trainer) defaults off
            data = {**data, "overlap_comm": isinstance(stage, int) and
                    partitions_parameters(stage)}
        return data

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload_optimizer.device != "none"

    @property
    def offloads_params(self) -> bool:
        return self.offload_param.device != "none"


# Keys only ZeRO stage 3 reads (DeepSpeed passes them to the stage-3 optimizer and parameter
# coordinator alone; stages 0-2 never look at them).
STAGE3_ONLY_KEYS = (
    "sub_group_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_model_persistence_threshold", "stage3_max_live_parameters",
    "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold",
)

_Z = "zero_optimization"


def check_zero(zero: ZeroConfig, pipeline_stages: int | str,
               broken: Callable[[str], bool] = lambda path: False) -> tuple[list[str], list[str]]:
    """Problems (one line each) and warnings for ZeRO keys that contradict each other, as
    ``resolve_batch`` does for the batch sizes. ``broken(path)`` says that the value at a dotted
    key path failed validation (its default stands in), so rules reading it are skipped.

    Every rule follows what DeepSpeed 0.19.8 does with the same config; where DeepSpeed ignores a
    key silently, a key that asks for memory to be moved is an error (the run would not have the
    memory the user counted on) and a tuning key that has nothing to tune is a warning."""
    problems: list[str] = []
    warnings: list[str] = []
    stage_ok = not broken(f"{_Z}.stage")
    stage = zero.stage
    opt, par = zero.offload_optimizer, zero.offload_param

    # DeepSpeed hands offload_param only to the stage-3 optimizer (its engine's
    # _configure_zero_optimizer builds stages 1-2 without it): at stages 0-2 the parameters
    # stay where they are, silently.
    if stage_ok and not partitions_parameters(stage) and par.device != "none" and \
            not broken(f"{_Z}.offload_param"):
        problems.append(
            f"{_Z}.offload_param.device {show(par.device)} with {_Z}.stage {stage}: parameter "
            f"offload works only with ZeRO stage 3 (DeepSpeed ignores it below stage 3, so "
            f"nothing would be offloaded); set stage 3 or offload_param.device \"none\"")
    # Optimizer offload is part of the ZeRO optimizer (stages 1-3). At stage 0 DeepSpeed has no
    # ZeRO optimizer: it builds DeepSpeedCPUAdam over the parameters, which stay on the GPU, and
    # the first step fails ("CPUAdam param is on cuda:0 and must be 'cpu'").
    if stage_ok and not shards_optimizer(stage) and opt.device != "none" and \
            not broken(f"{_Z}.offload_optimizer"):
        problems.append(
            f"{_Z}.offload_optimizer.device {show(opt.device)} with {_Z}.stage 0: optimizer "
            f"offload is part of the ZeRO optimizer and needs stage 1, 2 or 3; set one of those "
            f"stages or offload_optimizer.device \"none\"")
    # DeepSpeedZeroConfig.offload_ratio_check: "Partial offloading only supported for ZeRO Stage
    # 3." (at stage 3 it is valid DeepSpeed, and support.py says flowtrain cannot run it).
    if (stage_ok and not partitions_parameters(stage) and opt.ratio < 1
            and not broken(f"{_Z}.offload_optimizer")):
        problems.append(
            f"{_Z}.offload_optimizer.ratio {opt.ratio:g} with {_Z}.stage {stage}: partial "
            f"optimizer offload (ratio < 1) exists only for ZeRO stage 3 in DeepSpeed, and "
            f"flowtrain does not support it at any stage; use 1.0")
    # PipelineEngine.__init__: assert stage < 2, "ZeRO-2 and ZeRO-3 are incompatible with pipeline
    # parallelism". (DeepSpeedConfig alone accepts the pair; initialize() with a PipelineModule
    # refuses it.) pipeline.stages "auto" leaves the count to the model, so it cannot be checked.
    if (stage_ok and partitions_gradients(stage) and isinstance(pipeline_stages, int)
            and pipeline_stages > 1 and not broken("pipeline.stages")):
        problems.append(
            f"{_Z}.stage {stage} with pipeline.stages {pipeline_stages}: ZeRO stages 2 and 3 "
            f"cannot be combined with pipeline parallelism (DeepSpeed refuses them); use "
            f"{_Z}.stage 0 or 1, or pipeline.stages 1")
    # Stage-3 tuning keys below stage 3: DeepSpeed accepts and never reads them. Only values that
    # differ from the default warn: to_dict() writes every key, and reloading it must stay quiet.
    if stage_ok and not partitions_parameters(stage):
        ignored = [name for name in STAGE3_ONLY_KEYS
                   if name in zero.model_fields_set and not broken(f"{_Z}.{name}")
                   and getattr(zero, name) != ZeroConfig.model_fields[name].default]
        if ignored:
            names = " and ".join(f"{_Z}.{n}" for n in ignored)
            verb, it = ("are", "they apply") if len(ignored) > 1 else ("is", "it applies")
            warnings.append(
                f"{names} {verb} set but {_Z}.stage is {stage}: {it} only to ZeRO stage 3 and "
                f"{verb} ignored; remove {'them' if len(ignored) > 1 else 'it'} or use stage 3")
    # Not rules, on purpose:
    # - reduce_scatter false with stage 3: DeepSpeed 0.19.8 reads it at stage 3 (stage3.py
    #   all-reduces the contiguous bucket and keeps this rank's slice instead of reduce-scattering,
    #   and Muon requires it: "Muon and reduce scatter cannot be used together"), so it is valid.
    # - contiguous_gradients / overlap_comm: valid at every stage.
    # - stage3_max_live_parameters 0: DeepSpeed's parameter coordinator then prefetches nothing
    #   and still fetches what each module needs; a valid memory/speed trade.
    return problems, warnings


_LEGACY_OFFLOAD = (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"))


def legacy_offload_conflicts(zero: object, problems: list[str]) -> None:
    """Reports a deprecated ``cpu_offload``/``cpu_offload_param`` flag given together with the
    ``offload_optimizer``/``offload_param`` section that replaced it, and removes the flag from
    ``zero`` (the raw section, a private copy) so that it is not reported twice.

    DeepSpeed refuses every such pair, whatever the values ("Cannot provide deprecated parameter
    'cpu_offload' and replacing parameter 'offload_optimizer' together"); this says in addition
    when the two disagree about the device. A null section counts as not given (flowtrain's reading
    of null everywhere else), so ``cpu_offload`` then still decides."""
    if not isinstance(zero, dict):
        return
    for flag, target in _LEGACY_OFFLOAD:
        value, section = zero.get(flag), zero.get(target)
        if not isinstance(value, bool) or not isinstance(section, dict):
            continue  # no pair, or a bad value that the alias rewrite reports
        device = section.get("device", "none")
        known = isinstance(device, str) and device.lower() in ("none", "cpu", "nvme")
        del zero[flag]
        if not known or device.lower() == ("cpu" if value else "none"):
            problems.append(f"{_Z}.{flag} (deprecated) and {_Z}.{target} are both set; keep "
                            f"only {target}")
            continue
        shown = show(device) + ("" if "device" in section else " (the default)")
        problems.append(
            f"{_Z}.{flag} {show(value)} (deprecated) and {_Z}.{target}.device {shown} "
            f"contradict each other; remove {flag} and set {target}.device to the device you "
            f"want (\"cpu\" or \"none\")")
