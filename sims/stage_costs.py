"""What one pipeline stage's tasks cost: the factors a step's tasks are priced with (compute and
memory slowdown of ranks sharing a host, a calibrated CPU host's measured engine costs, the
collective and channel each reduce goes over), and the seconds of each pass, collective and
optimizer step. ``sims.graph`` lays the tasks out; ``sims.pricing`` asks this for
each one's time."""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from flowtrain.plan.spec import TrainingSpec, reduce_op
from flowtrain.plan.zero_stage import partitions_gradients, partitions_parameters, shards_optimizer
from sims import costs, gpu_costs
from sims.frameworks import get_framework
from sims.gpu_kernels import GpuKernels
from sims.layer_ops import (
    Gemm,
    RankShape,
    SimOptions,
    attention_core,
    cp_exchange_bytes,
    embed_backward,
    embed_forward,
    fp8_casts,
    head_backward,
    head_forward,
    layer_backward,
    layer_forward,
    tp_collectives_per_layer,
)
from sims.workload import DTYPE_BYTES, Layout, ParamSpec, TransformerShape, Workload
from sims.workload import numel as _numel

if TYPE_CHECKING:
    from flowtrain.plan import BucketPlan
    from sims.engine_costs import EngineCosts
    from sims.graph import Segment
    from sims.hardware import HardwareProfile

# ranks of the pipeline job `flowtrain calibrate` measures pipeline hand-offs on
PIPELINE_JOB_RANKS = 2


