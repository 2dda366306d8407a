"""How close `flowtrain simulate` comes to real runs on this machine: each configuration (world
1, 2 and 4; ZeRO stages 0-3; bucket sizes, accumulation, micro-batch sizes, CPU offload; 1F1B
pipelines of 2 stages) is launched for real with `flowtrain launch`, then predicted with
`simulate --compare` against this host's calibrated profile. Prints predicted vs measured step
time per configuration, the mean absolute percentage error (MAPE) over them and per task class,
and a gloo all-reduce row across sizes (measured now vs the profile's model).

    .venv/bin/flowtrain calibrate            # once: writes the this-host profile
    .venv/bin/python benchmarks/sim_accuracy.py [--steps 24] [--only 3,17] [--quiet-wait 120]
    # or a calibration before each round, each round's runs predicted with their own:
    .venv/bin/python benchmarks/sim_accuracy.py --calibrate-each-round --repeat 3 --lock FILE

A shared host makes every figure noisy: before each launch the script waits (at most
--quiet-wait seconds) until the CPUs are nearly idle, each config is run --repeat times (a
round over all configs, then another) and the quiet run with the median step is kept, as
calibration keeps each job size's median quiet run: the host's speed moves in phases of
minutes (on a VM its neighbours', unseen), so the typical run is the figure both sides can
agree on. A run during which other processes kept more than --busy-cores cores busy is
launched again (up to --attempts times), and only where no run was quiet do disturbed ones
count.
Each row reports how many cores other processes kept busy during the kept run ("others", from
/proc/stat less this job's own CPU time) and how much longer the slowest run of the config was
("spread"), and how slow the host computed around the kept run against its profile ("host":
``sims.calibrate.probe.host_speed``, a calibration Linear pass timed just before and just after
the run, over the profile's time, geometric mean; the host's speed drifts over minutes, and the
profile holds its calibration's). "at host" is the step's error when the
prediction is given that speed (``simulate --compare --host-speed``): what is left is the cost
model's own error, and the difference from "error" is the host's drift since calibration.
A shared host's speed drifts over tens of minutes, in phases the probe reads only in part;
--calibrate-each-round keeps a calibration within minutes of the runs it predicts.

The same file is the training script (``--worker``): a residual MLP whose parameter names carry
layer numbers, as the simulator's planner expects, trained as a plain module or as a
PipelineModule; ``--gloo-worker`` times gloo all-reduces.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
SMALL_BUCKET = 200_000
GLOO_BYTES = (128 << 10, 2 << 20, 12 << 20)  # not the calibration's sizes
CLASSES = ("forward", "backward", "reduce", "gather", "optimizer", "step")
CALIBRATE_TIMEOUT_S = 1800.0
T = TypeVar("T")


@dataclass(frozen=True)
class Config:
    name: str
    ranks: int
    overrides: dict[str, Any] = field(default_factory=dict)
    pp: int = 1


CONFIGS: list[Config] = [
    Config("1 rank", 1, {"zero_optimization": {"stage": 0}}),
    Config("1 rank, 2 micro-batches of 32", 1,
           {"train_micro_batch_size_per_gpu": 32, "gradient_accumulation_steps": 2}),
    Config("dp", 2, {"zero_optimization": {"stage": 0}}),
    Config("dp, 2 micro-batches", 2, {"gradient_accumulation_steps": 2}),
    Config("dp, small buckets", 2, {"zero_optimization": {"stage": 0,
                                                          "reduce_bucket_size": SMALL_BUCKET}}),
    Config("dp, micro-batch 16", 2, {"train_micro_batch_size_per_gpu": 16}),
    Config("zero1", 2, {"zero_optimization": {"stage": 1}}),
    Config("zero1, small buckets", 2, {"zero_optimization": {"stage": 1,
                                                             "reduce_bucket_size": SMALL_BUCKET}}),
    Config("zero2", 2, {"zero_optimization": {"stage": 2}}),
    Config("zero2, 2 micro-batches", 2, {"zero_optimization": {"stage": 2},
                                         "gradient_accumulation_steps": 2}),
    Config("zero2, offload", 2, {"zero_optimization": {"stage": 2, "offload_optimizer":
                                                       {"device": "cpu"}}}),
    Config("zero3", 2, {"zero_optimization": {"stage": 3}}),
    Config("zero3, no prefetch", 2, {"zero_optimization": {"stage": 3,
                                                           "stage3_prefetch_bucket_size": 0}}),
    Config("4 ranks, dp", 4, {"zero_optimization": {"stage": 0}}),
    Config("4 ranks, zero1", 4, {"zero_optimization": {"stage": 1}}),
    Config("4 ranks, zero2", 4, {"zero_optimization": {"stage": 2}}),
    Config("pp 2, 4 micro-batches", 2, {"gradient_accumulation_steps": 4}, pp=2),
    Config("pp 2 x dp 2, 4 micro-batches", 4, {"gradient_accumulation_steps": 4}, pp=2),
]


# ----------------------------------------------------------------------------- the workers

def worker(config: str, steps: int, width: int, layers: int, pp: int) -> None:
    """The training job one config runs (every rank)."""
    import torch
    from torch import nn

    import flowtrain

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(width, 4 * width)
            self.proj = nn.Linear(4 * width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.proj(torch.relu(self.fc(x)))

    class Net(nn.Module):
        def __init__(self, parts: list[nn.Module]) -> None:
            super().__init__()
            self.embed = parts[0]
            self.layers = nn.ModuleList(parts[1:-1])
            self.head = parts[-1]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x)
            for block in self.layers:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    flowtrain.init_distributed()
    parts = [nn.Linear(64, width), *(Block() for _ in range(layers)), nn.Linear(width, 10)]
    if pp > 1:
        from flowtrain.pipe import PipelineModule

        net: nn.Module = PipelineModule(parts, num_stages=pp,
                                        loss_fn=nn.functional.cross_entropy,
                                        partition_method="parameters")
    else:
        net = Net(parts)
    engine, _, _, _ = flowtrain.initialize(model=net, model_parameters=net.parameters(),
                                           config=config)
    generator = torch.Generator().manual_seed(1)
    size = engine.train_micro_batch_size_per_gpu()

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(size, 64, generator=generator),
                torch.randint(0, 10, (size,), generator=generator))

    gas = engine.gradient_accumulation_steps()
    for _ in range(steps):
        if pp > 1:
            engine.train_batch(iter([batch() for _ in range(gas)]))
            continue
        for _ in range(gas):
            x, y = batch()
            engine.backward(nn.functional.cross_entropy(engine(x), y))
            engine.step()
    if pp > 1:
        engine.destroy()


def gloo_worker(out: str, trials: int) -> None:
    """Gloo all-reduce of each size in GLOO_BYTES among the launched ranks, timed as
    `flowtrain calibrate` times collectives (back-to-back calls per trial, the median trial);
    rank 0 writes {bytes: seconds}."""
    import torch
    import torch.distributed as dist

    import flowtrain
    from sims.calibrate.timing import agreed_repeats

    torch.set_num_threads(1)
    flowtrain.init_distributed()
    results = {}
    for nbytes in GLOO_BYTES:
        buffer = torch.ones(nbytes // 4)
        start = time.perf_counter()
        dist.all_reduce(buffer)
        repeats = agreed_repeats(time.perf_counter() - start, 0.05, None)
        times = []
        for _ in range(trials):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeats):
                dist.all_reduce(buffer)
            times.append((time.perf_counter() - start) / repeats)
        results[nbytes] = statistics.median(times)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))


# ----------------------------------------------------------------------------- the host

def wait_for_quiet(limit_s: float, busy_below: float = 0.25) -> float:
    """Waits until the host's CPUs are less than ``busy_below`` busy over one second, at most
    ``limit_s`` seconds; returns the busy fraction last seen."""
    from sims.calibrate.timing import host_busy_seconds

    cores = os.cpu_count() or 1
    deadline = time.monotonic() + limit_s
    while True:
        before = host_busy_seconds()
        time.sleep(1.0)
        busy = (host_busy_seconds() - before) / cores
        if busy < busy_below or time.monotonic() >= deadline:
            return busy


def host_speed(cluster: str) -> float:
    """How slow this host computes now against its profile
    (``sims.calibrate.probe.host_speed``): 1.15 means 15 % slower than at calibration; nan for
    a profile without engine costs."""
    from sims.calibrate.probe import host_speed as probe
    from sims.hardware import get_profile

    hw = get_profile(cluster)
    return probe(hw) if hw.engine is not None else float("nan")


@contextlib.contextmanager
def host_lock(path: Path | None) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` while the block runs (nothing when None): other jobs
    on the host that take the same lock (``flock PATH cmd``) wait instead of running beside it."""
    if path is None:
        yield
        return
    import fcntl

    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def launch_quietly(args: argparse.Namespace, run: Callable[[], T], label: str,
                   cluster: str | None = None) -> tuple[T, float, float]:
    """``run()`` under the host lock once the host is quiet, and again (up to --attempts) while
    other processes (and steal time) kept more than --busy-cores cores busy: a run beside them
    does not count, but the last attempt is kept whatever it saw. Returns its result, the cores
    others kept busy, and with ``cluster`` the host's speed over it (the probes on either side,
    geometric mean; nan without)."""
    from sims.calibrate.timing import ForeignLoad

    before = after = math.nan
    for attempt in range(args.attempts):
        with host_lock(args.lock):
            wait_for_quiet(args.quiet_wait)
            if cluster is not None:
                before = host_speed(cluster)
            with ForeignLoad() as others:
                result = run()
            if cluster is not None:
                after = host_speed(cluster)
        print(f"  ... {label}.{attempt + 1}: others {others.cores:.2f} cores", file=sys.stderr,
              flush=True)
        if others.cores <= args.busy_cores:
            break
    return result, others.cores, math.sqrt(before * after)


