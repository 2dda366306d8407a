"""The engine jobs ``flowtrain calibrate`` launches (``sims.calibrate_job``): running them on a
shared host (keeping each size's median quiet run), reading the engine's own overheads off their
spans, and fitting the profile's engine factors so that the simulator's prediction of each job
is what it measured."""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from typing import Any, Self

JOB_STEPS = 16
FIT_ROUNDS = 12
BUCKET_PASSES = 8  # at most, fitting the small-bucket run's figures and the sizes' in turn
MIN_FACTOR = 0.1
PROBE_SECONDS = 0.3  # the host-speed probe before and after each job run
# a data-parallel job's runs besides its sizes (2 ranks or more): ZeRO-3, small buckets
EXTRA_RUNS = ("zero3", "buckets")


class ForeignLoad:
    """Cores kept busy by other processes while a block runs: the host's busy CPU time
    (/proc/stat) less this process's and its finished children's, over the wall time. A
    shared host's other users skew any timing; this says how much they were there."""

    def __enter__(self) -> Self:
        self._busy, self._ours = host_busy_seconds(), own_cpu_seconds()
        self._start = time.monotonic()
        self.cores = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(time.monotonic() - self._start, 1e-9)
        others = (host_busy_seconds() - self._busy) - (own_cpu_seconds() - self._ours)
        self.cores = max(0.0, others) / wall


def host_busy_seconds() -> float:
    """CPU seconds the whole host has been busy (not idle or waiting for I/O); 0 where there
    is no /proc/stat."""
    import os
    from pathlib import Path

    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    import resource

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def measure_jobs(jobs: Sequence[tuple[int, int]], steps: int, timeout_s: float,
                 runs: int = 1, attempts: int = 3, busy_cores: float = 0.1
                 ) -> list[dict[str, Any]]:
    """Launches ``sims.calibrate_job`` with ``flowtrain launch`` for each (ranks, pipeline
    stages) and keeps what it recorded: its plan (and pipeline stage records), the median
    seconds per task class of its steps (the first left out), and what the spans show of the
    engine's own overheads.

    Each job runs ``runs`` times, one round over all jobs after the other, and of each size
    (and of the ZeRO-3 and small-bucket runs) the run with the median step is kept
    (``keep_typical``): on a shared host other work (other processes, and on a VM its
    neighbours, whose share shows nowhere) lengthens steps by 20-40 % for minutes. A run
    during which other processes (and the hypervisor: steal time counts) kept more than
    ``busy_cores`` cores busy does not count, and is run again, up to ``attempts`` launches
    per run (``others_cores`` says how busy they were). A 2-rank run kept at 0.2 cores had
    every step 50 % longer than one at 0.08, and its factors made every 2-rank prediction
    15-50 % long. A failed launch raises CalibrationError with its last error line.

    Around each run the probe pass (``sims.probe``) is timed, and ``probe_s`` (the geometric
    mean of before and after) is what it took: the host's speed during the run, recorded and
    printed (``job_speed``) but not applied by the fit (see ``fit_factors``)."""
    from sims.probe import probe_seconds

    recorded: dict[tuple[int, int], list[dict[str, Any]]] = {job: [] for job in jobs}
    for _ in range(runs):
        for ranks, pp in jobs:
            record: dict[str, Any] | None = None
            for _ in range(attempts):
                before = probe_seconds(PROBE_SECONDS)
                attempt = _run_job(ranks, pp, steps, timeout_s)
                attempt["probe_s"] = math.sqrt(before * probe_seconds(PROBE_SECONDS))
                if record is None or attempt["others_cores"] < record["others_cores"]:
                    record = attempt
                if attempt["others_cores"] <= busy_cores:
                    break
            assert record is not None
            recorded[(ranks, pp)].append(record)
    return [keep_typical(recorded[job], busy_cores) for job in jobs]


