"""The simulated step: a model's parameters, a ds_config and a cluster layout turned into what
one representative rank of each pipeline stage does, priced by the cost model.

Each stage's tasks are laid out by ``sims.graph`` (the engine's own step plan, cut
finer where communication overlaps a pass; its docstring lists the task names), then priced
(``sims.pricing``) from the stage's costs (``sims.stage_costs``); ``sims.executor`` runs them.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flowtrain.plan import StepPlan
from flowtrain.plan.schedule import one_f_one_b
from flowtrain.plan.spec import TrainingSpec, resolve
from flowtrain.plan.stage3 import stage3_uses
from flowtrain.plan.zero_stage import partitions_gradients, shards_optimizer
from sims.executor import SimTask
from sims.frameworks import get_framework
from sims.graph import StageLayout, TaskGraph
from sims.layer_ops import SimOptions, cfg_checkpoints_activations, stage_layer_costs
from sims.pricing import PricedColumns, pipeline_tasks
from sims.stage_costs import PIPELINE_JOB_RANKS, StageCosts
from sims.workload import (
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
from sims.workload import numel as _numel

if TYPE_CHECKING:
    from flowtrain.config.model import FlowtrainConfig
    from sims.hardware import HardwareProfile

__all__ = ["DTYPE_BYTES", "PIPELINE_JOB_RANKS", "PRECISION_DTYPE",
           "LaidOutStep", "Layout", "ParamSpec", "SimPlan", "Workload", "build_plan",
           "lay_out", "layer_of", "module_units", "one_f_one_b",
           "paused_gc", "pipeline_tasks", "split_stages", "stage3_uses"]


@dataclass(frozen=True)
class SimPlan:
    """The step's tasks for one representative rank per pipeline stage, and what is needed to
    turn a step time into throughput and MFU."""

    tasks: Sequence[SimTask]  # a TaskTable: columns, read task by task on demand
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
    stages: tuple[StageLayout, ...] = field(default=(), repr=False)  # each stage's layout
    notes: tuple[str, ...] = ()
    slowdown: float = 1.0  # how much longer a collective takes while its stage computes

    @property
    def step_plans(self) -> tuple[StepPlan, ...]:
        """The data-parallel plan of each stage."""
        return tuple(stage.step_plan for stage in self.stages)


def build_plan(work: Workload, cfg: FlowtrainConfig, layout: Layout, hw: HardwareProfile,
               options: SimOptions | None = None) -> SimPlan:
    """The step of ``work`` trained with ``cfg`` (a loaded FlowtrainConfig whose batch rule was
    applied for ``layout.dp`` data-parallel ranks) on ``layout`` with hardware ``hw``;
    ``options`` are what the config has no key for (recompute, sequence parallelism, the
    attention kernel, fp8 GEMMs)."""
    return lay_out(work, cfg, layout, hw, options).price(hw)


@dataclass
class _Stage:
    """What one stage's pricing reads besides the hardware."""

    params: list[ParamSpec]
    weights: list[int]  # the parameters' unsharded element counts
    total_weight: int  # ... and the whole model's
    flops: float  # the stage's forward FLOPs of one sample
    act_bytes: float
    layout: StageLayout
    # embedding weights tied to the head (stage-local indices): their compute is the head's
    tied: frozenset[int] = frozenset()