class StageCosts:
    """The prices of one pipeline stage's tasks on hardware ``hw``; ``price_passes`` then
    prices the stage's passes, once its segments and buckets are laid out."""

    # embedding weights tied to the head (``price_passes``)
    with_head: frozenset[int] = frozenset()

    def __init__(self, stage: int, *, layout: Layout, hw: HardwareProfile, spec: TrainingSpec,
                 params: list[ParamSpec], recompute: str, options: SimOptions | None = None
                 ) -> None:
        self.stage, self.layout, self.hw = stage, layout, hw
        self.options = options or SimOptions()
        # a GPU profile with kernel figures prices a known transformer op by op
        self.kernels: GpuKernels | None = hw.gpu_kernels
        # the stage's spec, in the framework's variant (sims.planner)
        self.spec = spec
        self.recompute = recompute
        self.m, self.mb = spec.gradient_accumulation_steps, spec.micro_batch_size
        self.dp, self.tp, self.pp = layout.dp, layout.tp, layout.pp
        # what the ZeRO stage decides (flowtrain.plan.zero_stage)
        self.shards = shards_optimizer(spec.zero_stage)
        self.partitions_grads = partitions_gradients(spec.zero_stage)
        self.partitions_params = partitions_parameters(spec.zero_stage)
        self.partitioned = self.partitions_params and self.dp > 1 and layout.pp == 1
        self.params = params
        self.comm_elem = spec.comm_elem_size
        self.param_elem = params[0][3] if params else 2
        self.gpu = hw.kind == "gpu"
        self.clip = spec.gradient_clipping > 0
        self.fp16 = spec.precision == "fp16"
        dtype = spec.compute_dtype
        # A CPU host calibrated with the engine's own costs (float32: what was measured)
        self.engine: EngineCosts | None = \
            None if self.gpu or dtype != "float32" else hw.engine
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
        self.forward_extra_s = engine.factor(ranks_here, "forward_s") / self.m \
            if engine else 0.0
        self.backward_extra_s = engine.factor(ranks_here, "backward_s") / self.m \
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
        piped = self.engine if self.pp > 1 else None
        pipelined = piped is not None
        crowding = self.slowdown / costs.compute_slowdown(PIPELINE_JOB_RANKS, hw) \
            if pipelined else 1.0
        self.op_s = piped.pipeline_op_s * crowding if piped is not None else 0.0
        self.message_s = piped.pipeline_message_s * crowding if piped is not None else 0.0
        # model-parallel clipping sums the gradient norm over every rank (one all-reduce of
        # the world), and the pipeline broadcasts the step's loss from the last stage
        self.world_norm_s = costs.collective_seconds(
            "all_reduce", 8, layout.world_size, hw) + piped.factor(ranks_here, "gloo_s") \
            if piped is not None and self.clip else 0.0
        self.loss_broadcast_s = costs.collective_seconds("broadcast", 4, self.pp, hw) \
            if pipelined else 0.0
        # the engine reduces over its shared-memory channel when every rank of a
        # data-parallel-only job is a CPU rank on one host (flowtrain.engine.FlowtrainEngine)
        self.channel = (self.engine is not None and bool(self.engine.channel)
                        and layout.nodes == 1 and self.tp == 1 and self.pp == 1 and self.dp > 1
                        and spec.host.data_channel != "torch")
        # ZeRO over the channel keeps the host's one copy of the parameters in shared memory
        # (flowtrain.zero.sharded share_params): no all-gather after the step, and a stage-3
        # use is a view of it, no gather. A run's record names the channel it used; a plan's
        # "auto" is the channel where this host has one.
        channel = spec.host.data_channel
        self.shared_params = spec.shares_host_params(
            shm_channel=layout.nodes == 1 and (channel == "shm" or
                                               (channel is None and self.channel)))
        # the collective the spec reduces with (flowtrain.plan.spec.reduce_op; the planner's
        # variant of it for a framework whose ZeRO-1 all-reduces)
        self.reduce_op: str = reduce_op(spec.zero_stage, reduce_scatter=spec.reduce_scatter)

    def overheads(self) -> dict[str, float]:
        """The engine overheads (``sims.graph.OVERHEADS``) this host's costs model as
        tasks of their own, and their seconds; the others are part of the passes."""
        seconds = {"loss": self.micro_batch_s, "step": self.step_s,
                   "loss_broadcast": self.loss_broadcast_s, "pass_start": self.op_s,
                   "fetch": self.fetch_s, "release": self.release_s,
                   "bucket_hand_off": self.bucket_s}
        return {k: v for k, v in seconds.items() if v}

    def send_seconds(self, nbytes: float, sender: int) -> float:
        """A pipeline send of ``nbytes`` from stage ``sender`` to the next one (a GPU with
        kernel figures: at the achieved NVLink or NIC rate)."""
        if self.kernels is not None:
            if self.layout.pipe_link_inter_node(sender):
                rate = self.hw.inter_node.bandwidth / self.hw.devices_per_node * \
                    self.kernels.network_efficiency
            else:
                rate = self.hw.intra_node.bandwidth * self.kernels.p2p_efficiency
            return self.kernels.collective_base_latency_s + nbytes / rate
        return costs.p2p_seconds(nbytes, self.hw, self.layout.pipe_link_inter_node(sender)) + \
            self.message_s

    def reduce_seconds(self, nbytes: float) -> tuple[float, float | None, float | None]:
        """A gradient bucket's reduce of ``nbytes``: its seconds, and the interference and
        slowdown of its channel where they differ from the plan's (the shared-memory channel's)."""
        seconds = costs.channel_seconds(self.reduce_op, nbytes, self.dp, self.hw) \
            if self.channel else None
        share = slowed = None
        if seconds is None:
            seconds = self.collective(self.reduce_op, nbytes)
        else:
            assert self.engine is not None
            share, slowed = self.engine.channel_interference, self.engine.channel_slowdown
        if self.engine is not None:
            # the reducer then scales the sum by 1 / dp: a multiply over the bucket (read +
            # write), or an add of the scattered shard into the gradient shard (2 reads + write)
            scaled = nbytes * 2 if self.reduce_op == "all_reduce" else nbytes / self.dp * 3
            seconds += scaled / self.hw.memory_bandwidth * self.memory_slowdown
        return seconds + self.reduce_s, share, slowed

    def price_passes(self, segments: list[Segment], buckets: tuple[BucketPlan, ...], *,
                     stage_flops: float, work: Workload, weights: list[int], total_weight: int,
                     dtype: str, act_bytes: float,
                     with_head: Collection[int] = ()) -> None:
        """Each of the stage's ``segments``' forward and backward seconds (``stage_flops``: the
        stage's forward FLOPs of one sample; ``weights``: its parameters' unsharded element
        counts), and a layer's tensor-parallel all-reduces of ``act_bytes``. ``with_head``:
        embedding weights tied to the head (stage-local indices), whose FLOPs are the head's
        matmul and are priced in the last segment, where the head runs."""
        self.segments, self.buckets, self.stage_flops = segments, buckets, stage_flops
        self.with_head = frozenset(with_head)
        self.forward_s = [0.0] * len(segments)
        self.backward_s = [0.0] * len(segments)
        self.shape = RankShape(micro_batch=self.mb, tp=self.tp,
                               sequence_parallel=self.options.sequence_parallel,
                               flash=self.attention != "unfused", recompute=self.recompute,
                               act_bytes=DTYPE_BYTES.get(dtype, 2), cp=self.options.cp,
                               eager=self.options.elementwise == "eager",
                               loss=self.options.loss_kernel,
                               fused_projections=get_framework(
                                   self.options.framework).fused_projections)
        if self.kernels is not None and (work.transformer is not None or
                                         work.program is not None):
            if work.transformer is not None:
                self._cost_op_segments(work.transformer, weights, dtype)
            else:
                self._cost_program_segments(work.program, weights, dtype)
            self._cost_shard_copies()
            # the kernel figures are one GPU's; every collective and the step's end wait for
            # the slowest of the job's GPUs, so the passes run at its pace
            slowest = self.kernels.slowest_device_factor(self.layout.world_size)
            self.forward_s = [s * slowest for s in self.forward_s]
            self.backward_s = [s * slowest for s in self.backward_s]
        else:
            self._cost_segments(work, weights, total_weight, dtype)
        one = self.collective_seconds_tp(act_bytes)
        rows = 2  # a transformer layer's row-parallel linears (attention output, MLP down)
        if work.transformer is None and work.program is not None and work.program.layers:
            rows = work.program.row_parallel(0)
        self.tp_pass_s = {kind: tp_collectives_per_layer(self.shape, kind, rows) * one
                          for kind in ("forward", "backward")} if self.kernels is not None \
            else {"forward": 2 * one, "backward": 2 * one}
        if self.options.tp_overlap and self.kernels is not None and self.tp > 1 and \
                (work.transformer is not None or work.program is not None):
            # pipelined with the layer's GEMMs: only what outlasts them is exposed, and the
            # GEMMs run slower by the overlap's share while it lasts
            for kind, gemms in self.layer_gemm_s.items():
                comm = self.tp_pass_s[kind]
                self.tp_pass_s[kind] = max(0.0, comm - gemms) + \
                    self.kernels.overlap_slowdown * min(comm, gemms)

    @property
    def attention(self) -> str:
        """The attention kernel: as asked, else the profile's default flash kernel."""
        if self.options.attention is not None:
            return self.options.attention
        return self.kernels.default_attention if self.kernels is not None else "flash2"

    def collective_seconds_tp(self, nbytes: float) -> float:
        """One all-reduce of ``nbytes`` over the tensor-parallel group (inside a node); with
        sequence parallelism the all-gather and reduce-scatter that replace it."""
        if self.tp == 1:
            return 0.0
        if self.kernels is not None:
            if self.options.sequence_parallel:
                # an all-gather and a reduce-scatter move an all-reduce's bytes, at their own
                # bus bandwidth (on Hopper the ring's: NVLink SHARP serves only all-reduce)
                seconds = sum(gpu_costs.intra_node_seconds(op, nbytes, self.tp, self.kernels)
                              for op in ("all_gather", "reduce_scatter"))
                if get_framework(self.options.framework).sp_layout_copies and \
                        not self.options.tp_overlap:
                    # each collective's layout copy reads and writes the gathered activation
                    seconds += 2 * 2 * nbytes / (self.hw.memory_bandwidth *
                                                 self.kernels.memory_efficiency)
                return seconds
            return gpu_costs.intra_node_seconds("all_reduce", nbytes, self.tp, self.kernels)
        return costs.collective_seconds("all_reduce", nbytes, self.tp, self.hw, nodes=1)

    def _cp_rate(self) -> float:
        """Bytes/s of a context-parallel hop: over NVLink when the tensor- and context-parallel
        ranks fit in a node (Megatron numbers them tp fastest, then cp), else over the NICs."""
        kern = self.kernels
        assert kern is not None
        if self.tp * self.options.cp <= self.hw.devices_per_node:
            return self.hw.intra_node.bandwidth * kern.p2p_efficiency
        return self.hw.inter_node.bandwidth / self.hw.devices_per_node * kern.network_efficiency

    def tp_seconds(self, kind: str) -> float:
        """A layer's tensor-parallel collectives in a ``kind`` ("forward"/"backward") pass."""
        return self.tp_pass_s[kind]

    def _cost_op_segments(self, shape: TransformerShape, weights: list[int],
                          dtype: str) -> None:
        """Each segment's seconds from the ops it runs on the GPU (``sims.layer_ops``): a
        layer's ops are shared among the layer's segments (ZeRO-3 modules) by parameter count;
        segments before the first layer run the embedding, those after the last the final
        norm, the LM head and the loss."""
        kern = self.kernels
        assert kern is not None

        def seconds(ops: list[Any], gemm_dtype: str | None = self.options.gemm_dtype
                    ) -> float:
            return self._ops_seconds(ops, dtype, gemm_dtype)

        r = self.shape
        forward, backward = layer_forward(shape, r), layer_backward(shape, r)
        if self.options.gemm_dtype == "float8":
            forward = forward + fp8_casts(forward, backward=False)
            backward = backward + fp8_casts(backward, backward=True)
        layer = [seconds(forward), seconds(backward)]
        self.layer_gemm_s = {
            kind: seconds([op for op in ops if isinstance(op, Gemm)])
            for kind, ops in (("forward", layer_forward(shape, r)),
                              ("backward", layer_backward(shape, r)))}
        if r.cp > 1:
            # ring attention: each hop's K/V transfer overlaps the attention on the chunk
            # before it; what the transfers take beyond the attention is exposed
            sent = cp_exchange_bytes(shape, r)
            for i, is_backward in enumerate((False, True)):
                hop_s = (2 if is_backward else 1) * sent / self._cp_rate()
                attention_s = seconds(attention_core(shape, r, backward=is_backward))
                layer[i] += max(0.0, hop_s - attention_s)
        parts = {"layer": (layer[0], layer[1]),
                 "embed": (seconds(embed_forward(shape, r)), seconds(embed_backward(shape, r))),
                 # fp8 training leaves the LM head in the training dtype: Transformer
                 # Engine's recipes cover the transformer layers' linears, Megatron-Core's
                 # output layer is its own ColumnParallelLinear, and torchtitan's float8
                 # conversion skips the "output" linear
                 "head": (seconds(head_forward(shape, r), None),
                          seconds(head_backward(shape, r), None))}
        self._distribute(weights, lambda part, _: parts[part])

    def _cost_program_segments(self, program: Any, weights: list[int], dtype: str) -> None:
        """Each segment's seconds from a traced module's recognized ops (``sims.op_program``),
        priced as ``_cost_op_segments`` prices a known transformer's: each layer its own ops,
        the ops before the first layer on the segments before it, the rest after the last."""
        kern = self.kernels
        assert kern is not None
        if program.batch != self.mb:
            raise ValueError(f"the module was traced at micro-batch {program.batch}, the step "
                             f"runs {self.mb}")

        def seconds(ops: list[Any], gemm_dtype: str | None = self.options.gemm_dtype
                    ) -> float:
            return self._ops_seconds(ops, dtype, gemm_dtype)

        r = self.shape
        fp8 = self.options.gemm_dtype == "float8"

        def priced(which: int) -> tuple[float, float]:
            forward, backward = program.forward(which, r), program.backward(which, r)
            if fp8 and which >= 0:
                forward = forward + fp8_casts(forward, backward=False)
                backward = backward + fp8_casts(backward, backward=True)
            gemm_dtype = self.options.gemm_dtype if which >= 0 else None
            return seconds(forward, gemm_dtype), seconds(backward, gemm_dtype)

        if program.layers:
            self.layer_gemm_s = {
                "forward": seconds([op for op in program.forward(0, r) if isinstance(op, Gemm)]),
                "backward": seconds([op for op in program.backward(0, r)
                                     if isinstance(op, Gemm)])}
        layers = {seg.layer for seg in self.segments if seg.layer is not None}
        if not layers <= set(range(len(program.layers))):
            # the parameters' layer numbers are not the traced layer list's (no list of layers,
            # or numbers of another kind): the model's work shared by parameter count
            whole = [a + b for a, b in zip(priced(-1), priced(-2))]
            total = max(1, sum(weights))
            for j, seg in enumerate(self.segments):
                share = sum(weights[i] for i in seg.params) / total
                self.forward_s[j] += whole[0] * share
                self.backward_s[j] += whole[1] * share
            return
        cache: dict[int, tuple[float, float]] = {}
        self._distribute(weights, lambda part, layer: cache.setdefault(
            layer if part == "layer" else (-1 if part == "embed" else -2),
            priced(layer if part == "layer" else (-1 if part == "embed" else -2))))

    def _distribute(self, weights: list[int],
                    seconds_of: Any) -> None:
        """Adds each part's (forward, backward) seconds, ``seconds_of(part, layer)``, to the
        segments that run it: a layer's to its segments by parameter count (ZeRO-3 modules),
        "embed" to those before the first layer, "head" to those after the last."""
        groups: dict[tuple[str, int], list[int]] = {}
        seen_layer = False
        for j, seg in enumerate(self.segments):
            seen_layer = seen_layer or seg.layer is not None
            key = ("layer", seg.layer) if seg.layer is not None else \
                ("head" if seen_layer else "embed", -1)
            groups.setdefault(key, []).append(j)
        if self.segments:
            # a part without parameters of its own there (a tied head after the last layer, a
            # final norm registered before the first, as Hugging Face's OPT does) still runs:
            # on the last stage's last segment (the first stage's first)
            if self.stage == self.pp - 1:
                groups.setdefault(("head", -1), [len(self.segments) - 1])
            if self.stage == 0:
                groups.setdefault(("embed", -1), [0])
        for (part, layer), members in groups.items():
            weight = [sum(weights[i] for i in self.segments[j].params) for j in members]
            total = sum(weight)
            fwd, bwd = seconds_of(part, layer)
            for j, w in zip(members, weight):
                share = w / total if total else 1 / len(members)
                self.forward_s[j] += fwd * share
                self.backward_s[j] += bwd * share

    def _ops_seconds(self, ops: list[Any], dtype: str, gemm_dtype: str | None) -> float:
        """``ops`` one after another on this GPU (``sims.gpu_costs.ops_seconds``)."""
        assert self.kernels is not None
        return gpu_costs.ops_seconds(ops, dtype=dtype, peaks=self.hw.peak_flops,
                                     hbm=self.hw.memory_bandwidth, kern=self.kernels,
                                     attention=self.attention, gemm_dtype=gemm_dtype)

    def _cost_shard_copies(self) -> None:
        """Each segment's share of the copies its framework makes around ZeRO 2-3's
        collectives (``Framework.shard_copy_bytes``) of the segment's parameters on this rank,
        streamed at the achieved HBM bandwidth. They run in every micro-batch, as the reduce
        and (at stage 3) the gathers do without pipeline stages; with pipeline stages the
        parameters are gathered and their gradients reduced once a step, which the passes do
        not carry."""
        kern = self.kernels
        assert kern is not None
        if not self.partitions_grads or self.dp == 1 or self.pp > 1:
            return
        fw = get_framework(self.options.framework)
        forward, backward = fw.shard_copy_bytes(self.param_elem, self.comm_elem,
                                                gathers=self.partitions_params)
        if not forward and not backward:
            return
        rate = self.hw.memory_bandwidth * kern.memory_efficiency
        for j, seg in enumerate(self.segments):
            elements = sum(_numel(self.params[i][1]) for i in seg.params)
            if not elements:
                continue
            if forward:
                self.forward_s[j] += forward * elements / rate + kern.kernel_overhead_s
            self.backward_s[j] += backward * elements / rate + kern.kernel_overhead_s

    def pass_seconds(self, kind: str, segment: int) -> float:
        """A ``kind`` pass over segment ``segment`` (-1: the whole stage)."""
        seconds = self.forward_s if kind == "forward" else self.backward_s
        return sum(seconds) if segment < 0 else seconds[segment]

    def _cost_segments(self, work: Workload, weights: list[int], total_weight: int, dtype: str
                       ) -> None:
        """Each segment's forward and backward seconds: one roofline op per parameter (so the
        efficiency curve sees matmul-sized ops), FLOPs shared by (unsharded) parameter count.
        On a host with the engine's measured costs, one op per module instead (a Linear's
        weight and bias are one call), timed as the engine runs it."""
        scale = self.stage_flops * self.mb / max(1, sum(weights)) / self.tp
        act_scale = work.activation_bytes_per_sample * self.mb / total_weight / self.tp
        recompute = self.pp > 1 and self.spec.recompute_interval > 0
        if self.engine is not None:
            self._cost_engine_segments(work, weights, recompute)
            return
        for j, i in self._priced_params():
            numel = _numel(self.params[i][1])
            flops = weights[i] * scale
            moved = numel * self.param_elem + weights[i] * act_scale
            fwd = costs.compute_seconds(flops, moved, dtype, self.hw)
            bwd = costs.compute_seconds(2 * flops, 2 * moved, dtype, self.hw)
            self.forward_s[j] += fwd
            self.backward_s[j] += bwd + (fwd if recompute else 0.0)

    def _priced_params(self) -> list[tuple[int, int]]:
        """(segment, stage-local parameter index) of each parameter, in the segment whose
        passes run its compute: a tied embedding weight's in the last (the head's)."""
        last = len(self.segments) - 1
        return [(last if i in self.with_head else j, i)
                for j, seg in enumerate(self.segments) for i in seg.params]

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
        stash_bytes = 16.0 if self.partitions_grads and self.dp > 1 else 0.0
        other = self._other_ops(census)
        by_segment: dict[int, dict[str, list[int]]] = {}
        for j, i in self._priced_params():
            by_segment.setdefault(j, {}).setdefault(
                self.params[i][0].rpartition(".")[0], []).append(i)
        for j, modules in by_segment.items():
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
                self.forward_s[j] += fwd
                self.backward_s[j] += bwd + (fwd if recompute else 0.0)
        if self.segments:
            self.forward_s[0] += self.forward_extra_s
            self.backward_s[-1] += self.backward_extra_s

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

    def collective(self, op: str, nbytes: float) -> float:
        """A gloo/NCCL collective over the data-parallel group; on a calibrated CPU host, plus
        what such a call took beside a live engine over the bare ranks' figure, and slowed
        as compute is where more ranks than the group's share the host. A GPU with kernel
        figures: NCCL at its measured bus bandwidth (``sims.gpu_costs``)."""
        if self.kernels is not None:
            return gpu_costs.collective_seconds(
                op, nbytes, self.dp, self.layout.dp_nodes,
                self.hw.inter_node.bandwidth / self.hw.devices_per_node, self.kernels)
        return costs.collective_seconds(op, nbytes, self.dp, self.hw,
                                        nodes=self.layout.dp_nodes) * self.comm_crowding + \
            self.gloo_s

    def optimizer_seconds(self, numel: int) -> float:
        """The optimizer step over ``numel`` stepped elements. With the engine's measured costs
        it is what the engine's step does: its fused Adam called once per parameter (stage 0)
        or per bucket shard (ZeRO), a gradient-norm pass and a clip multiply when clipping
        (read, then read + write), and zeroing the gradients (whole buckets at stages 0-1, the
        shards at 2-3), at the compute slowdown of ranks sharing the host."""
        if self.engine is None:
            return costs.optimizer_seconds(numel, self.hw)
        calls = len(self.buckets) if self.shards else len(self.params)
        kernel = costs.optimizer_seconds(numel, self.hw, calls=calls,
                                         memory_slowdown=self.memory_slowdown)
        whole = sum(b.numel for b in self.buckets)
        zeroed = numel if self.partitions_grads and self.dp > 1 else whole
        passes = zeroed * self.comm_elem + (numel * 12 if self.clip else 0)
        seconds = (kernel + passes / self.hw.memory_bandwidth * self.memory_slowdown) * \
            self.optimizer_factor
        if self.shards and self.dp > 1 and (self.clip or self.fp16):
            # ZeRO's global gradient norm: one blocking all-reduce of a float64 sum of squares
            seconds += self.collective("all_reduce", 8)
        return seconds + self.world_norm_s
