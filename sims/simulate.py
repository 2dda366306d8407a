"""``flowtrain simulate``: predicts a training step (time, throughput, MFU, communication
overlap, pipeline bubble, peak memory per rank) for a model + ds_config + cluster, sweeps config
keys, and holds a prediction against a measured run (``--compare runs/<id>``)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import itertools
import json
import sys
import time
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_CLUSTER = "h100-x8"
# Sweepable besides config keys: the cluster layout.
LAYOUT_KEYS = ("nodes", "tp", "pp")
_PROGRESS_FROM = 4  # sweeps of at least this many runs show progress (on a terminal)


class SimulateError(ValueError):
    """Bad input to ``flowtrain simulate``: one line naming the value and the valid choices."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's flags (argparse only: nothing heavy is imported here)."""
    p.add_argument("--model", metavar="NAME|pkg.mod:fn",
                   help="a preset (gpt2, gpt2-xl, llama2-70b, ...) or a factory returning an "
                        "nn.Module, traced on the meta device")
    p.add_argument("--config", metavar="ds_config.json", help="the DeepSpeed/flowtrain config")
    p.add_argument("--cluster", metavar="PROFILE",
                   help=f"hardware profile: a builtin name, a profile JSON path or this-host "
                        f"(default: {DEFAULT_CLUSTER}; with --compare, this-host)")
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default: 1)")
    p.add_argument("--devices-per-node", type=int, default=None, metavar="N",
                   help="ranks per node (default: the profile's devices per node; with "
                        "--compare, the run's world size / --nodes)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel size (default: the config's tensor_parallel, else 1)")
    p.add_argument("--pp", type=int, default=None,
                   help="pipeline stages (default: the config's pipeline.stages, else 1)")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="sequence length (default: the preset's context; needed to trace)")
    p.add_argument("--trace", metavar="out.json",
                   help="write the predicted step as Chrome/Perfetto trace JSON")
    p.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help="try each value of a dotted config key (or nodes, tp, pp); repeat for "
                        "a cross product, ranked by throughput")
    p.add_argument("--compare", metavar="RUN_DIR",
                   help="predict a launched run (runs/<id>: plan.json, spans/) and print "
                        "predicted vs measured per task class")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--host-speed", metavar="auto|FACTOR", default=None,
                   help="a calibrated CPU host's speed now against its profile, every task "
                        "scaled by it: a factor (1.2: 20%% slower than at calibration) or auto "
                        "(time the calibration's probe pass now, half a second)")


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

def _profile(name: str) -> Any:
    from sims.hardware import get_profile

    try:
        return get_profile(name)
    except ValueError as exc:
        raise SimulateError(f"--cluster: {exc}") from None


def _host_speed(ns: argparse.Namespace, hw: Any) -> float:
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


