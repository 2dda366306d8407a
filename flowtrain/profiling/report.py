"""The text ``FlopsProfiler.print_model_profile`` prints: a summary (totals, throughput, MFU),
the top modules at each depth, and the module tree with each module's figures; the same
sections as DeepSpeed's profile so its readers find their way around."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from flowtrain.profiling.peak import NO_PEAK, find_peak
from flowtrain.profiling.rows import ModuleRow
from flowtrain.profiling.units import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
    percent,
)

if TYPE_CHECKING:
    from flowtrain.engine.parts import ProfiledEngine


class Profile(Protocol):
    """What the report reads of a profiler (``FlopsProfiler``): its model, settings, totals and
    module rows."""

    model: nn.Module
    ds_engine: Any
    recompute_fwd_factor: float
    peak_tflops: float | None

    def get_total_flops(self, as_string: bool = False) -> int | str: ...

    def get_total_macs(self, as_string: bool = False) -> int | str: ...

    def get_total_params(self, as_string: bool = False) -> int | str: ...

    def get_total_duration(self, as_string: bool = False) -> float | str: ...

    def module_rows(self, depth: int = -1) -> list[ModuleRow]: ...

_WIDTH = 62  # column where summary values start


def _line(label: str, value: Any) -> str:
    return f"{label + ':':<{_WIDTH}} {value}"


def _engine_step(engine: ProfiledEngine | None) -> dict[str, float]:
    """The engine's last step, in seconds per phase (forward_s, backward_s, comm_s,
    optimizer_s, step_s); empty without an engine or before its first step."""
    timer = getattr(engine, "timer", None)
    try:
        return dict(timer.breakdown(1)) if timer is not None else {}
    except Exception:  # another engine's timer: the summary just lacks the step lines
        return {}


def _model_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    return torch.float32, torch.device("cpu")


def _summary(prof: Profile, profile_step: int) -> list[str]:
    engine = prof.ds_engine
    r = prof.recompute_fwd_factor
    flops = int(prof.get_total_flops())
    macs = int(prof.get_total_macs())
    params = int(prof.get_total_params())
    fwd_s = float(prof.get_total_duration())
    if engine is not None and hasattr(engine, "world_size"):
        world = int(engine.world_size)
    else:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    # DeepSpeed's engine methods, which flowtrain's engine has too
    micro = engine.train_micro_batch_size_per_gpu() if engine is not None else None
    gas = engine.gradient_accumulation_steps() if engine is not None else 1
    out = [
        "-------------------------- flowtrain FLOPs profiler --------------------------",
        f"Profile summary at step {profile_step}:",
        "Notation: params (parameters), MACs (multiply-accumulates), flops (floating-point",
        "operations, 2 per MAC, matmul-like ops only), FLOPS (flops per second), fwd/bwd",
        "(forward/backward pass), step latency (gradient wait + optimizer), iter latency",
        "(the whole training step), MFU (achieved FLOPS / the device's peak FLOPS).",
        "",
        _line("world size", world),
        _line("data parallel size", world),
        _line("model parallel size", 1),
    ]
    if micro is not None:
        out.append(_line("batch size per GPU", micro))
    out += [
        _line("params per GPU", params_to_string(params)),
        _line("params of model = params per GPU * mp_size", params_to_string(params)),
        _line("fwd MACs per GPU", macs_to_string(macs)),
        _line("fwd flops per GPU", number_to_string(flops)),
        _line("fwd flops of model = fwd flops per GPU * mp_size", number_to_string(flops)),
        _line("fwd latency", duration_to_string(fwd_s)),
        _line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency",
              flops_to_string(flops / fwd_s if fwd_s > 0 else 0.0)),
    ]
    step = _engine_step(engine)
    iter_s = step.get("step_s", 0.0)
    if iter_s > 0:
        bwd_s = step.get("backward_s", 0.0) / gas
        step_s = step.get("optimizer_s", 0.0) + step.get("comm_s", 0.0)
        factor = f"{2 + r:g}"
        out += [
            _line("bwd latency (mean per micro-batch)", duration_to_string(bwd_s)),
            _line(f"bwd FLOPS per GPU = {factor} * fwd flops per GPU / bwd latency",
                  flops_to_string((2 + r) * flops / bwd_s if bwd_s > 0 else 0.0)),
            _line(f"fwd+bwd FLOPS per GPU = {3 + r:g} * fwd flops per GPU / (fwd+bwd latency)",
                  flops_to_string((3 + r) * flops / (fwd_s + bwd_s) if fwd_s + bwd_s > 0
                                  else 0.0)),
            _line("step latency", duration_to_string(step_s)),
            _line("iter latency", duration_to_string(iter_s)),
        ]
        if micro is not None:
            out.append(_line("samples/second", f"{micro * gas / iter_s:.2f}"))
        step_flops = (3 + r) * flops * gas
        achieved = step_flops / iter_s
        out += [
            _line(f"step flops per GPU = {3 + r:g} * fwd flops per GPU * {gas} micro-batches",
                  number_to_string(step_flops)),
            _line("achieved FLOPS per GPU = step flops / iter latency", flops_to_string(achieved)),
        ]
        mfu_label = "MFU (training step)"
    else:
        achieved = flops / fwd_s if fwd_s > 0 else 0.0
        mfu_label = "MFU (forward only)"
    dtype, device = _model_dtype_device(prof.model)
    peak = find_peak(dtype, device, prof.peak_tflops)
    if peak is None:
        out.append(NO_PEAK)
    else:
        out.append(_line("peak FLOPS per GPU", f"{flops_to_string(peak.flops_per_s)} "
                                               f"({peak.source})"))
        out.append(_line(mfu_label, f"{100.0 * achieved / peak.flops_per_s:.2f}%"))
    return out


def _aggregated(rows: list[ModuleRow], max_depth: int, top: int) -> list[str]:
    out = ["",
           "----------------------------- Aggregated profile per GPU -----------------------------",
           f"Top {top} modules in terms of params, MACs or fwd latency at each depth (modules of "
           f"one class at a depth are summed):"]
    for depth in range(max_depth + 1):
        at = [r for r in rows if r.depth == depth]
        if not at:
            break
        sums: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])
        for r in at:
            s = sums[r.type_name]
            s[0] += r.params
            s[1] += r.macs
            s[2] += r.duration
        out += [f"depth {depth}:",
                f"    params      - {_best(sums, 0, params_to_string, top)}",
                f"    MACs        - {_best(sums, 1, macs_to_string, top)}",
                f"    fwd latency - {_best(sums, 2, duration_to_string, top)}"]
    return out


def _best(sums: dict[str, list[float]], i: int, fmt: Any, top: int) -> str:
    """The ``top`` classes by figure ``i`` of ``sums``, as DeepSpeed prints them."""
    ranked = sorted(((v[i], k) for k, v in sums.items() if v[i] > 0), key=lambda kv: -kv[0])[:top]
    return "{" + ", ".join(f"'{k}': '{fmt(v)}'" for v, k in ranked) + "}"


def _detailed(prof: Profile, rows: list[ModuleRow], max_depth: int) -> list[str]:
    by_name = {r.name: r for r in rows}
    root = by_name[""]
    out = ["",
           "------------------------------ Detailed profile per GPU ------------------------------",
           "Each module's profile follows its name: params, % of total params, MACs, % of total",
           "MACs, fwd flops, fwd latency, % of total fwd latency, fwd FLOPS (achieved), and the",
           "number of calls when the module ran more than once.",
           "",
           "Note: work a module does itself (functional calls such as attention's matmuls) counts",
           "in that module but in none of its children, so a parent can exceed the sum of its",
           "children. Only matmul-like operations are counted (flops = 2 * MACs); latencies of",
           "the profiled forward include the profiler's own hooks.",
           ""]

    def figures(r: ModuleRow) -> str:
        text = (f"{params_to_string(r.params)}, {percent(r.params, root.params)} Params, "
                f"{macs_to_string(r.macs)}, {percent(r.macs, root.macs)} MACs, "
                f"{number_to_string(r.flops)} flops, {duration_to_string(r.duration)}, "
                f"{percent(r.duration, root.duration)} latency, {flops_to_string(r.flops_per_s)}")
        return text + (f", {r.calls} calls" if r.calls > 1 else "")

    seen: set[int] = set()

    def visit(name: str, module: nn.Module, label: str, indent: str) -> None:
        if id(module) in seen:  # a module registered twice: its figures are at its first place
            out.append(f"{indent}{label}{type(module).__name__}(same module as above)")
            return
        seen.add(id(module))
        r = by_name.get(name)
        if r is None:
            return
        children = list(module.named_children())
        if not children or r.depth >= max_depth:
            out.append(f"{indent}{label}{type(module).__name__}({figures(r)})")
            return
        out.append(f"{indent}{label}{type(module).__name__}(")
        out.append(f"{indent}  {figures(r)},")
        for child_name, child in children:
            full = f"{name}.{child_name}" if name else child_name
            visit(full, child, f"({child_name}): ", indent + "  ")
        out.append(f"{indent})")

    visit("", prof.model, "", "")
    return out


def render(prof: Profile, *, profile_step: int, module_depth: int, top_modules: int,
           detailed: bool) -> str:
    rows = prof.module_rows()
    deepest = max(r.depth for r in rows)
    max_depth = deepest if module_depth == -1 else min(module_depth, deepest)
    lines = _summary(prof, profile_step)
    lines += _aggregated(rows, max_depth, top_modules)
    if detailed:
        lines += _detailed(prof, [r for r in rows if r.depth <= max_depth], max_depth)
    lines.append("-" * 86)
    return "\n".join(lines)
