"""One prediction of ``flowtrain simulate``: its inputs read and checked (profile, config,
model, layout, host speed; a bad one raises ``SimulateError`` naming the flag), and ``predict``,
which plans, executes and measures one configuration into a ``Prediction``."""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flowtrain.config.model import FlowtrainConfig
    from sims.hardware import HardwareProfile
    from sims.layer_ops import SimOptions
    from sims.models import ModelSpec
    from sims.workload import Layout, Workload

DEFAULT_CLUSTER = "h100-x8"


class SimulateError(ValueError):
    """Bad input to ``flowtrain simulate``: one line naming the value and the valid choices."""


@dataclass
class Prediction:
    """The figures of one simulated configuration."""

    model: str
    cluster: str
    nodes: int
    devices_per_node: int
    dp: int
    tp: int
    pp: int
    zero_stage: int
    precision: str
    micro_batch_size: int
    micro_batches: int
    step_time_s: float
    samples_per_s: float
    tokens_per_s: float | None
    mfu: float
    resource_s: dict[str, float]
    comm_s: float
    exposed_comm_s: float
    overlap_pct: float | None
    bubble_pct: float
    peak_memory_bytes: float | None
    device_memory_bytes: int
    tasks: int
    simulate_s: float
    notes: list[str] = field(default_factory=list)
    timeline: Any = field(default=None, repr=False)
    # the central 80 % of the step times the uncertain inputs allow (sims.interval): the
    # published figures the GPU's costs rest on, and what the command does not state (None: a
    # profile without such ranges)
    step_time_range_s: tuple[float, float] | None = None
    # the step time with every figure at its optimistic end and with every one at its
    # pessimistic end
    hardware_range_s: tuple[float, float] | None = None
    # what the prediction assumed: where each kind of cost comes from (--explain)
    assumptions: list[str] = field(default_factory=list)
    # the peak rank's memory, part by part (sims.memory.memory_per_rank); None without a model
    memory: dict[str, float] | None = None
    # the inputs not stated that widened the range: name -> [fastest, slowest ratio to the
    # step, the alternatives tried] (sims.unstated)
    widened_by: dict[str, Any] | None = None
    # where the run does not fit as entered: the other values of the inputs the command does
    # not state that do fit, each as "input value" with its step time's ratio to this one
    fits_with: list[str] | None = None

    @property
    def oom(self) -> bool:
        return self.peak_memory_bytes is not None and \
            self.peak_memory_bytes > self.device_memory_bytes

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "timeline"}
        out["world_size"] = self.nodes * self.devices_per_node
        out["oom"] = self.oom
        return out


# -- inputs ------------------------------------------------------------------------------------

def load_profile(name: str) -> HardwareProfile:
    """--cluster's hardware profile."""
    from sims.hardware import get_profile

    try:
        return get_profile(name)
    except ValueError as exc:
        raise SimulateError(f"--cluster: {exc}") from None


def with_network(hw: HardwareProfile, nic_gbps: float | None, nics: int | None
                 ) -> HardwareProfile:
    """``hw`` with its nodes' network as ``nics`` NICs of ``nic_gbps`` Gb/s each (one
    direction); either left None keeps the profile's figure for it."""
    if nic_gbps is None and nics is None:
        return hw
    if hw.kind != "gpu":
        raise SimulateError("--nic-gbps and --nics-per-node describe GPU nodes' network; the "
                            f"profile {hw.name!r} is a CPU host")
    per_node = nics if nics is not None else hw.devices_per_node
    if nic_gbps is None:  # the profile's rate per NIC, assuming one NIC per device
        bandwidth = hw.inter_node.bandwidth / hw.devices_per_node * per_node
    else:
        bandwidth = nic_gbps * 1e9 / 8 * per_node
    from sims.profile_fields import Link

    return dataclasses.replace(hw, inter_node=Link(hw.inter_node.latency_s, bandwidth))


def host_speed_factor(ns: argparse.Namespace, hw: HardwareProfile) -> float:
    """--host-speed as a factor: 1.0 without it, the probe's figure for auto."""
    from sims.calibrate.probe import check_speed, host_speed

    text = getattr(ns, "host_speed", None)
    if text is None:
        return 1.0
    if str(text).strip().lower() == "auto":
        try:
            return host_speed(hw)
        except ValueError as exc:
            raise SimulateError(f"--host-speed auto: {exc}") from None
    try:
        return check_speed(float(text), "--host-speed")
    except ValueError as exc:
        message = str(exc) if str(exc).startswith("--host-speed") else \
            f"--host-speed: auto or a positive factor (1.2: the host is 20 % slower than " \
            f"its profile), got {text!r}"
        raise SimulateError(message) from None