# ----------------------------------------------------------------------------- running

def launch(cfg: Config, workdir: Path, args: argparse.Namespace, run: int = 0) -> Path:
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": args.micro_batch,
                              "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    config.update(cfg.overrides)
    slug = "".join(c if c.isalnum() else "-" for c in cfg.name)
    config_path = workdir / f"{slug}.json"
    config_path.write_text(json.dumps(config))
    run_dir = workdir / (slug if run == 0 else f"{slug}-run{run + 1}")
    cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node", str(cfg.ranks),
           "--run-dir", str(run_dir), __file__, "--worker", "--config", str(config_path),
           "--steps", str(args.steps), "--width", str(args.width), "--layers", str(args.layers),
           "--pp", str(cfg.pp)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout,
                          check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{cfg.name}: launch failed ({proc.returncode}): "
                           f"{proc.stderr.strip().splitlines()[-1:]}")
    return run_dir


def calibrate(out: Path, args: argparse.Namespace, label: str) -> str:
    """``flowtrain calibrate --out OUT`` under the host lock once the host is quiet (the
    command reruns its own disturbed jobs); returns OUT as the profile to predict with."""
    with host_lock(args.lock):
        wait_for_quiet(args.quiet_wait)
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "calibrate", "--out",
                               str(out), "--save-measurements", str(out.with_suffix(".raw.json"))],
                              cwd=ROOT, capture_output=True, text=True,
                              timeout=CALIBRATE_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{label}: flowtrain calibrate failed ({proc.returncode}): "
                           f"{proc.stderr.strip().splitlines()[-1:]}")
    speeds = [line.strip() for line in proc.stdout.splitlines() if "host speed during" in line]
    print(f"  {label}: calibrated in {time.monotonic() - started:.0f} s -> {out.name}"
          + (f"; {speeds[0]}" if speeds else ""), flush=True)
    return str(out)


