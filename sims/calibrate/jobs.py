"""The engine jobs ``flowtrain calibrate`` launches (``sims.calibrate.job``): running them on a
shared host (keeping each size's median quiet run) and reading the engine's own overheads off
their spans. ``sims.calibrate.factors`` fits the profile's engine factors to what they
measured."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flowtrain.plan import names
from sims.calibrate.job import BUCKETS_DIR, GLOO_FILE, ZERO3_DIR
from sims.calibrate.probe import probe_seconds
from sims.calibrate.settings import CalibrationError
from sims.calibrate.timing import ForeignLoad
from sims.compare import measured_classes, read_run

PROBE_SECONDS = 0.3  # the host-speed probe before and after each job run
# a data-parallel job's runs besides its sizes (2 ranks or more): ZeRO-3, small buckets
EXTRA_RUNS = ("zero3", "buckets")


def measure_jobs(jobs: Sequence[tuple[int, int]], steps: int, timeout_s: float,
                 runs: int = 1, attempts: int = 3, busy_cores: float = 0.1
                 ) -> list[dict[str, Any]]:
    """Launches ``sims.calibrate.job`` with ``flowtrain launch`` for each (ranks, pipeline
    stages) and keeps what it recorded: its plan (and pipeline stage records), the median
    seconds per task class of its steps (the first left out), and what the spans show of the
    engine's own overheads.

    Each job runs ``runs`` times, one round over all jobs after the other, and of each size
    (and of the ZeRO-3 and small-bucket runs) the run with the median step is kept
    (``keep_typical``): on a shared host other work (other processes, and on a VM its
    neighbours, whose share shows nowhere) lengthens steps by tens of percent for minutes. A run
    during which other processes (and the hypervisor: steal time counts) kept more than
    ``busy_cores`` cores busy does not count, and is run again, up to ``attempts`` launches
    per run (``others_cores`` says how busy they were): a run beside a fraction of a busy core
    has every step longer, and factors fitted to it make every prediction of its rank count
    long. A failed launch raises CalibrationError with its last error line.

    Around each run the probe pass (``sims.calibrate.probe``) is timed, and ``probe_s`` (the
    geometric mean of before and after) is what it took: the host's speed during the run,
    recorded and printed (``sims.calibrate.factors.job_speed``) but not applied by the fit (see
    ``fit_factors`` there)."""
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

    Sizes, not whole runs: a run's sizes go one after the other and a shared host's speed can
    change inside a run, so a run kept whole can hold one size slow and tilt the line through
    the sizes. The median, not the fastest: the host's speed moves in phases of minutes (a
    VM's neighbours) rather than only gaining disturbances on a steady floor, and the fastest
    of a few short windows (a size is 16 steps, a fraction of a second) lands lower than the
    typical run of a longer configuration, so predictions fitted to it come out short."""
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
    """One launch of the job on ``ranks`` ranks: what each of its runs recorded, and how busy
    other processes kept the host meanwhile."""
    with tempfile.TemporaryDirectory(prefix="flowtrain-calibrate-job-") as tmp:
        cmd = [sys.executable, "-m", "flowtrain.cli", "launch", "--nproc-per-node",
               str(ranks), "--run-dir", tmp, "-m", "sims.calibrate.job", "--steps",
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
            ends = {names.micro_batch_of(n): b for n, _, b in spans
                    if names.task_class(n) == "forward"}
            for n, a, _ in spans:
                mb = names.micro_batch_of(n) if names.task_class(n) == "backward" else None
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
            passes = [(a, b) for n, a, b in spans if names.task_class(n) in names.PASSES]
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