def read_config(path: str) -> dict[str, Any]:
    """--config's JSON object."""
    from sims.model_files import read_json_object

    return read_json_object(Path(path), "--config", SimulateError)


def validated_config(raw: dict[str, Any], dp: int, source: str) -> FlowtrainConfig:
    """The validated config for ``dp`` data-parallel ranks. The engine's support gate is off:
    the simulator plans what flowtrain cannot run yet (pipeline, tensor parallel)."""
    import warnings

    from flowtrain.config import ConfigError, load_config

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecations are the engine's to report
            return load_config(raw, world_size=dp, check_supported=False)
    except ConfigError as exc:
        raise SimulateError(f"{source}: " + "; ".join(exc.problems)) from None


def _config_parallel(raw: dict[str, Any]) -> tuple[int, int]:
    tp_section = raw.get("tensor_parallel") or {}
    tp = max(int(tp_section.get("tp_size", 1) or 1), int(tp_section.get("autotp_size", 0) or 0))
    stages = (raw.get("pipeline") or {}).get("stages", 1)
    return tp, stages if isinstance(stages, int) and stages > 0 else 1


def model_spec(name: str, seq_len: int | None, micro_batch: int, precision: str) -> ModelSpec:
    """--model's ModelSpec: a preset, an architecture file or a Hugging Face config, or
    "pkg.mod:fn" traced at ``micro_batch`` x ``seq_len`` in ``precision`` (a bad name, file or
    factory raises SimulateError)."""
    from sims.model_files import is_model_file
    from sims.models import get_model, trace_module

    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
    try:
        if ":" in name and not is_model_file(name):
            if seq_len is None:
                raise SimulateError(f"--seq-len is needed to trace {name!r} (the token count "
                                    f"of one sample)")
            return trace_module(name, seq_len=seq_len, batch=micro_batch, dtype=dtype)
        return get_model(name, seq_len)
    except SimulateError:
        raise
    except (ValueError, ImportError, AttributeError, RuntimeError, TypeError) as exc:
        # a factory that is not one (returns no module, wants arguments) is bad input too
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SimulateError(f"--model: {first}") from None


# -- one prediction ----------------------------------------------------------------------------

def predict(model: ModelSpec | None, cfg: FlowtrainConfig, layout: Layout, hw: HardwareProfile,
            *, cluster: str, workload: Workload | None = None, host_speed: float = 1.0,
            options: SimOptions | None = None,
            software: str | None = None, with_range: bool = True) -> Prediction:
    """Plans, executes and measures one configuration. ``model`` is a ModelSpec (memory is
    estimated from it) or None with ``workload`` given (a measured run: no memory figure).
    ``host_speed`` scales every task's duration (the host computes that much slower now than
    its profile says; on a CPU host comm is CPU work too), so the step scales by it.
    ``software``: the training stack whose memory layout the estimate follows
    (``sims.memory.SOFTWARE``; by default the one of the options' framework, as
    ``memory_per_rank`` takes it)."""
    from sims.planner import paused_gc

    # the step's graph is freed when _predict returns, before the collector runs again
    with paused_gc():
        return _predict(model, cfg, layout, hw, cluster=cluster, workload=workload,
                        host_speed=host_speed, options=options, software=software,
                        with_range=with_range)


