"""What a valid config asks for that the engine cannot do (yet). Later work switches a feature on
by adding its name to ``SUPPORTED_FEATURES`` (or an optimizer to ``AVAILABLE_OPTIMIZERS``)."""

from __future__ import annotations

from flowtrain.config.fields import show
from flowtrain.config.model import MONITOR_SECTIONS, OPAQUE_SECTIONS, FlowtrainConfig
from flowtrain.config.params import AVAILABLE_OPTIMIZERS
from flowtrain.plan.zero_stage import partitions_parameters, shards_optimizer

# Feature names: "zero_stage_1".."zero_stage_3", "cpu_offload_optimizer", "cpu_offload_param",
# "pipeline", "tensor_parallel", "flops_profiler", each monitor section name, each opaque
# section name (see model.OPAQUE_SECTIONS).
SUPPORTED_FEATURES: set[str] = {"zero_stage_1", "zero_stage_2", "zero_stage_3",
                                "cpu_offload_optimizer", "cpu_offload_param", "pipeline",
                                "tensor_parallel", "flops_profiler"}

# Not on the roadmap: these get "not supported", never "not supported yet".
NEVER_SUPPORTED = {"nvme_offload", "partial_offload", "amp"}

# Opaque sections that only tune another feature and mean nothing on their own.
_PASSIVE_SECTIONS = {"aio", "timers"}


def _enabled(section: dict | None) -> bool:
    if section is None:
        return False
    return section.get("enabled", True) is not False


def unsupported_features(cfg: FlowtrainConfig) -> list[str]:
    """One sentence per feature ``cfg`` uses that flowtrain cannot run; empty when it can."""
    out: list[str] = []

    def want(feature: str, sentence: str) -> None:
        if feature not in SUPPORTED_FEATURES:
            out.append(sentence)

    zero = cfg.zero_optimization
    if shards_optimizer(zero.stage):
        want(f"zero_stage_{zero.stage}",
             f"zero_optimization.stage {zero.stage}: ZeRO stage {zero.stage} is not supported "
             f"yet; use stage 0")
    for name, section in (("offload_optimizer", zero.offload_optimizer),
                          ("offload_param", zero.offload_param)):
        if section.device == "nvme":
            out.append(f"zero_optimization.{name}.device nvme: offloading to NVMe is not "
                       f"supported by flowtrain; use \"cpu\" or \"none\"")
        elif section.nvme_path is not None:
            # DeepSpeed reads nvme_path only when the device is nvme and ignores it otherwise;
            # a path says the user meant NVMe, which flowtrain never runs, so it is refused
            # like device nvme rather than dropped without a word.
            out.append(f"zero_optimization.{name}.nvme_path {show(section.nvme_path)} with "
                       f"device {show(section.device)}: nvme_path is only for offloading to "
                       f"NVMe, which flowtrain does not support; remove nvme_path and use "
                       f"device \"cpu\" to offload")
        if section.device == "cpu":
            want(f"cpu_{name}", f"zero_optimization.{name}.device cpu: CPU offload is not "
                                f"supported yet; use \"none\"")
    # Partial offload (ZeRO-Offload++: a fraction of the optimizer steps on the GPU) is valid
    # DeepSpeed at stage 3 only; below stage 3 DeepSpeed refuses it and zero.check_zero reports it.
    ratio = zero.offload_optimizer.ratio
    if partitions_parameters(zero.stage) and ratio < 1:
        out.append(f"zero_optimization.offload_optimizer.ratio {ratio:g}: partial optimizer "
                   f"offload (ZeRO-Offload++, ratio < 1) is not supported by flowtrain; use 1.0")
    if isinstance(cfg.pipeline.stages, int) and cfg.pipeline.stages > 1:
        want("pipeline", f"pipeline.stages {cfg.pipeline.stages}: pipeline parallelism is not "
                         f"supported yet; use 1 stage")
    tp = max(cfg.tensor_parallel.tp_size, cfg.tensor_parallel.autotp_size)
    if tp > 1:
        want("tensor_parallel", f"tensor_parallel size {tp}: tensor parallelism is not "
                                f"supported yet; use 1")
    if cfg.optimizer is not None and cfg.optimizer.type not in AVAILABLE_OPTIMIZERS:
        out.append(f"optimizer {cfg.optimizer.type} is not available; flowtrain has: "
                   f"{', '.join(AVAILABLE_OPTIMIZERS)}")
    if cfg.amp.enabled:
        out.append("amp: NVIDIA apex AMP is not supported; use fp16 or bf16 instead")
    if cfg.flops_profiler.enabled:
        want("flops_profiler", "flops_profiler: the FLOPs profiler is not supported yet; set "
                               "flops_profiler.enabled false")
    for name in MONITOR_SECTIONS:
        if getattr(cfg, name).enabled:
            want(name, f"{name}: the {name} monitor is not supported yet; set {name}.enabled "
                       f"false")
    for name in OPAQUE_SECTIONS:
        if name not in _PASSIVE_SECTIONS and _enabled(getattr(cfg, name)):
            want(name, f"{name}: this DeepSpeed feature is not supported yet; remove the "
                       f"section or set {name}.enabled false")
    return out
