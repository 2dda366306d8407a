"""``flowtrain simulate``: predicts a training step (time, throughput, MFU, communication
overlap, pipeline bubble, peak memory per rank) for a model + ds_config + cluster, sweeps config
keys, and holds a prediction against a measured run (``--compare runs/<id>``). The command and
its report; one prediction is ``sims.prediction``, a sweep ``sims.sweep``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from flowtrain.plan.partition import PARTITIONS
from sims.frameworks import FRAMEWORKS, LOSSES
from sims.prediction import (
    DEFAULT_CLUSTER,
    Prediction,
    SimulateError,
    host_speed_factor,
    load_profile,
    predict,
    predict_widened,
    read_config,
    with_network,
)
from sims.sweep import parse_sweeps, run_sweep

__all__ = ["DEFAULT_CLUSTER", "Prediction", "SimulateError", "add_arguments", "memory_lines",
           "predict", "report_lines", "run", "sweep_lines"]


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
    p.add_argument("--nic-gbps", type=float, default=None, metavar="G",
                   help="each NIC's line rate between nodes in Gb/s, one direction (200: HDR "
                        "InfiniBand or 200G RoCE, 400: NDR; default: the profile's)")
    p.add_argument("--nics-per-node", type=int, default=None, metavar="N",
                   help="NICs per node for --nic-gbps (default: one per GPU of the profile)")
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
    p.add_argument("--explain", action="store_true",
                   help="also print what the prediction assumed (cost sources, algorithms)")
    run_opts = p.add_argument_group("how the run trains (beyond the ds_config)")
    run_opts.add_argument("--recompute", choices=("none", "selective", "op", "full"),
                          help="activation recompute: selective = Megatron's attention core, "
                               "op = torchtitan's per-op checkpointing (default: full when the "
                               "config checkpoints activations, else none)")
    run_opts.add_argument("--sequence-parallel", action="store_true",
                          help="Megatron sequence parallelism over the tensor-parallel ranks")
    run_opts.add_argument("--cp", type=int, default=None, metavar="N",
                          help="context-parallel ranks (counted within the data-parallel "
                               "ones; each holds 1/N of every sequence)")
    run_opts.add_argument("--attention", choices=("flash2", "flash3", "flash-triton", "unfused"),
                          help="attention kernel (default: the GPU profile's); flash-triton "
                               "is FlashAttention in Triton (MPT's attn_impl triton)")
    run_opts.add_argument("--tp-overlap", action="store_true",
                          help="tensor-parallel collectives overlapped with the GEMMs")
    run_opts.add_argument("--fp8", action="store_true", help="fp8 GEMMs (Transformer Engine)")
    run_opts.add_argument("--zero1-reduce-scatter", action="store_true",
                          help="ZeRO-1 reduce-scatters gradients (DeepSpeed, Megatron's "
                               "distributed optimizer) instead of flowtrain's all-reduce")
    run_opts.add_argument("--framework", choices=tuple(FRAMEWORKS), default=None,
                          help="the framework the run trains with, for what it does beyond "
                               "the config (its buckets, overlaps, pipeline sends, ZeRO-3 "
                               "units, memory layout; --explain says which; default: "
                               "flowtrain)")
    run_opts.add_argument("--elementwise", choices=("fused", "eager"), default=None,
                          help="memory-bound ops as fused kernels (default) or as eager "
                               "PyTorch's primitive kernels (no torch.compile)")
    run_opts.add_argument("--loss", choices=LOSSES, default=None,
                          help="the cross-entropy's kernels: fused, eager (torch's "
                               "F.cross_entropy over fp32 logits) or megatron (Megatron's "
                               "vocab-parallel one; default: the framework's)")
    run_opts.add_argument("--overlap-param-gather", action="store_true",
                          help="ZeRO 1-2: gather the updated parameters under the next "
                               "forward (Megatron's --overlap-param-gather)")
    run_opts.add_argument("--fsdp", action="store_true",
                          help="ZeRO-3 as PyTorch FSDP shards: a unit per transformer block, "
                               "the next one prefetched")
    run_opts.add_argument("--partition", choices=PARTITIONS, default=None,
                          help="how a preset is cut into pipeline stages: layers (even layer "
                               "counts, Megatron), parameters (balanced parameter counts, "
                               "DeepSpeed's PipelineModule), balanced (forward FLOPs with the "
                               "LM head's), ends (even, the embedding and the loss counted as "
                               "a layer each: Llama 3; default: the framework's)")
    run_opts.add_argument("--blocking-p2p", action="store_true",
                          help="pipeline stages wait for each send before their next pass")
    run_opts.add_argument("--assumed", metavar="INPUT[,INPUT]", default=None,
                          help="inputs given but not known (micro-batch, recompute, "
                               "attention): the range covers their alternatives, as it does "
                               "for --attention and --recompute left out and a config without "
                               "a micro-batch")
    p.add_argument("--host-speed", metavar="auto|FACTOR", default=None,
                   help="a calibrated CPU host's speed now against its profile, every task "
                        "scaled by it: a factor (1.2: 20%% slower than at calibration) or auto "
                        "(time the calibration's probe pass now, half a second)")


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
             f"  step time        {_seconds(p.step_time_s)}" + (
                 f"  (range {_seconds(p.step_time_range_s[0])} - "
                 f"{_seconds(p.step_time_range_s[1])}"
                 + (f", with {', '.join(p.widened_by)} not stated" if p.widened_by else "")
                 + ")" if p.step_time_range_s else ""),
             f"  throughput       {p.samples_per_s:,.1f} samples/s" +
             (f", {p.tokens_per_s:,.0f} tokens/s" if p.tokens_per_s else ""),
             f"  MFU              {100 * p.mfu:.1f} %",
             (f"  exposed comm     {_seconds(p.exposed_comm_s)} of {_seconds(p.comm_s)} "
             f"(overlap {'n/a' if p.overlap_pct is None else f'{p.overlap_pct:.1f} %'})"),
             f"  pipeline bubble  {p.bubble_pct:.1f} %"]
    if p.peak_memory_bytes is not None:
        flag = "  OOM" if p.oom else ""
        stage = f" (pipeline stage {int(p.memory['pipeline_stage'])})" \
            if p.memory and p.pp > 1 else ""
        lines.append(f"  peak memory      {_gib(p.peak_memory_bytes)} per rank of "
                     f"{_gib(p.device_memory_bytes)}{stage}{flag}")
        if p.memory:
            lines += memory_lines(p.memory)
        if p.oom and p.fits_with:
            lines.append(f"    fits instead with one unstated input changed: "
                         f"{'; '.join(p.fits_with)}")
    lines.append("  time per resource (busy, per rank):")
    for name, seconds in p.resource_s.items():
        lines.append(f"    {name:<10} {_seconds(seconds)}")
    lines += [f"  note: {n}" for n in p.notes]
    lines.append(f"  ({p.tasks:,} tasks simulated in {p.simulate_s:.2f} s)")
    return lines


def memory_lines(m: dict[str, float]) -> list[str]:
    """The peak rank's memory part by part (``sims.memory.memory_per_rank``'s breakdown)."""
    held = int(m["in_flight_micro_batches"])
    chunks = " (model chunks)" if held > m["pp"] > 1 else ""
    lines = [f"    parameters {_gib(m['parameters'])}, gradients {_gib(m['gradients'])}, "
             f"optimizer states {_gib(m['optimizer'])}",
             f"    activations {_gib(m['activations'])} ({held} micro-batch"
             f"{'es' if held != 1 else ''}{chunks} in flight"
             f"{', checkpointed' if m['checkpointing'] else ''}; loss end and recompute "
             f"{_gib(m['activation_temporaries'])})",
             f"    buffers {_gib(m['buffers'])} (gradient buckets "
             f"{m['gradient_buckets'] / 2**30:.1f}, gathered parameters "
             f"{m['gathered_parameters'] / 2**30:.1f}, fp32 gradients "
             f"{m['fp32_gradients'] / 2**30:.1f})"]
    if m["host"]:
        lines.append(f"    on the host {_gib(m['host'])}")
    return lines


def sweep_lines(results: list[tuple[dict[str, Any], Any]]) -> list[str]:
    """The sweep as a table (``run_sweep``'s order: what fits, by throughput, then what does
    not). Each column has one unit, named in its header, so that rows compare by eye; a row
    that does not fit says OOM in its own column."""
    keys = list(results[0][0]) if results else []
    head = [*keys, "fits", "step (s)", "samples/s", "tokens/s", "MFU %", "exposed (s)",
            "bubble %", "memory (GiB)"]
    rows = []
    for chosen, result in results:
        values = [json.dumps(chosen[k]) if not isinstance(chosen[k], str) else chosen[k]
                  for k in keys]
        if isinstance(result, Prediction):
            memory = "-" if result.peak_memory_bytes is None else \
                f"{result.peak_memory_bytes / 2**30:.1f}"
            rows.append([*values, "OOM" if result.oom else "yes",
                         f"{result.step_time_s:.4g}", f"{result.samples_per_s:,.1f}",
                         f"{result.tokens_per_s:,.0f}" if result.tokens_per_s else "-",
                         f"{100 * result.mfu:.1f}", f"{result.exposed_comm_s:.4g}",
                         f"{result.bubble_pct:.1f}", memory])
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
    for flag in ("nodes", "devices_per_node", "tp", "pp", "seq_len", "cp", "nic_gbps",
                 "nics_per_node"):
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
    hw = with_network(load_profile(cluster), ns.nic_gbps, ns.nics_per_node)
    speed = host_speed_factor(ns, hw)
    raw = read_config(ns.config)
    if sweeps:
        results = run_sweep(ns, raw, hw, cluster, sweeps, speed)
        best = next((r for _, r in results if isinstance(r, Prediction)), None)
        if ns.json:
            print(json.dumps({"sweep": [{"values": v, **(r.to_dict() if isinstance(
                r, Prediction) else {"error": r})} for v, r in results]}, indent=1))
        else:
            fits = sum(isinstance(r, Prediction) and not r.oom for _, r in results)
            print(f"{len(results)} configurations of {ns.model} on {cluster}, {fits} fit the "
                  f"devices' memory; those first, best throughput first:")
            print("\n".join(sweep_lines(results)))
        if best is not None and ns.trace:
            _write_trace(best, ns.trace, ns.json)
        return 0 if best is not None else 1
    prediction = predict_widened(ns, raw, hw, cluster, f"config file {ns.config}", speed)
    if ns.json:
        print(json.dumps(prediction.to_dict(), indent=1))
    else:
        print("\n".join(report_lines(prediction)))
        if ns.explain:
            print("  assumed:")
            print("\n".join(f"    {line}" for line in prediction.assumptions))
    if ns.trace:
        _write_trace(prediction, ns.trace, ns.json)
    return 0


def _write_trace(prediction: Prediction, path: str, quiet: bool) -> None:
    from sims.trace import write_trace

    try:
        out = write_trace(prediction.timeline, path, label=f"{prediction.model} (simulated)",
                          ranks_per_stage=prediction.dp * prediction.tp)
    except OSError as exc:
        raise SimulateError(f"--trace: cannot write {path!r}: {exc.strerror or exc}") from None
    if not quiet:
        print(f"  trace written to {out} (open in ui.perfetto.dev or chrome://tracing)")


def _run_compare(ns: argparse.Namespace) -> int:
    from sims.compare import comparison_rows, measured_classes, predict_run, predicted_classes

    record, prediction = predict_run(ns.compare, ns.cluster or "this-host", nodes=ns.nodes,
                                     devices_per_node=ns.devices_per_node, ns=ns)
    world = int(record.plan["world_size"])
    pp = prediction.pp
    cluster = prediction.cluster
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

