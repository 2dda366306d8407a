"""Hugging Face's Trainer route on this machine's CPUs: flowtrain's Trainer
(flowtrain.integrations.transformers, under `flowtrain launch`) against transformers' Trainer
with DeepSpeed (under torchrun), on a GPT-2 shaped GPT2LMHeadModel, 2 ranks, the same seed,
data, HF style "auto" config and HF optimizer (AdamW, linear schedule); alternating rounds,
medians, the ratio printed with both routes' logged losses.

    python benchmarks/hf_trainer.py [--rounds 3] [--steps 6] [--stages 2,3]
        [--peer-python /tmp/dsvenv/bin/python] [worker flags: --n-layer 4 --n-embd 256 ...]

DeepSpeed is not a flowtrain dependency: the peer runs in --peer-python (default: this
Python), which needs deepspeed (scripts/install_deepspeed.sh, e.g. VENV=/tmp/dsvenv PREBUILD=0)
and accelerate. DeepSpeed runs with DS_ACCELERATOR=cpu and gloo; its first run builds its
shared-memory comm op (minutes, cached after). When DeepSpeed is not importable there, or its
run fails, the benchmark says so and compares against transformers' Trainer with plain DDP
instead. OMP_NUM_THREADS is cores/ranks for both unless set. BENCH_SHOW=1 prints each run's
output. Default: 3 rounds x 2 stages x 2 routes, about 8 minutes on an idle 2-core machine,
mostly process start and model setup.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "hf_trainer_worker.py"


def peer_usable(python: str, env: dict[str, str]) -> str | None:
    """None when ``python`` can import deepspeed and accelerate, else why not."""
    probe = "import deepspeed, accelerate; print(deepspeed.__version__)"
    proc = subprocess.run([python, "-c", probe], capture_output=True, text=True, env=env,
                          timeout=300)
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit {proc.returncode}"


def run(engine: str, stage: int, args: argparse.Namespace, tmp: Path,
        env: dict[str, str]) -> dict[str, Any]:
    """One launch of 2 ranks; the row rank 0 wrote, or {"failed": why}."""
    out = tmp / "out.jsonl"
    out.unlink(missing_ok=True)
    worker = [str(WORKER), "--engine", engine, "--stage", str(stage), "--steps",
              str(args.steps), "--warmup", str(args.warmup), "--out", str(out),
              *args.model_args]
    if engine == "flowtrain":
        cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node",
               str(args.nproc), "--run-dir", str(tmp / f"run-{stage}"), *worker]
    else:
        cmd = [args.peer_python, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.nproc), *worker]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"failed": f"timed out after {args.timeout}s"}
    log = f"{proc.stdout}\n{proc.stderr}"
    if os.environ.get("BENCH_SHOW"):
        print(log, file=sys.stderr)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if proc.returncode != 0 or not rows:
        errors = [ln.strip() for ln in log.splitlines() if "Error" in ln or "error:" in ln]
        return {"failed": f"exit {proc.returncode}: "
                          f"{(errors or log.strip().splitlines() or ['no output'])[-1][:300]}"}
    row: dict[str, Any] = rows[0]
    # the median step: robust to a short load spike from other processes on the machine
    row["samples_per_s"] = row["samples_per_step"] / statistics.median(row["step_times"])
    row["wall_s"] = time.perf_counter() - start
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per stage")
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--stages", default="2,3", help="ZeRO stages, comma separated")
    parser.add_argument("--nproc", type=int, default=2, help="ranks")
    parser.add_argument("--peer-python", default=sys.executable,
                        help="the Python with deepspeed and accelerate for the peer runs")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per launch")
    args, model_args = parser.parse_known_args()
    args.model_args = model_args
    if args.warmup < 1:
        raise SystemExit("--warmup must be at least 1: the first timed step starts at the end "
                         "of a warm-up step")
    stages = [int(s) for s in args.stages.split(",") if s.strip()]

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    peer = "deepspeed"
    why = peer_usable(args.peer_python, env)
    if why is not None:
        print(f"DeepSpeed cannot run from {args.peer_python} ({why}): comparing against "
              f"transformers' Trainer with plain DDP instead", file=sys.stderr)
        peer = "ddp"

    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    failed: dict[tuple[str, int], str] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for round_ in range(args.rounds):
            for stage in stages:
                for engine in ("flowtrain", peer):
                    if (engine, stage) in failed:
                        continue
                    r = run(engine, stage, args, tmp, env)
                    if "failed" in r and engine == "deepspeed" and not results:
                        print(f"transformers' Trainer with DeepSpeed failed ({r['failed']}): "
                              f"comparing against plain DDP instead", file=sys.stderr)
                        peer = engine = "ddp"
                        r = run(engine, stage, args, tmp, env)
                    if "failed" in r:
                        failed[(engine, stage)] = r["failed"]
                        msg = f"failed: {r['failed']}"
                    else:
                        results.setdefault((engine, stage), []).append(r)
                        msg = (f"{r['samples_per_s']:7.2f} samples/s ({r['wrapped']}), "
                               f"{r['wall_s']:5.1f}s")
                    print(f"round {round_ + 1}: ZeRO-{stage} {engine:9s} {msg}",
                          file=sys.stderr, flush=True)
    some = next((rs[0] for rs in results.values() if rs), None)
    if some is None:
        raise SystemExit("no run succeeded")
    shape = " ".join(model_args) or "the worker's default shape"
    print(f"\nGPT2LMHeadModel with {some['params'] / 1e6:.2f}M parameters ({shape}), "
          f"{args.nproc} ranks, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, "
          f"{some['samples_per_step']} samples a step; {args.rounds} alternating rounds of "
          f"{args.warmup}+{args.steps} steps, median step per run, median over runs; "
          f"{(time.perf_counter() - t0) / 60:.1f} min")
    peer_name = "HF Trainer + DeepSpeed" if peer == "deepspeed" else "HF Trainer + DDP"
    print(f"\n{'case':8s} {'flowtrain':>10s} {peer_name:>22s} {'ratio':>6s} "
          f"{'largest |loss diff|':>20s}")
    for stage in stages:
        ft, pe = results.get(("flowtrain", stage), []), results.get((peer, stage), [])
        if not ft or not pe:
            gone = failed.get(("flowtrain", stage)) or failed.get((peer, stage), "no result")
            print(f"ZeRO-{stage:<3d} {'-':>10s} ({gone})")
            continue
        a = statistics.median(r["samples_per_s"] for r in ft)
        b = statistics.median(r["samples_per_s"] for r in pe)
        diff = max(abs(x - y) for x, y in zip(ft[-1]["losses"], pe[-1]["losses"]))
        print(f"ZeRO-{stage:<3d} {a:10.2f} {b:22.2f} {a / b:6.3f} {diff:20.2e}")
    print("\nsamples/s: samples a step / the run's median step time; ratio: flowtrain / peer "
          "(higher is better); loss diff: over every logged step of the last runs")


if __name__ == "__main__":
    main()
