"""`flowtrain calibrate`: measures this host (matmul, memory copies, gloo collectives over
loopback, how much a collective slows compute) and, on it, the engine's own pieces and a few
launched calibration jobs (``sims.calibrate_engine``), fits the cost model and writes a profile.

Measuring and fitting are separate: the measurements are plain JSON (``--save-measurements``)
and ``fit_profile`` turns them into a HardwareProfile without touching the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from sims import calibrate_engine, calibrate_jobs, calibrate_ops
from sims.calibrate_comm import MEASURED_OPS, measure_collectives
from sims.costs import ring_factor, ring_steps
from sims.hardware import HardwareProfile, Link, host_profile_path

MEASUREMENTS_VERSION = 1
DTYPES = ("float32", "bfloat16", "float16")


class CalibrationError(RuntimeError):
    """Measuring or fitting failed; the message says what and how to retry."""


@dataclass(frozen=True)
class Settings:
    """How much to measure: --quick trades points and repetitions for time."""

    matmul_sizes: tuple[int, ...]  # square fp32 matmuls, n x n @ n x n
    low_precision_sizes: tuple[int, ...]  # bf16 / fp16, stopped early when too slow
    seconds_per_point: float  # each matmul or copy size is repeated for about this long
    max_op_seconds: float  # skip larger sizes of a dtype once one op would take longer
    memory_elements: int  # float32 elements in the copy benchmark (well past the L3 cache)
    collective_bytes: tuple[int, ...]  # full-buffer sizes, multiples of 4 x 4 B x ranks
    collective_trials: int
    trial_seconds: float  # back-to-back collectives per trial, about this long
    interference_bytes: int
    interference_window_s: float
    # the engine's own pieces (sims.calibrate_engine)
    pass_shapes: tuple[tuple[int, int, int], ...] = calibrate_engine.PASS_SHAPES
    optimizer_sets: tuple[tuple[int, int], ...] = calibrate_engine.OPTIMIZER_SETS
    weight_shapes: tuple[tuple[int, int, int], ...] = calibrate_engine.WEIGHT_SHAPES
    p2p_bytes: tuple[int, ...] = (4 << 10, 64 << 10, 1 << 20, 8 << 20)
    concurrency_window_s: float = 0.5
    # (ranks, pipeline stages) of the launched calibration jobs (None: data parallel on 1 and
    # every measured rank count, and a 2-stage pipeline)
    jobs: tuple[tuple[int, int], ...] | None = None
    job_runs: int = 3  # each job's runs, a round over all jobs after the other; each size's
    # median quiet run is kept (with 2, one slow round of the 2-rank job moved every prediction)
    job_steps: int = calibrate_jobs.JOB_STEPS  # steps of each size (the first left out)


DEFAULT = Settings(
    matmul_sizes=(32, 64, 128, 256, 512, 1024), low_precision_sizes=(64, 256, 512, 1024),
    seconds_per_point=0.1, max_op_seconds=0.1, memory_elements=1 << 25,
    collective_bytes=(4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 25 << 20),
    collective_trials=7, trial_seconds=0.03, interference_bytes=8 << 20,
    interference_window_s=1.0)
QUICK = Settings(
    matmul_sizes=(64, 256, 512), low_precision_sizes=(256, 512), seconds_per_point=0.04,
    max_op_seconds=0.03, memory_elements=1 << 24,
    collective_bytes=(16 << 10, 1 << 20, 8 << 20), collective_trials=3, trial_seconds=0.02,
    interference_bytes=4 << 20, interference_window_s=0.4,
    pass_shapes=calibrate_engine.QUICK_PASS_SHAPES,
    optimizer_sets=calibrate_engine.QUICK_OPTIMIZER_SETS,
    p2p_bytes=(4 << 10, 256 << 10, 4 << 20), concurrency_window_s=0.25, jobs=((2, 1),),
    job_runs=1)


# ----------------------------------------------------------------------------- measuring

def _repeat(fn: Callable[[], object], seconds: float, min_reps: int = 3) -> float:
    """Fastest time of ``fn`` over about ``seconds`` of repetitions (after one warm-up). The
    fastest, because other work on a shared host only ever adds time: it is the figure that
    repeats from run to run (the median swung 2-3x with the load of a busy 2-core host)."""
    fn()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < min_reps or time.perf_counter() < end:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_matmul(settings: Settings) -> list[dict[str, Any]]:
    """Single-thread matmul times. One thread stands for one device of a CPU profile: with as
    many ranks as cores, ``flowtrain launch`` gives each rank one thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    records: list[dict[str, Any]] = []
    try:
        for dtype in DTYPES:
            sizes = settings.matmul_sizes if dtype == "float32" else settings.low_precision_sizes
            last: tuple[int, float] | None = None
            for n in sizes:
                if last and last[1] * (n / last[0]) ** 3 > settings.max_op_seconds:
                    break  # this dtype is too slow here for larger sizes to be worth the time
                a = torch.randn(n, n).to(getattr(torch, dtype))
                b = torch.randn(n, n).to(getattr(torch, dtype))
                seconds = _repeat(lambda a=a, b=b: torch.mm(a, b), settings.seconds_per_point)
                records.append({"dtype": dtype, "n": n, "flops": 2.0 * n**3,
                                "seconds": seconds})
                last = (n, seconds)
    finally:
        torch.set_num_threads(previous)
    return records


