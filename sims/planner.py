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

__all__ = ["DEFAULT_BUCKET_BYTES", "DTYPE_BYTES", "PIPELINE_JOB_RANKS", "PRECISION_DTYPE",
           "Layout", "ParamSpec", "SimPlan", "Workload", "build_plan", "config_bucket_numel",
           "layer_of", "module_units", "one_f_one_b", "pipeline_tasks", "split_stages",
           "stage3_uses"]

# The engine's bucket size when the config sets none (flowtrain.api.DEFAULT_BUCKET_BYTES):
# DeepSpeed's 5e8-element default would put a whole model in one bucket, leaving no overlap.
DEFAULT_BUCKET_BYTES = 25 * 2**20
# ranks of the pipeline job `flowtrain calibrate` measures pipeline hand-offs on
PIPELINE_JOB_RANKS = 2


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


class _StageBuilder:
    """Builds one pipeline stage's tasks into a shared ``Tasks``."""

    def __init__(self, plan: Tasks, stage: int, *, layout: Layout, hw: Any, cfg: Any,
                 work: Workload, params: list[ParamSpec], weights: list[int], total_weight: int,
                 stage_flops: float, micro_batches: int, micro_batch: int, dtype: str,
                 comm_elem: int, comm_dtype: str) -> None:
        self.plan, self.stage, self.layout, self.hw = plan, stage, layout, hw
        self.zero = cfg.zero_optimization
        self.m, self.mb = micro_batches, micro_batch
        self.dp, self.tp, self.pp = layout.dp, layout.tp, layout.pp
        self.stage_no = self.zero.stage
        self.partitioned = self.stage_no == 3 and self.dp > 1
        self.params = params
        self.comm_elem = comm_elem
        self.param_elem = params[0][3] if params else 2
        self.gpu = getattr(hw, "kind", "gpu") == "gpu"
        self.clip = bool(cfg.gradient_clipping and cfg.gradient_clipping > 0)
        self.fp16 = cfg.precision == "fp16"
        # A CPU host calibrated with the engine's own costs (float32: what was measured)
        self.engine = None if self.gpu or dtype != "float32" else getattr(hw, "engine", None)
        ranks_here = layout.devices_per_node
        self.threads = costs.rank_threads(ranks_here, hw) if not self.gpu else 1
        # ranks sharing this host's cores compute, and stream memory, slower (1 on GPUs)
        self.slowdown = costs.compute_slowdown(ranks_here, hw) if not self.gpu else 1.0
        self.memory_slowdown = costs.compute_slowdown(ranks_here, hw, memory=True) \
            if not self.gpu else 1.0
        # what a launched engine job on this many ranks took over the isolated measurements
        # ... and what its other work takes from each step's forwards and backwards, spread
        # over the step's micro-batches
        engine = self.engine
        self.forward_factor = engine.factor(ranks_here, "forward") if engine else 1.0
        self.backward_factor = engine.factor(ranks_here, "backward") if engine else 1.0
        self.forward_extra_s = engine.factor(ranks_here, "forward_s") / micro_batches \
            if engine else 0.0
        self.backward_extra_s = engine.factor(ranks_here, "backward_s") / micro_batches \
            if engine else 0.0
        self.optimizer_factor = self.engine.factor(ranks_here, "optimizer") \
            if self.engine else 1.0
        # between a micro-batch's forward and backward, and per step (flush, bookkeeping),
        # as the launched job showed; a pipeline engine computes the loss inside its forward
        self.micro_batch_s = self.engine.factor(ranks_here, "micro_batch_s") \
            if self.engine is not None and self.pp == 1 else 0.0
        self.step_s = self.engine.factor(ranks_here, "step_s") \
            if self.engine is not None and self.pp == 1 else 0.0
        self.gloo_s = self.engine.factor(ranks_here, "gloo_s") \
            if self.engine is not None and self.dp > 1 else 0.0
        # ZeRO-3's hooks: each module use handed to the parameter fetcher, and each
        # partitioned module's backward bookkeeping, as the launched ZeRO-3 job showed them
        self.fetch_s = self.engine.factor(ranks_here, "zero3_fetch_s") \
            if self.engine is not None and self.partitioned else 0.0
        self.release_s = self.engine.factor(ranks_here, "zero3_backward_s") \
            if self.engine is not None and self.partitioned else 0.0
        # each full bucket's hand-off to the reducer, and each reduce's own overhead, as the
        # launched job's small-bucket run showed them
        self.bucket_s, self.reduce_s = (
            self.engine.factor(ranks_here, kind) if self.engine is not None and self.dp > 1
            else 0.0 for kind in ("bucket_s", "reduce_s"))
        # calibration timed a data-parallel group's collectives with only its ranks on the
        # host; where more ranks share it (pipeline stages, tensor-parallel groups), the
        # collective's copying and summing wait for cores as compute does
        self.comm_crowding = self.slowdown / costs.compute_slowdown(self.dp, hw) \
            if self.engine is not None and 1 < self.dp < ranks_here else 1.0
        # a pipeline stage's hand-offs per instruction, and per message delivered, as the
        # 2-rank pipeline job measured them: thread hand-offs that wait for a core, so with more
        # ranks sharing the host they take as much longer as its compute does
        pipelined = self.engine is not None and self.pp > 1
        crowding = self.slowdown / costs.compute_slowdown(PIPELINE_JOB_RANKS, hw) \
            if pipelined else 1.0
        self.op_s = self.engine.pipeline_op_s * crowding if pipelined else 0.0
        self.message_s = self.engine.pipeline_message_s * crowding if pipelined else 0.0
        # model-parallel clipping sums the gradient norm over every rank (one all-reduce of
        # the world), and the pipeline broadcasts the step's loss from the last stage
        self.world_norm_s = costs.collective_seconds(
            "all_reduce", 8, layout.world_size, hw) + self.engine.factor(ranks_here, "gloo_s") \
            if pipelined and self.clip else 0.0
        self.loss_broadcast_s = costs.collective_seconds("broadcast", 4, self.pp, hw) \
            if pipelined else 0.0
        # the engine reduces over its shared-memory channel when every rank of a
        # data-parallel-only job is a CPU rank on one host (flowtrain.engine.FlowtrainEngine)
        self.channel = (self.engine is not None and bool(self.engine.channel)
                        and layout.nodes == 1 and self.tp == 1 and self.pp == 1 and self.dp > 1
                        and cfg.flowtrain.data_channel != "torch")
        self.offload_opt = self.zero.offloads_optimizer and self.stage_no >= 1
        self.offload_param = self.partitioned and self.zero.offloads_params and self.gpu
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
        self.reduce_op = "reduce_scatter" if self.stage_no >= 2 else "all_reduce"

    def _cost_segments(self, work: Workload, weights: list[int], total_weight: int, dtype: str,
                       cfg: Any) -> None:
        """Each segment's forward and backward seconds: one roofline op per parameter (so the
        efficiency curve sees matmul-sized ops), FLOPs shared by (unsharded) parameter count.
        On a host with the engine's measured costs, one op per module instead (a Linear's
        weight and bias are one call), timed as the engine runs it."""
        scale = self.stage_flops * self.mb / max(1, sum(weights)) / self.tp
        act_scale = work.activation_bytes_per_sample * self.mb / total_weight / self.tp
        recompute = self.pp > 1 and cfg.pipeline.activation_checkpoint_interval > 0
        if self.engine is not None:
            self._cost_engine_segments(work, weights, recompute)
            return
        for seg in self.segments:
            for i in seg.params:
                numel = _numel(self.params[i][1])
                flops = weights[i] * scale
                moved = numel * self.param_elem + weights[i] * act_scale
                fwd = costs.compute_seconds(flops, moved, dtype, self.hw)
                bwd = costs.compute_seconds(2 * flops, 2 * moved, dtype, self.hw)
                seg.forward_s += fwd
                seg.backward_s += bwd + (fwd if recompute else 0.0)

    def _cost_engine_segments(self, work: Workload, weights: list[int], recompute: bool) -> None:
        """Forward and backward per module at the rank's measured pass rates (its thread count,
        slowed by the ranks sharing the host). ZeRO 2-3 backward also adds each gradient into a
        pooled bucket buffer (``GradBuckets`` transient mode): a zeroed buffer, then a read of
        the gradient and a read-modify-write of the buffer, 16 bytes per element. The forward's
        other ops (its census: norms, activations, attention, ...) at their measured costs are
        shared among the modules as their FLOPs are."""
        census = self._stage_census(work)
        scale = (self.stage_flops - census["attention_flops_per_sample"]) * self.mb / \
            max(1, sum(weights)) / self.tp
        stash_bytes = 16.0 if self.stage_no >= 2 and self.dp > 1 else 0.0
        other = self._other_ops(census)
        for seg in self.segments:
            modules: dict[str, list[int]] = {}
            for i in seg.params:
                modules.setdefault(self.params[i][0].rpartition(".")[0], []).append(i)
            for members in modules.values():
                share = sum(weights[i] for i in members) / max(1, sum(weights))
                flops = sum(weights[i] for i in members) * scale
                numel = sum(_numel(self.params[i][1]) for i in members)
                weight_bytes = 4.0 * numel  # the engine's costs are float32's
                fwd = (costs.pass_seconds("forward", flops, self.threads, self.hw,
                                          weight_bytes) +
                       other["forward"] * share) * self.slowdown * self.forward_factor
                bwd = (costs.pass_seconds("backward", 2 * flops, self.threads, self.hw,
                                          weight_bytes) +
                       other["backward"] * share) * self.slowdown * self.backward_factor + \
                    numel * stash_bytes / self.hw.memory_bandwidth * self.memory_slowdown
                seg.forward_s += fwd
                seg.backward_s += bwd + (fwd if recompute else 0.0)
        if self.segments:
            self.segments[0].forward_s += self.forward_extra_s
            self.segments[-1].backward_s += self.backward_extra_s

    def stage_share(self, work: Workload) -> float:
        """This stage's part of the model's forward FLOPs (1 without pipeline stages)."""
        total = work.forward_flops_per_sample
        return self.stage_flops / total if total > 0 else 1.0

    def _stage_census(self, work: Workload) -> dict[str, Any]:
        """This pipeline stage's census of one sample's forward (``Workload.census_fields``):
        its own where the run recorded one per stage, else its FLOPs' share of the model's."""
        if work.stage_census:
            return {"op_census": (), "attention_calls": 0.0, "attention_flops_per_sample": 0.0,
                    **work.stage_census[self.stage]}
        share = self.stage_share(work)
        return {"op_census": tuple((cls, calls * share, elements * share)
                                   for cls, calls, elements in work.op_census),
                "attention_calls": work.attention_calls * share,
                "attention_flops_per_sample": work.attention_flops_per_sample * share}

    def _other_ops(self, stage: dict[str, Any]) -> dict[str, float]:
        """Seconds of this stage's census ops (``_stage_census``) in one micro-batch, per pass
        kind, at the rank's thread count (split evenly over tensor-parallel ranks)."""
        if not (stage["op_census"] or stage["attention_calls"]) or self.engine is None:
            return {"forward": 0.0, "backward": 0.0}
        census = [(cls, calls / self.tp, elements * self.mb / self.tp)
                  for cls, calls, elements in stage["op_census"]]
        if stage["attention_calls"]:
            census.append(("attention", stage["attention_calls"] / self.tp,
                           stage["attention_flops_per_sample"] * self.mb / self.tp))
        return {kind: self.engine.op_seconds(self.threads, kind, census)
                for kind in ("forward", "backward")}

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
        return stage3_uses(self.trace, numel,
                           prefetch_numel=self.zero.stage3_prefetch_bucket_size,
                           max_live_numel=self.zero.stage3_max_live_parameters,
                           max_reuse_distance=self.zero.stage3_max_reuse_distance)

    # -- durations ---------------------------------------------------------------------------

    def _collective(self, op: str, nbytes: float) -> float:
        """A gloo/NCCL collective over the data-parallel group; on a calibrated CPU host, plus
        what such a call took beside a live engine over the bare ranks' figure, and slowed
        as compute is where more ranks than the group's share the host."""
        return costs.collective_seconds(op, nbytes, self.dp, self.hw,
                                        nodes=self.layout.dp_nodes) * self.comm_crowding + \
            self.gloo_s

    def _shard(self, numel: int) -> int:
        return math.ceil(numel / self.dp) if self.stage_no >= 1 else numel

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
                             costs.p2p_seconds(self.send_bytes, self.hw,
                                               self.layout.pipe_link_inter_node(s))
                             + self.message_s, [last], nbytes=self.send_bytes)
            else:
                refs = [(s + 1, names.pipe_op("send_grad", k))] if s < self.pp - 1 else []
                last, refs = self._handoff("backward", k, last, refs)
                last = self._backward(k, last, refs, reduces)
                if s > 0:
                    plan.add(s, names.pipe_op("send_grad", k), "send", "comm:pp",
                             costs.p2p_seconds(self.recv_bytes, self.hw,
                                               self.layout.pipe_link_inter_node(s - 1))
                             + self.message_s, [last], nbytes=self.recv_bytes)
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
        seconds = costs.channel_seconds(self.reduce_op, nbytes, self.dp, self.hw) \
            if self.channel else None
        share = slowed = None
        if seconds is None:
            seconds = self._collective(self.reduce_op, nbytes)
        else:
            assert self.engine is not None
            share, slowed = self.engine.channel_interference, self.engine.channel_slowdown
        if self.engine is not None:
            # the reducer then scales the sum by 1 / dp: a multiply over the bucket (read +
            # write), or an add of the scattered shard into the gradient shard (2 reads + write)
            scaled = nbytes * 2 if self.reduce_op == "all_reduce" else nbytes / self.dp * 3
            seconds += scaled / self.hw.memory_bandwidth * self.memory_slowdown
        seconds += self.reduce_s
        return self.plan.add(self.stage, names.reduce(bucket.index, mb), "reduce", "comm:dp",
                             seconds, [after, reduces[-1] if reduces else None], nbytes=nbytes,
                             interference=share, slowdown=slowed)

    def _fetch(self, kind: str, k: int, j: int, last: int | None,
               refs: list[tuple[int, str]]) -> tuple[int | None, list[tuple[int, str]]]:
        """ZeRO-3 on a calibrated CPU host: when segment ``j``'s use in a ``kind`` pass hands
        anything to the parameter fetcher (a bucket to wait for, or gathers to start), as the
        engine's hooks do then, the hand-off as a task of the pass. Returns the segment's new
        predecessor and refs."""
        if not self.fetch_s or self.uses is None or self.bucket_of_seg[j] is None:
            return last, refs
        pos = self.use_pos[("fwd" if kind == "forward" else "bwd", self.bucket_of_seg[j])]
        if not (self.uses.launched[pos] or self.uses.gathered_for[pos]):
            return last, refs
        return self.plan.add(self.stage, names.fetch(kind, k, self.segments[j].label), kind,
                             "compute", self.fetch_s, [last], refs), []

    def _gathers(self, k: int, j: int, direction: str, before: int | None) -> list[int]:
        """ZeRO-3: starts the all-gathers launched when segment ``j`` is used (once ``before``,
        the task ahead of the use, is done) and returns the gathers the segment waits for."""
        if self.uses is None or self.bucket_of_seg[j] is None:
            return []
        s, plan = self.stage, self.plan
        pos = self.use_pos[(direction, self.bucket_of_seg[j])]
        for b in self.uses.launched[pos]:
            # a gather serves the bucket's next use from here on
            use = next(p for p in range(pos, len(self.trace)) if self.trace[p] == b)
            tag = "fwd" if use < len(self.trace) // 2 else "bwd"
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

    def _optimizer_seconds(self, numel: int) -> float:
        """The optimizer step over ``numel`` stepped elements. With the engine's measured costs
        it is what the engine's step does: its fused Adam called once per parameter (stage 0)
        or per bucket shard (ZeRO), a gradient-norm pass and a clip multiply when clipping
        (read, then read + write), and zeroing the gradients (whole buckets at stages 0-1, the
        shards at 2-3), at the compute slowdown of ranks sharing the host."""
        if self.engine is None:
            return costs.optimizer_seconds(numel, self.hw)
        calls = len(self.params) if self.stage_no == 0 else len(self.buckets)
        kernel = costs.optimizer_seconds(numel, self.hw, calls=calls,
                                         memory_slowdown=self.memory_slowdown)
        whole = sum(b.numel for b in self.buckets)
        zeroed = whole if self.stage_no <= 1 or self.dp == 1 else numel
        passes = zeroed * self.comm_elem + (numel * 12 if self.clip else 0)
        seconds = (kernel + passes / self.hw.memory_bandwidth * self.memory_slowdown) * \
            self.optimizer_factor
        if self.stage_no >= 1 and self.dp > 1 and (self.clip or self.fp16):
            # ZeRO's global gradient norm: one blocking all-reduce of a float64 sum of squares
            seconds += self._collective("all_reduce", 8)
        return seconds + self.world_norm_s

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