def _read_config(path: str) -> dict[str, Any]:
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as exc:
        raise SimulateError(f"--config: cannot read {path!r}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise SimulateError(f"--config: {path!r} is not valid JSON (line {exc.lineno} column "
                            f"{exc.colno}: {exc.msg})") from None
    if not isinstance(raw, dict):
        raise SimulateError(f"--config: {path!r} must hold a JSON object, got "
                            f"{type(raw).__name__}")
    return raw


def _load_config(raw: dict[str, Any], dp: int, source: str) -> Any:
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


def _model(name: str, seq_len: int | None, micro_batch: int, precision: str) -> Any:
    from sims.models import get_model, trace_module

    dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[precision]
    try:
        if ":" in name:
            if seq_len is None:
                raise SimulateError(f"--seq-len is needed to trace {name!r} (the token count "
                                    f"of one sample)")
            return trace_module(name, seq_len=seq_len, batch=micro_batch, dtype=dtype)
        return get_model(name, seq_len)
    except SimulateError:
        raise
    except (ValueError, ImportError, AttributeError, RuntimeError) as exc:
        raise SimulateError(f"--model: {exc}") from None


# -- one prediction ----------------------------------------------------------------------------

def predict(model: Any, cfg: Any, layout: Any, hw: Any, *, cluster: str,
            workload: Any = None, host_speed: float = 1.0) -> Prediction:
    """Plans, executes and measures one configuration. ``model`` is a ModelSpec (memory is
    estimated from it) or None with ``workload`` given (a measured run: no memory figure).
    ``host_speed`` scales every task's duration (the host computes that much slower now than
    its profile says; on a CPU host comm is CPU work too), so the step scales by it."""
    from sims.executor import execute, step_figures
    from sims.planner import Workload, build_plan

    started = time.perf_counter()
    work = workload if workload is not None else Workload.from_model(model, cfg.precision)
    try:
        plan = build_plan(work, cfg, layout, hw)
    except ValueError as exc:
        raise SimulateError(str(exc)) from None
    tasks = plan.tasks
    if host_speed != 1.0:
        tasks = [dataclasses.replace(t, duration=t.duration * host_speed) for t in tasks]
    timeline = execute(tasks, interference=plan.interference, slowdown=plan.slowdown)
    figures = step_figures(timeline)
    elapsed = time.perf_counter() - started
    notes = list(plan.notes)
    if host_speed != 1.0:
        notes.append(f"every task scaled by the host speed {host_speed:.3f} (the host "
                     f"computes {abs(host_speed - 1) * 100:.1f} % "
                     f"{'slower' if host_speed > 1 else 'faster'} than its profile says)")
    peak = None
    if model is not None:
        from sims.memory import memory_per_rank

        try:
            peak = float(memory_per_rank(model, cfg, world_size=layout.world_size, tp=layout.tp,
                                         pp=layout.pp)["peak"])
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
        simulate_s=elapsed, notes=notes, timeline=timeline)


def _layout(nodes: int, devices_per_node: int, tp: int, pp: int) -> Any:
    from sims.planner import Layout

    try:
        return Layout(nodes, devices_per_node, tp, pp)
    except ValueError as exc:
        raise SimulateError(str(exc)) from None


def _predict_config(ns: argparse.Namespace, raw: dict[str, Any], hw: Any, cluster: str,
                    layout_over: dict[str, int], source: str,
                    models: dict[tuple[Any, ...], Any], host_speed: float = 1.0) -> Prediction:
    config_tp, config_pp = _config_parallel(raw)
    tp = layout_over.get("tp", ns.tp if ns.tp is not None else config_tp)
    pp = layout_over.get("pp", ns.pp if ns.pp is not None else config_pp)
    nodes = layout_over.get("nodes", ns.nodes)
    per_node = ns.devices_per_node or hw.devices_per_node
    layout = _layout(nodes, per_node, tp, pp)
    cfg = _load_config(raw, layout.dp, source)
    key = (ns.model, ns.seq_len, cfg.train_micro_batch_size_per_gpu, cfg.precision)
    if key not in models:  # a traced model is traced once per micro-batch size and precision
        models[key] = _model(ns.model, ns.seq_len, cfg.train_micro_batch_size_per_gpu,
                             cfg.precision)
    return predict(models[key], cfg, layout, hw, cluster=cluster, host_speed=host_speed)


# -- sweeps ------------------------------------------------------------------------------------