def measure_memory(settings: Settings) -> list[dict[str, Any]]:
    """Single-thread streaming copy and add (bytes read + written), and a 4 KiB copy whose
    time stands for the latency of one host copy."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = settings.memory_elements
        src, other, dst = torch.ones(n), torch.ones(n), torch.zeros(n)
        small_src, small_dst = torch.ones(1024), torch.zeros(1024)
        return [
            {"kind": "copy", "bytes_moved": 2 * 4 * n,
             "seconds": _repeat(lambda: dst.copy_(src), settings.seconds_per_point)},
            {"kind": "add", "bytes_moved": 3 * 4 * n,
             "seconds": _repeat(lambda: torch.add(src, other, out=dst),
                                settings.seconds_per_point)},
            {"kind": "small_copy", "bytes_moved": 2 * 4 * 1024,
             "seconds": _repeat(lambda: small_dst.copy_(small_src), 0.01, min_reps=50)},
        ]
    finally:
        torch.set_num_threads(previous)


def host_facts() -> dict[str, Any]:
    """What the profile describes: the CPU model, core count and memory of this host."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "cpu": model, "cores": os.cpu_count() or 1,
            "memory_bytes": int(psutil.virtual_memory().total), "torch": torch.__version__,
            # Other work on the host skews every figure; the load says how much there was.
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "recorded": time.strftime("%Y-%m-%d %H:%M:%S %z")}