def _predict(model: ModelSpec | None, cfg: FlowtrainConfig, layout: Layout,
             hw: HardwareProfile, *, cluster: str, workload: Workload | None,
             host_speed: float, options: SimOptions | None, software: str | None,
             with_range: bool) -> Prediction:
    from sims.executor import execute, step_figures
    from sims.planner import Workload, lay_out
    from sims.task_table import TaskTable

    started = time.perf_counter()
    work = workload if workload is not None else Workload.from_model(model, cfg.precision)
    try:
        # laid out once: the range's ends below only price the same tasks otherwise
        laid = lay_out(work, cfg, layout, hw, options)
        plan = laid.price(hw)
    except ValueError as exc:
        raise SimulateError(str(exc)) from None
    tasks = plan.tasks
    if host_speed != 1.0:
        tasks = tasks.scaled(host_speed) if isinstance(tasks, TaskTable) else \
            tuple(dataclasses.replace(t, duration=t.duration * host_speed) for t in tasks)
    timeline = execute(tasks, interference=plan.interference, slowdown=plan.slowdown)
    figures = step_figures(timeline)
    step_range = hardware_range = None
    kernels = hw.gpu_kernels
    if kernels is not None and kernels.ranges and host_speed == 1.0 and with_range:
        from sims.interval import central_interval

        ends = []
        for bound in kernels.bounds():
            bounded = laid.price(dataclasses.replace(hw, kernels=bound))
            ends.append(execute(bounded.tasks, interference=bounded.interference,
                                slowdown=bounded.slowdown).step_time)
        hardware_range = (min(ends), max(ends))
        step_range = central_interval(figures.step_time, hardware_range)
    elapsed = time.perf_counter() - started
    notes = list(getattr(model, "notes", ())) + list(plan.notes)
    if host_speed != 1.0:
        notes.append(f"every task scaled by the host speed {host_speed:.3f} (the host "
                     f"computes {abs(host_speed - 1) * 100:.1f} % "
                     f"{'slower' if host_speed > 1 else 'faster'} than its profile says)")
    peak = memory = None
    if model is not None:
        from sims.memory import memory_per_rank

        if kernels is None and getattr(model, "program", None) is not None:
            # off a GPU profile a traced module keeps what autograd saved in its trace
            model = dataclasses.replace(model, program=None)
        try:
            memory = memory_per_rank(model, cfg, world_size=layout.world_size, tp=layout.tp,
                                     pp=layout.pp, options=_memory_options(hw, options),
                                     software=software)
            peak = float(memory["peak"])
        except (ValueError, KeyError) as exc:
            notes.append(f"no memory estimate: {exc}")
    step = figures.step_time
    peak_flops = hw.peak_flops.get(plan.dtype) or max(hw.peak_flops.values())
    return Prediction(
        model=work.name, cluster=cluster, nodes=layout.nodes,
        devices_per_node=layout.devices_per_node, dp=layout.dp, tp=layout.tp, pp=layout.pp,
        zero_stage=plan.zero_stage, precision=cfg.precision,
        micro_batch_size=plan.micro_batch_size, micro_batches=plan.micro_batches,
        step_time_s=step, samples_per_s=plan.samples_per_step / step if step else 0.0,
        tokens_per_s=plan.tokens_per_step / step if step and plan.tokens_per_step else None,
        mfu=plan.model_flops_per_step / (step * peak_flops * layout.world_size) if step else 0.0,
        resource_s=figures.resource_seconds, comm_s=figures.comm_seconds,
        exposed_comm_s=figures.exposed_comm_seconds, overlap_pct=figures.overlap_pct,
        bubble_pct=figures.bubble_pct, peak_memory_bytes=peak,
        device_memory_bytes=int(hw.device_memory_bytes), tasks=len(plan.tasks),
        simulate_s=elapsed, notes=notes, timeline=timeline, step_time_range_s=step_range,
        hardware_range_s=hardware_range,
        assumptions=assumption_lines(work, cfg, layout, hw, options), memory=memory)


def _memory_options(hw: HardwareProfile, options: SimOptions | None) -> SimOptions | None:
    """The run options as the memory model reads them: on a GPU with kernel figures the
    attention kernel is the profile's flash kernel unless asked otherwise."""
    kernels = hw.gpu_kernels
    if options is None and kernels is None:
        return None
    from sims.layer_ops import SimOptions

    opts = options or SimOptions()
    if opts.attention is None and kernels is None:
        return dataclasses.replace(opts, attention="unfused")
    return opts


