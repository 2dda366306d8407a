"""flowtrain's data parallel against torch DDP and a no-communication bound, same model, data and
seed, over gloo on this machine, runs alternating; prints medians, the range over rounds and the
ratios. Also the engine's overhead over a plain torch loop with one rank. flowtrain.initialize
sets glibc's malloc to keep freed memory (flowtrain/host_memory.py); DDP and the plain loop run
both as users run them and with those settings ("kept heap"), so the engine's own share of a
gain shows apart from the allocator's. The no-communication bound runs with them, twice: its
ranks independent, and waiting for each other after every step with no data moved (what
synchronous data parallel with free communication reaches).

    python benchmarks/dp_vs_ddp.py [--rounds 5] [--steps 20] [--nproc 2]
        [--shapes L,E,S,V;L,E,S,V;...] [--no-single | --single-only]
        [worker flags such as --micro-batch 8]

Each run warms up until the ranks' heaps stop growing (dp_worker.warm_up), then times
``--steps`` steps.

``--shapes`` runs each GPT shape in turn (layers, width, sequence length, vocabulary; e.g.
"4,256,128,50304;12,128,64,96;2,512,256,8192"), every case of a shape alternating with the
others; without it, the worker's own shape flags (--n-layer, --n-embd, --seq-len, --vocab).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "dp_worker.py"


def run(case: str, mode: str, nproc: int, extra: list[str], args: argparse.Namespace,
        out: Path) -> dict[str, float]:
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node", str(nproc),
           "--run-dir", str(out.parent / f"run-{case}"), str(WORKER), "--mode", mode,
           "--steps", str(args.steps), "--out", str(out), *extra, *args.model_args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{case} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {"samples_per_s": statistics.mean(r["samples_per_s"] for r in rows),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rows), "params": rows[0]["params"],
            "warmup_steps": max(r["warmup_steps"] for r in rows)}


def parse_shapes(text: str) -> list[list[str]]:
    """Worker flags for each "layers,width,seq,vocab" of ``text`` (";"-separated)."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = part.split(",")
        if len(fields) != 4 or not all(f.strip().isdigit() for f in fields):
            raise SystemExit(f"--shapes: {part!r} is not layers,width,seq,vocab (4 integers)")
        layers, width, seq, vocab = (f.strip() for f in fields)
        shapes.append(["--n-layer", layers, "--n-embd", width, "--seq-len", seq,
                       "--vocab", vocab])
    return shapes


def ratio_range(num: list[float], den: list[float]) -> str:
    """The range of the per-round ratios (rounds pair up as they alternate)."""
    ratios = [a / b for a, b in zip(num, den)]
    return f"{min(ratios):.3f}-{max(ratios):.3f}"


