"""`flowtrain simulate` against published large-scale GPU training runs.

Each run of ``benchmarks/published_runs.json`` (papers' and repositories' tables: model shape,
parallel layout, batch, precision, recompute, hardware, and the step time its published
throughput implies, each with its citation and assumptions) is entered into `flowtrain
simulate` as a user enters it (``published_inputs``: an architecture file, a ds_config.json and
the command's flags) and the predicted step time is set beside the published one: signed error
per run, then MAPE, mean signed error (bias) and the count of optimistic predictions per source,
for the frozen held-out part first and the development part after it
(``published_split.json``). Nothing here is fitted to these runs: every factor the simulator
uses is a property of the hardware or software (``sims/gpu_figures.py``). The memory column is
the peak rank's memory as the run's framework lays it out, "OOM" where it exceeds the GPU's,
with the published figure beside it where the source states one.

    .venv/bin/python benchmarks/sim_published.py            # the table
    .venv/bin/python benchmarks/sim_published.py --json out.json --source megatron-2021
    .venv/bin/python benchmarks/sim_published.py --inputs runs/ --show-commands
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from published_inputs import command, framework, prepare, shell_line, simulate  # noqa: E402
from published_set import load_runs, load_split, part_of, split_problems  # noqa: E402

from sims.memory import memory_per_rank  # noqa: E402

__all__ = ["command", "framework", "load_runs", "main", "memory", "prepare", "simulate"]


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
    ap.add_argument("--inputs", type=Path, help="keep each run's architecture file and "
                    "ds_config.json in this directory (default: a temporary one)")
    ap.add_argument("--show-commands", action="store_true",
                    help="print each run's `flowtrain simulate` command line")
    ap.add_argument("--subprocess", action="store_true",
                    help="run the installed command in a process of its own for each run "
                         "(slower: torch is imported each time)")
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
        p = simulate(run, ns.inputs, subprocess_cli=ns.subprocess)
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
                     "fits_with": getattr(p, "fits_with", None),
                     "published_memory_gib": stated, "memory": p.memory,
                     "framework": framework(run)})
        mem = f"{(p.peak_memory_bytes or 0) / 2**30:.1f}" + (f" ({stated:.1f})" if stated else "")
        if ns.show_commands and ns.inputs:
            print("  " + shell_line(command(run, ns.inputs)))
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
    # a run that does not fit as entered but fits at another value of an input its source
    # does not state is reported apart: the entry's guess is what does not fit
    flagged = [r["id"] for r in rows if r["oom"] and not r["fits_with"]]
    guessed = [f"{r['id']} (fits with {' or '.join(r['fits_with'])})" for r in rows
               if r["oom"] and r["fits_with"]]
    in_range = sum(r["published_in_range"] for r in rows)
    every_row = summary["all"]
    print(f"{'all':30s} {every_row['runs']:5d} {every_row['mape'] * 100:7.1f}% "
          f"{every_row['bias'] * 100:+7.1f}% {every_row['optimistic']:>6d}/{every_row['runs']}")
    print(f"published step inside the predicted range (*): {in_range} of {len(rows)}; "
          f"flagged out of memory: {len(flagged)}" + (f" ({', '.join(flagged)})" if flagged
                                                      else ""))
    if guessed:
        print(f"out of memory only at an input the source does not state: {len(guessed)} "
              f"({'; '.join(guessed)})")
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