def assumption_lines(work: Workload, cfg: FlowtrainConfig, layout: Layout, hw: HardwareProfile,
                     options: SimOptions | None) -> list[str]:
    """Where the prediction's costs come from, one line per kind (``--explain``)."""
    from sims.gpu_costs import collective_algorithm
    from sims.layer_ops import SimOptions, cfg_checkpoints_activations

    opts = options or SimOptions()
    kernels = hw.gpu_kernels
    out = []
    program = getattr(work, "program", None)
    if kernels is None or (work.transformer is None and program is None):
        why = "a CPU host's measured engine costs" if hw.engine else \
            "a roofline with the profile's FLOP-size efficiency curve"
        out.append(f"compute: each parameter's share of the FLOPs priced by {why}")
    else:
        if work.transformer is None and program is not None:
            out += program.summary()
        src = kernels.sources
        attention = opts.attention or kernels.default_attention
        out.append(f"compute: each layer op by op; GEMMs at "
                   f"{kernels.gemm_efficiency.get('bfloat16', 0):.3f} of peak with tile and "
                   f"wave quantization ({src.get('gemm_efficiency', 'profile')})")
        out.append(f"attention: {attention}" + (
            f" ({src.get('attention', 'profile')})" if attention != "unfused"
            else " (scores stored; softmax and dropout memory-bound)"))
        out.append(f"memory-bound ops: at {kernels.memory_efficiency:.2f} of HBM bandwidth "
                   f"({src.get('memory_efficiency', 'profile')}); elementwise "
                   f"{opts.elementwise}; loss {opts.loss_kernel}")
        recompute = opts.recompute or ("full" if cfg_checkpoints_activations(cfg) else "none")
        out.append(f"recompute: {recompute}; sequence parallel: "
                   f"{'yes' if opts.sequence_parallel else 'no'}; context parallel: {opts.cp}; "
                   f"TP overlap: {'yes' if opts.tp_overlap else 'no'}; GEMM dtype: "
                   f"{opts.gemm_dtype or 'training dtype'}")
        dp_nodes = layout.dp_nodes
        out.append(f"collectives: data parallel over {layout.dp} ranks on {dp_nodes} node(s): "
                   f"{collective_algorithm(layout.dp, dp_nodes)}; tensor parallel in a node at "
                   f"the measured NVLink bus bandwidth ({src.get('collectives', 'profile')})")
        out.append(f"overlap: compute {kernels.overlap_slowdown:.0%} slower while NCCL runs "
                   f"beside it ({src.get('overlap_slowdown', 'profile')})")
        slowest = kernels.slowest_device_factor(layout.world_size)
        out.append(f"slowest GPU: compute {slowest - 1:.1%} slower than one GPU's figures, the "
                   f"expected slowest of {layout.world_size} with a spread of "
                   f"{kernels.device_spread:.2%} between GPUs "
                   f"({src.get('device_spread', 'profile')})")
        from sims.frameworks import get_framework

        fw = get_framework(opts.framework)
        out.append(f"framework: {fw.name}: {fw.summary}")
        if kernels.ranges:
            out.append("range: the central 80 % of the step times between each figure's "
                       "ends (sims.interval): " + "; ".join(f"{k} {v[0]:g} (optimistic) to "
                                                           f"{v[1]:g}"
                                             for k, v in kernels.ranges.items()))
    return out


def make_layout(nodes: int, devices_per_node: int, tp: int, pp: int) -> Layout:
    """The cluster layout; an impossible one raises SimulateError."""
    from sims.planner import Layout

    try:
        return Layout(nodes, devices_per_node, tp, pp)
    except ValueError as exc:
        raise SimulateError(str(exc)) from None


@dataclass(frozen=True)
class Inputs:
    """What one configuration of the command's flags resolves to: the predict() arguments."""

    model: ModelSpec
    cfg: FlowtrainConfig
    layout: Layout
    hw: HardwareProfile
    options: SimOptions


def resolve_inputs(ns: argparse.Namespace, raw: dict[str, Any], hw: HardwareProfile,
                   layout_over: dict[str, int], source: str,
                   models: dict[tuple[Any, ...], ModelSpec]) -> Inputs:
    """The model, config, layout and options of the command's flags (``layout_over``: a
    sweep's nodes, tp or pp in their place); ``models`` caches traced models across a
    sweep."""
    config_tp, config_pp = _config_parallel(raw)
    tp = layout_over.get("tp", ns.tp if ns.tp is not None else config_tp)
    pp = layout_over.get("pp", ns.pp if ns.pp is not None else config_pp)
    nodes = layout_over.get("nodes", ns.nodes)
    per_node = ns.devices_per_node or hw.devices_per_node
    layout = make_layout(nodes, per_node, tp, pp)
    cfg = validated_config(raw, layout.dp, source)
    options = sim_options(ns)
    seq_len = _rank_seq_len(ns.model, ns.seq_len, options.cp)
    key = (ns.model, seq_len, cfg.train_micro_batch_size_per_gpu, cfg.precision)
    if key not in models:  # a traced model is traced once per micro-batch size and precision
        models[key] = model_spec(ns.model, seq_len, cfg.micro_batch, cfg.precision)
    return Inputs(models[key], cfg, layout, hw, options)