class LaidOutStep:
    """A step laid out for every pipeline stage (``lay_out``), to be priced on hardware: the
    tasks and their dependencies do not depend on the hardware's speeds, only their times do,
    so one layout serves several pricings (the ends of a prediction's range)."""

    def __init__(self, work: Workload, cfg: FlowtrainConfig, layout: Layout,
                 options: SimOptions | None, stages: list[_Stage], costs: list[StageCosts],
                 graph: TaskGraph, recompute: str) -> None:
        self.work, self.cfg, self.layout, self.options = work, cfg, layout, options
        self.recompute = recompute
        self.stages, self.costs = stages, costs
        self.columns = PricedColumns(graph.columns())

    def price(self, hw: HardwareProfile) -> SimPlan:
        """The step's tasks priced on ``hw``; hardware that lays the step out otherwise (other
        engine overheads as tasks, another kind of device) gets a layout of its own."""
        work, cfg, layout = self.work, self.cfg, self.layout
        costs = self.costs if hw is self.costs[0].hw else \
            [_stage_costs(s, stage.layout.spec, layout, hw, self.options, stage.params,
                          self.recompute) for s, stage in enumerate(self.stages)]
        if any(_lays_out(c) != _lays_out(mine) for c, mine in zip(costs, self.costs)):
            return lay_out(work, cfg, layout, hw, self.options).price(hw)
        if costs is not self.costs:
            for c, stage in zip(costs, self.stages):
                _price_passes(c, stage, work)
        spec = self.stages[0].layout.spec  # the batch and precision every stage shares
        micro_batch = spec.micro_batch_size
        micro_batches = spec.gradient_accumulation_steps
        samples = micro_batch * micro_batches * layout.dp
        notes = []
        if (layout.tp > 1 or layout.pp > 1) and not (work.seq_len and work.hidden) and \
                not work.layer_input_bytes_per_sample and \
                not (layout.tp == 1 and work.stage_output_bytes_per_sample):
            notes.append("activation size unknown: pipeline sends and TP all-reduces cost "
                         "latency only")
        cpu = hw.kind == "cpu"
        kernels = hw.kernels if not cpu else None
        # a CPU host's collectives take cores from compute; a GPU's NCCL kernels take SMs and
        # memory bandwidth from the kernels they overlap
        interference = float(hw.comm_compute_interference) if cpu else \
            (kernels.overlap_slowdown if kernels is not None else 0.0)
        slowdown = float(hw.compute_comm_slowdown) if cpu else 1.0
        return SimPlan(self.columns.price(costs), layout, work.name, micro_batch,
                       micro_batches, spec.compute_dtype, spec.zero_stage, samples,
                       samples * work.seq_len, 3.0 * work.forward_flops_per_sample * samples,
                       interference, tuple(s.layout for s in self.stages), tuple(notes),
                       slowdown)


def _lays_out(costs: StageCosts) -> tuple[Any, ...]:
    """What of a stage's costs its layout depends on: the device kind, the engine overheads
    laid out as tasks, and whether a known transformer's pipeline sends are split over TP."""
    return costs.gpu, frozenset(costs.overheads()), costs.kernels is not None


def _stage_costs(s: int, spec: TrainingSpec, layout: Layout, hw: HardwareProfile,
                 options: SimOptions | None, params: list[ParamSpec], recompute: str
                 ) -> StageCosts:
    return StageCosts(s, layout=layout, hw=hw, spec=spec, params=params, recompute=recompute,
                      options=options)


def _price_passes(costs: StageCosts, stage: _Stage, work: Workload) -> None:
    spec = stage.layout.spec
    costs.price_passes(stage.layout.segments, stage.layout.buckets, stage_flops=stage.flops,
                       work=work, weights=stage.weights, total_weight=stage.total_weight,
                       dtype=spec.compute_dtype, act_bytes=stage.act_bytes,
                       with_head=stage.tied)


def _stage_params(work: Workload, v: int, layout: Layout, options: SimOptions
                  ) -> tuple[list[list[ParamSpec]], list[list[int]],
                             list[list[list[int]]] | None]:
    """Each stage's parameters as one rank holds them, their global indices, and (``v`` model
    chunks per stage, interleaved) each stage's chunks' global parameter indices; an unmeasured
    model is cut by the options' partition method."""
    shape = work.transformer
    costs = None if layout.pp == 1 else \
        stage_layer_costs(work.params, options, hidden=shape.hidden, vocab=shape.vocab,
                          seq_len=shape.seq_len, chunks=layout.pp * v) if shape is not None \
        else stage_layer_costs(work.params, options, chunks=layout.pp * v)
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
    params = [[work.params[i] if work.split_for_tp else tp_shard(work.params[i], layout.tp)
               for i in indices] for indices in split]
    return params, split, chunks


def _tied_params(work: Workload, spec: TrainingSpec, layout: Layout, indices: Sequence[int],
                 params: Sequence[ParamSpec], splits: bool) -> tuple[set[int], dict[int, float]]:
    """The embedding weights tied to the head (stage-local indices; none with pipeline stages,
    where the head runs on another stage), and those of them whose gradient the engine splits
    (``splits``: the framework does), each with the distinct rows a rank exchanges a step, under
    the engine's own conditions: ZeRO stage 0, data parallel, no tensor parallelism,
    ``flowtrain.tied_embedding_rows`` on, and the ranks' rows fewer than the vocabulary (else
    the engine reduces the weight densely from its first step on)."""
    if layout.pp > 1:
        return set(), {}  # the head is on another stage than the embedding
    local = {work.params[g][0]: i for i, g in enumerate(indices)}
    tied = {local[name]: lookups for name, lookups in work.tied if name in local}
    if not (splits and tied and not shards_optimizer(spec.zero_stage) and layout.dp > 1 and
            layout.tp == 1 and spec.host.tied_embedding_rows):
        return set(tied), {}
    split = {}
    for i, lookups in tied.items():
        vocab = params[i][1][0]
        tokens = lookups * spec.micro_batch_size * spec.gradient_accumulation_steps
        rows = distinct_rows(tokens, vocab)
        if layout.dp * rows <= vocab:
            split[i] = rows
    return set(tied), split