def compare(run_dir: Path, cluster: str, speed: float | None = None) -> dict[str, Any]:
    """``flowtrain simulate --compare run_dir --json [--host-speed SPEED]``, through the
    command's own code."""
    import contextlib
    import io

    from sims.simulate import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    extra = ["--host-speed", repr(speed)] if speed is not None and not math.isnan(speed) else []
    ns = parser.parse_args(["--compare", str(run_dir), "--cluster", cluster, "--json", *extra])
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        run(ns)
    out = json.loads(buffer.getvalue())
    return {row["class"]: row for row in out["classes"]}


def time_gloo(workdir: Path, args: argparse.Namespace, label: str
              ) -> tuple[dict[int, float], float]:
    """One launch of the gloo worker (2 ranks) on a quiet host, as the configs are launched:
    seconds per all-reduce of each size, and the cores others kept busy."""
    out = workdir / "gloo.json"
    cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node", "2",
           "--run-dir", str(workdir / "gloo-run"), __file__, "--gloo-worker", "--out", str(out)]
    _, others, _ = launch_quietly(
        args, lambda: subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                     timeout=args.timeout, check=True), label)
    return {int(k): float(v) for k, v in json.loads(out.read_text()).items()}, others


def gloo_rows(timed: list[tuple[str, dict[int, float], float]]) -> list[str]:
    """Measured gloo all-reduce over 2 ranks against the profile's cost for each size: per
    launch (``time_gloo``) the profile it is held against, its seconds per size and the cores
    others kept busy. Each size's row is the launch with the median error (with one profile for
    all, the median time): one launch can land on a host that is slow for every size."""
    from sims.costs import collective_seconds
    from sims.hardware import get_profile

    # The bare collective's cost, without the profile's gloo_s (what a gloo call takes beside
    # a live engine): these ranks run no engine. Timed the calibration's way, back to back,
    # the launched ranks and calibration's forked ones agree within the host's noise (3
    # rounds of each in turn: 128 KiB 0.8-2.2 ms either way).
    pairs: dict[int, list[tuple[float, float]]] = {}
    for cluster, seconds, _ in timed:
        hw = get_profile(cluster)
        for nbytes, measured in seconds.items():
            pairs.setdefault(nbytes, []).append(
                (collective_seconds("all_reduce", nbytes, 2, hw), measured))
    busiest = max(others for *_, others in timed)
    lines = []
    for nbytes, seen in sorted(pairs.items()):
        errors = sorted(100 * (model - measured) / measured for model, measured in seen)
        seen.sort(key=lambda pair: (pair[0] - pair[1]) / pair[1])
        model, measured = seen[(len(seen) - 1) // 2]
        lines.append(f"  gloo all_reduce {nbytes / 2**20:7.3f} MiB, 2 ranks: model "
                     f"{model * 1e3:7.2f} ms, measured {measured * 1e3:7.2f} ms, "
                     f"{100 * (model - measured) / measured:+6.1f} %  (median of {len(seen)} "
                     f"launches, {errors[0]:+.1f} to {errors[-1]:+.1f} %; others up to "
                     f"{busiest:.2f} cores)")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--gloo-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=24,
                        help="optimizer steps per run (default 24; the first is left out)")
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--cluster", default="this-host", help="profile to predict with")
    parser.add_argument("--only", default=None,
                        help="comma-separated config numbers to run (1-based), e.g. 10,13")
    parser.add_argument("--keep", type=Path, default=None, help="keep run directories here")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    parser.add_argument("--quiet-wait", type=float, default=60.0,
                        help="most seconds to wait before each launch for the host to be idle")
    parser.add_argument("--no-gloo", action="store_true", help="skip the gloo all-reduce rows")
    parser.add_argument("--gloo-only", action="store_true",
                        help="only the gloo all-reduce rows, no configs")
    parser.add_argument("--lock", type=Path, default=None,
                        help="hold an exclusive flock on this file during each launch, so other "
                             "jobs that take the same lock do not run beside a measured run "
                             "(do not also run this script under flock on the same file: it "
                             "would wait for itself)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs of each config, a round over all configs after the other; "
                             "the quiet one with the median step is kept")
    parser.add_argument("--calibrate-each-round", action="store_true",
                        help="run `flowtrain calibrate` before each round and predict the "
                             "round's runs with it (and time a gloo launch right after it, "
                             "held against it), instead of --cluster for all: on a host "
                             "whose speed drifts over tens of minutes, a calibration taken "
                             "long before a run holds the drift against the model")
    parser.add_argument("--busy-cores", type=float, default=0.1,
                        help="a run during which other processes (and steal time) kept more "
                             "cores busy than this is run again (default 0.1, as calibration)")
    parser.add_argument("--attempts", type=int, default=3,
                        help="launches per run at most while they are disturbed (default 3)")
    args = parser.parse_args()
    if args.worker:
        worker(args.config, args.steps, args.width, args.layers, args.pp)
        return 0
    if args.gloo_worker:
        gloo_worker(args.out, trials=9)
        return 0
    configs = [] if args.gloo_only else list(enumerate(CONFIGS, start=1))
    if args.only:
        try:
            configs = [(int(n), CONFIGS[int(n) - 1]) for n in args.only.split(",")]
        except (ValueError, IndexError):
            parser.error(f"--only: config numbers from 1 to {len(CONFIGS)}, got {args.only!r}")
    errors: dict[str, list[float]] = {c: [] for c in CLASSES}
    load = os.getloadavg()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="sim_accuracy_") as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        against = "the profile calibrated just before its round" if args.calibrate_each_round \
            else args.cluster
        print(f"{len(configs)} configs, {args.steps} steps each, {args.repeat} run(s) of each "
              f"(the median quiet run kept), each predicted with {against} ({os.cpu_count()} "
              f"CPUs here; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")
        # (rows, rows at the host's speed, others' cores, host speed) of each run of each config
        runs: dict[int, list[tuple[dict[str, Any], dict[str, Any], float, float]]] = {}
        at_speed: dict[str, list[float]] = {c: [] for c in CLASSES}
        cluster = args.cluster
        # gloo launches: (the profile they are held against, seconds per size, others' cores)
        timed: list[tuple[str, dict[int, float], float]] = []
        for repeat in range(args.repeat):
            if args.calibrate_each_round and (configs or not args.no_gloo):
                try:
                    cluster = calibrate(workdir / f"profile-round{repeat + 1}.json", args,
                                        f"round {repeat + 1}")
                    if not args.no_gloo:  # right after its calibration, as the configs are
                        timed.append((cluster, *time_gloo(workdir, args,
                                                          f"gloo all_reduce round {repeat + 1}")))
                except (RuntimeError, subprocess.SubprocessError, OSError, ValueError) as exc:
                    print(f"  round {repeat + 1} left out: {exc}", flush=True)
                    continue
            for number, cfg in configs:
                try:
                    run_dir, others, speed = launch_quietly(
                        args, lambda cfg=cfg, repeat=repeat: launch(cfg, workdir, args, repeat),
                        f"{number:>2} {cfg.name:<30} run {repeat + 1}", cluster)
                    rows = compare(run_dir, cluster)
                    rows_at_speed = compare(run_dir, cluster, speed)
                except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
                    print(f"  {number:>2} {cfg.name:<30} run {repeat + 1} failed: {exc}",
                          flush=True)
                    continue
                runs.setdefault(number, []).append((rows, rows_at_speed, others, speed))
                print(f"  ... {number:>2} {cfg.name:<30} run {repeat + 1}: measured "
                      f"{rows['step']['measured_s'] * 1e3:8.2f} ms", file=sys.stderr, flush=True)
        print(f"  {'#':>2} {'config':<30} {'ranks':>5} {'predicted':>10} {'measured':>10} "
              f"{'error':>8} {'others':>7} {'spread':>7} {'host':>6} {'at host':>8}")
        for number, cfg in configs:
            if number not in runs:
                continue
            # the quiet run with the median step (the faster of the middle two of an even
            # count); "spread" is how much longer the longest run was than the shortest
            measured = [r["step"]["measured_s"] for r, *_ in runs[number]]
            quiet = [run for run in runs[number] if run[2] <= args.busy_cores] or runs[number]
            quiet.sort(key=lambda run: run[0]["step"]["measured_s"])
            rows, rows_at, others, speed = quiet[(len(quiet) - 1) // 2]
            step = rows["step"]
            print(f"  {number:>2} {cfg.name:<30} {cfg.ranks:>5} {step['predicted_s'] * 1e3:8.2f}ms "
                  f"{step['measured_s'] * 1e3:8.2f}ms {step['error_pct']:+7.1f}% "
                  f"{others:6.2f} {100 * (max(measured) / min(measured) - 1):6.1f}% "
                  f"{speed:6.2f} {rows_at['step']['error_pct']:+7.1f}%", flush=True)
            for c, row in rows.items():
                if row["error_pct"] is not None:
                    errors[c].append(abs(row["error_pct"]))
                if rows_at[c]["error_pct"] is not None:
                    at_speed[c].append(abs(rows_at[c]["error_pct"]))
        if errors["step"]:
            print(f"step time: MAPE {statistics.fmean(errors['step']):.1f} %, worst "
                  f"{max(errors['step']):.1f} % over {len(errors['step'])} configs")
            print(f"  at the host's speed over each run (--host-speed): MAPE "
                  f"{statistics.fmean(at_speed['step']):.1f} %, worst "
                  f"{max(at_speed['step']):.1f} %")
        print("MAPE per task class (as calibrated / at the host's speed):")
        for c in CLASSES:
            if errors[c]:
                print(f"  {c:<10} {statistics.fmean(errors[c]):6.1f} % "
                      f"{statistics.fmean(at_speed[c]):6.1f} %  ({len(errors[c])} runs)")
        if not args.no_gloo:
            try:
                for repeat in range(0 if args.calibrate_each_round else args.repeat):
                    timed.append((cluster, *time_gloo(workdir, args,
                                                      f"gloo all_reduce run {repeat + 1}")))
                print("\n".join(gloo_rows(timed)) if timed else "  gloo all_reduce: no launch")
            except (subprocess.SubprocessError, OSError, ValueError) as exc:
                print(f"  gloo all_reduce: failed: {exc}")
    end = os.getloadavg()
    print(f"took {time.monotonic() - started:.0f} s; load average at the end {end[0]:.2f} "
          f"{end[1]:.2f} {end[2]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
