"""The simulated step's tasks: a model's parameters, a ds_config and a cluster layout turned into
what one representative rank of each pipeline stage does, with each task's duration from the
cost model.

The data-parallel skeleton (buckets, their order, ZeRO-3's module units) is the engine's own
``flowtrain.plan`` output, so predicted and measured tasks share names. On top of it the planner
adds what the engine does per ZeRO stage, CPU offload, 1F1B pipelining and tensor-parallel
all-reduces. Task names (the first two path parts are the name the engine records for a span):

- ``forward/mb{k}``, ``backward/mb{k}``: one micro-batch's pass on a stage; when the pass is
  split (ZeRO-3 modules, TP layers, buckets that become ready during backward) its pieces are
  ``forward/mb{k}/<segment>`` (segment: ``layer{l}``, ``embed``, ``head`` or a module name).
  On a calibrated CPU host, ZeRO-3's hooks add ``<pass>/mb{k}/<segment>/fetch`` (the use
  handed to the parameter fetcher) and ``backward/mb{k}/<segment>/release``.
- ``reduce/bucket{i}`` (once per step) or ``reduce/bucket{i}/mb{k}`` (every micro-batch,
  ZeRO 2-3): the bucket's gradient all-reduce (stages 0-1) or reduce-scatter (2-3).
- ``gather/bucket{i}/fwd/mb{k}``, ``gather/bucket{i}/bwd/mb{k}``: ZeRO-3 parameter all-gathers
  before a module's forward and backward.
- ``optimizer/step`` (``optimizer/step/bucket{i}`` per shard when the optimizer is offloaded).
- ``allgather/bucket{i}``: after the step, the updated shards of a whole (not ZeRO-3
  partitioned) bucket to every rank (the engine records this inside ``optimizer/step``).
- ``copy/d2h/bucket{i}``, ``copy/h2d/bucket{i}``: offload copies of a gradient shard down and a
  parameter shard up; ``copy/h2d/bucket{i}/fwd/mb{k}`` a parameter shard before its gather.
- ``send_act/mb{k}``, ``send_grad/mb{k}``: pipeline sends of activations to the next stage and
  of input gradients to the previous one (the engine's PipeStage names; its ``recv_*`` spans
  are the receiving pass's wait for them).
- ``tp/fwd/mb{k}/layer{l}``, ``tp/bwd/mb{k}/layer{l}``: a layer's two tensor-parallel
  all-reduces of one pass (Megatron-style attention and MLP), merged into one task.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from flowtrain.plan import BucketPlan, StepPlan, build_step_plan, names, plan_buckets, plan_units
from flowtrain.plan.stage3 import Stage3Uses, stage3_uses
from flowtrain.plan.step_plan import gather_uses
from flowtrain.plan.workload import (
    DTYPE_BYTES,
    PRECISION_DTYPE,
    Layout,
    ParamSpec,
    Workload,
    layer_of,
    module_units,
    split_stages,
    tp_shard,
)
from flowtrain.plan.workload import numel as _numel
from sims import costs
from sims.executor import SimTask
from sims.plan_tasks import Tasks, one_f_one_b, pipeline_tasks, segments
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


class _StageBuilder(StageCosts):
    """Builds one pipeline stage's tasks into a shared ``Tasks``, each task priced by the
    stage's ``StageCosts``."""

    def __init__(self, plan: Tasks, stage: int, *, layout: Layout, hw: Any, cfg: Any,
                 work: Workload, params: list[ParamSpec], weights: list[int], total_weight: int,
                 stage_flops: float, micro_batches: int, micro_batch: int, dtype: str,
                 comm_elem: int, comm_dtype: str) -> None:
        super().__init__(stage, layout=layout, hw=hw, cfg=cfg, params=params,
                         micro_batches=micro_batches, micro_batch=micro_batch, dtype=dtype,
                         comm_elem=comm_elem)
        self.plan = plan
        self.segments = segments(params, self.partitioned)
        seg_of = {i: j for j, seg in enumerate(self.segments) for i in seg.params}
        units = [seg.params for seg in self.segments] if self.partitioned else None
        bucket_numel = config_bucket_numel(self.zero, self.param_elem)
        buckets = plan_units(params, units, bucket_numel=bucket_numel,
                             persistence_threshold=self.zero.stage3_param_persistence_threshold) \
            if units is not None else plan_buckets(params, bucket_numel)
        self.buckets: tuple[BucketPlan, ...] = tuple(buckets)
        self.reduce_every_mb = self.stage_no >= 2
        self.uses = self._stage3_uses() if self.partitioned else None
        # this stage's forward FLOPs of one sample, shared by its parameters by element count
        self.stage_flops = stage_flops
        flops_mb = stage_flops * micro_batch / self.tp
        self.step_plan = build_step_plan(
            params, world_size=self.dp, gradient_accumulation_steps=micro_batches,
            micro_batch_size=micro_batch, bucket_numel=bucket_numel, comm_dtype=comm_dtype,
            comm_elem_size=comm_elem, forward_flops=flops_mb, buckets=buckets,
            reduce_every_micro_batch=self.reduce_every_mb, stage=stage, stages=self.pp,
            stage3=(self.uses, self.trace) if self.uses is not None else None)
        # a bucket's gradients are complete after the backward of its earliest-forward segment
        self.ready_after: dict[int, list[BucketPlan]] = {}
        for b in self.buckets:
            self.ready_after.setdefault(min(seg_of[s.index] for s in b.slots), []).append(b)
        self._cost_segments(work, weights, total_weight, dtype, cfg)
        # what crosses a stage boundary, and what a TP all-reduce sums: one layer's output
        self.act_bytes = micro_batch * (work.seq_len * work.hidden * DTYPE_BYTES.get(dtype, 2)
                                        or work.layer_input_bytes_per_sample)
        # sent to the next stage and (its gradient) to the previous one: a run's own records
        self.send_bytes = self.recv_bytes = self.act_bytes
        if work.stage_output_bytes_per_sample:
            self.send_bytes = micro_batch * work.stage_output_bytes_per_sample[stage]
            self.recv_bytes = micro_batch * work.stage_output_bytes_per_sample[stage - 1] \
                if stage > 0 else 0.0
        self.tp_s = 2 * costs.collective_seconds("all_reduce", self.act_bytes, self.tp, hw,
                                                 nodes=1) if self.tp > 1 else 0.0

    def _stage3_uses(self) -> Stage3Uses:
        """Which partitioned bucket each segment uses, and the gathers of one micro-batch."""
        self.bucket_of_seg: list[int | None] = []
        for seg in self.segments:
            part = [b.index for b in self.buckets
                    if b.partitioned and b.slots[0].index in seg.params]
            self.bucket_of_seg.append(part[0] if part else None)
        order = [b for b in self.bucket_of_seg if b is not None]
        self.trace = order + order[::-1]
        self.use_pos = {("fwd", b): p for p, b in enumerate(order)}
        self.use_pos.update({("bwd", b): 2 * len(order) - 1 - p for p, b in enumerate(order)})
        self.last_gather: int | None = None  # gathers start in the order asked, step-wide
        numel = {b.index: b.numel for b in self.buckets}
        uses = stage3_uses(self.trace, numel,
                           prefetch_numel=self.zero.stage3_prefetch_bucket_size,
                           max_live_numel=self.zero.stage3_max_live_parameters,
                           max_reuse_distance=self.zero.stage3_max_reuse_distance)
        # each gather named for the use it serves, as the plan names it
        self.gather_tags = gather_uses(uses, self.trace)
        return uses

    # -- passes ------------------------------------------------------------------------------

    def build(self) -> None:
        s, plan = self.stage, self.plan
        last: int | None = None
        reduces: list[int] = []
        for op, k in self.step_plan.pass_order():
            if op == "forward":
                refs = [(s - 1, names.pipe_op("send_act", k))] if s > 0 else []
                last, refs = self._handoff("forward", k, last, refs)
                last = self._forward(k, last, refs)
                if self.micro_batch_s:
                    last = plan.add(s, names.overhead("loss", k), "overhead", "compute",
                                    self.micro_batch_s, [last])
                if s < self.pp - 1:
                    plan.add(s, names.pipe_op("send_act", k), "send", "comm:pp",
                             self.send_seconds(self.send_bytes, s), [last],
                             nbytes=self.send_bytes)
            else:
                refs = [(s + 1, names.pipe_op("send_grad", k))] if s < self.pp - 1 else []
                last, refs = self._handoff("backward", k, last, refs)
                last = self._backward(k, last, refs, reduces)
                if s > 0:
                    plan.add(s, names.pipe_op("send_grad", k), "send", "comm:pp",
                             self.send_seconds(self.recv_bytes, s - 1), [last],
                             nbytes=self.recv_bytes)
        if self.step_s:
            last = plan.add(s, names.overhead("step"), "overhead", "compute", self.step_s,
                            [last, reduces[-1] if reduces else None])
        if self.loss_broadcast_s:
            last = plan.add(s, names.overhead("loss-broadcast"), "overhead", "compute",
                            self.loss_broadcast_s, [last])
        self._step(last, reduces[-1] if reduces else None)

    def _handoff(self, kind: str, k: int, last: int | None, refs: list[tuple[int, str]]
                 ) -> tuple[int | None, list[tuple[int, str]]]:
        """On a calibrated CPU host's pipeline stage, the time the stage's actor takes to get
        a pass going once its input is there (the received tensor handed to the event loop,
        the pass to the compute thread): a task of its own, so the pass's span stays its
        compute, as the engine records it. Returns the pass's new predecessor and refs."""
        if not self.op_s:
            return last, refs
        return self.plan.add(self.stage, names.handoff(kind, k), "handoff", "compute",
                             self.op_s, [last], refs), []

    def _pass_chunked(self, k: int, backward: bool) -> bool:
        if self.partitioned or self.tp > 1:
            return True
        reduces_here = self.dp > 1 and (self.reduce_every_mb or k == self.m - 1)
        return backward and reduces_here and len(self.buckets) > 1

    def _forward(self, k: int, last: int | None, refs: list[tuple[int, str]]) -> int:
        s, plan = self.stage, self.plan
        if not self._pass_chunked(k, backward=False):
            return plan.add(s, names.forward(k), "forward", "compute",
                            sum(g.forward_s for g in self.segments), [last], refs,
                            flops=self.step_plan.task(names.forward(k)).flops)
        for j, seg in enumerate(self.segments):
            first = refs if j == 0 else []
            last, first = self._fetch("forward", k, j, last, first)
            waits = self._gathers(k, j, "fwd", last)
            last = plan.add(s, names.forward(k, seg.label), "forward", "compute", seg.forward_s,
                            [last, *waits], first)
            if self.tp_s and seg.layer is not None and (
                    j == len(self.segments) - 1 or self.segments[j + 1].layer != seg.layer):
                last = plan.add(s, names.tp("fwd", k, seg.layer), "tp", "comm:tp",
                                self.tp_s, [last], nbytes=2 * self.act_bytes)
        assert last is not None
        return last

    def _backward(self, k: int, last: int | None, refs: list[tuple[int, str]],
                  reduces: list[int]) -> int:
        s, plan = self.stage, self.plan
        reduce_now = self.dp > 1 and (self.reduce_every_mb or k == self.m - 1)
        mb = k if self.reduce_every_mb and self.m > 1 else None
        if not self._pass_chunked(k, backward=True):
            last = plan.add(s, names.backward(k), "backward", "compute",
                            sum(g.backward_s for g in self.segments), [last], refs,
                            flops=self.step_plan.task(names.backward(k)).flops)
            if reduce_now:
                for b in self.buckets:
                    last = self._hand_off(k, b, last)
                    reduces.append(self._reduce(b, mb, last, reduces))
            return last
        n = len(self.segments)
        for j in range(n - 1, -1, -1):
            seg = self.segments[j]
            first = refs if j == n - 1 else []
            last, first = self._fetch("backward", k, j, last, first)
            waits = self._gathers(k, j, "bwd", last)
            last = plan.add(s, names.backward(k, seg.label), "backward", "compute",
                            seg.backward_s, [last, *waits], first)
            chunk = last
            if self.release_s and self.bucket_of_seg[j] is not None:
                last = plan.add(s, names.release(k, seg.label), "backward", "compute",
                                self.release_s, [last])
            if self.tp_s and seg.layer is not None and (
                    j == 0 or self.segments[j - 1].layer != seg.layer):
                last = plan.add(s, names.tp("bwd", k, seg.layer), "tp", "comm:tp",
                                self.tp_s, [last], nbytes=2 * self.act_bytes)
            if reduce_now:
                for b in self.ready_after.get(j, []):
                    if self.bucket_s:
                        chunk = last = self._hand_off(k, b, last)
                    reduces.append(self._reduce(b, mb, chunk, reduces))
        assert last is not None
        return last

    def _hand_off(self, k: int, bucket: BucketPlan, last: int) -> int:
        """The engine handing a full bucket to its reducer on the backward's thread (a task of
        the backward, ``bucket_s``), before the bucket's reduce can start."""
        if not self.bucket_s:
            return last
        return self.plan.add(self.stage, names.hand_off(k, bucket.index),
                             "backward", "compute", self.bucket_s, [last])

    def _reduce(self, bucket: BucketPlan, mb: int | None, after: int,
                reduces: list[int]) -> int:
        nbytes = bucket.numel * self.comm_elem
        seconds, share, slowed = self.reduce_seconds(nbytes)
        return self.plan.add(self.stage, names.reduce(bucket.index, mb), "reduce", "comm:dp",
                             seconds, [after, reduces[-1] if reduces else None], nbytes=nbytes,
                             interference=share, slowdown=slowed)

    def _fetch(self, kind: str, k: int, j: int, last: int | None,
               refs: list[tuple[int, str]]) -> tuple[int | None, list[tuple[int, str]]]:
        """ZeRO-3 on a calibrated CPU host: when segment ``j``'s use in a ``kind`` pass hands
        anything to the parameter fetcher (a bucket to wait for, or gathers to start), as the
        engine's hooks do then, the hand-off as a task of the pass. Returns the segment's new
        predecessor and refs."""
        if not self.fetch_s or self.uses is None:
            return last, refs
        bucket = self.bucket_of_seg[j]  # set with the uses
        if bucket is None:
            return last, refs
        pos = self.use_pos[("fwd" if kind == "forward" else "bwd", bucket)]
        if not (self.uses.launched[pos] or self.uses.gathered_for[pos]):
            return last, refs
        return self.plan.add(self.stage, names.fetch(kind, k, self.segments[j].label), kind,
                             "compute", self.fetch_s, [last], refs), []

    def _gathers(self, k: int, j: int, direction: str, before: int | None) -> list[int]:
        """ZeRO-3: starts the all-gathers launched when segment ``j`` is used (once ``before``,
        the task ahead of the use, is done) and returns the gathers the segment waits for."""
        if self.uses is None:
            return []
        bucket = self.bucket_of_seg[j]  # set with the uses
        if bucket is None:
            return []
        s, plan = self.stage, self.plan
        pos = self.use_pos[(direction, bucket)]
        for b, tag in self.gather_tags[pos]:
            deps: list[int | None] = [before, self.last_gather]
            if self.offload_param:
                shard = math.ceil(self.buckets[b].numel / self.dp) * self.param_elem
                deps.append(plan.add(s, names.copy("h2d", b, tag, names.micro_batch(k)), "copy",
                                     "copy:h2d", costs.copy_seconds(shard, self.hw), [before],
                                     nbytes=shard))
            nbytes = self.buckets[b].numel * self.param_elem
            self.last_gather = plan.add(s, names.gather(b, tag, k), "gather", "comm:dp",
                                        self._collective("all_gather", nbytes), deps,
                                        nbytes=nbytes)
        return [plan.index[(s, names.gather(b, direction, k))]
                for b in self.uses.gathered_for[pos]]

    # -- optimizer -----------------------------------------------------------------------------

    def _step(self, last: int | None, last_reduce: int | None) -> None:
        s, plan = self.stage, self.plan
        after = [last, last_reduce]
        whole = [b for b in self.buckets if not b.partitioned]
        finished: list[int | None]
        if self.offload_opt:
            host = "host" if self.gpu else "compute"
            finished = []
            for b in self.buckets:
                shard = self._shard(b.numel)
                deps: list[int | None] = list(after)
                if self.gpu:
                    deps = [plan.add(s, names.copy("d2h", b.index), "copy", "copy:d2h",
                                     costs.copy_seconds(shard * self.comm_elem, self.hw), after,
                                     nbytes=shard * self.comm_elem)]
                stepped = plan.add(s, names.optimizer_step(b.index), "optimizer", host,
                                   costs.optimizer_seconds(shard, self.hw, on_host=True), deps,
                                   nbytes=shard * 16)
                if self.gpu:
                    stepped = plan.add(s, names.copy("h2d", b.index), "copy", "copy:h2d",
                                       costs.copy_seconds(shard * self.param_elem, self.hw),
                                       [stepped], nbytes=shard * self.param_elem)
                finished.append(stepped)
        else:
            numel = sum(self._shard(b.numel) for b in self.buckets)
            finished = [plan.add(s, names.OPTIMIZER_STEP, "optimizer", "compute",
                                 self._optimizer_seconds(numel), after, nbytes=numel * 16)]
        if self.stage_no >= 1 and self.dp > 1:
            for b in whole:
                nbytes = b.numel * self.param_elem
                plan.add(s, names.allgather(b.index), "allgather", "comm:dp",
                         self._collective("all_gather", nbytes), finished, nbytes=nbytes)


