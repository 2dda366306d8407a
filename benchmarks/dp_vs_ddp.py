"""flowtrain's data parallel against torch DDP and a no-communication bound, same model, data and
seed, 2 ranks over gloo on this machine, runs alternating; prints medians and ratios. Also the
engine's overhead over a plain torch loop with one rank.

    python benchmarks/dp_vs_ddp.py [--rounds 5] [--steps 20]
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
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rows), "params": rows[0]["params"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per case")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run")
    parser.add_argument("--no-single", action="store_true", help="skip the world-size-1 cases")
    args, model_args = parser.parse_known_args()
    args.model_args = model_args

    cases = {
        "flowtrain fp32": ("flowtrain", 2, ["--comm-dtype", "fp32"]),
        "flowtrain bf16-comm": ("flowtrain", 2, ["--comm-dtype", "bf16"]),
        "torch DDP": ("ddp", 2, []),
        "no-comm bound": ("nocomm", 2, []),
    }
    if not args.no_single:
        cases["flowtrain 1 rank"] = ("flowtrain", 1, ["--comm-dtype", "fp32"])
        cases["plain torch 1 rank"] = ("plain", 1, [])
    results: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, (mode, nproc, extra) in cases.items():
                r = run(name.replace(" ", "_"), mode, nproc, extra, args, Path(tmp) / "out.jsonl")
                results[name].append(r)
                print(f"round {round_ + 1}: {name:22s} {r['samples_per_s']:8.1f} samples/s",
                      file=sys.stderr, flush=True)

    med = {n: statistics.median(r["samples_per_s"] for r in rs) for n, rs in results.items()}
    rss = {n: statistics.median(r["peak_rss_mib"] for r in rs) for n, rs in results.items()}
    params = next(iter(results.values()))[0]["params"]
    print(f"\nGPT with {params / 1e6:.1f}M parameters, {args.rounds} alternating rounds of "
          f"{args.steps} steps; medians")
    print(f"{'case':24s} {'samples/s':>10s} {'peak RSS/rank MiB':>18s}")
    for name in cases:
        print(f"{name:24s} {med[name]:10.1f} {rss[name]:18.0f}")
    ddp, bound = med["torch DDP"], med["no-comm bound"]
    print(f"\nflowtrain fp32 / DDP      = {med['flowtrain fp32'] / ddp:.3f}  (aim >= 1.05)")
    print(f"flowtrain bf16-comm / DDP = {med['flowtrain bf16-comm'] / ddp:.3f}")
    print(f"flowtrain fp32 / bound    = {med['flowtrain fp32'] / bound:.3f}  (aim >= 0.90)")
    print(f"DDP / bound               = {ddp / bound:.3f}")
    if not args.no_single:
        overhead = med["plain torch 1 rank"] / med["flowtrain 1 rank"] - 1
        print(f"engine overhead, 1 rank   = {overhead * 100:+.1f}%  (aim <= 3%)")


if __name__ == "__main__":
    main()