def distinct_rows(tokens: float, vocab: int) -> float:
    """The expected distinct ids among ``tokens`` draws from ``vocab`` equally likely ones:
    vocab * (1 - (1 - 1/vocab)^tokens). Text repeats its frequent tokens more than uniform
    draws do, so this is the most rows a rank's tokens are expected to touch."""
    if vocab <= 1:
        return float(min(vocab, tokens))
    return -vocab * math.expm1(tokens * math.log1p(-1.0 / vocab))


def lay_out(work: Workload, cfg: FlowtrainConfig, layout: Layout, hw: HardwareProfile,
            options: SimOptions | None = None) -> LaidOutStep:
    """The step of ``work`` (see ``build_plan``) laid out for ``hw``'s kind of device, ready to
    be priced (``LaidOutStep.price``) on ``hw`` or on hardware that differs in speeds only."""
    with paused_gc():
        return _lay_out(work, cfg, layout, hw, options)


@contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector paused (as it was after): a big step's graph is millions
    of small tuples, none of them in a reference cycle, which each of the collector's passes
    would walk again while the step is laid out, priced and run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _lay_out(work: Workload, cfg: FlowtrainConfig, layout: Layout, hw: HardwareProfile,
             options: SimOptions | None) -> LaidOutStep:
    if not work.params:
        raise ValueError(f"model {work.name!r} has no trainable parameters to plan a step for")
    # the grid, batch and precision every stage shares; each stage's own spec below
    shared = resolve(cfg, dp=layout.dp, tp=layout.tp, pp=layout.pp, elem_size=work.params[0][3])
    dtype, micro_batch, v = shared.compute_dtype, shared.micro_batch_size, shared.virtual_stages
    weights_all = [_numel(p[1]) for p in work.params]
    total_weight = sum(weights_all)
    if total_weight == 0:
        raise ValueError(f"model {work.name!r} has only empty parameters")
    opts = options or SimOptions()
    fw = get_framework(opts.framework)
    # the model's layers recomputed in backward: as the options say, else as the config does
    recompute = opts.recompute or ("full" if cfg_checkpoints_activations(cfg) else "none")
    graph = TaskGraph()
    stage_costs = []
    stages = []
    stage_params, split, chunks = _stage_params(work, v, layout, opts)
    for s, indices in enumerate(split):
        params = stage_params[s]
        weights = [weights_all[i] for i in indices]
        if work.stage_flops_per_sample:
            flops = work.stage_flops_per_sample[s]
        else:
            flops = work.forward_flops_per_sample * sum(weights) / total_weight
        # the engine's decisions for this stage's parameters (their element size sets the
        # default bucket), in the framework's variant: its own buckets, and an all-reduce at
        # ZeRO-1 where it does not reduce-scatter there (zero1_reduce overrides either)
        spec = resolve(cfg, dp=layout.dp, tp=layout.tp, pp=layout.pp,
                       elem_size=params[0][3] if params else 2)
        scatters = spec.reduce_scatter
        if shards_optimizer(spec.zero_stage) and not partitions_gradients(spec.zero_stage):
            scatters = opts.zero1_reduce == "reduce_scatter" or (
                scatters and fw.zero1_reduce_scatter)
        spec = spec.replace(bucket_numel=fw.bucket_numel(layout.dp, spec.bucket_numel),
                            reduce_scatter=scatters)
        priced = _stage_costs(s, spec, layout, hw, options, params, recompute)
        tied, split_rows = _tied_params(work, spec, layout, indices, params, fw.tied_rows)
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
            graph, s, params=params, spec=spec,
            forward_flops=flops * micro_batch / layout.tp, gpu=priced.gpu,
            act_bytes=act_bytes, send_bytes=send_bytes, recv_bytes=recv_bytes,
            overheads=priced.overheads(),
            chunk_params=[[indices.index(i) for i in chunk] for chunk in chunks[s]]
            if chunks is not None else None,
            param_gather_overlap=opts.param_gather_overlap or fw.param_gather_overlap,
            fsdp=opts.fsdp or fw.fsdp_units,
            blocking_p2p=opts.blocking_p2p or fw.blocks_sends(v),
            shared_params=priced.shared_params, split_rows=split_rows)
        stages.append(_Stage(params, weights, total_weight, flops, act_bytes, stage,
                             frozenset(tied)))
        _price_passes(priced, stages[-1], work)
        stage.build()
        stage_costs.append(priced)
    return LaidOutStep(work, cfg, layout, options, stages, stage_costs, graph, recompute)