def keep_typical(records: Sequence[dict[str, Any]], busy_cores: float) -> dict[str, Any]:
    """One job's record from its runs: of each size and each of EXTRA_RUNS, the quiet run's
    (``others_cores`` <= ``busy_cores``; any run where none was quiet) with the median step
    (the faster of the middle two of an even count); the rest (gloo calls, probe,
    others_cores) from the quiet run with the median steps in all. ``size_runs`` says which
    run each size came from.

    Sizes, not whole runs: a run's sizes go one after the other, and on the project's host the
    speed changed inside a run, so the run kept whole held one size 1.5x slow (round L's
    1-rank job: 9.9 and 10.4 ms at 48 and 192 rows, where a run measures about 1:1.7), and
    the line through them made a 1-rank pass half its isolated time plus 1.5 ms. The median,
    not the fastest: the host's speed moves in phases of minutes (a VM's neighbours) rather
    than only gaining disturbances on a steady floor, and the fastest of three short windows
    (a size is 16 steps, a fraction of a second) lands lower than the fastest of three longer
    runs of a configuration: with each size's fastest, round M's and N's predictions came out
    short in 29 of 36 configurations (their tables: the fastest of three runs each)."""
    if not records:
        raise ValueError("keep_typical needs at least one run")
    quiet = [i for i, r in enumerate(records) if r["others_cores"] <= busy_cores] or \
        list(range(len(records)))

    def step(size: dict[str, Any]) -> float:
        return float(size["measured"].get("step", math.inf))

    def median(runs: Sequence[int], key: Any) -> int:
        return sorted(runs, key=key)[(len(runs) - 1) // 2]

    kept = dict(records[median(quiet, lambda i: sum(step(s) for s in records[i]["sizes"]))])
    count = min(len(records[i]["sizes"]) for i in quiet)
    kept["size_runs"] = [median(quiet, lambda i, n=n: step(records[i]["sizes"][n]))
                         for n in range(count)]
    kept["sizes"] = [records[i]["sizes"][n] for n, i in enumerate(kept["size_runs"])]
    for key in EXTRA_RUNS:
        runs = [i for i in quiet if key in records[i]]
        if runs:
            kept[key] = records[median(runs, lambda i, key=key: step(records[i][key]))][key]
    return kept


def _run_job(ranks: int, pp: int, steps: int, timeout_s: float) -> dict[str, Any]:
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from sims.calibrate import CalibrationError
    from sims.compare import measured_classes, read_run

    with tempfile.TemporaryDirectory(prefix="flowtrain-calibrate-job-") as tmp:
        cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node",
               str(ranks), "--run-dir", tmp, "-m", "sims.calibrate_job", "--steps",
               str(steps), "--pp", str(pp)]
        try:
            with ForeignLoad() as others:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                                      check=False)
        except subprocess.TimeoutExpired:
            raise CalibrationError(f"the {ranks}-rank calibration job did not finish within "
                                   f"{timeout_s:g} s; rerun with a larger --timeout or on a "
                                   "less busy host") from None
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise CalibrationError(f"the {ranks}-rank calibration job failed (exit "
                                   f"{proc.returncode}): {last}")
        # a data-parallel job records each size in a directory of its own
        dirs = [Path(tmp)] if pp > 1 else sorted(
            (d for d in Path(tmp).glob("rows*") if d.is_dir()),
            key=lambda d: int(d.name.removeprefix("rows")))
        sizes = []
        for run_dir in dirs:
            try:
                run = read_run(run_dir)
            except ValueError as exc:
                raise CalibrationError(f"the {ranks}-rank calibration job: {exc}") from None
            measured, used = measured_classes(run)
            size: dict[str, Any] = {"ranks": ranks, "pp": pp, "plan": run.plan,
                                    "stages": list(run.stages), "measured": measured,
                                    "steps": used}
            if pp > 1:
                size["gap_per_op_s"] = gap_per_op(run.steps)
            else:
                size["micro_batch_gap_s"] = micro_batch_gap(run.steps)
            sizes.append(size)
        if not sizes:
            raise CalibrationError(f"the {ranks}-rank calibration job recorded no run")
        from sims.calibrate_job import BUCKETS_DIR, GLOO_FILE, ZERO3_DIR

        gloo_path = Path(tmp) / GLOO_FILE
        gloo = json.loads(gloo_path.read_text()) if gloo_path.is_file() else []
        record = {"ranks": ranks, "pp": pp, "sizes": sizes, "others_cores": others.cores,
                  "gloo": gloo}
        for key, directory, what in (("zero3", ZERO3_DIR, "ZeRO-3"),
                                     ("buckets", BUCKETS_DIR, "small-bucket")):
            if pp > 1 or not (Path(tmp) / directory).is_dir():
                continue
            try:
                run = read_run(Path(tmp) / directory)
            except ValueError as exc:
                raise CalibrationError(f"the {ranks}-rank calibration job's {what} run: "
                                       f"{exc}") from None
            measured, used = measured_classes(run)
            record[key] = {"ranks": ranks, "pp": 1, "plan": run.plan, "stages": [],
                           "measured": measured, "steps": used}
        return record