def _annotation_parts(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    if not args:
        return [annotation]
    return [part for a in args for part in _annotation_parts(a)] + [annotation]


def config_keys() -> tuple[set[str], set[str]]:
    """Dotted keys of the config schema: (leaf keys, prefixes that take any sub-key: dict-valued
    params and sections that allow extra keys)."""
    from pydantic import BaseModel

    from flowtrain.config import FlowtrainConfig

    leaves: set[str] = set()
    open_prefixes: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        if model.model_config.get("extra") == "allow" and prefix:
            open_prefixes.add(prefix.rstrip("."))
        for name, info in model.model_fields.items():
            path = prefix + name
            parts = _annotation_parts(info.annotation)
            sections = [a for a in parts if isinstance(a, type) and issubclass(a, BaseModel)]
            if sections:
                walk(sections[0], path + ".")
                continue
            leaves.add(path)
            if any(a is dict or typing.get_origin(a) is dict for a in parts):
                open_prefixes.add(path)

    walk(FlowtrainConfig, "")
    return leaves, open_prefixes


def parse_sweeps(specs: Sequence[str]) -> list[tuple[str, list[Any]]]:
    """``key=v1,v2`` flags as (key, values); keys checked against the config schema, values
    read as JSON scalars (a bare word is a string)."""
    if not specs:
        return []
    leaves, open_prefixes = config_keys()
    known = sorted(leaves | set(LAYOUT_KEYS))
    out: list[tuple[str, list[Any]]] = []
    for spec in specs:
        key, sep, values_text = spec.partition("=")
        key = key.strip()
        if not sep or not key or not values_text.strip():
            raise SimulateError(f"--sweep {spec!r}: expected KEY=V1,V2,... such as "
                                f"zero_optimization.stage=1,2,3")
        if key not in leaves and key not in LAYOUT_KEYS and \
                not any(key.startswith(p + ".") for p in open_prefixes):
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else \
                f"; keys are dotted config paths such as zero_optimization.stage, or " \
                f"{', '.join(LAYOUT_KEYS)}"
            raise SimulateError(f"--sweep: unknown key {key!r}{hint}")
        if any(k == key for k, _ in out):
            raise SimulateError(f"--sweep: key {key!r} is given twice; list all its values in "
                                f"one --sweep")
        values = [_scalar(key, v.strip()) for v in values_text.split(",")]
        if key in LAYOUT_KEYS and not all(isinstance(v, int) and not isinstance(v, bool)
                                          and v > 0 for v in values):
            raise SimulateError(f"--sweep {key}: values must be integers > 0, got "
                                f"{values_text!r}")
        out.append((key, values))
    return out


def _scalar(key: str, text: str) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(value, (list, dict)):
        raise SimulateError(f"--sweep {key}: values must be JSON scalars (number, true/false, "
                            f"null or a word), got {text!r}")
    return value


def _with_value(raw: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(raw)
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value
    return out


class _Progress:
    """A progress bar on stderr for long sweeps (rich when installed, else a counter); silent
    when stderr is not a terminal."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self._rich: Any = None
        self._task: Any = None
        self.active = total >= _PROGRESS_FROM and sys.stderr.isatty()
        if not self.active:
            return
        try:
            from rich.console import Console
            from rich.progress import Progress

            self._rich = Progress(console=Console(stderr=True), transient=True)
            self._rich.start()
            self._task = self._rich.add_task("simulating", total=total)
        except ImportError:
            self._rich = None

    def advance(self) -> None:
        self.done += 1
        if not self.active:
            return
        if self._rich is not None:
            self._rich.update(self._task, advance=1)
        else:
            print(f"\rsimulated {self.done}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.active:
            return
        if self._rich is not None:
            self._rich.stop()
        else:
            print(file=sys.stderr)


def run_sweep(ns: argparse.Namespace, raw: dict[str, Any], hw: Any, cluster: str,
              sweeps: list[tuple[str, list[Any]]], host_speed: float = 1.0,
              ) -> list[tuple[dict[str, Any], Any]]:
    """Every combination: (its values, a Prediction or the one-line reason it cannot run),
    best throughput first, failures last."""
    combos = list(itertools.product(*[values for _, values in sweeps]))
    progress = _Progress(len(combos))
    models: dict[tuple[Any, ...], Any] = {}
    results: list[tuple[dict[str, Any], Any]] = []
    try:
        for combo in combos:
            chosen = dict(zip([k for k, _ in sweeps], combo))
            config = raw
            layout_over: dict[str, int] = {}
            for key, value in chosen.items():
                if key in LAYOUT_KEYS:
                    layout_over[key] = value
                else:
                    config = _with_value(config, key, value)
            try:
                result: Any = _predict_config(ns, config, hw, cluster, layout_over, "config",
                                              models, host_speed)
            except SimulateError as exc:
                if str(exc).startswith("--model"):
                    raise
                result = str(exc)
            results.append((chosen, result))
            progress.advance()
    finally:
        progress.close()
    results.sort(key=lambda r: -r[1].samples_per_s if isinstance(r[1], Prediction) else 1.0)
    return results


# -- output ------------------------------------------------------------------------------------

def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s >= 10:
        return f"{s:.1f} s"
    if s >= 1:
        return f"{s:.3f} s"
    return f"{s * 1e3:.2f} ms"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def report_lines(p: Prediction) -> list[str]:
    """The human-readable report of one prediction."""
    layout = f"{p.nodes} x {p.devices_per_node} ranks on {p.cluster}: dp {p.dp}, tp {p.tp}, " \
             f"pp {p.pp}"
    samples = p.micro_batch_size * p.micro_batches * p.dp
    lines = [f"{p.model}, {layout}",
             (f"  ZeRO stage {p.zero_stage}, {p.precision}, micro-batch {p.micro_batch_size} x "
             f"{p.micro_batches} {'micro-batches' if p.pp > 1 else 'accumulation steps'} x dp "
             f"{p.dp} = {samples} samples/step"),
             f"  step time        {_seconds(p.step_time_s)}",
             f"  throughput       {p.samples_per_s:,.1f} samples/s" +
             (f", {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else ""),
             f"  MFU              {100 * p.mfu:.1f} %",
             (f"  exposed comm     {_seconds(p.exposed_comm_s)} of {_seconds(p.comm_s)} "
             f"(overlap {'n/a' if p.overlap_pct is None else f'{p.overlap_pct:.1f} %'})"),
             f"  pipeline bubble  {p.bubble_pct:.1f} %"]
    if p.peak_memory_bytes is not None:
        flag = "  OOM" if p.oom else ""
        lines.append(f"  peak memory      {_gib(p.peak_memory_bytes)} per rank of "
                     f"{_gib(p.device_memory_bytes)}{flag}")
    lines.append("  time per resource (busy, per rank):")
    for name, seconds in p.resource_s.items():
        lines.append(f"    {name:<10} {_seconds(seconds)}")
    lines += [f"  note: {n}" for n in p.notes]
    lines.append(f"  ({p.tasks:,} tasks simulated in {p.simulate_s:.2f} s)")
    return lines


def sweep_lines(results: list[tuple[dict[str, Any], Any]]) -> list[str]:
    """The sweep as a table ranked by throughput."""
    keys = list(results[0][0]) if results else []
    head = [*keys, "step", "samples/s", "tokens/s", "MFU", "exposed", "bubble", "memory"]
    rows = []
    for chosen, result in results:
        values = [json.dumps(chosen[k]) if not isinstance(chosen[k], str) else chosen[k]
                  for k in keys]
        if isinstance(result, Prediction):
            memory = "-" if result.peak_memory_bytes is None else \
                _gib(result.peak_memory_bytes) + (" OOM" if result.oom else "")
            rows.append([*values, _seconds(result.step_time_s), f"{result.samples_per_s:,.1f}",
                         f"{result.tokens_per_s:,.0f}" if result.tokens_per_s else "-",
                         f"{100 * result.mfu:.1f} %", _seconds(result.exposed_comm_s),
                         f"{result.bubble_pct:.1f} %", memory])
        else:
            rows.append([*values, f"cannot run: {result}"])
    widths = [max(len(str(r[i])) for r in [head] + [r for r in rows if len(r) > i])
              for i in range(len(head))]
    out = ["  ".join(h.ljust(w) for h, w in zip(head, widths))]
    for row in rows:
        out.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return out


# -- entry -------------------------------------------------------------------------------------

def run(ns: argparse.Namespace) -> int:
    """Runs the subcommand; input problems raise SimulateError (one line, exit 2)."""
    for flag in ("nodes", "devices_per_node", "tp", "pp", "seq_len"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            raise SimulateError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if ns.compare:
        return _run_compare(ns)
    missing = [f for f in ("model", "config") if getattr(ns, f) is None]
    if missing:
        raise SimulateError(f"missing {' and '.join('--' + m for m in missing)}; usage: "
                            f"flowtrain simulate --model NAME --config ds_config.json "
                            f"[--cluster {DEFAULT_CLUSTER}] [--nodes N]")
    sweeps = parse_sweeps(ns.sweep)
    cluster = ns.cluster or DEFAULT_CLUSTER
    hw = _profile(cluster)
    speed = _host_speed(ns, hw)
    raw = _read_config(ns.config)
    if sweeps:
        results = run_sweep(ns, raw, hw, cluster, sweeps, speed)
        best = next((r for _, r in results if isinstance(r, Prediction)), None)
        if ns.json:
            print(json.dumps({"sweep": [{"values": v, **(r.to_dict() if isinstance(
                r, Prediction) else {"error": r})} for v, r in results]}, indent=1))
        else:
            print(f"{len(results)} configurations of {ns.model} on {cluster}, best first:")
            print("\n".join(sweep_lines(results)))
        if best is not None and ns.trace:
            _write_trace(best, ns.trace, ns.json)
        return 0 if best is not None else 1
    prediction = _predict_config(ns, raw, hw, cluster, {}, f"config file {ns.config}", {},
                                 speed)
    if ns.json:
        print(json.dumps(prediction.to_dict(), indent=1))
    else:
        print("\n".join(report_lines(prediction)))
    if ns.trace:
        _write_trace(prediction, ns.trace, ns.json)
    return 0


def _write_trace(prediction: Prediction, path: str, quiet: bool) -> None:
    from sims.trace import write_trace

    try:
        out = write_trace(prediction.timeline, path, label=f"{prediction.model} (simulated)")
    except OSError as exc:
        raise SimulateError(f"--trace: cannot write {path!r}: {exc.strerror or exc}") from None
    if not quiet:
        print(f"  trace written to {out} (open in ui.perfetto.dev or chrome://tracing)")


def _run_compare(ns: argparse.Namespace) -> int:
    from sims.compare import comparison_rows, measured_classes, predicted_classes, read_run
    from sims.planner import Workload

    try:
        record = read_run(ns.compare)
    except ValueError as exc:
        raise SimulateError(str(exc)) from None
    cluster = ns.cluster or "this-host"
    hw = _profile(cluster)
    speed = _host_speed(ns, hw)
    world = int(record.plan["world_size"])
    if world % ns.nodes:
        raise SimulateError(f"--nodes {ns.nodes} does not divide the run's world size {world}")
    pp = len(record.stages) or 1  # a pipeline run records each stage
    layout = _layout(ns.nodes, ns.devices_per_node or world // ns.nodes, 1, pp)
    if layout.world_size != world:
        raise SimulateError(f"--nodes {ns.nodes} x --devices-per-node {layout.devices_per_node}"
                            f" = {layout.world_size} ranks, but the run had {world}")
    cfg = _load_config(record.plan["config"], layout.dp, f"{record.path / 'plan.json'} config")
    micro_batch = cfg.train_micro_batch_size_per_gpu
    work = Workload.from_stages(record.stages, micro_batch, name=record.path.name) \
        if record.stages else Workload.from_run(record.plan, micro_batch, name=record.path.name)
    prediction = predict(None, cfg, layout, hw, cluster=cluster, workload=work,
                         host_speed=speed)
    empty = [name for name, shape, _, _ in work.params if 0 in shape]
    if empty:
        prediction.notes.append(
            f"plan.json lists {len(empty)} of {len(work.params)} parameters with no elements "
            f"(first: {empty[0]}); ZeRO-3 placeholders recorded instead of the full shapes "
            f"make the prediction miss those parameters")
    predicted = predicted_classes(prediction.timeline)
    measured, steps = measured_classes(record)
    rows = comparison_rows(predicted, measured)
    if ns.json:
        print(json.dumps({"run": str(record.path), "cluster": cluster, "ranks": world,
                          "steps_per_rank": steps, "classes": rows,
                          "prediction": prediction.to_dict()}, indent=1))
    else:
        stages = f", {pp} pipeline stages" if pp > 1 else ""
        print(f"{record.path}: {world} ranks{stages}, ZeRO stage {prediction.zero_stage}, "
              f"{len(record.steps)} ranks x {steps} steps measured, predicted on {cluster}")
        print(f"  {'task class':<10} {'predicted':>12} {'measured':>12} {'error':>9}")
        for row in rows:
            error = "-" if row["error_pct"] is None else f"{row['error_pct']:+.1f} %"
            print(f"  {row['class']:<10} {_seconds(row['predicted_s']):>12} "
                  f"{_seconds(row['measured_s']):>12} {error:>9}")
        for note in prediction.notes:
            print(f"  note: {note}")
    if ns.trace:
        _write_trace(prediction, ns.trace, ns.json)
    return 0