def predict_config(ns: argparse.Namespace, raw: dict[str, Any], hw: HardwareProfile,
                   cluster: str,
                   layout_over: dict[str, int], source: str,
                   models: dict[tuple[Any, ...], ModelSpec], host_speed: float = 1.0,
                   with_range: bool = True) -> Prediction:
    """One configuration of the command's flags (``resolve_inputs``), predicted."""
    got = resolve_inputs(ns, raw, hw, layout_over, source, models)
    return predict(got.model, got.cfg, got.layout, hw, cluster=cluster, host_speed=host_speed,
                   options=got.options, with_range=with_range)


def predict_widened(ns: argparse.Namespace, raw: dict[str, Any], hw: HardwareProfile,
                    cluster: str,
                    source: str, host_speed: float = 1.0) -> Prediction:
    """``predict_config``'s prediction, its range widened on a GPU profile by what the command
    does not state (``sims.unstated``)."""
    from sims.unstated import parse_assumed, widen

    try:
        parse_assumed(getattr(ns, "assumed", None))
    except ValueError as exc:
        raise SimulateError(str(exc)) from None
    models: dict[tuple[Any, ...], ModelSpec] = {}
    point = predict_config(ns, raw, hw, cluster, {}, source, models, host_speed)
    if hw.kernels is None or hw.kind != "gpu" or \
            host_speed != 1.0:
        return point

    def one(flags: argparse.Namespace, config: dict[str, Any]) -> Prediction:
        return predict_config(flags, config, hw, cluster, {}, source, models, host_speed,
                              with_range=False)

    return widen(point, ns, raw, hw, one)


def sim_options(ns: argparse.Namespace) -> SimOptions:
    """The run options of the command's flags (recompute, sequence and context parallelism,
    attention kernel, TP overlap, fp8 GEMMs)."""
    from sims.layer_ops import SimOptions

    try:
        return SimOptions(recompute=getattr(ns, "recompute", None),
                          sequence_parallel=bool(getattr(ns, "sequence_parallel", False)),
                          attention=getattr(ns, "attention", None),
                          gemm_dtype="float8" if getattr(ns, "fp8", False) else None,
                          cp=int(getattr(ns, "cp", None) or 1),
                          tp_overlap=bool(getattr(ns, "tp_overlap", False)),
                          zero1_reduce="reduce_scatter"
                          if getattr(ns, "zero1_reduce_scatter", False) else None,
                          elementwise=getattr(ns, "elementwise", None) or "fused",
                          loss=getattr(ns, "loss", None),
                          param_gather_overlap=bool(getattr(ns, "overlap_param_gather",
                                                            False)),
                          fsdp=bool(getattr(ns, "fsdp", False)),
                          blocking_p2p=bool(getattr(ns, "blocking_p2p", False)),
                          framework=getattr(ns, "framework", None) or "flowtrain",
                          partition=getattr(ns, "partition", None))
    except ValueError as exc:
        raise SimulateError(f"--{str(exc).split()[0].replace('_', '-')}: {exc}") from None


def _rank_seq_len(name: str, seq_len: int | None, cp: int) -> int | None:
    """One rank's tokens per sample: with context parallelism, 1/cp of the sequence."""
    if cp == 1:
        return seq_len
    from sims.model_files import is_model_file
    from sims.models import PRESETS, get_model

    full = seq_len
    if full is None and (name in PRESETS or is_model_file(name)):
        try:
            full = get_model(name).seq_len
        except ValueError as exc:
            raise SimulateError(f"--model: {exc}") from None
    if full is None:
        raise SimulateError(f"--cp {cp} needs --seq-len (the whole sequence, split over the "
                            f"context-parallel ranks)")
    if full % cp:
        raise SimulateError(f"--cp {cp} must divide the sequence length {full}")
    return full // cp