def build_plan(work: Workload, cfg: Any, layout: Layout, hw: Any) -> SimPlan:
    """The step of ``work`` trained with ``cfg`` (a loaded FlowtrainConfig whose batch rule was
    applied for ``layout.dp`` data-parallel ranks) on ``layout`` with hardware ``hw``."""
    if not work.params:
        raise ValueError(f"model {work.name!r} has no trainable parameters to plan a step for")
    zero = cfg.zero_optimization
    if layout.pp > 1 and zero.stage >= 2:
        raise ValueError(f"ZeRO stage {zero.stage} with pp {layout.pp}: gradients are "
                         f"partitioned while the pipeline still accumulates them; use "
                         f"zero_optimization.stage 0 or 1 with pipeline parallelism")
    dtype = PRECISION_DTYPE[cfg.precision]
    comm_dtype = str(cfg.communication_dtype).removeprefix("torch.")
    comm_elem = DTYPE_BYTES.get(comm_dtype, 4)
    micro_batch = int(cfg.train_micro_batch_size_per_gpu)
    micro_batches = int(cfg.gradient_accumulation_steps)
    weights_all = [_numel(p[1]) for p in work.params]
    total_weight = sum(weights_all)
    if total_weight == 0:
        raise ValueError(f"model {work.name!r} has only empty parameters")
    plan = Tasks()
    step_plans = []
    if work.stage_params:
        if len(work.stage_params) != layout.pp:
            raise ValueError(f"the run was split into {len(work.stage_params)} pipeline stages; "
                             f"plan it with pp {len(work.stage_params)}, not {layout.pp}")
        split = [list(indices) for indices in work.stage_params]
    else:
        split = split_stages(work.params, layout.pp)
    for s, indices in enumerate(split):
        params = [work.params[i] if work.split_for_tp else tp_shard(work.params[i], layout.tp)
                  for i in indices]
        weights = [weights_all[i] for i in indices]
        if work.stage_flops_per_sample:
            flops = work.stage_flops_per_sample[s]
        else:
            flops = work.forward_flops_per_sample * sum(weights) / total_weight
        builder = _StageBuilder(plan, s, layout=layout, hw=hw, cfg=cfg, work=work, params=params,
                                weights=weights, total_weight=total_weight,
                                stage_flops=flops, micro_batches=micro_batches,
                                micro_batch=micro_batch, dtype=dtype, comm_elem=comm_elem,
                                comm_dtype=comm_dtype)
        builder.build()
        step_plans.append(builder.step_plan)
    samples = micro_batch * micro_batches * layout.dp
    notes = []
    if (layout.tp > 1 or layout.pp > 1) and not (work.seq_len and work.hidden) and \
            not work.layer_input_bytes_per_sample and \
            not (layout.tp == 1 and work.stage_output_bytes_per_sample):
        notes.append("activation size unknown: pipeline sends and TP all-reduces cost latency "
                     "only")
    cpu = getattr(hw, "kind", "gpu") == "cpu"
    interference = float(getattr(hw, "comm_compute_interference", 0.0)) if cpu else 0.0
    slowdown = float(getattr(hw, "compute_comm_slowdown", 1.0)) if cpu else 1.0
    return SimPlan(plan.resolve(), layout, work.name, micro_batch, micro_batches, dtype,
                   zero.stage, samples, samples * work.seq_len,
                   3.0 * work.forward_flops_per_sample * samples, interference,
                   tuple(step_plans), tuple(notes), slowdown)
