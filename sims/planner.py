"""The simulated step: a model's parameters, a ds_config and a cluster layout turned into what
one representative rank of each pipeline stage does, priced by the cost model.

Each stage's tasks are laid out by ``flowtrain.plan.graph`` (the engine's own step plan, cut
finer where communication overlaps a pass; its docstring lists the task names), then priced
(``sims.pricing``) from the stage's costs (``sims.stage_costs``); ``sims.executor`` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowtrain.plan import StepPlan
from flowtrain.plan.graph import StageLayout, TaskGraph
from flowtrain.plan.schedule import one_f_one_b
from flowtrain.plan.stage3 import stage3_uses
from flowtrain.plan.workload import (
    DTYPE_BYTES,
    PRECISION_DTYPE,
    Layout,
    ParamSpec,
    Workload,
    interleaved_chunks,
    layer_of,
    module_units,
    split_stages,
    tp_shard,
)
from flowtrain.plan.workload import numel as _numel
from sims.executor import SimTask
from sims.frameworks import get_framework
from sims.layer_ops import SimOptions, stage_layer_costs
from sims.pricing import pipeline_tasks, price
from sims.stage_costs import PIPELINE_JOB_RANKS, StageCosts

__all__ = ["DEFAULT_BUCKET_BYTES", "DTYPE_BYTES", "PIPELINE_JOB_RANKS", "PRECISION_DTYPE",
           "Layout", "ParamSpec", "SimPlan", "Workload", "build_plan", "config_bucket_numel",
           "layer_of", "module_units", "one_f_one_b", "pipeline_tasks", "split_stages",
           "stage3_uses"]

# The engine's bucket size when the config sets none (flowtrain.api.DEFAULT_BUCKET_BYTES):
# DeepSpeed's 5e8-element default would put a whole model in one bucket, leaving no overlap.
DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True)
class SimPlan:
    """The step's tasks for one representative rank per pipeline stage, and what is needed to
    turn a step time into throughput and MFU."""

    tasks: tuple[SimTask, ...]
    layout: Layout
    workload: str
    micro_batch_size: int
    micro_batches: int  # gradient accumulation steps (pipeline micro-batches when pp > 1)
    dtype: str  # compute dtype, a key of hw.peak_flops
    zero_stage: int
    samples_per_step: int
    tokens_per_step: int  # 0 when the sequence length is not known
    model_flops_per_step: float  # forward + backward (3x forward), no recomputation
    interference: float  # fraction of a collective's time it also takes from compute
    step_plans: tuple[StepPlan, ...] = field(default=())  # the data-parallel plan of each stage
    notes: tuple[str, ...] = ()
    slowdown: float = 1.0  # how much longer a collective takes while its stage computes


def config_bucket_numel(zero: Any, elem_size: int) -> int:
    """The engine's bucket size in elements (as ``flowtrain.api`` picks it): the config's
    reduce/allgather bucket sizes when set, else 25 MiB of parameters."""
    if zero.stage and {"reduce_bucket_size", "allgather_bucket_size"} & zero.model_fields_set:
        return min(int(getattr(zero, k)) for k in ("reduce_bucket_size", "allgather_bucket_size")
                   if k in zero.model_fields_set)
    if "reduce_bucket_size" in zero.model_fields_set:
        return int(zero.reduce_bucket_size)
    return DEFAULT_BUCKET_BYTES // elem_size


def build_plan(work: Workload, cfg: Any, layout: Layout, hw: Any,
               options: SimOptions | None = None) -> SimPlan:
    """The step of ``work`` trained with ``cfg`` (a loaded FlowtrainConfig whose batch rule was
    applied for ``layout.dp`` data-parallel ranks) on ``layout`` with hardware ``hw``;
    ``options`` are what the config has no key for (recompute, sequence parallelism, the
    attention kernel, fp8 GEMMs)."""
    if not work.params:
        raise ValueError(f"model {work.name!r} has no trainable parameters to plan a step for")
    zero = cfg.zero_optimization
    dtype = PRECISION_DTYPE[cfg.precision]
    comm_dtype = str(cfg.communication_dtype).removeprefix("torch.")
    comm_elem = DTYPE_BYTES.get(comm_dtype, 4)
    micro_batch = int(cfg.train_micro_batch_size_per_gpu)
    micro_batches = int(cfg.gradient_accumulation_steps)
    weights_all = [_numel(p[1]) for p in work.params]
    total_weight = sum(weights_all)
    if total_weight == 0:
        raise ValueError(f"model {work.name!r} has only empty parameters")
    opts = options or SimOptions()
    fw = get_framework(opts.framework)
    shape = work.transformer
    costs = stage_layer_costs(work.params, opts, hidden=shape.hidden, vocab=shape.vocab,
                              seq_len=shape.seq_len) if shape is not None else \
        stage_layer_costs(work.params, opts)
    if layout.pp == 1:
        costs = None
    graph = TaskGraph()
    stage_costs = []
    step_plans = []
    v = int(cfg.pipeline.virtual_stages) if layout.pp > 1 else 1
    chunks: list[list[list[int]]] | None = None  # each stage's chunks' global param indices
    if work.stage_params:
        if len(work.stage_params) != layout.pp:
            raise ValueError(f"the run was split into {len(work.stage_params)} pipeline stages; "
                             f"plan it with pp {len(work.stage_params)}, not {layout.pp}")
        split = [list(indices) for indices in work.stage_params]
        if v > 1:
            if len(work.stage_chunk_layers) != layout.pp or \
                    any(len(c) != v for c in work.stage_chunk_layers):
                raise ValueError(f"pipeline.virtual_stages {v}: the run's stage records do not "
                                 f"hold {v} model chunks per stage")
            chunks = [interleaved_chunks(work.params, indices, layers)
                      for indices, layers in zip(split, work.stage_chunk_layers)]
    elif v > 1:
        # interleaved: p * v chunks, stage s holding chunks s, s + p, ... (Megatron's order)
        parts = split_stages(work.params, layout.pp * v, costs)
        chunks = [[parts[c * layout.pp + s] for c in range(v)] for s in range(layout.pp)]
        split = [[i for chunk in stage for i in chunk] for stage in chunks]
    else:
        split = split_stages(work.params, layout.pp, costs)
    for s, indices in enumerate(split):
        params = [work.params[i] if work.split_for_tp else tp_shard(work.params[i], layout.tp)
                  for i in indices]
        weights = [weights_all[i] for i in indices]
        if work.stage_flops_per_sample:
            flops = work.stage_flops_per_sample[s]
        else:
            flops = work.forward_flops_per_sample * sum(weights) / total_weight
        priced = StageCosts(s, layout=layout, hw=hw, cfg=cfg, params=params,
                            micro_batches=micro_batches, micro_batch=micro_batch, dtype=dtype,
                            comm_elem=comm_elem, options=options)
        # what crosses a stage boundary, and what a TP all-reduce sums: one layer's output
        act_bytes = micro_batch * (work.seq_len * work.hidden * DTYPE_BYTES.get(dtype, 2)
                                   or work.layer_input_bytes_per_sample)
        # sent to the next stage and (its gradient) to the previous one: a run's own records
        send_bytes = recv_bytes = act_bytes
        if work.stage_output_bytes_per_sample:
            send_bytes = micro_batch * work.stage_output_bytes_per_sample[s]
            recv_bytes = micro_batch * work.stage_output_bytes_per_sample[s - 1] \
                if s > 0 else 0.0
        elif priced.kernels is not None and work.transformer is not None:
            # Megatron's pipeline sends each tensor rank's 1/tp of the activations (gathered
            # again over NVLink on the other side); with sequence parallelism they are split
            send_bytes = recv_bytes = act_bytes / layout.tp
        stage = StageLayout(
            graph, s, params=params, stages=layout.pp, dp=layout.dp, tp=layout.tp,
            zero=zero, micro_batches=micro_batches, micro_batch=micro_batch,
            bucket_numel=fw.bucket_numel(layout.dp,
                                         config_bucket_numel(zero, params[0][3] if params
                                                             else 2)),
            comm_dtype=comm_dtype, comm_elem=comm_elem,
            forward_flops=flops * micro_batch / layout.tp, gpu=priced.gpu,
            act_bytes=act_bytes, send_bytes=send_bytes, recv_bytes=recv_bytes,
            overheads=priced.overheads(),
            chunk_params=[[indices.index(i) for i in chunk] for chunk in chunks[s]]
            if chunks is not None else None,
            param_gather_overlap=opts.param_gather_overlap or fw.param_gather_overlap,
            fsdp=opts.fsdp or fw.fsdp_units,
            blocking_p2p=opts.blocking_p2p or fw.blocks_sends(v))
        priced.price_passes(stage.segments, stage.buckets, stage_flops=flops, work=work,
                            weights=weights, total_weight=total_weight, dtype=dtype, cfg=cfg,
                            act_bytes=act_bytes)
        stage.build()
        stage_costs.append(priced)
        step_plans.append(stage.step_plan)
    samples = micro_batch * micro_batches * layout.dp
    notes = []
    if (layout.tp > 1 or layout.pp > 1) and not (work.seq_len and work.hidden) and \
            not work.layer_input_bytes_per_sample and \
            not (layout.tp == 1 and work.stage_output_bytes_per_sample):
        notes.append("activation size unknown: pipeline sends and TP all-reduces cost latency "
                     "only")
    cpu = getattr(hw, "kind", "gpu") == "cpu"
    kernels = getattr(hw, "kernels", None) if not cpu else None
    # a CPU host's collectives take cores from compute; a GPU's NCCL kernels take SMs and
    # memory bandwidth from the kernels they overlap
    interference = float(getattr(hw, "comm_compute_interference", 0.0)) if cpu else \
        (kernels.overlap_slowdown if kernels is not None else 0.0)
    slowdown = float(getattr(hw, "compute_comm_slowdown", 1.0)) if cpu else 1.0
    return SimPlan(price(graph.resolve(), stage_costs), layout, work.name, micro_batch,
                   micro_batches, dtype, zero.stage, samples, samples * work.seq_len,
                   3.0 * work.forward_flops_per_sample * samples, interference,
                   tuple(step_plans), tuple(notes), slowdown)
