"""One pipeline stage's step as a task graph at the grain the simulator prices it: the step plan
(``build_step_plan``) with its passes cut into segments where communication overlaps them, each
task saying what decides its time (``GraphTask.cost``) but not what that time is. The simulator
prices the graph (``sims.pricing``) and its executor runs it.

Task names (the first two path parts are the name the engine records for a span):

- ``forward/mb{k}``, ``backward/mb{k}``: one micro-batch's pass on a stage; when the pass is
  split (ZeRO-3 modules, TP layers, buckets that become ready during backward) its pieces are
  ``forward/mb{k}/<segment>`` (segment: ``layer{l}``, ``embed``, ``head`` or a module name).
  Where the engine's own overheads are modelled as tasks, ZeRO-3's hooks add
  ``<pass>/mb{k}/<segment>/fetch`` (the use handed to the parameter fetcher) and
  ``backward/mb{k}/<segment>/release``.
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
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

from flowtrain.plan import names
from flowtrain.plan.buckets import BucketPlan, plan_buckets, plan_units
from flowtrain.plan.schedule import handover, stage_ops, stage_passes
from flowtrain.plan.spec import TrainingSpec, plan_step
from flowtrain.plan.stage3 import Stage3Uses, stage3_uses
from flowtrain.plan.step_plan import StepPlan, gather_uses, pass_flops
from flowtrain.plan.zero_stage import partitions_parameters, shards_optimizer
from sims.task_graph import GraphColumns, GraphTask, TaskGraph
from sims.workload import ParamSpec, layer_of, module_units

__all__ = ["COSTS", "OVERHEADS", "GraphColumns", "GraphTask", "Segment", "StageLayout",
           "TaskGraph", "bare_pipeline", "link_of", "segments"]

# What decides a task's time (``GraphTask.cost``), besides the engine's overheads below:
# "forward" / "backward": a pass over segment ``arg`` of the stage (-1: every segment);
# "send": a pipeline send of ``nbytes`` from stage ``arg``; "reduce": a gradient bucket's
# reduce of ``nbytes``; "all_gather": a data-parallel all-gather of ``nbytes``; "tp": a layer's
# tensor-parallel collectives of one pass (``arg`` 0: forward, 1: backward); "copy": a
# host<->device copy of ``nbytes``; "optimizer": the step over ``arg`` elements;
# "host_optimizer": an offloaded shard's step of ``arg`` elements on the host.
COSTS = ("forward", "backward", "send", "reduce", "all_gather", "tp", "copy", "optimizer",
         "host_optimizer")
# The engine's own work around the model's, each a task where the pricing models it as one
# (on a calibrated CPU host; elsewhere it is part of the passes and no task is laid out):
# "loss": between a micro-batch's forward and backward; "step": per-step bookkeeping;
# "loss_broadcast": the pipeline's loss from the last stage; "pass_start": a pipeline stage's
# actor getting a pass going once its input is there; "fetch": a ZeRO-3 use handed to the
# parameter fetcher; "release": a partitioned module's backward bookkeeping;
# "bucket_hand_off": a full bucket handed to the reducer on the backward's thread.
OVERHEADS = ("loss", "step", "loss_broadcast", "pass_start", "fetch", "release",
             "bucket_hand_off")


@dataclass
class Segment:
    """A piece of a stage's forward order: one ZeRO-3 module, or a layer and the parts before
    (``embed``) and after (``head``) the layers."""

    label: str
    params: list[int]  # stage-local parameter indices
    layer: int | None


def _size(param: ParamSpec) -> int:
    return math.prod(param[1])


def segments(params: Sequence[ParamSpec], stage3: bool, blocks: bool = False) -> list[Segment]:
    """A stage's forward order cut into pieces: one per module for ZeRO-3 (each is gathered
    before it runs), otherwise, and for FSDP-style sharding (``blocks``: each transformer block
    is one unit), one per layer plus the parts before and after the layers."""
    if stage3 and not blocks:
        return [Segment(params[u[0]][0].rpartition(".")[0] or params[u[0]][0], u,
                        layer_of(params[u[0]][0])) for u in module_units(params)]
    out: list[Segment] = []
    seen_layer = False
    for i, p in enumerate(params):
        n = layer_of(p[0])
        seen_layer = seen_layer or n is not None
        label = names.layer(n) if n is not None else ("head" if seen_layer else "embed")
        if out and out[-1].label == label:
            out[-1].params.append(i)
        else:
            out.append(Segment(label, [i], n))
    return out


def link_of(kind: str, stage: int, stages: int) -> int:
    """The stage boundary a pipeline send of ``stage`` crosses, as the pricing takes it (a send
    from stage ``arg`` to ``arg + 1``): the ring's wrap (interleaved) is the last stage's."""
    return min(stage, stages - 1) if kind == "send_act" else \
        (stage - 1 if stage > 0 else stages - 1)


def bare_pipeline(stages: int, micro_batches: int,
                  virtual_stages: int = 1) -> tuple[GraphTask, ...]:
    """A bare 1F1B pipeline (no data parallelism): each stage's passes and sends; with
    ``virtual_stages`` > 1, interleaved 1F1B, each pass one model chunk's."""
    schedule = "interleaved" if virtual_stages > 1 else "1f1b"
    out = TaskGraph()
    for s in range(stages):
        last: int | None = None
        refs: list[tuple[int, str]] = []
        for op in stage_ops(schedule, s, stages, micro_batches, virtual_stages):
            if op.kind in ("recv_act", "recv_grad"):
                peer, chunk = handover(op.kind, s, stages, op.chunk)
                sent = "send_act" if op.kind == "recv_act" else "send_grad"
                refs = [(peer, names.pipe_op(sent, op.mb, chunk))]
            elif op.kind in names.PASSES:
                last = out.add(s, op.task_name, op.kind, "compute", op.kind, [last], refs,
                               chunk=op.chunk)
                refs = []
            else:
                out.add(s, op.task_name, "send", "comm:pp", "send", [last],
                        arg=link_of(op.kind, s, stages), chunk=op.chunk)
    return out.resolve()