def micro_batch_gap(steps: dict[int, list[list[tuple[str, float, float]]]]) -> float:
    """The time between a micro-batch's forward and its backward (the loss, then the engine's
    backward entry: loss scaling, bucket bookkeeping), median over ranks, steps and
    micro-batches, the first step left out."""
    gaps = []
    for rows in steps.values():
        for spans in rows[1:] if len(rows) > 1 else rows:
            ends = {n.split("/")[1]: b for n, _, b in spans if n.startswith("forward/")}
            for n, a, _ in spans:
                mb = n.split("/")[1] if n.startswith("backward/") else None
                if mb in ends and a >= ends[mb]:
                    gaps.append(a - ends[mb])
    return statistics.median(gaps) if gaps else 0.0


def gap_per_op(steps: dict[int, list[list[tuple[str, float, float]]]]) -> float:
    """A pipeline stage's time outside any span, per span, between its first and last pass
    (median over ranks and steps, the first step left out): what getting each instruction
    going costs it (actor, compute thread and gloo hand-offs)."""
    per_step = []
    for rows in steps.values():
        for spans in rows[1:] if len(rows) > 1 else rows:
            passes = [(a, b) for n, a, b in spans if n.startswith(("forward/", "backward/"))]
            if not passes:
                continue
            first, last = min(a for a, _ in passes), max(b for _, b in passes)
            inside = sorted((max(a, first), min(b, last)) for _, a, b in spans
                            if b > first and a < last)
            covered, reach = 0.0, first
            for a, b in inside:
                if b > reach:
                    covered += b - max(a, reach)
                    reach = b
            per_step.append((last - first - covered) / len(inside))
    return statistics.median(per_step) if per_step else 0.0


def job_speed(profile: Any, job: dict[str, Any]) -> float:
    """How much slower the host computed during a job run than ``profile`` says (its
    ``probe_s`` over the profile's probe time); 1.0 for a record without a probe."""
    from sims.probe import profile_probe_seconds

    probe = job.get("probe_s")
    if not probe or profile.engine is None:
        return 1.0
    return float(probe) / profile_probe_seconds(profile)


