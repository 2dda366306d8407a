"""Device memory of one rank, component by component: parameters, gradients, optimizer states,
activations, and the buffers and temporaries beside them, for a ModelSpec and a ds_config, at
the pipeline stage that needs the most.

Model states follow the training stack's own layout (``Software``): DeepSpeed's ZeRO
(arXiv:1910.02054, the default and what flowtrain's engine does), Megatron-LM's mixed precision
with its distributed optimizer (docs/user-guide/features/dist_optimizer.md), or PyTorch FSDP
(sharded fp32 parameters are the master copy; units gathered and reduce-scattered one at a
time). Activations are Korthikanti et al. 2022 (arXiv:2205.05198) per layer as the stack's
kernels save them (``sims.activation_memory``), times what the pipeline schedule keeps in
flight, walked over the stage's own instruction list."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flowtrain.config import ConfigSource, FlowtrainConfig, load_config
from sims.activation_memory import Kernels, in_flight, layer_bytes, loss_bytes
from sims.frameworks import get_framework
from sims.layer_ops import SimOptions, cfg_checkpoints_activations, stage_layer_costs
from sims.memory_states import (
    ADAM_K,
    SOFTWARE,
    STAGES,
    Software,
    fsdp_state_bytes,
    megatron_state_bytes,
    model_state_bytes,
    positive_int,
    software_named,
    stage_states,
)
from sims.models import ModelSpec
from sims.workload import layer_of, split_stages

__all__ = ["ADAM_K", "SOFTWARE", "STAGES", "Software", "fsdp_state_bytes",
           "megatron_state_bytes", "memory_per_rank", "model_state_bytes"]


def _raw(config: FlowtrainConfig | ConfigSource) -> dict[str, Any] | None:
    """The config as a dict (None for an already loaded FlowtrainConfig)."""
    if isinstance(config, FlowtrainConfig):
        return None
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"config {os.fspath(config)!r} could not be read as JSON: "
                             f"{err}") from err
        if not isinstance(data, dict):
            # the file's content is wrong, not the argument's type: a ValueError
            message = f"config {os.fspath(config)!r} holds a {type(data).__name__}, not a " \
                "JSON object"
            raise ValueError(message)  # noqa: TRY004
        return data
    raise TypeError(f"config must be a FlowtrainConfig, a dict or a JSON path, got "
                    f"{type(config).__name__}")


def _parallel_sizes(cfg: FlowtrainConfig | ConfigSource, raw: dict[str, Any] | None
                    ) -> tuple[int, int]:
    """(tp, pp) the config asks for: tensor_parallel autotp_size/tp_size and pipeline.stages,
    1 when unset or "auto"."""
    if raw is None:
        assert isinstance(cfg, FlowtrainConfig)  # _raw is None only for a loaded config
        tp_section = cfg.tensor_parallel.model_dump()
        stages: Any = cfg.pipeline.stages
    else:
        tp_section = raw.get("tensor_parallel") or {}
        stages = (raw.get("pipeline") or {}).get("stages", "auto")
    tp = tp_section.get("autotp_size") or tp_section.get("tp_size") or 1
    pp = stages if isinstance(stages, int) and not isinstance(stages, bool) else 1
    return int(tp), int(pp)


@dataclass(frozen=True)
class _Stage:
    """One pipeline stage as the planner cuts it: its parameters (whole model's, before the
    tensor split), the layers of each of its model chunks, and its parameters' units (a
    layer's, or the parameters outside the layers)."""

    params: int
    chunk_layers: tuple[int, ...]
    units: tuple[int, ...]


def _stages(model: ModelSpec, pp: int, v: int, options: SimOptions | None) -> list[_Stage]:
    """The planner's cut (``sims.workload.split_stages``): the layers split evenly
    in order into pp·v chunks, stage s holding chunks s, s + pp, ... (interleaved 1F1B), the
    embeddings on the first chunk and the final norm and head on the last. A tied LM head's
    embedding is held on the last stage as well (DeepSpeed's TiedLayerSpec and Megatron keep a
    copy on both ends)."""
    specs = model.param_specs()
    # as the planner weighs them: by the model's shape where it is a known transformer
    shape = {"hidden": model.hidden, "vocab": model.vocab, "seq_len": model.seq_len} \
        if model.arch is not None else {}
    costs = stage_layer_costs(specs, options, **shape, chunks=pp * v) if pp > 1 else None
    parts = split_stages(specs, pp * v, costs) if pp > 1 else [list(range(len(specs)))]
    out = []
    for s in range(pp):
        chunks = [parts[c * pp + s] for c in range(v)] if pp > 1 else parts
        numel: dict[int | None, int] = {}
        for index in (i for chunk in chunks for i in chunk):
            layer = layer_of(specs[index][0])
            numel[layer] = numel.get(layer, 0) + math.prod(specs[index][1])
        held = sum(numel.values())
        if pp > 1 and s == pp - 1 and model.arch is not None and model.arch.tied_embeddings:
            held += model.arch.vocab * model.arch.hidden
        layers = tuple(len({layer_of(specs[i][0]) for i in chunk} - {None}) for chunk in chunks)
        out.append(_Stage(held, layers, tuple(numel.values())))
    return out


