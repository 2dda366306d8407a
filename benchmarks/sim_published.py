"""`flowtrain simulate` against published large-scale GPU training runs.

Each run of ``benchmarks/published_runs.json`` (papers' and repositories' tables: model shape,
parallel layout, batch, precision, recompute, hardware, and the step time its published
throughput implies, each with its citation and assumptions) is simulated with the builtin
profile of its GPU and network, and the predicted step time is set beside the published one:
signed error per run, then MAPE, mean signed error (bias) and the count of optimistic
predictions per source and overall. Nothing here is fitted to these runs: every factor the
simulator uses is a property of the hardware or software (``sims/gpu_figures.py``). The memory
column is the peak rank's memory as the run's framework lays it out (``SOURCE_FRAMEWORKS``,
``sims.frameworks``, ``sims.memory``), "OOM" where it exceeds the GPU's, with the published
figure beside it where the source states one.

    .venv/bin/python benchmarks/sim_published.py            # the table
    .venv/bin/python benchmarks/sim_published.py --json out.json --source megatron-2021
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from published_set import load_runs, load_split, part_of, split_problems  # noqa: E402

from flowtrain.config import load_config  # noqa: E402
from flowtrain.plan.workload import Layout, Workload  # noqa: E402
from sims.hardware import HardwareProfile, Link, get_profile  # noqa: E402
from sims.layer_ops import SimOptions  # noqa: E402
from sims.memory import memory_per_rank  # noqa: E402
from sims.models import Architecture, spec_from_architecture  # noqa: E402
from sims.prediction import predict  # noqa: E402

# the builtin node profile of each GPU name the runs use
GPU_PROFILES = {"a100-40g": "a100-40g-x8", "a100-80g": "a100-80g-x8", "h100-sxm": "h100-x8",
                "h100-sxm-hbm2e-capped": "h100-hbm2e-x8", "h200": "h200-x8"}
# per-NIC bytes/s of each network the runs name (one direction)
NETWORKS = {"ib-hdr-200": 25e9, "roce-200": 25e9, "ib-ndr-400": 50e9, "roce-400": 50e9,
            "rdma-400": 50e9, "omnipath-100": 12.5e9}
PRECISION = {"fp16": "fp16", "bf16": "bf16", "fp8": "bf16"}
# the framework each source trained with (sims.frameworks; a run's own "framework" wins)
SOURCE_FRAMEWORKS = {
    "megatron-2021": "megatron-lm", "korthikanti-2022": "megatron-lm",
    "megatron-lm-readme": "megatron-lm",
    "megatron-lm-readme-2024": "megatron-core", "nemo-24.07-perf": "megatron-core",
    "megatron-bridge-25.11-perf": "megatron-core",
    # NeMo 1.x: Megatron-LM's layers with Apex's DistributedFusedAdam, which reduce-scatters
    # gradient buckets during backward and gathers the parameters under the next forward
    "nemo-megatron-launcher-2022": "megatron-core",
    "bloom-2022": "megatron-deepspeed", "mtnlg-2022": "megatron-deepspeed",
    "opt-2022": "fsdp1",  # metaseq: FairScale's fully sharded data parallel
    "torchtitan-bench": "fsdp", "nemo-automodel-perf": "fsdp",  # FSDP2
    "llmfoundry-bench": "llm-foundry", "llama3-2024": "llama3",
}


def framework(run: Mapping[str, Any]) -> str:
    """The framework ``run`` trained with."""
    name = run.get("framework") or SOURCE_FRAMEWORKS.get(run["source"])
    if name is None:
        raise KeyError(f"source {run['source']!r} of {run['id']} has no framework in "
                       f"SOURCE_FRAMEWORKS; add the one it trained with (or a 'framework' "
                       f"field to the run)")
    return str(name)


def architecture(run: Mapping[str, Any]) -> Architecture:
    m = run["model"]
    family = "llama" if m["family"] == "llama" else "gpt2"
    return Architecture(family, int(m["layers"]), int(m["hidden"]), int(m["heads"]),
                        int(m.get("kv_heads") or m["heads"]), int(m["ffn"]), int(m["vocab"]),
                        int(m["seq_len"]), source=run["citation"],
                        dropout=bool(m.get("dropout", False)),
                        tied=m.get("tied_embeddings"))


def profile(run: Mapping[str, Any]) -> HardwareProfile:
    hw = run["hardware"]
    base = get_profile(GPU_PROFILES[hw["gpu"]])
    per_nic = NETWORKS.get(str(hw.get("inter_node")))
    nics = int(hw.get("nics_per_node") or base.devices_per_node)
    if per_nic is None:
        return base
    return dataclasses.replace(base, inter_node=Link(base.inter_node.latency_s, per_nic * nics))


def prepare(run: Mapping[str, Any]) -> tuple[Any, Any, Layout, HardwareProfile, SimOptions]:
    """The simulator's inputs for ``run``: model, config, layout, hardware and options."""
    par, batch, train = run["parallel"], run["batch"], run["training"]
    hw = profile(run)
    per_node = int(run["hardware"].get("gpus_per_node") or hw.devices_per_node)
    gpus = int(run["hardware"]["gpus"])
    cp = int(par.get("cp") or 1)
    tp, pp = int(par["tp"]), int(par["pp"])
    # context-parallel ranks count as data-parallel ranks whose samples are 1/cp of a sequence
    # (the gradient reduce spans both), with attention over the whole sequence (SimOptions.cp)
    layout = Layout(gpus // per_node, per_node, tp, pp)
    dp = layout.dp
    micro = int(batch["micro_batch"])
    accumulation = max(1, int(batch["global_batch"]) * cp // (micro * dp))
    precision = PRECISION[train["precision"]]
    virtual = int(par.get("virtual_stages") or 1)
    zero: dict[str, Any] = {"stage": int(par.get("zero_stage") or 0)}
    cfg = load_config({
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": 1.0,
        precision: {"enabled": True},
        "zero_optimization": zero,
        "communication_data_type": train.get("grad_reduce_dtype") or
        ("fp32" if precision == "bf16" else "fp16"),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        **({"pipeline": {"schedule": "interleaved", "virtual_stages": virtual}}
           if virtual > 1 and pp > 1 else {}),
    }, world_size=dp, check_supported=False)
    arch = architecture(run)
    model = spec_from_architecture(run["id"], arch, int(run["model"]["seq_len"]) // cp)
    options = SimOptions(
        recompute=str(train.get("recompute") or "none"),
        sequence_parallel=bool(par.get("sequence_parallel")) and tp > 1,
        attention=train.get("attention") or (None if train.get("flash_attention")
                                             else "unfused"),
        gemm_dtype="float8" if train["precision"] == "fp8" else None, cp=cp,
        tp_overlap=bool(par.get("tp_overlap")),
        elementwise=str(train.get("elementwise") or "fused"),
        fsdp=bool(par.get("fsdp")), framework=framework(run))
    return model, cfg, layout, hw, options


def simulate(run: Mapping[str, Any]) -> Any:
    """The simulator's Prediction for ``run``."""
    model, cfg, layout, hw, options = prepare(run)
    work = Workload.from_model(model, cfg.precision)
    return predict(model, cfg, layout, hw, cluster=hw.name, workload=work, options=options)


def memory(run: Mapping[str, Any]) -> tuple[dict[str, float], int]:
    """(the peak rank's memory breakdown, the GPU's memory in bytes) for ``run``, without
    simulating its step."""
    model, cfg, layout, hw, options = prepare(run)
    return memory_per_rank(model, cfg, world_size=layout.world_size, tp=layout.tp, pp=layout.pp,
                           options=options), int(hw.device_memory_bytes)


def memory_summary(rows: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Predicted against published peak memory, over the runs whose source states it."""
    ratios = [r["peak_memory_gib"] / r["published_memory_gib"] for r in rows
              if r.get("published_memory_gib")]
    if not ratios:
        return {"runs": 0}
    return {"runs": len(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
            "mean_ratio": statistics.fmean(ratios)}


def summarize(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    errors = [r["error"] for r in rows]
    if not errors:
        return {"runs": 0, "mape": 0.0, "bias": 0.0, "optimistic": 0}
    return {"runs": len(errors), "mape": statistics.fmean(abs(e) for e in errors),
            "bias": statistics.fmean(errors), "optimistic": sum(e < 0 for e in errors)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=None, help="the runs file (default: "
                    "published_runs.json beside this script)")
    ap.add_argument("--source", action="append", help="only these sources")
    ap.add_argument("--id", action="append", help="only these run ids")
    ap.add_argument("--json", type=Path, help="write every row and summary here")
    ns = ap.parse_args(argv)
    split = load_split()
    every = load_runs(ns.runs) if ns.runs else load_runs()
    problems = split_problems(every, split)
    if problems:
        print("the published set breaks its split's rules (published_split.json):\n  " +
              "\n  ".join(problems), file=sys.stderr)
        return 2
    runs = [r for r in every
            if (not ns.source or r["source"] in ns.source) and (not ns.id or r["id"] in ns.id)]
    # the held-out part first: its figures are the headline
    runs.sort(key=lambda r: part_of(r["source"], split) != "held-out")
    rows = []
    print(f"{'run':40s} {'source':26s} {'GPUs':>6s} {'published s':>11s} {'predicted s':>11s}"
          f" {'error':>7s}  {'range':>17s}  {'memory GiB (published)':>22s}")
    for run in runs:
        p = simulate(run)
        predicted = p.step_time_s
        published = float(run["step_time_s"])
        error = (predicted - published) / published
        low, high = p.step_time_range_s or (predicted, predicted)
        inside = low <= published <= high
        stated = run["published"].get("memory_gib")
        rows.append({"id": run["id"], "source": run["source"],
                     "part": part_of(run["source"], split), "gpus": run["hardware"]["gpus"],
                     "published_s": published, "predicted_s": predicted, "error": error,
                     "range_s": [low, high], "published_in_range": inside,
                     "peak_memory_gib": (p.peak_memory_bytes or 0) / 2**30, "oom": p.oom,
                     "published_memory_gib": stated, "memory": p.memory,
                     "framework": framework(run)})
        mem = f"{(p.peak_memory_bytes or 0) / 2**30:.1f}" + (f" ({stated:.1f})" if stated else "")
        print(f"{run['id'][:40]:40s} {run['source'][:26]:26s} {run['hardware']['gpus']:6d} "
              f"{published:11.3f} {predicted:11.3f} {error * 100:+6.1f}%  "
              f"{low:7.2f}-{high:<7.2f}{'*' if inside else ' '}  {mem:>18s}"
              f"{' OOM' if p.oom else '    '}")
    print()
    summary: dict[str, Any] = {}
    print(f"{'part / source':30s} {'runs':>5s} {'MAPE':>8s} {'bias':>8s} {'optimistic':>11s}")
    for part in ("held-out", "development"):
        mine = [r for r in rows if r["part"] == part]
        by_source: dict[str, list[dict[str, Any]]] = {}
        for row in mine:
            by_source.setdefault(row["source"], []).append(row)
        summary[part] = {"all": summarize(mine), "in_range": sum(r["published_in_range"]
                                                                 for r in mine),
                         **{source: summarize(rs) for source, rs in sorted(by_source.items())}}
        for source, s in summary[part].items():
            if source == "in_range":
                continue
            label = f"{part}: all" if source == "all" else f"  {source}"
            print(f"{label:30s} {s['runs']:5d} {s['mape'] * 100:7.1f}% {s['bias'] * 100:+7.1f}% "
                  f"{s['optimistic']:>6d}/{s['runs']}")
        if mine:
            print(f"  published step inside the predicted range: {summary[part]['in_range']} of "
                  f"{len(mine)}")
    summary["all"] = summarize(rows)
    flagged = [r["id"] for r in rows if r["oom"]]
    in_range = sum(r["published_in_range"] for r in rows)
    every_row = summary["all"]
    print(f"{'all':30s} {every_row['runs']:5d} {every_row['mape'] * 100:7.1f}% "
          f"{every_row['bias'] * 100:+7.1f}% {every_row['optimistic']:>6d}/{every_row['runs']}")
    print(f"published step inside the predicted range (*): {in_range} of {len(rows)}; "
          f"flagged out of memory: {len(flagged)}" + (f" ({', '.join(flagged)})" if flagged
                                                      else ""))
    mem = memory_summary(rows)
    if mem["runs"]:
        print(f"peak memory against the {mem['runs']} published figures: predicted / published "
              f"{mem['min_ratio']:.2f}-{mem['max_ratio']:.2f} (mean {mem['mean_ratio']:.2f})")
    if ns.json:
        ns.json.write_text(json.dumps({"rows": rows, "summary": summary, "memory": mem},
                                      indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
