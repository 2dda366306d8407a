"""`flowtrain calibrate`: measures this host (``sims.calibrate.host``: matmul, memory copies;
``sims.calibrate.collectives``: gloo collectives over loopback, how much a collective slows
compute; ``sims.calibrate.engine_pieces`` and ``ops``: the engine's own pieces; and
``sims.calibrate.jobs``: a few launched calibration jobs), fits the cost model
(``sims.calibrate.profile_fit``) and writes a profile.

Measuring and fitting are separate: the measurements are plain JSON (``--save-measurements``)
and ``fit_profile`` turns them into a HardwareProfile without touching the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sims.calibrate.collectives import measure_collectives
from sims.calibrate.engine_pieces import measure_optimizer, measure_passes
from sims.calibrate.factors import job_speed
from sims.calibrate.host import host_facts, measure_matmul, measure_memory
from sims.calibrate.jobs import measure_jobs
from sims.calibrate.ops import measure_ops
from sims.calibrate.profile_fit import fit_profile
from sims.calibrate.settings import DEFAULT, MEASUREMENTS_VERSION, QUICK, CalibrationError, Settings
from sims.hardware import EngineCosts, HardwareProfile, host_profile_path
from sims.planner import PIPELINE_JOB_RANKS


def measure(settings: Settings, ranks: Sequence[int], timeout_s: float) -> dict[str, Any]:
    """Every measurement, as the JSON that ``fit_profile`` reads. Collectives go first so the
    ranks are forked before this process has started its own compute threads."""
    collectives, interference, engine = measure_collectives(settings, ranks, timeout_s)
    cores = os.cpu_count() or 1
    threads = [max(1, cores // n) for n in (1, *ranks)]
    engine["optimizer"] = measure_optimizer(settings.optimizer_sets, settings.seconds_per_point)
    engine["passes"] = measure_passes(threads, settings.pass_shapes, settings.seconds_per_point)
    engine["weight_passes"] = measure_passes(threads, settings.weight_shapes,
                                             settings.seconds_per_point)
    engine["ops"] = measure_ops(threads, settings.seconds_per_point)
    jobs = settings.jobs if settings.jobs is not None else \
        tuple((n, 1) for n in (1, *ranks)) + ((PIPELINE_JOB_RANKS, 2),)
    engine["jobs"] = measure_jobs(jobs, settings.job_steps, timeout_s, runs=settings.job_runs)
    return {"v": MEASUREMENTS_VERSION, "host": host_facts(), "threads_per_device": 1,
            "matmul": measure_matmul(settings), "memory": measure_memory(settings),
            "collectives": collectives, "interference": interference, "engine": engine}


def write_profile(measurements: dict[str, Any], out: str | os.PathLike[str],
                  name: str = "this-host") -> HardwareProfile:
    """Fits the measurements and saves the profile at ``out``."""
    profile = fit_profile(measurements, name)
    profile.save(out)
    return profile


# ----------------------------------------------------------------------------- command line

def _rank_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        counts = ()
    if not counts or counts[0] < 2 or counts[-1] > 16:
        raise argparse.ArgumentTypeError(f"must be comma-separated rank counts from 2 to 16, "
                                         f"e.g. 2,4; got {text!r}")
    return counts


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowtrain calibrate",
        description="Measure this host (matmul, memory, gloo collectives, comm/compute "
                    "interference, the engine's own pieces and launched calibration jobs), "
                    "fit the simulator's cost model and write a hardware profile that "
                    "`flowtrain simulate --cluster this-host` reads.")
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes and repetitions, one 2-rank calibration job: about "
                             "20 s instead of 2-3 minutes")
    parser.add_argument("--out", type=Path, default=None,
                        help="profile path (default: $FLOWTRAIN_HOST_PROFILE or "
                             "~/.cache/flowtrain/host_profile.json)")
    parser.add_argument("--ranks", type=_rank_counts, default=(2, 4),
                        help="gloo rank counts to measure collectives for (default: 2,4)")
    parser.add_argument("--timeout", type=_positive, default=120.0,
                        help="seconds the collective ranks may take before they are stopped "
                             "(default: 120)")
    parser.add_argument("--name", default="this-host", help="profile name (default: this-host)")
    parser.add_argument("--save-measurements", type=Path, default=None, metavar="PATH",
                        help="also write the raw measurements as JSON")
    parser.add_argument("--from-measurements", type=Path, default=None, metavar="PATH",
                        help="fit measurements saved earlier instead of measuring")
    return parser


def engine_summary_lines(engine: EngineCosts) -> list[str]:
    """The engine figures in the units people quote, for ``flowtrain calibrate``'s report."""
    lines = []
    for threads, kinds in sorted(engine.pass_rates.items()):
        for kind, curve in kinds.items():
            lines.append(f"  engine {kind:<8} {threads} thread{'s' if threads > 1 else ' '}: "
                         f"{curve[0][1] / 1e9:6.1f} GFLOP/s at {curve[0][0]:.3g} FLOPs .. "
                         f"{curve[-1][1] / 1e9:6.1f} at {curve[-1][0]:.3g}")
    kernel = engine.optimizer
    lines.append(f"  engine Adam kernel: {kernel.latency_s * 1e6:.1f} us per call, "
                 f"{kernel.bandwidth / 1e9:.1f} GB/s")
    for op, by_ranks in engine.channel.items():
        for ranks, link in sorted(by_ranks.items()):
            lines.append(f"  shm channel {op:<14} {ranks} ranks: latency "
                         f"{link.latency_s * 1e6:8.1f} us, bandwidth {link.bandwidth / 1e9:6.3f} "
                         "GB/s")
    lines.append(f"  shm channel interference {engine.channel_interference:.2f}, all-reduce "
                 f"x{engine.channel_slowdown:.2f} while computing")
    if engine.p2p is not None:
        lines.append(f"  pipeline send: {engine.p2p.latency_s * 1e6:.1f} us + "
                     f"{engine.p2p.bandwidth / 1e9:.3f} GB/s")
    if engine.pipeline_op_s or engine.pipeline_message_s:
        lines.append(f"  engine pipeline: {engine.pipeline_op_s * 1e6:.0f} us to start each "
                     f"instruction, {engine.pipeline_message_s * 1e6:.0f} us to deliver each "
                     "message beyond the send")
    for ranks, by_class in sorted(engine.factors.items()):
        lines.append(f"  engine job on {ranks} rank{'s' if ranks > 1 else ' '}: forward x"
                     f"{by_class.get('forward', 1.0):.2f} + "
                     f"{by_class.get('forward_s', 0.0) * 1e3:.2f} ms, backward x"
                     f"{by_class.get('backward', 1.0):.2f} + "
                     f"{by_class.get('backward_s', 0.0) * 1e3:.2f} ms per step, optimizer x"
                     f"{by_class.get('optimizer', 1.0):.2f} the isolated measurements; "
                     f"{by_class.get('micro_batch_s', 0.0) * 1e3:.2f} ms between forward and "
                     f"backward, {by_class.get('step_s', 0.0) * 1e3:.2f} ms more per step, "
                     f"gloo calls {by_class.get('gloo_s', 0.0) * 1e3:.2f} ms longer")
        if "zero3_fetch_s" in by_class or "zero3_backward_s" in by_class:
            lines.append(f"    ZeRO-3 hooks: {by_class.get('zero3_fetch_s', 0.0) * 1e3:.2f} ms "
                         f"per module fetch, {by_class.get('zero3_backward_s', 0.0) * 1e3:.2f}"
                         " ms per module in a backward")
        if "bucket_s" in by_class or "reduce_s" in by_class:
            lines.append(f"    buckets: {by_class.get('bucket_s', 0.0) * 1e3:.2f} ms to hand each "
                         f"to the reducer, {by_class.get('reduce_s', 0.0) * 1e3:.2f} ms more "
                         "per reduce")
    for ranks, factor in sorted(engine.slowdown.items()):
        memory = engine.memory_slowdown.get(ranks)
        lines.append(f"  {ranks} ranks working at once: each computes {factor:.2f}x slower"
                     + (f", streams memory {memory:.2f}x slower" if memory else ""))
    return lines


