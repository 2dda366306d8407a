"""Device memory of one rank: ZeRO model states (arXiv:1910.02054), activations (Korthikanti et
al. 2022, with recompute and 1F1B in-flight micro-batches) and the communication buffers a
DeepSpeed-style config sets, for a ModelSpec and a ds_config."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from typing import Any

from flowtrain.config import load_config
from sims.layer_ops import SimOptions, cfg_checkpoints_activations
from sims.models import ModelSpec, layer_activation_bytes, outside_activation_bytes

# Adam's optimizer state in bytes per parameter (ZeRO paper Sec. 3.1, "K"): mixed precision
# keeps an fp32 master copy, momentum and variance (4 + 4 + 4); fp32 training only the two
# moments (the parameters are already fp32).
ADAM_K = {True: 12, False: 8}
STAGES = (0, 1, 2, 3)


def _positive_int(label: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{label} must be an integer > 0, got {value!r}")
    return value


def model_state_bytes(psi: int, *, stage: int, dp: int, mixed: bool = True,
                      offload_optimizer: bool = False, offload_param: bool = False
                      ) -> dict[str, float]:
    """Per-device bytes of parameters, gradients and Adam state for ``psi`` parameters.

    ZeRO paper (Rajbhandari et al., arXiv:1910.02054, Sec. 5), mixed precision with K = 12:
    baseline (2 + 2 + K)Ψ; stage 1 (P_os) 2Ψ + 2Ψ + KΨ/N_d; stage 2 (P_os+g)
    2Ψ + (2 + K)Ψ/N_d; stage 3 (P_os+g+p) (2 + 2 + K)Ψ/N_d. fp32 training: 4-byte parameters
    and gradients, K = 8.
    ``offload_optimizer`` (ZeRO-Offload) moves the optimizer part, fp32 master included, to the
    host; ``offload_param`` (stage 3 only) moves the parameter shard there too. "host" is what
    was moved; "total" is what stays on the device.
    """
    _positive_int("psi (parameter count)", psi)
    _positive_int("dp (data-parallel ranks)", dp)
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, got {stage!r}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3 (the optimizer it "
                         "moves is ZeRO's), got stage 0")
    if offload_param and stage != 3:
        raise ValueError(f"offload_param needs ZeRO stage 3 (only partitioned parameters can "
                         f"live on the host), got stage {stage}")
    width = 2 if mixed else 4
    params = width * psi / (dp if stage >= 3 else 1)
    grads = width * psi / (dp if stage >= 2 else 1)
    optimizer = ADAM_K[mixed] * psi / (dp if stage >= 1 else 1)
    host = 0.0
    if offload_optimizer:
        host, optimizer = host + optimizer, 0.0
    if offload_param:
        host, params = host + params, 0.0
    return {"parameters": params, "gradients": grads, "optimizer": optimizer,
            "total": params + grads + optimizer, "host": host}


def _raw(config: Any) -> dict[str, Any] | None:
    """The config as a dict (None for an already loaded FlowtrainConfig)."""
    from flowtrain.config import FlowtrainConfig

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


def _parallel_sizes(cfg: Any, raw: dict[str, Any] | None) -> tuple[int, int]:
    """(tp, pp) the config asks for: tensor_parallel autotp_size/tp_size and pipeline.stages,
    1 when unset or "auto"."""
    if raw is None:
        tp_section = cfg.tensor_parallel.model_dump()
        stages: Any = cfg.pipeline.stages
    else:
        tp_section = raw.get("tensor_parallel") or {}
        stages = (raw.get("pipeline") or {}).get("stages", "auto")
    tp = tp_section.get("autotp_size") or tp_section.get("tp_size") or 1
    pp = stages if isinstance(stages, int) and not isinstance(stages, bool) else 1
    return int(tp), int(pp)


def _stage_layers(layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage, as even as possible, earlier stages taking the remainder."""
    return [layers // pp + (1 if i < layers % pp else 0) for i in range(pp)]


def _stage_params(model: ModelSpec, pp: int) -> list[int]:
    """Parameters each pipeline stage holds: its layers; the parameters before the first layer
    (embeddings) on stage 0, those after the last (final norm, LM head) on the last stage, and
    a tied LM head's embedding on the last stage as well (DeepSpeed's TiedLayerSpec keeps a
    copy on both ends)."""
    if pp == 1:
        return [model.num_params]
    owners = model.layer_of()
    counts = _stage_layers(model.layers, pp)
    first = [sum(counts[:i]) for i in range(pp)]
    stage_of_layer = {layer: s for s in range(pp)
                      for layer in range(first[s], first[s] + counts[s])}
    held = [0] * pp
    seen_layer = False
    for (_, shape), layer in zip(model.params, owners):
        numel = math.prod(shape)
        if layer >= 0:
            seen_layer = True
            held[stage_of_layer.get(layer, pp - 1)] += numel
        else:
            held[pp - 1 if seen_layer else 0] += numel
    if model.arch is not None and model.arch.tied_embeddings:
        held[-1] += model.arch.vocab * model.arch.hidden
    return held


def _checkpointing(cfg: Any, asked: bool | None) -> bool:
    return asked if asked is not None else cfg_checkpoints_activations(cfg)


def _activations(model: ModelSpec, *, layers: int, tp: int, last_stage: bool,
                 checkpointed: bool, partition: bool, options: SimOptions | None = None
                 ) -> tuple[float, float]:
    """(per micro-batch in flight, once) bytes per sample of a pipeline stage holding
    ``layers`` layers. Without recompute each micro-batch in flight keeps its layers' full
    saved set; with recompute it keeps only the layer inputs, and one layer's full set is live
    while that layer is recomputed. The loss end (final norm, logits) is live for one micro-batch
    on the last stage, which runs its backward right after its forward."""
    if model.arch is not None:
        opts = options or SimOptions()
        # flash attention stores no attention maps, nor does selective recompute; with
        # sequence parallelism the per-token tensors are split over the tensor ranks too
        maps = opts.attention == "unfused" and opts.recompute not in ("selective", "op") \
            if options is not None else True
        sp = opts.sequence_parallel and tp > 1
        layer = layer_activation_bytes(model.arch, model.seq_len, tp=tp, maps=maps,
                                       sequence_parallel=sp)
        if opts.recompute == "op":
            # torchtitan's per-op checkpointing keeps every other matmul's output and the
            # attention output: about half the layer's saved tensors
            layer /= 2
        outside = outside_activation_bytes(model.arch, model.seq_len, tp=tp)
    elif model.layers:  # a traced module: no formula, so tensor ranks are taken to split evenly
        layer = model.layer_activation_bytes_per_sample / tp
        outside = model.outside_activation_bytes_per_sample / tp
    else:
        layer, outside = 0.0, model.activation_bytes_per_sample / tp
    outside = outside if last_stage else 0.0
    if not checkpointed or not model.layers:
        return layers * layer, outside
    layer_input = model.layer_input_bytes_per_sample / (tp if partition else 1)
    return layers * layer_input, (layer if layers else 0.0) + outside


def memory_per_rank(model: ModelSpec, config: Any, *, world_size: int, tp: int | None = None,
                    pp: int | None = None, checkpointing: bool | None = None,
                    options: SimOptions | None = None) -> dict[str, float]:
    """Bytes one rank needs at its peak, for the pipeline stage that needs the most.

    Model states: ``model_state_bytes`` of the stage's parameters divided by ``tp``, with the
    config's ZeRO stage, offload and precision (bf16/fp16: mixed, else fp32), over
    dp = world_size / (tp · pp) ranks. Activations: ``train_micro_batch_size_per_gpu`` samples
    of the stage's layers (16-bit formula bytes, doubled for fp32), times the micro-batches a
    1F1B schedule keeps in flight (stage i: min(pp - i, gradient_accumulation_steps)); with
    checkpointing only layer inputs wait per micro-batch (divided by tp with
    ``partition_activations``, moved to the host with ``cpu_checkpointing``), plus one layer
    recomputed at a time. Buffers: two gradient buckets of ``reduce_bucket_size`` in flight
    (communication dtype); at stage 3 the gathered parameters of the largest module plus the
    ``stage3_prefetch_bucket_size`` window, at most ``stage3_max_live_parameters``, and
    parameters under ``stage3_param_persistence_threshold`` kept whole; the fp32 gradient the
    optimizer steps on (mixed precision; stage 3 a ``sub_group_size`` at a time), on the host
    with optimizer offload, which also keeps 16-bit gradient and parameter copy buffers there.

    ``tp``/``pp`` default to the config's ``tensor_parallel``/``pipeline.stages`` (1 when unset
    or "auto"); ``checkpointing`` overrides the config's reading (see ``_checkpointing``), as
    ``options.recompute`` does ("full": checkpointed); ``options`` also says whether attention
    maps are kept (unfused attention without selective recompute) and whether sequence
    parallelism splits the per-token activations. Without ``options`` the maps are kept.
    """
    if checkpointing is None and options is not None and options.recompute is not None:
        checkpointing = options.recompute == "full"
    _positive_int("world_size", world_size)
    raw = _raw(config)
    config_tp, config_pp = _parallel_sizes(config, raw)
    tp = config_tp if tp is None else tp
    pp = config_pp if pp is None else pp
    _positive_int("tp", tp)
    _positive_int("pp", pp)
    if world_size % (tp * pp):
        raise ValueError(f"world_size {world_size} is not a multiple of tp x pp = {tp} x {pp} "
                         f"= {tp * pp}; pick sizes whose product divides the world")
    if model.layers and pp > model.layers:
        raise ValueError(f"pp {pp} is more pipeline stages than {model.name}'s {model.layers} "
                         f"layers; use pp <= {model.layers}")
    dp = world_size // (tp * pp)
    # The simulator plans runs the engine may not execute yet: the support gate is off, every
    # other check (batch rule against dp, ZeRO key conflicts) still applies.
    cfg = config if raw is None else load_config(raw, world_size=dp, check_supported=False)
    zero = cfg.zero_optimization
    mixed = cfg.precision != "fp32"
    act_scale = 1.0 if mixed else 2.0  # formula bytes are for 16-bit activations
    width = 2 if mixed else 4
    comm_width = 4 if str(cfg.communication_dtype).endswith("float32") else 2
    micro = cfg.train_micro_batch_size_per_gpu or 1
    gas = cfg.gradient_accumulation_steps or 1
    ckpt = _checkpointing(cfg, checkpointing)
    section = cfg.activation_checkpointing
    layer_counts = _stage_layers(model.layers, pp) if model.layers else [0] * pp
    stage_psi = [max(1, math.ceil(n / tp)) for n in _stage_params(model, pp)]
    largest_unit = max((sum(math.prod(model.params[i][1]) for i in unit)
                        for unit in model.units()), default=0)
    persistent = sum(math.prod(shape) for _, shape in model.params
                     if math.prod(shape) <= zero.stage3_param_persistence_threshold)

    best: dict[str, float] | None = None
    for s in range(pp):
        psi = stage_psi[s]
        states = model_state_bytes(psi, stage=zero.stage, dp=dp, mixed=mixed,
                                   offload_optimizer=zero.offloads_optimizer and zero.stage > 0,
                                   offload_param=zero.offloads_params and zero.stage == 3)
        in_flight = min(pp - s, gas) if pp > 1 else 1
        per_micro, once = _activations(model, layers=layer_counts[s], tp=tp,
                                       last_stage=s == pp - 1, checkpointed=ckpt,
                                       partition=(section.partition_activations or bool(
                                           options and options.sequence_parallel)) and tp > 1,
                                       options=options)
        waiting = act_scale * micro * in_flight * per_micro
        host_activations = waiting if ckpt and section.cpu_checkpointing else 0.0
        activations = act_scale * micro * once + waiting - host_activations
        buckets = 2 * min(zero.reduce_bucket_size, psi) * comm_width if dp > 1 else 0.0
        gathered = resident = 0.0
        if zero.stage == 3 and dp > 1:
            live = min(zero.stage3_max_live_parameters,
                       math.ceil(largest_unit / tp) + zero.stage3_prefetch_bucket_size, psi)
            gathered = live * width
            resident = min(persistent / tp, psi) * width * (1 - 1 / dp)
        shard = psi / dp if zero.stage >= 1 else psi
        step_numel = min(shard, zero.sub_group_size) if zero.stage == 3 else shard
        fp32_grads = 4 * step_numel if mixed else 0.0
        host = states["host"] + host_activations
        if zero.offloads_optimizer and zero.stage > 0:
            host += fp32_grads + 2 * width * shard  # gradient copy-down and parameter staging
            fp32_grads = 0.0
        buffers = buckets + gathered + resident + fp32_grads
        peak = states["total"] + activations + buffers
        row = {"parameters": states["parameters"], "gradients": states["gradients"],
               "optimizer": states["optimizer"], "model_states": states["total"],
               "activations": activations, "gradient_buckets": buckets,
               "gathered_parameters": gathered + resident, "fp32_gradients": fp32_grads,
               "buffers": buffers, "peak": peak, "host": host, "pipeline_stage": float(s),
               "in_flight_micro_batches": float(in_flight), "stage_parameters": float(psi),
               "checkpointing": float(ckpt), "dp": float(dp), "tp": float(tp), "pp": float(pp)}
        if best is None or row["peak"] > best["peak"]:
            best = row
    assert best is not None
    return best