class StageLayout:
    """Lays out pipeline stage ``stage``'s tasks into a shared ``TaskGraph``.

    ``params`` are the stage's parameters as one rank holds them (tensor-parallel shards);
    ``spec`` is the run's decisions (``flowtrain.plan.spec``, in the planner's variant for a
    framework that decides otherwise); ``forward_flops`` one micro-batch's
    forward on the rank; ``act_bytes`` one layer's output (what a TP all-reduce sums),
    ``send_bytes`` / ``recv_bytes`` what goes to the next stage and (its gradient) to the
    previous one; ``overheads`` the ``OVERHEADS`` laid out as tasks of their own.
    ``param_gather_overlap`` (ZeRO 1-2, Megatron's ``--overlap-param-gather``): the all-gather
    of the updated parameters that follows the optimizer step runs under the next step's
    first forward instead, each bucket gathered before the first segment that reads it; laid
    out at the start of the step, so the step is the steady state's period.
    ``fsdp`` (ZeRO-3): PyTorch FSDP's units instead of DeepSpeed's: each transformer block (and
    what comes before and after the blocks) is one flat unit of every parameter it holds, the
    next unit's all-gather starts when a unit starts, and a unit is resharded after its
    forward unless its backward comes next.
    ``blocking_p2p``: the stage waits for each pipeline send to complete before its next pass
    (Megatron's and DeepSpeed's 1F1B wait on their point-to-point requests), instead of sending
    while it computes.
    ``shared_params`` (ZeRO, CPU ranks of one host): the ranks keep the host's one copy of the
    parameters in shared memory, so nothing is all-gathered after the step and a stage-3 use
    gathers nothing.
    ``chunk_params`` (interleaved 1F1B): the stage-local parameter indices of each of its model
    chunks, in chunk order; each pass is then one chunk's, laid out as its segments.
    ``split_rows`` (ZeRO 0, no pipeline or TP): tied embedding weights whose gradient the engine
    splits (``flowtrain.engine.embedding_rows``), by stage-local index, with the distinct rows a
    rank exchanges a step. Such a weight's gradient is first in gradient order, its bucket
    reduced after the head's backward; the rows' all-gather (``reduce/rows``) follows the
    reduces."""

    def __init__(self, graph: TaskGraph, stage: int, *, params: list[ParamSpec],
                 spec: TrainingSpec, forward_flops: float,
                 gpu: bool, act_bytes: float, send_bytes: float, recv_bytes: float,
                 overheads: Collection[str] = (),
                 chunk_params: Sequence[Sequence[int]] | None = None,
                 param_gather_overlap: bool = False, fsdp: bool = False,
                 blocking_p2p: bool = False, shared_params: bool = False,
                 split_rows: Mapping[int, float] | None = None) -> None:
        unknown = set(overheads) - set(OVERHEADS)
        if unknown:
            raise ValueError(f"unknown engine overheads {sorted(unknown)}; known: "
                             f"{', '.join(OVERHEADS)}")
        self.spec = spec
        stages, dp = spec.pp, spec.dp
        self.graph, self.stage, self.pp, self.dp, self.tp = graph, stage, stages, dp, spec.tp
        self.m, self.gpu = spec.gradient_accumulation_steps, gpu
        self.overheads = frozenset(overheads)
        self.shards = shards_optimizer(spec.zero_stage)
        # a pipeline keeps its stage's parameters gathered (and its gradients whole) through the
        # step's micro-batches, as torchtitan's and Megatron's sharded pipelines do: ZeRO 2-3
        # then reduce-scatter once after the last backward and all-gather after the step
        self.partitioned = partitions_parameters(spec.zero_stage) and dp > 1 and stages == 1
        self.param_elem = params[0][3] if params else 2
        self.comm_elem = spec.comm_elem_size
        self.act_bytes, self.send_bytes, self.recv_bytes = act_bytes, send_bytes, recv_bytes
        self.offload_opt = spec.offload_optimizer != "none"
        self.offload_param = self.partitioned and spec.offload_params != "none" and gpu
        self.fsdp, self.blocking_p2p = fsdp and self.partitioned, blocking_p2p
        self.segments = segments(params, self.partitioned, blocks=self.fsdp)
        self.seg_of = seg_of = {i: j for j, seg in enumerate(self.segments) for i in seg.params}
        self.v = len(chunk_params) if chunk_params else 1
        self.schedule = "interleaved" if self.v > 1 else \
            spec.schedule.replace("interleaved", "1f1b")  # the spec's, as chunks allow
        # each chunk's segments, in forward order (one chunk, every segment, without them)
        self.chunk_segments = [list(range(len(self.segments)))]
        chunk_flops = None
        if chunk_params and self.v > 1:
            chunk_of = {i: c for c, chunk in enumerate(chunk_params) for i in chunk}
            self.chunk_segments = [[j for j, seg in enumerate(self.segments)
                                    if chunk_of[seg.params[0]] == c] for c in range(self.v)]
            empty = [c for c, segs in enumerate(self.chunk_segments) if not segs]
            if empty:
                raise ValueError(f"model chunk {empty[0]} of pipeline stage {stage} has no "
                                 f"parameters: the simulator prices a chunk's passes by its "
                                 f"parameters")
            sizes = [sum(_size(params[i]) for i in chunk) for chunk in chunk_params]
            chunk_flops = [forward_flops * n / max(1, sum(sizes)) for n in sizes]
        units = [seg.params for seg in self.segments] if self.partitioned else None
        self.split_rows = dict(split_rows or {})  # the planner decides where the engine splits
        order = None
        if self.split_rows:
            # the engine's observed order: the split weights' gradients are complete first
            order = sorted(self.split_rows, reverse=True) + \
                [i for i in range(len(params) - 1, -1, -1) if i not in self.split_rows]
        buckets = plan_units(params, units, bucket_numel=spec.bucket_numel,
                             persistence_threshold=0 if self.fsdp else
                             spec.stage3.persistence_threshold) \
            if units is not None else plan_buckets(params, spec.bucket_numel, order)
        self.buckets: tuple[BucketPlan, ...] = tuple(buckets)
        # the spec's cadence: once a step, or every micro-batch into ZeRO 2-3's gradient shards
        self.reduce_every_mb = spec.reduction.every_micro_batch
        self.gather_ahead = param_gather_overlap and self.shards and \
            not partitions_parameters(spec.zero_stage) and dp > 1 and \
            any(not b.partitioned for b in self.buckets) and not shared_params
        # the gathers each segment waits for before its first forward (param_gather_overlap)
        self.gathers_before: dict[int, list[int]] = {}
        self.uses = self._stage3_uses() if self.partitioned else None
        # ZeRO ranks of one host sharing its copy of the parameters (ZeroOptimizer.share_params):
        # no all-gather after the step, and a stage-3 use is a view, no gather
        self.shared_params = shared_params
        self.params, self.forward_flops, self.chunk_flops = params, forward_flops, chunk_flops
        self.micro_batch, self.bucket_numel = spec.micro_batch_size, spec.bucket_numel
        self.comm_dtype = spec.comm_dtype
        # the passes in the order the step plan runs them (the plan itself is made when read)
        self.passes = stage_passes(self.schedule, stage, stages, self.m, self.v)
        self.layer_count = len({seg.layer for seg in self.segments if seg.layer is not None})
        # per segment: whether a TP layer's all-reduces follow it going forward and backward
        self.ends_forward = [self._ends_layer(j, +1) for j in range(len(self.segments))]
        self.ends_backward = [self._ends_layer(j, -1) for j in range(len(self.segments))]
        self.tp_bytes = 2 * self.act_bytes  # a layer's two all-reduces of its output
        # the stage, send and chunk each kind of receive of each chunk gets its tensor from
        self.peers: dict[tuple[str, int | None], tuple[int, str, int | None]] = {}
        # a bucket's gradients are complete after the backward of its earliest-forward segment
        # (a split weight's after the last segment's: the head's part is all it waits for)
        self.ready_after: dict[int, list[BucketPlan]] = {}
        head = len(self.segments) - 1
        for b in self.buckets:
            self.ready_after.setdefault(min(head if s.index in self.split_rows else
                                            seg_of[s.index] for s in b.slots), []).append(b)
        # the rows' all-gather: each rank's distinct rows, a token id and the fp32 row each
        self.rows_bytes = int(sum(dp * math.ceil(rows) * (params[i][1][-1] + 1) * 4
                                  for i, rows in self.split_rows.items())) \
            if self.split_rows else None

    @cached_property
    def step_plan(self) -> StepPlan:
        """The engine's step plan of the stage, which the graph cuts finer."""
        return plan_step(
            self.spec.replace(virtual_stages=self.v, schedule=self.schedule), self.params,
            forward_flops=self.forward_flops, buckets=self.buckets, stage=self.stage,
            chunk_flops=self.chunk_flops,
            stage3=(self.uses, self.trace) if self.uses is not None and not self.shared_params
            else None, rows_bytes=self.rows_bytes)

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
        if self.fsdp:
            # one unit ahead, two units live, none kept gathered past its forward but the last
            one = max(numel.values(), default=0)
            prefetch, live, reuse = one, 2 * one, 0
        else:
            policy = self.spec.stage3
            prefetch, live, reuse = (policy.prefetch_numel, policy.max_live_numel,
                                     policy.max_reuse_distance)
        uses = stage3_uses(self.trace, numel, prefetch_numel=prefetch, max_live_numel=live,
                           max_reuse_distance=reuse)
        # each gather named for the use it serves, as the plan names it
        self.gather_tags = gather_uses(uses, self.trace)
        return uses

    def _overhead(self, which: str, name: str, kind: str, last: int | None,
                  also: Sequence[int | None] = (), refs: Sequence[tuple[int, str]] = ()
                  ) -> int | None:
        """The engine overhead ``which`` as a task on the stage's compute after ``last`` (and
        ``also``) when it is laid out as one; returns what the chain goes on from."""
        if which not in self.overheads:
            return last
        return self.graph.add(self.stage, name, kind, "compute", which, [last, *also], refs)

    # -- passes ------------------------------------------------------------------------------

    def build(self) -> None:
        s, graph = self.stage, self.graph
        last: int | None = None
        reduces: list[int] = []
        if self.gather_ahead:
            self._gathers_ahead()
        passes = self.passes
        self.last_backward = max((i for i, (op, _, _) in enumerate(passes) if op == "backward"),
                                 default=-1)
        last_chunk = self.pp * self.v - 1
        act_link, grad_link = link_of("send_act", s, self.pp), link_of("send_grad", s, self.pp)
        loss, pass_start = "loss" in self.overheads, "pass_start" in self.overheads
        for i, (op, k, c) in enumerate(passes):
            here = s if c is None else c * self.pp + s  # the model's chunk
            if op == "forward":
                refs = self._handed("recv_act", k, c) if here > 0 else []
                if pass_start:
                    last, refs = self._pass_start("forward", k, c, last, refs)
                last = self._forward(k, c, last, refs)
                if loss:
                    last = self._overhead("loss", names.overhead("loss", k, c), "overhead",
                                          last)
                if here < last_chunk:
                    sent = graph.add(s, names.pipe_op("send_act", k, c), "send", "comm:pp",
                                     "send", (last,), arg=act_link, nbytes=self.send_bytes,
                                     chunk=c)
                    last = sent if self.blocking_p2p else last
            else:
                refs = self._handed("recv_grad", k, c) if here < last_chunk else []
                if pass_start:
                    last, refs = self._pass_start("backward", k, c, last, refs)
                last = self._backward(k, c, last, refs, reduces, i == self.last_backward)
                if here > 0:
                    sent = graph.add(s, names.pipe_op("send_grad", k, c), "send", "comm:pp",
                                     "send", (last,), arg=grad_link, nbytes=self.recv_bytes,
                                     chunk=c)
                    last = sent if self.blocking_p2p else last
        last = self._overhead("step", names.overhead("step"), "overhead", last,
                              [reduces[-1] if reduces else None])
        last = self._overhead("loss_broadcast", names.overhead("loss-broadcast"), "overhead",
                              last)
        self._step(last, reduces[-1] if reduces else None)

    def _gathers_ahead(self) -> None:
        """The previous step's parameter all-gathers, one per whole bucket in the order the
        forward reads them, each before the first segment that uses its parameters."""
        first_use = {b.index: min(self.seg_of[slot.index] for slot in b.slots)
                     for b in self.buckets if not b.partitioned}
        last: int | None = None
        for b in sorted(first_use, key=lambda i: (first_use[i], i)):
            last = self.graph.add(self.stage, names.allgather(b), "allgather", "comm:dp",
                                  "all_gather", [last],
                                  nbytes=self.buckets[b].numel * self.param_elem)
            self.gathers_before.setdefault(first_use[b], []).append(last)

    def _handed(self, kind: str, k: int, c: int | None) -> list[tuple[int, str]]:
        """The send a pass waits for: (stage, task name) of the chunk that hands it over."""
        peer = self.peers.get((kind, c))
        if peer is None:
            stage, chunk = handover(kind, self.stage, self.pp, c)
            peer = self.peers[(kind, c)] = \
                (stage, "send_act" if kind == "recv_act" else "send_grad", chunk)
        return [(peer[0], names.pipe_op(peer[1], k, peer[2]))]

    def _pass_start(self, kind: str, k: int, c: int | None, last: int | None,
                    refs: list[tuple[int, str]]) -> tuple[int | None, list[tuple[int, str]]]:
        """A pipeline stage's actor getting a pass going once its input is there (the received
        tensor handed to the event loop, the pass to the compute thread), as a task of its own
        so the pass's span stays its compute, as the engine records it. Returns the pass's new
        predecessor and refs."""
        if "pass_start" not in self.overheads:
            return last, refs
        return self._overhead("pass_start", names.handoff(kind, k, c), "handoff", last,
                              refs=refs), []

    def _pass_chunked(self, k: int, backward: bool) -> bool:
        # A tensor-parallel pass whose layers nothing else interleaves with is one compute task
        # and one task of its layers' TP collectives (they block the pass either way).
        if self.partitioned or self.v > 1 or (self.tp > 1 and self.pp == 1):
            return True
        if self.gather_ahead and k == 0 and not backward:
            return True  # the first forward's segments wait for their parameter gathers
        reduces_here = self.dp > 1 and (self.reduce_every_mb or k == self.m - 1)
        return backward and reduces_here and (len(self.buckets) > 1 or bool(self.split_rows))

    def _pass_tp(self, direction: str, k: int, last: int) -> int:
        """A whole pass's TP collectives after its compute, one set per layer of the stage."""
        layers = self.layer_count
        if self.tp == 1 or not layers:
            return last
        return self.graph.add(self.stage, names.tp(direction, k), "tp", "comm:tp", "tp", [last],
                              arg=0 if direction == "fwd" else 1,
                              nbytes=2 * self.act_bytes * layers, repeat=layers)

    def _ends_layer(self, j: int, step: int) -> bool:
        """Whether segment ``j`` is the last of its layer in a pass that goes ``step`` (+1:
        forward, -1: backward) through the segments (a TP layer's all-reduces follow it)."""
        seg, n = self.segments[j], j + step
        return self.tp > 1 and seg.layer is not None and (
            not 0 <= n < len(self.segments) or self.segments[n].layer != seg.layer)

    def _forward(self, k: int, c: int | None, last: int | None,
                 refs: list[tuple[int, str]]) -> int:
        s, graph = self.stage, self.graph
        if not self._pass_chunked(k, backward=False):
            last = graph.add(s, names.forward(k), "forward", "compute", "forward", (last,), refs,
                             flops=pass_flops("forward", self.forward_flops))
            return self._pass_tp("fwd", k, last)
        segs = self.chunk_segments[c or 0]
        segments, ends = self.segments, self.ends_forward
        for j in segs:
            seg = segments[j]
            first = refs if j == segs[0] else []
            waits: list[int] = []
            if self.uses is not None:
                last, first = self._fetch("forward", k, j, last, first)
                waits = self._gathers(k, j, "fwd", last)
            if k == 0 and self.gathers_before:
                waits = waits + self.gathers_before.get(j, [])
            last = graph.add(s, names.pass_task("forward", k, seg.label, chunk=c), "forward",
                             "compute", "forward", [last, *waits] if waits else (last,),
                             first, arg=j, chunk=c)
            if ends[j]:
                assert seg.layer is not None
                last = graph.add(s, names.tp("fwd", k, seg.layer, c), "tp", "comm:tp", "tp",
                                 (last,), arg=0, nbytes=self.tp_bytes, chunk=c)
        assert last is not None
        return last

    def _backward(self, k: int, c: int | None, last: int | None, refs: list[tuple[int, str]],
                  reduces: list[int], final: bool) -> int:
        """Micro-batch ``k``'s backward over chunk ``c``; ``final``: the step's last one."""
        s, graph = self.stage, self.graph
        reduce_now = self.dp > 1 and (self.reduce_every_mb or final)
        if self.v > 1:
            last = self._chunk_backward(k, c or 0, last, refs)
            if reduce_now:
                # a bucket may hold several chunks' gradients: they all go once the step's
                # last backward is done, in the order the reducer launches them
                for b in self.buckets:
                    reduces.append(self._reduce(b, None, last, reduces))
            return last
        mb = k if self.reduce_every_mb and self.m > 1 else None
        if not self._pass_chunked(k, backward=True):
            last = graph.add(s, names.backward(k), "backward", "compute", "backward", (last,),
                             refs, flops=pass_flops("backward", self.forward_flops))
            last = self._pass_tp("bwd", k, last)
            if reduce_now:
                for b in self.buckets:
                    last = self._hand_off(k, b, last)
                    reduces.append(self._reduce(b, mb, last, reduces))
                self._rows(last, reduces)
            return last
        n = len(self.segments)
        for j in range(n - 1, -1, -1):
            seg = self.segments[j]
            first = refs if j == n - 1 else []
            last, first = self._fetch("backward", k, j, last, first)
            waits = self._gathers(k, j, "bwd", last)
            last = graph.add(s, names.backward(k, seg.label), "backward", "compute", "backward",
                             [last, *waits], first, arg=j)
            chunk = last
            if self.uses is not None and self.bucket_of_seg[j] is not None:
                last = self._overhead("release", names.release(k, seg.label), "backward",
                                      last)
            if self.ends_backward[j]:
                assert seg.layer is not None
                last = graph.add(s, names.tp("bwd", k, seg.layer), "tp", "comm:tp", "tp",
                                 (last,), arg=1, nbytes=self.tp_bytes)
            if reduce_now:
                for b in self.ready_after.get(j, []):
                    if "bucket_hand_off" in self.overheads:
                        assert last is not None
                        chunk = last = self._hand_off(k, b, last)
                    reduces.append(self._reduce(b, mb, chunk, reduces))
        assert last is not None
        if reduce_now:
            self._rows(last, reduces)
        return last

    def _rows(self, last: int, reduces: list[int]) -> None:
        """The split weights' rows, all-gathered after the step's reduces (in comm/wait)."""
        if self.rows_bytes is not None:
            reduces.append(self.graph.add(self.stage, names.ROWS, "reduce", "comm:dp",
                                          "all_gather", [last, reduces[-1] if reduces else None],
                                          nbytes=self.rows_bytes))

    def _chunk_backward(self, k: int, c: int, last: int | None,
                        refs: list[tuple[int, str]]) -> int:
        """Chunk ``c``'s backward over its segments, last first (interleaved)."""
        s, graph = self.stage, self.graph
        segs = self.chunk_segments[c]
        segments, ends = self.segments, self.ends_backward
        for j in reversed(segs):
            seg = segments[j]
            last = graph.add(s, names.pass_task("backward", k, seg.label, chunk=c), "backward",
                             "compute", "backward", (last,), refs if j == segs[-1] else (),
                             arg=j, chunk=c)
            if ends[j]:
                assert seg.layer is not None
                last = graph.add(s, names.tp("bwd", k, seg.layer, c), "tp", "comm:tp", "tp",
                                 (last,), arg=1, nbytes=self.tp_bytes, chunk=c)
        assert last is not None
        return last

    def _hand_off(self, k: int, bucket: BucketPlan, last: int) -> int:
        """The engine handing a full bucket to its reducer on the backward's thread (a task of
        the backward), before the bucket's reduce can start."""
        handed = self._overhead("bucket_hand_off", names.hand_off(k, bucket.index),
                                "backward", last)
        assert handed is not None
        return handed

    def _reduce(self, bucket: BucketPlan, mb: int | None, after: int,
                reduces: list[int]) -> int:
        return self.graph.add(self.stage, names.reduce(bucket.index, mb), "reduce", "comm:dp",
                              "reduce", [after, reduces[-1] if reduces else None],
                              nbytes=bucket.numel * self.comm_elem)

    def _fetch(self, kind: str, k: int, j: int, last: int | None,
               refs: list[tuple[int, str]]) -> tuple[int | None, list[tuple[int, str]]]:
        """ZeRO-3: when segment ``j``'s use in a ``kind`` pass hands anything to the parameter
        fetcher (a bucket to wait for, or gathers to start), as the engine's hooks do then, the
        hand-off as a task of the pass. Returns the segment's new predecessor and refs."""
        if "fetch" not in self.overheads or self.uses is None:
            return last, refs
        bucket = self.bucket_of_seg[j]  # set with the uses
        if bucket is None:
            return last, refs
        pos = self.use_pos[("fwd" if kind == "forward" else "bwd", bucket)]
        if not (self.uses.launched[pos] or self.uses.gathered_for[pos]):
            return last, refs
        return self.graph.add(self.stage, names.fetch(kind, k, self.segments[j].label), kind,
                              "compute", "fetch", [last], refs), []

    def _gathers(self, k: int, j: int, direction: str, before: int | None) -> list[int]:
        """ZeRO-3: starts the all-gathers launched when segment ``j`` is used (once ``before``,
        the task ahead of the use, is done) and returns the gathers the segment waits for."""
        if self.uses is None:
            return []
        bucket = self.bucket_of_seg[j]  # set with the uses
        if bucket is None:
            return []
        if self.shared_params:
            return []
        s, graph = self.stage, self.graph
        pos = self.use_pos[(direction, bucket)]
        for b, tag in self.gather_tags[pos]:
            deps: list[int | None] = [before, self.last_gather]
            if self.offload_param:
                shard = math.ceil(self.buckets[b].numel / self.dp) * self.param_elem
                deps.append(graph.add(s, names.copy("h2d", b, tag, names.micro_batch(k)),
                                      "copy", "copy:h2d", "copy", [before], nbytes=shard))
            nbytes = self.buckets[b].numel * self.param_elem
            self.last_gather = graph.add(s, names.gather(b, tag, k), "gather", "comm:dp",
                                         "all_gather", deps, nbytes=nbytes)
        return [graph.index[(s, names.gather(b, direction, k))]
                for b in self.uses.gathered_for[pos]]

    # -- optimizer -----------------------------------------------------------------------------

    def _shard(self, numel: int) -> int:
        return math.ceil(numel / self.dp) if self.shards else numel

    def _step(self, last: int | None, last_reduce: int | None) -> None:
        s, graph = self.stage, self.graph
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
                    deps = [graph.add(s, names.copy("d2h", b.index), "copy", "copy:d2h", "copy",
                                      after, nbytes=shard * self.comm_elem)]
                stepped = graph.add(s, names.optimizer_step(b.index), "optimizer", host,
                                    "host_optimizer", deps, arg=shard, nbytes=shard * 16)
                if self.gpu:
                    stepped = graph.add(s, names.copy("h2d", b.index), "copy", "copy:h2d",
                                        "copy", [stepped], nbytes=shard * self.param_elem)
                finished.append(stepped)
        else:
            numel = sum(self._shard(b.numel) for b in self.buckets)
            finished = [graph.add(s, names.OPTIMIZER_STEP, "optimizer", "compute", "optimizer",
                                  after, arg=numel, nbytes=numel * 16)]
        if self.shards and self.dp > 1 and not self.gather_ahead and \
                not self.shared_params:
            for b in whole:
                graph.add(s, names.allgather(b.index), "allgather", "comm:dp", "all_gather",
                          finished, nbytes=b.numel * self.param_elem)