def _checkpointing(cfg: FlowtrainConfig, asked: bool | None) -> bool:
    return asked if asked is not None else cfg_checkpoints_activations(cfg)


def _layer_figures(model: ModelSpec, *, tp: int, partition: bool, options: SimOptions | None,
                   kernels: Kernels) -> tuple[float, float, float]:
    """(one layer's saved bytes, one layer's input, the loss end), per sample, 16-bit. Presets
    use the formulas; a traced module its measured bytes, split evenly over the tensor
    ranks."""
    layer_input = model.layer_input_bytes_per_sample / (tp if partition else 1)
    if model.arch is None and model.program is not None and options is not None:
        # the run's kernels decide what a traced module's ops keep (without options, what
        # autograd saved in the trace)
        layer, outside = _program_figures(model, tp=tp, options=options, kernels=kernels)
        return layer, layer_input, outside
    if model.arch is None:
        if model.layers:
            return (model.layer_activation_bytes_per_sample / tp, layer_input,
                    model.outside_activation_bytes_per_sample / tp)
        return 0.0, 0.0, model.activation_bytes_per_sample / tp
    opts = options or SimOptions()
    recompute = opts.recompute if opts.recompute in ("selective", "op") else "none"
    # flash attention stores no attention maps, nor does selective recompute; without options
    # the maps are kept
    maps = opts.attention == "unfused" and recompute == "none" if options is not None else True
    layer = layer_bytes(model.arch, model.seq_len, tp=tp,
                        sequence_parallel=opts.sequence_parallel and tp > 1, maps=maps,
                        kernels=kernels, fp8=opts.gemm_dtype == "float8", recompute=recompute)
    return layer, layer_input, loss_bytes(model.arch, model.seq_len, tp=tp, kernels=kernels)


def _program_figures(model: ModelSpec, *, tp: int, options: SimOptions | None,
                     kernels: Kernels) -> tuple[float, float]:
    """(a layer's saved bytes, the loss end's) of a traced module from its recognized ops
    (``sims.op_program``): what each op keeps under the run's kernels, per sample."""
    program = model.program
    opts = options or SimOptions()
    recompute = opts.recompute if opts.recompute in ("selective", "op") else "none"
    sequence_parallel = opts.sequence_parallel and tp > 1
    figures = {"tp": tp, "sequence_parallel": sequence_parallel,
               "maps": opts.attention == "unfused" and recompute == "none",
               "fused_activation": kernels.fused_activation,
               "eager": opts.elementwise == "eager", "loss_bytes": kernels.loss_bytes}
    layers = [program.saved_bytes(i, **figures) for i in range(len(program.layers))]
    layer = max(layers, default=0.0) / program.batch
    if recompute == "op":
        layer /= 2  # the per-op policy keeps about every other matmul's output
    outside = (program.saved_bytes(-1, **figures) + program.saved_bytes(-2, **figures)) / \
        program.batch
    return layer, outside