def bench_shape(args: argparse.Namespace, shape: list[str], tmp: Path) -> None:
    nproc = args.nproc
    cases: dict[str, tuple[str, int, list[str]]] = {
        "flowtrain fp32": ("flowtrain", nproc, ["--comm-dtype", "fp32"]),
        "flowtrain bf16-comm": ("flowtrain", nproc, ["--comm-dtype", "bf16"]),
        "torch DDP": ("ddp", nproc, []),
        # DDP with glibc's malloc set as flowtrain sets it: what is left of the gain is the
        # engine's, not the allocator's
        "torch DDP kept heap": ("ddp", nproc, ["--kept-heap"]),
        # the bound under flowtrain's own allocator settings, so that it bounds flowtrain
        "no-comm bound": ("nocomm", nproc, ["--kept-heap"]),
        # the same with the ranks waiting for each other after each step and moving nothing:
        # what synchronous data parallel with free communication would reach; on a shared
        # host a rank slowed by another job holds every rank up, where unsynchronised ranks
        # each lose only their own time
        "no-comm bound, synced": ("nocomm", nproc, ["--kept-heap", "--sync-steps"]),
    }
    if args.single_only:
        cases = {}
    if not args.no_single:
        cases["flowtrain 1 rank"] = ("flowtrain", 1, ["--comm-dtype", "fp32"])
        cases["plain torch 1 rank"] = ("plain", 1, [])
        cases["plain 1 rank kept heap"] = ("plain", 1, ["--kept-heap"])
    results: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for round_ in range(args.rounds):
        for name, (mode, ranks, extra) in cases.items():
            r = run(name.replace(" ", "_"), mode, ranks, extra + shape, args, tmp / "out.jsonl")
            results[name].append(r)
            print(f"round {round_ + 1}: {name:22s} {r['samples_per_s']:8.1f} samples/s",
                  file=sys.stderr, flush=True)
    rates = {n: [r["samples_per_s"] for r in rs] for n, rs in results.items()}
    med = {n: statistics.median(v) for n, v in rates.items()}
    rss = {n: statistics.median(r["peak_rss_mib"] for r in rs) for n, rs in results.items()}
    params = next(iter(results.values()))[0]["params"]
    print(f"\nGPT {' '.join(shape) or '(worker defaults)'} {' '.join(args.model_args)}: "
          f"{params / 1e6:.2f}M parameters, {1 if args.single_only else nproc} rank(s), "
          f"{args.rounds} alternating rounds of "
          f"{args.steps} steps; medians (range over rounds)")
    warm = {n: [int(r["warmup_steps"]) for r in rs] for n, rs in results.items()}
    print(f"{'case':24s} {'samples/s':>10s} {'range':>17s} {'peak RSS/rank MiB':>18s} "
          f"{'warm-up steps':>14s}")
    for name in cases:
        print(f"{name:24s} {med[name]:10.1f} {min(rates[name]):8.1f}-{max(rates[name]):<8.1f} "
              f"{rss[name]:18.0f} {min(warm[name]):>8d}-{max(warm[name]):<5d}")
    if not args.single_only:
        print_multi_rank(med, rates)
    if not args.no_single:
        overhead = med["plain torch 1 rank"] / med["flowtrain 1 rank"] - 1
        print(f"engine overhead, 1 rank   = {overhead * 100:+.1f}% "
              f"({ratio_range(rates['plain torch 1 rank'], rates['flowtrain 1 rank'])} as "
              "ratios)  (aim <= 2%; against a plain loop as users run it)")
        same = med["plain 1 rank kept heap"] / med["flowtrain 1 rank"] - 1
        print(f"  same allocator          = {same * 100:+.1f}%  (against a plain loop with "
              "flowtrain's malloc settings)")


def print_multi_rank(med: dict[str, float], rates: dict[str, list[float]]) -> None:
    ddp, bound = med["torch DDP"], med["no-comm bound"]
    flow, half = rates["flowtrain fp32"], rates["flowtrain bf16-comm"]
    print(f"flowtrain fp32 / DDP      = {med['flowtrain fp32'] / ddp:.3f} "
          f"({ratio_range(flow, rates['torch DDP'])})  (aim >= 1.05)")
    print(f"flowtrain bf16-comm / DDP = {med['flowtrain bf16-comm'] / ddp:.3f} "
          f"({ratio_range(half, rates['torch DDP'])})")
    print(f"flowtrain fp32 / bound    = {med['flowtrain fp32'] / bound:.3f} "
          f"({ratio_range(flow, rates['no-comm bound'])})  (aim >= 0.95)")
    synced = med["no-comm bound, synced"]
    print(f"flowtrain fp32 / synced   = {med['flowtrain fp32'] / synced:.3f} "
          f"({ratio_range(flow, rates['no-comm bound, synced'])})  (the bound with a barrier "
          "per step)")
    print(f"synced bound / bound      = {synced / bound:.3f}  (what waiting for the slowest "
          "rank costs on this host)")
    print(f"flowtrain fp32 / DDP kept = {med['flowtrain fp32'] / med['torch DDP kept heap']:.3f} "
          f"({ratio_range(flow, rates['torch DDP kept heap'])})  (the engine alone)")
    print(f"DDP / bound               = {ddp / bound:.3f}")
    print(f"DDP kept heap / bound     = {med['torch DDP kept heap'] / bound:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per case")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--nproc", type=int, default=2, help="data-parallel ranks")
    parser.add_argument("--shapes", default="", help="layers,width,seq,vocab;... (see above)")
    parser.add_argument("--no-single", action="store_true", help="skip the world-size-1 cases")
    parser.add_argument("--single-only", action="store_true",
                        help="only the world-size-1 cases (the engine's overhead over a plain "
                             "loop), for more rounds of them in the same time")
    args, model_args = parser.parse_known_args()
    args.model_args = model_args
    if args.single_only and args.no_single:
        parser.error("--single-only and --no-single leave nothing to run")
    shapes = parse_shapes(args.shapes) or [[]]
    with tempfile.TemporaryDirectory() as tmp:
        for shape in shapes:
            bench_shape(args, shape, Path(tmp))


if __name__ == "__main__":
    main()