def measure(settings: Settings, ranks: Sequence[int], timeout_s: float) -> dict[str, Any]:
    """Every measurement, as the JSON that ``fit_profile`` reads. Collectives go first so the
    ranks are forked before this process has started its own compute threads."""
    collectives, interference, engine = measure_collectives(settings, ranks, timeout_s)
    cores = os.cpu_count() or 1
    engine["optimizer"] = calibrate_engine.measure_optimizer(settings.optimizer_sets,
                                                             settings.seconds_per_point)
    engine["passes"] = calibrate_engine.measure_passes(
        [max(1, cores // n) for n in (1, *ranks)], settings.pass_shapes,
        settings.seconds_per_point)
    engine["weight_passes"] = calibrate_engine.measure_passes(
        [max(1, cores // n) for n in (1, *ranks)], settings.weight_shapes,
        settings.seconds_per_point)
    engine["ops"] = calibrate_ops.measure_ops([max(1, cores // n) for n in (1, *ranks)],
                                              settings.seconds_per_point)
    from sims.planner import PIPELINE_JOB_RANKS

    jobs = settings.jobs if settings.jobs is not None else \
        tuple((n, 1) for n in (1, *ranks)) + ((PIPELINE_JOB_RANKS, 2),)
    engine["jobs"] = calibrate_jobs.measure_jobs(jobs, settings.job_steps, timeout_s,
                                                   runs=settings.job_runs)
    return {"v": MEASUREMENTS_VERSION, "host": host_facts(), "threads_per_device": 1,
            "matmul": measure_matmul(settings), "memory": measure_memory(settings),
            "collectives": collectives, "interference": interference, "engine": engine}


# ----------------------------------------------------------------------------- fitting

def _slowdown_during(record: dict[str, Any], key: str, links: dict[int, Link]) -> float:
    """How much longer the all-reduce of an interference measurement took while its rank
    computed than ``links`` (the fitted all-reduce by rank count) say it takes alone: at least
    1, and 1 where the record lacks its size (measurements written before it was kept)."""
    ranks = int(record.get("ranks", 2))
    if "bytes" not in record or key not in record or ranks not in links:
        return 1.0
    alone = links[ranks].seconds(float(record["bytes"]))
    return max(1.0, float(record[key]) / alone) if alone > 0 else 1.0


def _solve_relative(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of ``seconds = u * x0 + v * x1`` over rows (u, v, seconds), each row divided
    by its seconds so the error minimised is relative: a 4 KiB call counts as much as a
    32 MiB one. A negative x0 (latency) is refitted as 0, since it cannot be."""
    a = [(u / t, v / t) for u, v, t in rows]
    saa = sum(p * p for p, _ in a)
    sab = sum(p * q for p, q in a)
    sbb = sum(q * q for _, q in a)
    sa = sum(p for p, _ in a)
    sb = sum(q for _, q in a)
    det = saa * sbb - sab * sab
    if det <= 1e-12 * saa * sbb:
        raise CalibrationError("cannot fit latency and bandwidth: the points need at least two "
                               "different sizes")
    x0 = (sa * sbb - sb * sab) / det
    x1 = (saa * sb - sab * sa) / det
    if x0 < 0:
        x0, x1 = 0.0, sb / sbb
    return x0, x1


def _seconds_per_byte_to_link(latency: float, per_byte: float, what: str) -> Link:
    if per_byte <= 0:
        raise CalibrationError(f"{what}: the measured times do not grow with the buffer size, so "
                               "no bandwidth can be fitted; rerun on a less busy host")
    return Link(latency, 1.0 / per_byte)


def fit_link(points: Sequence[tuple[float, float]], what: str = "collective") -> Link:
    """The Link whose ``latency + bytes / bandwidth`` best fits (bytes, seconds) points."""
    latency, per_byte = _solve_relative([(1.0, nbytes, t) for nbytes, t in points])
    return _seconds_per_byte_to_link(latency, per_byte, what)


def fit_collectives(measurements: dict[str, Any], skipped: list[str] | None = None
                    ) -> dict[str, dict[int, Link]]:
    """One fitted Link per measured (op, rank count): ``collective_seconds`` then uses it for
    exactly that op and rank count, with ``nbytes`` the full buffer as measured. An entry that
    cannot be fitted raises CalibrationError, or, when ``skipped`` is given, is left out (the
    ring formula covers it) and named there."""
    grouped: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in measurements["collectives"]:
        grouped.setdefault((r["op"], int(r["ranks"])), []).append((r["bytes"], r["seconds"]))
    fitted: dict[str, dict[int, Link]] = {}
    for (op, ranks), points in sorted(grouped.items()):
        try:
            fitted.setdefault(op, {})[ranks] = fit_link(points, f"{op} over {ranks} ranks")
        except CalibrationError as exc:
            if skipped is None:
                raise
            skipped.append(str(exc))
    return {op: by_ranks for op, by_ranks in fitted.items() if by_ranks}


def fit_ring_link(measurements: dict[str, Any]) -> Link:
    """The per-rank link (latency per ring step, bandwidth) that explains the measured
    all-reduces of every rank count through the ring formula: what the simulator uses for rank
    counts, and ops, that were not measured. All-reduce only, because gloo's reduce-scatter is
    not a ring (it is several times slower than the formula over the same link)."""
    records = [r for r in measurements["collectives"] if r["op"] == "all_reduce"] \
        or measurements["collectives"]
    rows = [(float(ring_steps(r["op"], r["ranks"])), ring_factor(r["op"], r["ranks"]) * r["bytes"],
             r["seconds"]) for r in records]
    latency, per_byte = _solve_relative(rows)
    if per_byte <= 0 and len({v for _, v, _ in rows}) > 1:
        # A disturbed small size can leave no slope to fit (seen with --quick's few trials on
        # a busy host); the link every profile needs then comes from the largest transfer
        # (bandwidth) and the smallest (latency per step).
        steps, moved, seconds = max(rows, key=lambda row: row[1])
        small = min(rows, key=lambda row: row[1])
        latency = small[2] / small[0]
        per_byte = max(seconds - steps * latency, 0.5 * seconds) / moved
    return _seconds_per_byte_to_link(latency, per_byte, "ring link")


def fit_efficiency(records: Sequence[dict[str, Any]]) -> tuple[float, tuple[tuple[float, float],
                                                                               ...]]:
    """Peak FLOP/s (the best rate seen) and the fraction of it reached at each measured op size,
    so the roofline reproduces every measured matmul."""
    best: dict[float, float] = {}
    for r in records:
        best[r["flops"]] = max(best.get(r["flops"], 0.0), r["flops"] / r["seconds"])
    if not best:
        raise CalibrationError("no matmul measurements to fit an efficiency curve from")
    peak = max(best.values())
    return peak, tuple((flops, rate / peak) for flops, rate in sorted(best.items()))


def _need(d: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise CalibrationError(f"measurements: missing field '{where}{key}'")
    if not isinstance(d[key], kind):
        raise CalibrationError(f"measurements: field '{where}{key}' has the wrong type, got "
                               f"{d[key]!r}")
    return d[key]


def check_measurements(m: Any) -> dict[str, Any]:
    """Enough structure for fit_profile; errors name the field."""
    if not isinstance(m, dict):
        raise CalibrationError(f"measurements must be a JSON object, got {type(m).__name__}")
    if m.get("v") != MEASUREMENTS_VERSION:
        raise CalibrationError(f"measurements: field 'v' must be {MEASUREMENTS_VERSION}, got "
                               f"{m.get('v')!r}")
    host = _need(m, "host", dict, "")
    _need(host, "cores", int, "host.")
    _need(host, "memory_bytes", int, "host.")
    for key, fields in (("matmul", ("dtype", "flops", "seconds")),
                        ("memory", ("kind", "bytes_moved", "seconds")),
                        ("collectives", ("op", "ranks", "bytes", "seconds"))):
        for i, record in enumerate(_need(m, key, list, "")):
            for f in fields:
                _need(record, f, (str,) if f in ("dtype", "kind", "op") else (int, float),
                      f"{key}[{i}].")
            if key == "collectives" and record["op"] not in MEASURED_OPS:
                raise CalibrationError(f"measurements: field 'collectives[{i}].op' must be one "
                                       f"of {', '.join(MEASURED_OPS)}, got {record['op']!r}")
    _need(_need(m, "interference", dict, ""), "fraction", (int, float), "interference.")
    if "engine" in m:
        engine = _need(m, "engine", dict, "")
        for key, fields in (("passes", ("threads", "flops", "forward_s", "backward_s")),
                            ("optimizer", ("numel", "seconds"))):
            records = _need(engine, key, list, "engine.")
            if not records:
                raise CalibrationError(f"measurements: field 'engine.{key}' is empty")
            for i, record in enumerate(records):
                for f in fields:
                    _need(record, f, (int, float), f"engine.{key}[{i}].")
    return m


def fit_profile(measurements: dict[str, Any], name: str = "this-host") -> HardwareProfile:
    """The CPU profile of the measured host. One device is one core (the measurements are
    single-threaded, and ``flowtrain launch`` gives each rank cores // ranks threads); there is
    no second node, so the inter-node link repeats the loopback ring link per rank."""
    m = check_measurements(measurements)
    host = m["host"]
    cores = host["cores"]
    peaks: dict[str, float] = {}
    curve: tuple[tuple[float, float], ...] = ()
    for dtype in DTYPES:
        records = [r for r in m["matmul"] if r["dtype"] == dtype]
        if records:
            peaks[dtype], dtype_curve = fit_efficiency(records)
            if dtype == "float32":
                curve = dtype_curve
    if not curve:
        raise CalibrationError("measurements: no float32 matmul records, which the efficiency "
                               "curve is fitted from")
    by_kind = {r["kind"]: r for r in m["memory"]}
    for kind in ("copy", "small_copy"):
        if kind not in by_kind:
            raise CalibrationError(f"measurements: no memory record of kind {kind!r}")
    streaming = max(r["bytes_moved"] / r["seconds"] for r in m["memory"]
                    if r["kind"] in ("copy", "add"))
    copy = by_kind["copy"]
    ring = fit_ring_link(m)
    skipped: list[str] = []
    collectives = fit_collectives(m, skipped)
    engine = None
    if "engine" in m:
        engine, engine_skipped = calibrate_engine.fit_engine(m["engine"])
        skipped += engine_skipped
    when = f"measured on {host.get('hostname', '?')} ({host.get('cpu', '?')}, {cores} cores) " \
           f"{host.get('recorded', '')} by flowtrain calibrate"
    ranks_seen = sorted({r["ranks"] for r in m["collectives"]})
    profile = HardwareProfile(
        name=name, kind="cpu", devices_per_node=cores,
        device_memory_bytes=host["memory_bytes"] // cores,
        peak_flops=peaks, memory_bandwidth=streaming,
        intra_node=ring,
        inter_node=Link(ring.latency_s, ring.bandwidth * cores),
        host_to_device=Link(by_kind["small_copy"]["seconds"],
                            copy["bytes_moved"] / 2 / copy["seconds"]),
        efficiency=curve, collectives=collectives,
        comm_compute_interference=float(m["interference"]["fraction"]),
        compute_comm_slowdown=_slowdown_during(m["interference"], "all_reduce_seconds_during",
                                               collectives.get("all_reduce", {})),
        host_memory_bandwidth=streaming,
        engine=engine,
        sources={
            "peak_flops": f"{when}: best single-thread torch.mm rate per dtype",
            "efficiency": f"{when}: float32 torch.mm rate / peak at each size",
            "memory_bandwidth": f"{when}: single-thread copy/add, bytes read + written per s",
            "devices_per_node": "one device = one core (flowtrain launch gives each rank "
                                "cores // ranks threads)",
            "device_memory_bytes": "host memory / cores",
            "intra_node": f"{when}: gloo over loopback, {ranks_seen} ranks, all ops fitted "
                          "together through the ring formulas",
            "inter_node": "not measured (one host): the loopback link, per rank",
            "host_to_device": f"{when}: memcpy in host memory (offload on a CPU host); "
                              "latency = a 4 KiB copy",
            "collectives": f"{when}: least squares of seconds = latency + bytes / bandwidth per "
                           "op and rank count, relative error"
                           + "".join(f"; left out: {reason}" for reason in skipped),
            "comm_compute_interference": f"{when}: 1 - matmul rate during back-to-back "
                                         f"all-reduces / alone, {m['interference'].get('ranks', 2)}"
                                         " ranks",
            "compute_comm_slowdown": f"{when}: those all-reduces' time while the rank computed "
                                     "over the fitted all-reduce's",
            **({"engine": f"{when}: the engine's pieces (sims.calibrate_engine): nn.Linear "
                          "forward/backward with its gradient-bucket hooks per thread count, "
                          "its fused Adam kernel, its shared-memory channel, a pipeline send, "
                          "ranks computing at once"} if engine is not None else {}),
        })
    return _with_engine_factors(profile, m)


def _with_engine_factors(profile: HardwareProfile, m: dict[str, Any]) -> HardwareProfile:
    """The profile with its engine factors, fitted by predicting the launched calibration jobs
    with the profile itself (``sims.calibrate_jobs.fit_factors``)."""
    jobs = m.get("engine", {}).get("jobs")
    if profile.engine is None or not jobs:
        return profile
    import dataclasses

    return dataclasses.replace(profile, engine=calibrate_jobs.fit_factors(profile, jobs))


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
        lines += calibrate_engine.summary_lines(profile.engine)
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
              f"x{calibrate_jobs.job_speed(profile, job):.2f}"
              for job in measurements.get("engine", {}).get("jobs", []) if job.get("probe_s")]
    if speeds:
        print(f"  host speed during the jobs, probe pass against the profile's curve (recorded, "
              f"not applied): {', '.join(speeds)}")
    print(f"wrote {out} in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