def summary(profile: HardwareProfile) -> list[str]:
    """The fitted figures, one line each, in the units people quote."""
    lines = [f"profile {profile.name}: {profile.devices_per_node} devices (cores)"]
    for dtype, peak in profile.peak_flops.items():
        lines.append(f"  matmul {dtype:<9} peak {peak / 1e9:8.1f} GFLOP/s per core")
    small, large = profile.efficiency[0], profile.efficiency[-1]
    lines.append(f"  float32 efficiency {small[1]:.2f} at {small[0]:.3g} FLOPs .. "
                 f"{large[1]:.2f} at {large[0]:.3g} FLOPs")
    lines.append(f"  memory bandwidth {profile.memory_bandwidth / 1e9:.1f} GB/s per core "
                 "(read + write)")
    for op, by_ranks in profile.collectives.items():
        for ranks, link in sorted(by_ranks.items()):
            lines.append(f"  {op:<14} {ranks} ranks: latency {link.latency_s * 1e6:8.1f} us, "
                         f"bandwidth {link.bandwidth / 1e9:6.3f} GB/s")
    ring = profile.intra_node
    lines.append(f"  ring link: {ring.latency_s * 1e6:.1f} us per step, "
                 f"{ring.bandwidth / 1e9:.3f} GB/s per rank")
    lines.append(f"  comm/compute interference {profile.comm_compute_interference:.2f}, "
                 f"all-reduce x{profile.compute_comm_slowdown:.2f} while computing")
    if profile.engine is not None:
        lines += engine_summary_lines(profile.engine)
    for reason in profile.sources.get("collectives", "").split("; left out: ")[1:]:
        lines.append(f"  warning: {reason}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """`flowtrain calibrate`; returns the exit code (2 for bad flags, 1 when calibration
    fails)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed the problem
        return int(exc.code) if isinstance(exc.code, int) else 2
    out = args.out if args.out is not None else host_profile_path()
    started = time.monotonic()
    try:
        if args.from_measurements is not None:
            try:
                measurements = json.loads(args.from_measurements.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise CalibrationError(f"cannot read measurements {str(args.from_measurements)!r}"
                                       f": {exc}") from None
        else:
            settings = QUICK if args.quick else DEFAULT
            print(f"measuring this host ({'quick' if args.quick else 'full'}; gloo ranks "
                  f"{','.join(map(str, args.ranks))}) ...", flush=True)
            measurements = measure(settings, args.ranks, args.timeout)
            if args.save_measurements is not None:
                args.save_measurements.parent.mkdir(parents=True, exist_ok=True)
                args.save_measurements.write_text(json.dumps(measurements, indent=1) + "\n")
        profile = write_profile(measurements, out, args.name)
    except CalibrationError as exc:
        print(f"flowtrain calibrate: error: {exc}", file=sys.stderr)
        return 1
    print("\n".join(summary(profile)))
    speeds = [f"{job['ranks']} rank{'s' if int(job['ranks']) > 1 else ''}"
              f"{' pp ' + str(job['pp']) if int(job.get('pp', 1)) > 1 else ''} "
              f"x{job_speed(profile, job):.2f}"
              for job in measurements.get("engine", {}).get("jobs", []) if job.get("probe_s")]
    if speeds:
        print(f"  host speed during the jobs, probe pass against the profile's curve (recorded, "
              f"not applied): {', '.join(speeds)}")
    print(f"wrote {out} in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