def predict_job(profile: Any, job: dict[str, Any], host_speed: float = 1.0
                ) -> dict[str, float]:
    """The simulator's task classes for a recorded calibration job (one size of it) on
    ``profile``, the host ``host_speed`` times slower than the profile says."""
    from flowtrain.config import load_config
    from sims.compare import predicted_classes
    from sims.planner import Layout, Workload
    from sims.simulate import predict

    ranks, pp = int(job["ranks"]), int(job.get("pp", 1))
    cfg = load_config(job["plan"]["config"], world_size=ranks // pp, check_supported=False)
    micro_batch = cfg.train_micro_batch_size_per_gpu
    work = Workload.from_stages(job["stages"], micro_batch) if pp > 1 else \
        Workload.from_run(job["plan"], micro_batch, name="calibration job")
    prediction = predict(None, cfg, Layout(1, ranks, 1, pp), profile, cluster=profile.name,
                         workload=work, host_speed=host_speed)
    return predicted_classes(prediction.timeline)


def fit_factors(profile: Any, jobs: Sequence[dict[str, Any]]) -> Any:
    """The engine section of ``profile`` (whose factors are not fitted yet) completed from the
    launched jobs.

    Per rank count, from the data-parallel job's sizes: its forwards, and its backwards, as
    measured = factor x the simulator's from the isolated measurements + a time per step
    (``forward_s``, ``backward_s``: what the engine's other work takes from them whatever
    their size), a line through the sizes (one size: the factor alone); the optimizer's
    factor; the time between forward and backward (read off the spans); ``step_s``, what
    remains of the measured step; and ``gloo_s``, what the job's gloo calls took beside its
    live engine over the bare ranks' figure. A few rounds settle them together, since a
    factor scales only the compute it applies to, not what the prediction adds around it (a
    collective's share of the compute, the bucket passes).

    Then, from the pipeline job, the time a stage spends outside its spans per instruction
    (read off its spans) and the delivery time per message beyond the calibrated send that
    makes the predicted pipeline step the measured one (by bisection: the prediction grows
    with it).

    Each job is predicted at the profile's own speed. Predicting it at the host's speed during
    it (``job_speed``: the probe around the run over the profile's time for the probe pass)
    would keep drift out of the factors if the probe were unbiased, but on the project's host
    it read 0.67-0.94 in every calibration (one half-second pass against the least disturbed
    of the pass curve's rounds, interpolated between other shapes): applied, it inflated the
    factors by as much and the predictions with them (a 1-rank job x1.40, its configurations
    predicted 40-48 % long)."""
    import dataclasses

    engine = dataclasses.replace(profile.engine, factors={}, pipeline_op_s=0.0,
                                 pipeline_message_s=0.0)

    def predicted(fitted: dict[str, float], ranks: int, size: dict[str, Any]
                  ) -> dict[str, float]:
        trial = dataclasses.replace(profile, engine=dataclasses.replace(
            engine, factors={**engine.factors, ranks: dict(fitted)}))
        return predict_job(trial, size)

    for job in jobs:
        if int(job.get("pp", 1)) > 1:
            continue
        ranks, sizes = int(job["ranks"]), job["sizes"]
        fitted = {"forward": 1.0, "forward_s": 0.0, "backward": 1.0, "backward_s": 0.0,
                  "optimizer": 1.0,
                  "micro_batch_s": float(sizes[0].get("micro_batch_gap_s", 0.0)),
                  "step_s": 0.0}
        _fit_sizes(predicted, fitted, ranks, sizes)
        buckets = job.get("buckets")
        # the bucket hand-offs (and the reduces' own overhead) add to the sizes' own buckets
        # too: the sizes are fitted again with them in place, until they settle
        for _ in range(BUCKET_PASSES if buckets is not None else 0):
            before = (fitted.get("bucket_s", 0.0), fitted.get("reduce_s", 0.0))
            _fit_buckets(predicted, fitted, ranks, buckets, sizes)
            _fit_sizes(predicted, fitted, ranks, sizes)
            if max(abs(fitted["bucket_s"] - before[0]), abs(fitted["reduce_s"] - before[1])) < 1e-6:
                break
        if job.get("gloo"):
            # what a gloo call takes beside a live engine over what the bare ranks measured
            from sims.costs import collective_seconds

            fitted["gloo_s"] = max(0.0, statistics.median(
                r["seconds"] - collective_seconds(r["op"], r["bytes"], int(r["ranks"]), profile)
                for r in job["gloo"]))
        zero3 = job.get("zero3")
        if zero3 is not None:
            # what the engine's ZeRO-3 hooks take beyond the gathers and the compute: per
            # module use handed to the parameter fetcher in a forward, and per partitioned
            # module in a backward (its release once the gradients have landed); the two
            # meet (a micro-batch's gathers queue behind the reduces of the backward before
            # it), so a few rounds settle them together
            for _ in range(3):
                for kind, extra in (("forward", "zero3_fetch_s"),
                                    ("backward", "zero3_backward_s")):
                    if kind not in zero3["measured"]:
                        continue

                    def seconds(value: float, kind: str = kind, extra: str = extra,
                                fitted: dict[str, float] = fitted, ranks: int = ranks,
                                zero3: dict[str, Any] = zero3) -> float:
                        return predicted({**fitted, extra: value}, ranks, zero3).get(kind, 0.0)

                    fitted[extra] = _solve_seconds(seconds, zero3["measured"][kind])
        engine = dataclasses.replace(engine, factors={**engine.factors, ranks: fitted})
    for job in jobs:
        size = job["sizes"][0]
        if int(job.get("pp", 1)) <= 1 or "step" not in size["measured"]:
            continue
        engine = dataclasses.replace(engine, pipeline_op_s=float(size.get("gap_per_op_s", 0.0)))

        def step_with(message_s: float, engine: Any = engine, size: Any = size) -> float:
            trial = dataclasses.replace(profile, engine=dataclasses.replace(
                engine, pipeline_message_s=message_s))
            return predict_job(trial, size)["step"]

        target = size["measured"]["step"]
        low, high = 0.0, 0.001
        while step_with(high) < target and high < 1.0:
            low, high = high, high * 2
        for _ in range(30):
            middle = (low + high) / 2
            low, high = (middle, high) if step_with(middle) < target else (low, middle)
        engine = dataclasses.replace(engine, pipeline_message_s=low)
    return engine


def _fit_sizes(predicted: Any, fitted: dict[str, float], ranks: int,
               sizes: Sequence[dict[str, Any]]) -> None:
    """Fits ``fitted``'s pass factors, times per step, optimizer factor and ``step_s`` (in
    place) so that ``predicted(fitted, ranks, size)`` gives each size's measured classes."""
    # the passes from the isolated measurements alone: no factors, no hand-offs
    bare = {**fitted, "forward": 1.0, "forward_s": 0.0, "backward": 1.0, "backward_s": 0.0,
            "bucket_s": 0.0}
    first = [predicted(bare, ranks, size) for size in sizes]
    for _ in range(FIT_ROUNDS):
        got = [predicted(fitted, ranks, size) for size in sizes]
        for kind in ("forward", "backward"):
            iso = [g.get(kind, 0.0) for g in first]
            residual = [size["measured"].get(kind, 0.0) - g.get(kind, 0.0)
                        for size, g in zip(sizes, got)]
            extra = f"{kind}_s"
            factor_step, per_step = _line(iso, residual, free_intercept=len(sizes) > 1)
            if fitted[extra] + per_step < 0 or fitted[kind] + factor_step < MIN_FACTOR:
                # no negative overhead, and no pass faster than a tenth of its isolated
                # time (a disturbed size can tilt the line): the factor alone
                factor_step, _ = _line(iso, [r + fitted[extra] for r in residual],
                                       free_intercept=False)
                per_step = -fitted[extra]
            fitted[kind] = max(MIN_FACTOR, fitted[kind] + factor_step)
            fitted[extra] += per_step
        optimizer = sum(g.get("optimizer", 0.0) for g in got)
        if optimizer > 0:
            fitted["optimizer"] *= sum(size["measured"].get("optimizer", 0.0)
                                       for size in sizes) / optimizer
        step_left = [size["measured"]["step"] - g["step"] for size, g in zip(sizes, got)
                     if "step" in size["measured"]]
        if step_left:
            fitted["step_s"] = max(0.0, fitted["step_s"] + statistics.fmean(step_left))


def _fit_buckets(predicted: Any, fitted: dict[str, float], ranks: int,
                 run: dict[str, Any], sizes: Sequence[dict[str, Any]]) -> None:
    """From the job's small-bucket run (in place): ``bucket_s``, what handing each full bucket
    to the reducer adds to the backward (the engine's hook, its message to the reducer's
    actor), from the run's measured backward; then ``reduce_s``, what each reduce takes beyond
    the calibrated channel or collective (the reducer's actor picking it up on a busy host),
    from its measured step. The sizes hand off their own (fewer) buckets, which their fit had
    put into ``backward_s`` and ``step_s``: those give back what the sizes gain, so that the
    sizes stay as fitted. The two meet (a reduce launches after its hand-off), so a few rounds
    settle them together."""
    for _ in range(3):
        for kind, extra, offset in (("backward", "bucket_s", "backward_s"),
                                    ("step", "reduce_s", None)):
            if kind not in run["measured"]:
                continue
            here = fitted.get(extra, 0.0)
            per_second = 0.0 if offset is None else statistics.fmean(
                (predicted({**fitted, extra: here + 1e-3}, ranks, size).get(kind, 0.0)
                 - predicted(fitted, ranks, size).get(kind, 0.0)) / 1e-3 for size in sizes)

            def trial(value: float, extra: str = extra, offset: str | None = offset,
                      here: float = here, per_second: float = per_second) -> dict[str, float]:
                if offset is None:
                    return {**fitted, extra: value}
                return {**fitted, extra: value,
                        offset: max(0.0, fitted[offset] - per_second * (value - here))}

            def seconds(value: float, kind: str = kind, trial: Any = trial) -> float:
                return predicted(trial(value), ranks, run).get(kind, 0.0)

            fitted.update(trial(_solve_seconds(seconds, run["measured"][kind])))


def _solve_seconds(predict: Any, target: float, rounds: int = 4) -> float:
    """The seconds ``x`` >= 0 at which ``predict(x)`` (growing with ``x``, piecewise linear: a
    simulated step) is ``target``: Newton's steps on the slope seen over a millisecond."""
    x = 0.0
    for _ in range(rounds):
        here = predict(x)
        slope = (predict(x + 1e-3) - here) / 1e-3
        if slope <= 0:
            break
        step = (target - here) / slope
        x = max(0.0, x + step)
        if abs(step) < 1e-7:
            break
    return x


def _line(x: Sequence[float], y: Sequence[float], free_intercept: bool) -> tuple[float, float]:
    """Least squares y = slope x + intercept (intercept 0 unless ``free_intercept`` and the
    x differ)."""
    if free_intercept and len(x) > 1 and max(x) > min(x):
        mx, my = statistics.fmean(x), statistics.fmean(y)
        slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)
        return slope, my - slope * mx
    denominator = sum(a * a for a in x)
    return (sum(a * b for a, b in zip(x, y)) / denominator if denominator else 0.0), 0.0


# ----------------------------------------------------------------------------- fitting

