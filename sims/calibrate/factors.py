"""The profile's engine factors, fitted so that the simulator's prediction of each launched
calibration job (``sims.calibrate.jobs``) is what the job measured: per rank count, how much
longer the engine's passes, optimizer and step take than the isolated measurements say, and
what its buckets, ZeRO-3 hooks and pipeline instructions add. Pure: runs no job."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flowtrain.config import load_config
from sims.calibrate.probe import profile_probe_seconds
from sims.compare import predicted_classes
from sims.costs import collective_seconds
from sims.planner import Layout, Workload
from sims.prediction import predict

if TYPE_CHECKING:
    from sims.hardware import EngineCosts, HardwareProfile

FIT_ROUNDS = 12
BUCKET_PASSES = 8  # at most, fitting the small-bucket run's figures and the sizes' in turn
MIN_FACTOR = 0.1


def job_speed(profile: HardwareProfile, job: dict[str, Any]) -> float:
    """How much slower the host computed during a job run than ``profile`` says (its
    ``probe_s`` over the profile's probe time); 1.0 for a record without a probe."""
    probe = job.get("probe_s")
    if not probe or profile.engine is None:
        return 1.0
    return float(probe) / profile_probe_seconds(profile)


def predict_job(profile: HardwareProfile, job: dict[str, Any], host_speed: float = 1.0
                ) -> dict[str, float]:
    """The simulator's task classes for a recorded calibration job (one size of it) on
    ``profile``, the host ``host_speed`` times slower than the profile says."""
    ranks, pp = int(job["ranks"]), int(job.get("pp", 1))
    cfg = load_config(job["plan"]["config"], world_size=ranks // pp, check_supported=False)
    micro_batch = cfg.micro_batch
    work = Workload.from_stages(job["stages"], micro_batch) if pp > 1 else \
        Workload.from_run(job["plan"], micro_batch, name="calibration job")
    prediction = predict(None, cfg, Layout(1, ranks, 1, pp), profile, cluster=profile.name,
                         workload=work, host_speed=host_speed)
    return predicted_classes(prediction.timeline)


def fit_factors(profile: HardwareProfile, jobs: Sequence[dict[str, Any]]) -> EngineCosts:
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
    would keep drift out of the factors if the probe were unbiased, but the probe (one
    half-second pass against the least disturbed of the pass curve's rounds, interpolated
    between other shapes) reads below 1 on a host that has not changed: applied, it would
    inflate the factors by as much, and the predictions with them."""
    # the caller (profile_fit._with_engine_factors) fits only a profile with engine costs
    assert profile.engine is not None
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
        if buckets is not None:
            for _ in range(BUCKET_PASSES):
                before = (fitted.get("bucket_s", 0.0), fitted.get("reduce_s", 0.0))
                _fit_buckets(predicted, fitted, ranks, buckets, sizes)
                _fit_sizes(predicted, fitted, ranks, sizes)
                if max(abs(fitted["bucket_s"] - before[0]),
                       abs(fitted["reduce_s"] - before[1])) < 1e-6:
                    break
        if job.get("gloo"):
            # what a gloo call takes beside a live engine over what the bare ranks measured
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

        def step_with(message_s: float, engine: EngineCosts = engine,
                      size: dict[str, Any] = size) -> float:
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
