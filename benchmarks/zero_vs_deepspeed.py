"""flowtrain's ZeRO stages against DeepSpeed's and against torch DDP (no sharding) on this
machine's CPUs: the same GPT, seed, data and config, 2 ranks over gloo (flowtrain: its
shared-memory data channel by default), runs alternating flowtrain/DeepSpeed/DDP; prints median
samples/s, peak RSS per rank, the ratios and the engines' losses side by side.

    python benchmarks/zero_vs_deepspeed.py [--rounds 2] [--steps 8] [--cases 1,2,3,2o]
        [--dtypes fp32,bf16] [--grad-accum 2] [--torch-adam] [--data-channel shm|torch|auto]
        [--engines flowtrain,deepspeed,ddp] [--shapes L,E,S[,V];L,E,S[,V]]
        [worker flags such as --n-layer 8 --n-embd 384 --micro-batch 8]

torch DDP is the reference what sharding costs is measured against (the aim: every flowtrain
stage within 5% of it); it runs once per round and dtype (fp32 only), with torch's fused AdamW
(torch.optim.AdamW without --torch-adam is fused=True) and clip_grad_norm_. ``--shapes`` runs
each GPT shape (layers, width, sequence length and optionally vocabulary) in turn.

Cases: "1", "2", "3" are ZeRO stages, a trailing "o" adds offload_optimizer device cpu. A flowtrain
case the engine refuses as "not supported yet" is printed as "not available" (see
flowtrain/config/support.py SUPPORTED_FEATURES); a run that fails otherwise is printed as
"failed" with its last error line, and the benchmark goes on.

DeepSpeed is not a flowtrain dependency. Install it (0.19.8, CPU only, keeping the CPU torch) with
scripts/install_deepspeed.sh; without it only the flowtrain rows are run. DeepSpeed runs with
DS_ACCELERATOR=cpu and gloo (its CPU accelerator would pick oneCCL only if
oneccl_bindings_for_pytorch were installed), launched by torchrun; its optimizer is what its
config builds: FusedAdam (CPU op, built on first use) without offload, DeepSpeedCPUAdam with
offload; --torch-adam gives both engines torch.optim.AdamW (and DeepSpeed
zero_force_ds_cpu_optimizer false). OMP_NUM_THREADS is set to cores/ranks for both unless set.
BENCH_PRINT=N makes both engines log every N steps; BENCH_SHOW=1 prints each run's output.

The default (2 rounds of 2+8 steps, 4 cases, 16 launches) takes about 4-5 minutes on an idle
2-core machine, mostly process start and engine setup; for steadier numbers use e.g.
--rounds 5 --steps 30, and for ZeRO's memory savings to show above the fixed ~250 MiB/rank of
torch and the engines, a bigger model: --n-layer 8 --n-embd 512.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "zero_worker_bench.py"
ENGINES = ("flowtrain", "deepspeed", "ddp")
DDP_CASE = "ddp"  # DDP's row: one per dtype, whatever the stages


def parse_case(case: str) -> tuple[int, bool]:
    if case == DDP_CASE:
        return 0, False
    offload = case.endswith("o")
    stage = int(case.rstrip("o"))
    if stage not in (0, 1, 2, 3):
        raise SystemExit(f"case {case!r}: the stage must be 0..3")
    return stage, offload


def case_label(case: str, dtype: str) -> str:
    if case == DDP_CASE:
        return f"no ZeRO {dtype}"
    stage, offload = parse_case(case)
    return f"ZeRO-{stage}{' +offload' if offload else ''} {dtype}"


def flowtrain_cmd(nproc: int, run_dir: Path) -> list[str]:
    exe = Path(sys.executable).with_name("flowtrain")
    head = [str(exe)] if exe.exists() else [sys.executable, "-m", "flowtrain.cli"]
    return [*head, "launch", "--nproc-per-node", str(nproc), "--run-dir", str(run_dir),
            str(WORKER)]


def torchrun_cmd(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), str(WORKER)]


def last_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if any(k in ln for k in ("Error", "Exception", "error:")):
            return ln[:300]
    return lines[-1][:300] if lines else "(no output)"


def run(engine: str, case: str, dtype: str, args: argparse.Namespace, tmp: Path,
        env: dict[str, str]) -> dict:
    """One launch of ``args.nproc`` ranks; returns a summary (or unavailable/failed)."""
    out = tmp / "out.jsonl"
    out.unlink(missing_ok=True)
    stage, offload = parse_case(case)
    worker_args = ["--engine", engine, "--stage", str(stage), "--dtype", dtype,
                   "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--grad-accum", str(args.grad_accum), "--clip", str(args.clip),
                   "--reduce-bucket-size", str(args.reduce_bucket_size),
                   "--data-channel", args.data_channel, "--out", str(out),
                   *(["--offload"] if offload else []),
                   *(["--torch-adam"] if args.torch_adam else []),
                   *(["--overlap-comm"] if args.overlap_comm else []), *args.model_args]
    if engine == "flowtrain":
        run_dir = tmp / f"run-{case}-{dtype}"
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = flowtrain_cmd(args.nproc, run_dir) + worker_args
    else:
        cmd = torchrun_cmd(args.nproc) + worker_args
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env,
                              cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        return {"failed": f"timed out after {args.timeout}s",
                "log": f"{exc.stdout or ''}\n{exc.stderr or ''}"}
    wall = time.perf_counter() - start
    log = f"{proc.stdout}\n{proc.stderr}"
    if os.environ.get("BENCH_SHOW"):
        print(log, file=sys.stderr)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    unavailable = [r["unavailable"] for r in rows if "unavailable" in r]
    if unavailable:
        return {"unavailable": unavailable[0]}
    if proc.returncode != 0 or len(rows) != args.nproc:
        return {"failed": f"exit {proc.returncode}, {len(rows)}/{args.nproc} results: "
                          f"{last_error(log)}", "log": log}
    rows.sort(key=lambda r: r["rank"])
    losses = [statistics.mean(step) for step in zip(*(r["losses"] for r in rows))]
    # Robust to a short load spike from other tenants: the median step of the slowest rank.
    median_step = max(statistics.median(r["step_times"]) for r in rows)
    return {"samples_per_s": statistics.mean(r["samples_per_s"] for r in rows),
            "median_step_samples_per_s": rows[0]["samples_per_step"] / median_step,
            "cpu_step_ms": 1000 * max(r["cpu_step_s"] for r in rows),
            "peak_rss": [r["peak_rss_mib"] for r in rows],
            # the ranks' peak PSS added up: what the host held (a shared page counted once)
            "host_pss": sum(r["peak_pss_mib"] for r in rows),
            "engine_rss": [r["peak_rss_mib"] - r["rss_before_engine_mib"] for r in rows],
            "losses": losses, "params": rows[0]["params"], "optimizer": rows[0]["optimizer"],
            "channel": rows[0]["channel"], "threads": rows[0]["threads"],
            "init_s": max(r["init_s"] for r in rows), "wall_s": wall}


def med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def parse_shapes(text: str) -> list[list[str]]:
    """Worker flags for each "layers,width,seq[,vocab]" of ``text`` (";"-separated)."""
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = [f.strip() for f in part.split(",")]
        if len(fields) not in (3, 4) or not all(f.isdigit() for f in fields):
            raise SystemExit(f"--shapes: {part!r} is not layers,width,seq or "
                             "layers,width,seq,vocab (3 or 4 integers)")
        flags = ["--n-layer", fields[0], "--n-embd", fields[1], "--seq-len", fields[2]]
        if len(fields) == 4:
            flags += ["--vocab", fields[3]]
        shapes.append(flags)
    return shapes


def ratio_range(num: list[dict], den: list[dict], key: str) -> str:
    """The range of the per-round ratios (the rounds pair up as they alternate)."""
    ratios = [a[key] / b[key] for a, b in zip(num, den)]
    return f"{min(ratios):.3f}-{max(ratios):.3f}" if ratios else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds per case")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    parser.add_argument("--cases", default="1,2,3,2o",
                        help="ZeRO stages, comma separated; a trailing 'o' adds CPU optimizer "
                             "offload (default: 1,2,3,2o)")
    parser.add_argument("--dtypes", default="fp32", help="fp32 and/or bf16, comma separated")
    parser.add_argument("--nproc", type=int, default=2, help="ranks")
    parser.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient_clipping")
    parser.add_argument("--reduce-bucket-size", type=int, default=500_000,
                        help="reduce_bucket_size = allgather_bucket_size, in elements")
    parser.add_argument("--overlap-comm", action="store_true", help="zero overlap_comm on")
    parser.add_argument("--torch-adam", action="store_true",
                        help="torch.optim.AdamW (not fused) in every engine")
    parser.add_argument("--data-channel", choices=["shm", "torch", "auto"], default="shm",
                        help="flowtrain's flowtrain.data_channel (default shm)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="which engines to run, comma separated (default: all three)")
    parser.add_argument("--shapes", default="",
                        help="layers,width,seq[,vocab];... GPT shapes run in turn (default: the "
                             "worker's --n-layer/--n-embd/--seq-len)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per launch")
    args, model_args = parser.parse_known_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for c in cases:
        parse_case(c)
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    engines = [e for e in ENGINES if e in args.engines.split(",")]

    ds_version = None
    if "deepspeed" in engines:
        if importlib.util.find_spec("deepspeed") is None:
            print("DeepSpeed is not installed in this Python; running flowtrain only "
                  "(install it with scripts/install_deepspeed.sh)", file=sys.stderr)
            engines.remove("deepspeed")
        else:
            ds_version = importlib.metadata.version("deepspeed")

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for shape in parse_shapes(args.shapes) or [[]]:
        args.model_args = shape + model_args
        bench_shape(args, cases, dtypes, engines, env, ds_version)


def bench_shape(args: argparse.Namespace, cases: list[str], dtypes: list[str],
                engines: list[str], env: dict[str, str], ds_version: str | None) -> None:
    model_args = args.model_args
    keys = [(DDP_CASE, dtype) for dtype in dtypes if "ddp" in engines] + \
        [(case, dtype) for dtype in dtypes for case in cases]
    runs = [(engine, case, dtype) for case, dtype in keys
            for engine in (["ddp"] if case == DDP_CASE else
                           [e for e in engines if e != "ddp"])]
    results: dict[tuple[str, str, str], list[dict]] = {key: [] for key in runs}
    status: dict[tuple[str, str, str], str] = {}  # "not available" / "failed: ..." per row
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for round_ in range(args.rounds):
            for key in runs:
                engine, case, dtype = key
                if key in status:
                    continue  # refused or failed before: no use trying again
                r = run(engine, case, dtype, args, tmp, env)
                label = case_label(case, dtype)
                if "unavailable" in r:
                    status[key] = "not available"
                    msg = "not available: " + " ".join(r["unavailable"].split())[:160]
                elif "failed" in r:
                    status[key] = f"failed: {r['failed']}"
                    msg = status[key]
                    if os.environ.get("BENCH_SHOW") is None:
                        tail = r["log"].strip().splitlines()[-15:]
                        print("\n".join("    | " + ln[:200] for ln in tail), file=sys.stderr)
                else:
                    results[key].append(r)
                    msg = (f"{r['samples_per_s']:7.1f} samples/s, peak RSS "
                           f"{max(r['peak_rss']):6.0f} MiB, {r['wall_s']:5.1f}s")
                print(f"round {round_ + 1}: {label:22s} {engine:9s} {msg}", file=sys.stderr,
                      flush=True)
    total = time.perf_counter() - t0

    some = next((rs[0] for rs in results.values() if rs), None)
    if some is None:
        raise SystemExit("no run succeeded")
    print(f"\nGPT {' '.join(model_args)}: {some['params'] / 1e6:.2f}M parameters, "
          f"{args.nproc} ranks, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}, micro-batch/grad-accum "
          f"{_flag(model_args, '--micro-batch', '8')}/{args.grad_accum}, clip {args.clip}, "
          f"reduce_bucket_size {args.reduce_bucket_size}, overlap_comm {args.overlap_comm}; "
          f"{args.rounds} alternating rounds of {args.warmup}+{args.steps} steps, medians; "
          f"{total / 60:.1f} min")
    print(f"flowtrain data channel: {args.data_channel}; DeepSpeed: "
          f"{ds_version or 'not installed'}, DS_ACCELERATOR=cpu")
    for engine in engines:
        seen = sorted({f"{r['optimizer']} (reduces over {r['channel']})" for (e, _, _), rs
                       in results.items() if e == engine for r in rs})
        print(f"  {engine} optimizer: {'; '.join(seen) or '-'}")

    print(f"\n{'case':22s} {'engine':9s} {'samples/s':>9s} {'med-step':>8s} {'CPU ms':>7s} "
          f"{'peak RSS/rank MiB':>18s} {'host PSS MiB':>12s} "
          f"{'engine RSS MiB':>14s} {'init s':>6s} {'final loss':>10s}")
    label_of = ""
    for key in runs:
        engine, case, dtype = key
        label = case_label(case, dtype)
        label, label_of = ("" if label == label_of else label), label
        rs = results[key]
        if not rs:
            print(f"{label:22s} {engine:9s} {status.get(key, 'no result')}")
            continue
        rss = "/".join(f"{statistics.median(r['peak_rss'][i] for r in rs):.0f}"
                       for i in range(args.nproc))
        eng = statistics.median(max(r["engine_rss"]) for r in rs)
        print(f"{label:22s} {engine:9s} {med(rs, 'samples_per_s'):9.1f} "
              f"{med(rs, 'median_step_samples_per_s'):8.1f} {med(rs, 'cpu_step_ms'):7.1f} "
              f"{rss:>18s} {med(rs, 'host_pss'):12.0f} "
              f"{eng:14.0f} {med(rs, 'init_s'):6.1f} {rs[-1]['losses'][-1]:10.5f}")

    zero_keys = [(case, dtype) for case, dtype in keys if case != DDP_CASE]
    if "flowtrain" in engines and "deepspeed" in engines:
        print("\nflowtrain / DeepSpeed: throughput (higher is better; range over rounds), peak "
              "RSS per rank and engine RSS (lower is better); loss: largest |difference| over "
              "all steps")
        print(f"{'case':22s} {'throughput':>10s} {'range':>11s} {'med-step':>8s} "
              f"{'peak RSS':>9s} {'host PSS':>9s} {'engine RSS':>10s} {'loss diff':>10s}")
        for case, dtype in zero_keys:
            label = case_label(case, dtype)
            ft, ds = results[("flowtrain", case, dtype)], results[("deepspeed", case, dtype)]
            if not ft or not ds:
                why = status.get(("flowtrain", case, dtype)) if not ft else \
                    status.get(("deepspeed", case, dtype), "no result")
                print(f"{label:22s} {'-':>10s}  ({'flowtrain' if not ft else 'DeepSpeed'} "
                      f"{why})")
                continue
            thr = med(ft, "samples_per_s") / med(ds, "samples_per_s")
            thr_step = med(ft, "median_step_samples_per_s") / med(ds, "median_step_samples_per_s")
            rss = statistics.median(max(r["peak_rss"]) for r in ft) / \
                statistics.median(max(r["peak_rss"]) for r in ds)
            eng = statistics.median(max(r["engine_rss"]) for r in ft) / \
                statistics.median(max(r["engine_rss"]) for r in ds)
            pss = med(ft, "host_pss") / med(ds, "host_pss")
            diff = max(abs(a - b) for a, b in zip(ft[-1]["losses"], ds[-1]["losses"]))
            print(f"{label:22s} {thr:10.3f} {ratio_range(ft, ds, 'samples_per_s'):>11s} "
                  f"{thr_step:8.3f} {rss:9.3f} {pss:9.3f} {eng:10.3f} {diff:10.2e}")
    if "ddp" in engines:
        print("\nZeRO / torch DDP: throughput (aim for flowtrain >= 0.95; range over rounds), "
              "peak RSS per rank; loss: largest |difference| from DDP's over all steps")
        print(f"{'case':22s} {'engine':9s} {'throughput':>10s} {'range':>11s} {'med-step':>8s} "
              f"{'DDP CPU/CPU':>11s} {'peak RSS':>9s} {'host PSS':>9s} {'loss diff':>10s}")
        for case, dtype in zero_keys:
            label = case_label(case, dtype)
            ddp = results.get(("ddp", DDP_CASE, dtype), [])
            for engine in (e for e in engines if e != "ddp"):
                zs = results[(engine, case, dtype)]
                if not zs or not ddp:
                    print(f"{label:22s} {engine:9s} {'-':>10s}")
                    label = ""
                    continue
                thr = med(zs, "samples_per_s") / med(ddp, "samples_per_s")
                thr_step = med(zs, "median_step_samples_per_s") / \
                    med(ddp, "median_step_samples_per_s")
                rss = statistics.median(max(r["peak_rss"]) for r in zs) / \
                    statistics.median(max(r["peak_rss"]) for r in ddp)
                cpu = med(ddp, "cpu_step_ms") / med(zs, "cpu_step_ms")
                pss = med(zs, "host_pss") / med(ddp, "host_pss")
                diff = max(abs(a - b) for a, b in zip(zs[-1]["losses"], ddp[-1]["losses"]))
                print(f"{label:22s} {engine:9s} {thr:10.3f} "
                      f"{ratio_range(zs, ddp, 'samples_per_s'):>11s} {thr_step:8.3f} "
                      f"{cpu:11.3f} {rss:9.3f} {pss:9.3f} {diff:10.2e}")
                label = ""
    print("\nsamples/s over all timed steps; med-step = samples per step / the median step time "
          "(less hurt by a short load spike from other processes);\nCPU ms = the busiest "
          "rank's CPU time per step, every thread (the least disturbed by other jobs; it does "
          "not see time spent waiting);\n"
          "host PSS = the ranks' peak proportional set sizes added up, sampled over two "
          "untimed steps after the timed ones (a page shared by the ranks counts once);\n"
          "engine RSS = peak RSS minus the peak before initialize() (imports and the model); "
          "loss = mean over ranks of the last step's loss")


def _flag(argv: list[str], name: str, default: str) -> str:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


if __name__ == "__main__":
    main()