def memory_per_rank(model: ModelSpec, config: FlowtrainConfig | ConfigSource, *,
                    world_size: int, tp: int | None = None,
                    pp: int | None = None, checkpointing: bool | None = None,
                    options: SimOptions | None = None,
                    software: str | Software | None = None) -> dict[str, float]:
    """Bytes one rank needs at its peak, for the pipeline stage that needs the most, with the
    parts that make it up.

    Model states ("parameters", "gradients", "optimizer"; "model_states" their sum) of the
    stage's parameters divided by ``tp``, over dp = world_size / (tp · pp) ranks, with the
    config's ZeRO stage, offload and precision (bf16/fp16: mixed, else fp32), laid out as
    ``software`` does (``Software``; by default the layout of the options' framework,
    ``sims.frameworks``, which for flowtrain's is "deepspeed": ``model_state_bytes``).
    Activations: ``train_micro_batch_size_per_gpu`` samples of each model chunk's layers
    (16-bit formula bytes, doubled for fp32) for every micro-batch chunk the pipeline schedule
    holds at once ("activations_held"; 1F1B stage i: min(pp - i, gradient_accumulation_steps)
    micro-batches; interleaved 1F1B as Megatron's warm-up, walked), plus what is live once
    ("activation_temporaries": the loss end on the last stage, one layer recomputed at a time
    with checkpointing). With checkpointing only layer inputs wait (divided by tp with
    ``partition_activations`` or sequence parallelism, moved to the host with
    ``cpu_checkpointing``). Buffers ("buffers"): gradient buckets, gathered parameters (ZeRO-3:
    the largest module plus the ``stage3_prefetch_bucket_size`` window, at most
    ``stage3_max_live_parameters``, and parameters under ``stage3_param_persistence_threshold``
    kept whole; FSDP: a unit and the next), the fp32 gradient the optimizer steps on (stage 3:
    a ``sub_group_size`` at a time), on the host with optimizer offload, which also keeps
    16-bit gradient and parameter copy buffers there.

    ``tp``/``pp`` default to the config's ``tensor_parallel``/``pipeline.stages`` (1 when unset
    or "auto"); ``checkpointing`` overrides the config's reading, as ``options.recompute``
    does ("full": checkpointed); ``options`` also says whether attention maps are kept
    (unfused attention without selective recompute), whether sequence parallelism splits the
    per-token activations and whether the GEMMs run in fp8. Without ``options`` the maps are
    kept. "pipeline_stage" names the stage of the peak; "host" is what lives in host memory.
    """
    soft = software_named(software if software is not None else
                          get_framework(options.framework if options is not None
                                        else "flowtrain").memory)
    if checkpointing is None and options is not None and options.recompute is not None:
        checkpointing = options.recompute == "full"
    positive_int("world_size", world_size)
    raw = _raw(config)
    config_tp, config_pp = _parallel_sizes(config, raw)
    tp = config_tp if tp is None else tp
    pp = config_pp if pp is None else pp
    positive_int("tp", tp)
    positive_int("pp", pp)
    if world_size % (tp * pp):
        raise ValueError(f"world_size {world_size} is not a multiple of tp x pp = {tp} x {pp} "
                         f"= {tp * pp}; pick sizes whose product divides the world")
    if model.layers and pp > model.layers:
        raise ValueError(f"pp {pp} is more pipeline stages than {model.name}'s {model.layers} "
                         f"layers; use pp <= {model.layers}")
    dp = world_size // (tp * pp)
    # The simulator plans runs the engine may not execute yet: the support gate is off, every
    # other check (batch rule against dp, ZeRO key conflicts) still applies.
    if raw is None:
        assert isinstance(config, FlowtrainConfig)  # _raw is None only for a loaded config
        cfg = config
    else:
        cfg = load_config(raw, world_size=dp, check_supported=False)
    zero = cfg.zero_optimization
    mixed = cfg.precision != "fp32"
    act_scale = 1.0 if mixed else 2.0  # formula bytes are for 16-bit activations
    width = 2 if mixed else 4
    comm_width = 4 if str(cfg.communication_dtype).endswith("float32") else 2
    micro = cfg.train_micro_batch_size_per_gpu or 1
    gas = cfg.gradient_accumulation_steps or 1
    ckpt = _checkpointing(cfg, checkpointing)
    section = cfg.activation_checkpointing
    schedule = cfg.pipeline.schedule if pp > 1 else "1f1b"
    v = int(cfg.pipeline.virtual_stages) if schedule == "interleaved" else 1
    partition = (section.partition_activations or bool(
        options and options.sequence_parallel)) and tp > 1
    layer, layer_input, loss_end = _layer_figures(model, tp=tp, partition=partition,
                                                  options=options, kernels=soft.kernels)
    largest_unit = max((sum(math.prod(model.params[i][1]) for i in unit)
                        for unit in model.units()), default=0)
    persistent = sum(math.prod(shape) for _, shape in model.params
                     if math.prod(shape) <= zero.stage3_param_persistence_threshold)
    zero3 = (math.ceil(largest_unit / tp), persistent / tp)

    best: dict[str, float] | None = None
    for s, stage in enumerate(_stages(model, pp, v, options)):
        psi = max(1, math.ceil(stage.params / tp))
        parts = stage_states(soft, cfg, psi, dp=dp, pipelined=pp > 1, mixed=mixed,
                             width=width, comm_width=comm_width,
                             units=[math.ceil(u / tp) for u in stage.units], zero3=zero3)
        kept = layer_input if ckpt and model.layers else layer
        chunk_bytes = [act_scale * micro * n * kept for n in stage.chunk_layers]
        if not model.layers:
            chunk_bytes = [0.0] * v
        held, chunks = in_flight(schedule, s, pp, gas, chunk_bytes)
        once = loss_end if s == pp - 1 else 0.0
        if ckpt and model.layers and any(stage.chunk_layers):
            once += layer  # the layer being recomputed for its backward
        host_activations = held if ckpt and section.cpu_checkpointing else 0.0
        temporaries = act_scale * micro * once
        activations = held - host_activations + temporaries
        buffers = parts["gradient_buckets"] + parts["gathered_parameters"] + \
            parts["fp32_gradients"]
        peak = parts["total"] + activations + buffers
        row = {"parameters": parts["parameters"], "gradients": parts["gradients"],
               "optimizer": parts["optimizer"], "model_states": parts["total"],
               "activations": activations, "activations_held": held - host_activations,
               "activation_temporaries": temporaries,
               "gradient_buckets": parts["gradient_buckets"],
               "gathered_parameters": parts["gathered_parameters"],
               "fp32_gradients": parts["fp32_gradients"], "buffers": buffers, "peak": peak,
               "host": parts["host"] + host_activations, "pipeline_stage": float(s),
               "in_flight_micro_batches": float(chunks), "stage_parameters": float(psi),
               "checkpointing": float(ckpt), "dp": float(dp), "tp": float(tp), "pp": float(pp)}
        if best is None or row["peak"] > best["peak"]:
            best = row
    assert best is not None
    return best
