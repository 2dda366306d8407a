"""The calibration fits of the profile's ``engine`` section, on synthetic measurements and on
recorded runs: the engine's measured pieces, the launched jobs' factors and overheads (per size,
ZeRO-3 hand-offs, gloo beside a live engine), and which of a job's runs are kept."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from flowtrain.config import load_config
from helpers import DATA
from sim_helpers import PIPELINE_RUN, SIM_RUN, sim_config, tiny_workload
from sims import costs
from sims.calibrate import engine_pieces, fits
from sims.calibrate import factors as factor_fits
from sims.calibrate import jobs as job_runs
from sims.calibrate.profile_fit import fit_profile
from sims.calibrate.settings import CalibrationError
from sims.compare import measured_classes, read_run
from sims.hardware import HardwareProfile
from sims.planner import Layout, Workload, build_plan


def _synthetic_engine_measurements() -> dict[str, Any]:
    """Measurements a host with known figures would give: Linear rates 40 (forward) and 30
    (backward) GFLOP/s, Adam 15 us per call + 25 GB/s, a channel of 100 us + 4 GB/s."""
    passes = [{"threads": 1, "flops": f, "forward_s": f / 4e10, "backward_s": 2 * f / 3e10}
              for f in (1e4, 1e6, 1e8)]
    optimizer = [{"tensors": n, "numel": n * e, "seconds": n * 15e-6 + 28 * n * e / 25e9}
                 for n, e in ((256, 4096), (4, 1 << 20))]
    channel = [{"op": "all_reduce", "ranks": 2, "bytes": b, "seconds": 1e-4 + b / 4e9}
               for b in (4096, 1 << 20, 16 << 20)]
    concurrency = [{"ranks": 2, "compute_slowdown": 1.1, "memory_slowdown": 1.8},
                   {"ranks": 4, "compute_slowdown": 2.2, "memory_slowdown": 0.9}]
    p2p = [{"bytes": b, "seconds": 1.5e-4 + b / 2e9} for b in (4096, 1 << 20)]
    return {"passes": passes, "optimizer": optimizer, "channel": channel, "p2p": p2p,
            "concurrency": concurrency, "channel_interference": {"fraction": 0.4}}


def test_fit_engine_recovers_the_figures_behind_the_measurements() -> None:
    engine, skipped = fits.fit_engine(_synthetic_engine_measurements())
    assert skipped == []
    assert engine.pass_rates[1]["forward"] == tuple((f, pytest.approx(4e10))
                                                    for f in (1e4, 1e6, 1e8))
    assert [r for _, r in engine.pass_rates[1]["backward"]] == [pytest.approx(3e10)] * 3
    assert engine.optimizer.latency_s == pytest.approx(15e-6)
    assert engine.optimizer.bandwidth == pytest.approx(25e9)
    assert engine.channel["all_reduce"][2].latency_s == pytest.approx(1e-4)
    assert engine.channel["all_reduce"][2].bandwidth == pytest.approx(4e9)
    assert engine.p2p is not None and engine.p2p.bandwidth == pytest.approx(2e9)
    # a slowdown below 1 is noise: working beside others cannot make a rank faster
    assert engine.slowdown == {2: 1.1, 4: 2.2} and engine.memory_slowdown == {2: 1.8, 4: 1.0}
    assert engine.channel_interference == 0.4


def test_engine_measurements_are_checked_by_field(tmp_path: Path) -> None:
    sample = json.loads((DATA / "calibration_sample.json").read_text())
    broken = {**sample, "engine": {**_synthetic_engine_measurements(), "optimizer": []}}
    with pytest.raises(CalibrationError, match="'engine.optimizer' is empty"):
        fit_profile(broken)
    broken["engine"]["optimizer"] = [{"numel": 4}]
    with pytest.raises(CalibrationError, match=r"'engine.optimizer\[0\].seconds'"):
        fit_profile(broken)


def _size_from_run(run_dir: Path, ranks: int, pp: int) -> dict[str, Any]:
    """A recorded run as `measure_jobs` records one size of a calibration job."""
    record = read_run(run_dir)
    measured, steps = measured_classes(record)
    size = {"ranks": ranks, "pp": pp, "plan": record.plan, "stages": list(record.stages),
            "measured": measured, "steps": steps}
    if pp > 1:
        size["gap_per_op_s"] = job_runs.gap_per_op(record.steps)
    else:
        size["micro_batch_gap_s"] = job_runs.micro_batch_gap(record.steps)
    return size


def _job(*sizes: dict[str, Any]) -> dict[str, Any]:
    return {"ranks": sizes[0]["ranks"], "pp": sizes[0]["pp"], "sizes": list(sizes),
            "others_cores": 0.0}


def test_overheads_read_off_a_jobs_spans_by_hand() -> None:
    step = [("forward/mb0", 0.0, 1.0), ("backward/mb0", 1.5, 3.0), ("forward/mb1", 3.1, 4.0),
            ("backward/mb1", 4.3, 6.0), ("optimizer/step", 6.5, 7.0)]
    # gaps between each forward and its backward: 0.5 and 0.3; the first step is left out
    assert job_runs.micro_batch_gap({0: [[], step, step, step]}) == pytest.approx(0.4)
    pipe = [("forward/mb0", 0.0, 1.0), ("send_act/mb0", 1.2, 1.3), ("recv_grad/mb0", 1.3, 2.0),
            ("backward/mb0", 2.4, 4.0), ("optimizer/step", 5.0, 6.0)]
    # from 0 to 4: spans cover 3.4, gaps 0.6 (1.0-1.2 and 2.0-2.4) over 4 spans
    assert job_runs.gap_per_op({0: [pipe, pipe]}) == pytest.approx(0.15)


def _base_profile() -> HardwareProfile:
    sample = json.loads((DATA / "calibration_sample.json").read_text())
    return fit_profile({**sample, "engine": _synthetic_engine_measurements()})


def test_engine_factors_make_the_calibration_jobs_come_out_as_measured() -> None:
    base = _base_profile()
    assert base.engine is not None and base.engine.factors == {}
    # a data-parallel job (the recorded ZeRO-1 run) and the recorded pipeline run
    jobs = [_job(_size_from_run(SIM_RUN, 2, 1)), _job(_size_from_run(PIPELINE_RUN, 2, 2))]
    fitted = dataclasses.replace(base, engine=factor_fits.fit_factors(base, jobs))
    size = jobs[0]["sizes"][0]
    again = factor_fits.predict_job(fitted, size)
    measured = size["measured"]
    assert again["forward"] == pytest.approx(measured["forward"], rel=0.02)
    assert again["backward"] == pytest.approx(measured["backward"], rel=0.02)
    assert again["optimizer"] == pytest.approx(measured["optimizer"], rel=0.02)
    assert again["step"] == pytest.approx(measured["step"], rel=0.02)
    assert fitted.engine is not None
    factors = fitted.engine.factors[2]
    assert factors["micro_batch_s"] == size["micro_batch_gap_s"] > 0
    # one size: no line to fit, the factors alone
    assert factors["forward_s"] == factors["backward_s"] == 0.0
    pipeline = jobs[1]["sizes"][0]
    assert fitted.engine.pipeline_op_s == pipeline["gap_per_op_s"] > 0
    assert fitted.engine.pipeline_message_s > 0
    assert factor_fits.predict_job(fitted, pipeline)["step"] == \
        pytest.approx(pipeline["measured"]["step"], rel=1e-3)
    # fitting through fit_profile gives the same profile, and it survives JSON
    sample = json.loads((DATA / "calibration_sample.json").read_text())
    whole = fit_profile({**sample, "engine": {**_synthetic_engine_measurements(),
                                                        "jobs": jobs}})
    assert whole == fitted
    assert HardwareProfile.from_dict(json.loads(json.dumps(whole.to_dict()))) == whole


def _with_factors(base: HardwareProfile, factors: dict[str, float]) -> HardwareProfile:
    """``base`` whose engine has ``factors`` for 2 ranks: the host a fit should find again."""
    assert base.engine is not None
    return dataclasses.replace(base, engine=dataclasses.replace(base.engine,
                                                                factors={2: factors}))


def _scaled(size: dict[str, Any], scale: int) -> dict[str, Any]:
    """A recorded size with ``scale`` times the rows per micro-batch (and FLOPs)."""
    large = json.loads(json.dumps(size))
    large["plan"]["config"]["train_micro_batch_size_per_gpu"] *= scale
    large["plan"]["config"]["train_batch_size"] *= scale
    large["plan"]["forward_flops_per_micro_batch"] *= scale
    return large


@pytest.mark.parametrize("scales", [(4,), (2, 4)], ids=["two sizes", "three sizes"])
def test_job_sizes_split_a_factor_from_a_time_per_step(scales: tuple[int, ...]) -> None:
    base = _base_profile()
    small = _size_from_run(SIM_RUN, 2, 1)
    larger = [_scaled(small, scale) for scale in scales]
    # an engine whose forwards take 1.5x what the isolated measurements predict plus 2 ms per
    # step, its backwards 1.8x plus 1 ms (its optimizer 1.2x, 1 ms more per step): what its two
    # sizes would measure
    assert base.engine is not None
    truth = {"forward": 1.5, "forward_s": 0.002, "backward": 1.8, "backward_s": 0.001,
             "optimizer": 1.2,
             "micro_batch_s": small["micro_batch_gap_s"], "step_s": 0.001}
    host = _with_factors(base, truth)
    for size in (small, *larger):
        size["measured"] = factor_fits.predict_job(host, size)
    fitted = factor_fits.fit_factors(base, [_job(small, *larger)]).factors[2]
    assert fitted == pytest.approx(truth, rel=0.01)


def _run_of(steps: tuple[float, ...], others: float, zero3: float | None = None
            ) -> dict[str, Any]:
    record: dict[str, Any] = {"ranks": 2, "pp": 1, "others_cores": others, "gloo": [],
                              "sizes": [{"measured": {"step": s}} for s in steps]}
    if zero3 is not None:
        record["zero3"] = {"measured": {"step": zero3}}
    return record


def test_each_job_size_keeps_its_median_quiet_run() -> None:
    runs = [_run_of((10.0, 22.0, 40.0), 0.0, zero3=30.0),
            _run_of((15.0, 20.0, 41.0), 0.05, zero3=28.0),
            _run_of((9.0, 18.0, 35.0), 0.5, zero3=20.0),  # others were busy: left out
            _run_of((11.0, 21.0, 39.0), 0.02)]
    kept = job_runs.keep_typical(runs, busy_cores=0.1)
    # of the quiet runs 0, 1 and 3: sizes (10, 15, 11), (22, 20, 21), (40, 41, 39)
    assert [size["measured"]["step"] for size in kept["sizes"]] == [11.0, 21.0, 40.0]
    assert kept["size_runs"] == [3, 3, 0]
    # two quiet ZeRO-3 runs: the faster of the two
    assert kept["zero3"]["measured"]["step"] == 28.0
    # the rest from the quiet run with the median steps in all (72, 76 and 71): the first
    assert kept["others_cores"] == 0.0
    assert runs[3]["sizes"][2]["measured"]["step"] == 39.0  # the runs are left as they were
    # no quiet run: all of them count
    busy = [_run_of((12.0, 30.0), 0.4), _run_of((14.0, 25.0), 0.3), _run_of((13.0, 26.0), 0.5)]
    kept = job_runs.keep_typical(busy, busy_cores=0.1)
    assert [size["measured"]["step"] for size in kept["sizes"]] == [13.0, 26.0]
    with pytest.raises(ValueError, match="at least one run"):
        job_runs.keep_typical([], busy_cores=0.1)


def test_gloo_calls_beside_a_live_engine_take_what_the_job_measured() -> None:
    base = _base_profile()
    model = [("all_reduce", 65536), ("all_gather", 4 << 20), ("reduce_scatter", 4 << 20)]
    gloo = [{"op": op, "ranks": 2, "bytes": nbytes,
             "seconds": costs.collective_seconds(op, nbytes, 2, base) + extra}
            for (op, nbytes), extra in zip(model, (0.001, 0.002, 0.004))]
    job = {**_job(_size_from_run(SIM_RUN, 2, 1)), "gloo": gloo}
    engine = factor_fits.fit_factors(base, [job])
    assert engine.factors[2]["gloo_s"] == pytest.approx(0.002)
    hw = dataclasses.replace(base, engine=engine)
    cfg = sim_config(2, flowtrain={"data_channel": "torch"})
    [reduce] = [t for t in build_plan(tiny_workload(), cfg, Layout(1, 2), hw).tasks
                if t.kind == "reduce"]
    scale_pass = 2 * 56 * 4 / hw.memory_bandwidth * costs.compute_slowdown(2, hw, memory=True)
    assert reduce.duration == pytest.approx(costs.collective_seconds("all_reduce", 56 * 4, 2, hw)
                                            + 0.002 + scale_pass)


def test_a_measured_layer_pass_is_the_engines() -> None:
    timed = engine_pieces.time_pass((8, 16, 16), 0.02)
    assert timed["flops"] == 2 * 8 * 16 * 16
    assert 0 < timed["forward_s"] < 0.01 and 0 < timed["backward_s"] < 0.01
    # 4 MiB of weights: one copy of the layer
    op = engine_pieces.LinearPass(2, 1024, 1024)
    arrived: list[int] = []
    op.buckets.on_bucket_ready = arrived.append
    op.both()
    op.close()
    # the engine's bucket hooks saw both parameters land: each bucket (the engine's plan puts
    # a small first bucket ahead) reported ready once
    assert sorted(arrived) == list(range(len(op.buckets.plan))) and arrived
    assert math.isfinite(float(op.layer.weight.grad.sum()))
    # a small layer cycles through copies holding 4 MiB of weights, as a model's layers do
    small = engine_pieces.LinearPass(4, 8, 8)
    used = [id(small.layer) for _ in range(3) if small.forward() is not None]
    assert len(small.layers) == 16 and len(set(used)) == 3
    small.close()


def test_the_demo_factory_is_the_model_make_demo_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["train_gpt.py"])
    import gpt
    import train_gpt

    args = train_gpt.parse_args()
    text = Path(args.data).read_text(encoding="utf-8")
    built = gpt.build_demo_model().config
    assert (built.vocab_size, built.block_size, built.n_layer, built.n_head, built.n_embd) == \
        (len(set(text)), args.seq_len, args.n_layer, args.n_head, args.n_embd)


def test_job_speed_is_the_probe_over_the_profiles_probe_time() -> None:
    """A job run's recorded probe against the profile: 1.3x the profile's probe time reads 1.3;
    a record without a probe reads 1.0. The fit does not apply it (see fit_factors)."""
    from sims.calibrate.probe import profile_probe_seconds

    base = _base_profile()
    job = _job(_size_from_run(SIM_RUN, 2, 1))
    assert factor_fits.job_speed(base, job) == 1.0
    job["probe_s"] = 1.3 * profile_probe_seconds(base)
    assert factor_fits.job_speed(base, job) == pytest.approx(1.3)
    assert factor_fits.fit_factors(base, [job]) == \
        factor_fits.fit_factors(base, [{k: v for k, v in job.items() if k != "probe_s"}])


def _zero3_size(size: dict[str, Any], prefetch: int = 0) -> dict[str, Any]:
    """A recorded size turned into the calibration job's ZeRO-3 run of the same model."""
    zero3 = json.loads(json.dumps(size))
    zero = zero3["plan"]["config"]["zero_optimization"]
    zero.update(stage=3, stage3_prefetch_bucket_size=prefetch)
    return zero3


def test_zero3_hand_offs_are_fitted_from_the_jobs_zero3_run() -> None:
    """An engine whose ZeRO-3 hooks take 0.8 ms per module use handed to the parameter fetcher
    and 0.3 ms per partitioned module in a backward: the job's ZeRO-3 run, as it would measure
    them, gives both back, and every other factor stays what the data-parallel sizes give."""
    base = _base_profile()
    assert base.engine is not None
    small = _size_from_run(SIM_RUN, 2, 1)
    truth = {"forward": 1.3, "forward_s": 0.0, "backward": 1.6, "backward_s": 0.0,
             "optimizer": 1.1, "micro_batch_s": small["micro_batch_gap_s"], "step_s": 0.001,
             "zero3_fetch_s": 0.0008, "zero3_backward_s": 0.0003}
    host = _with_factors(base, truth)
    zero3 = _zero3_size(small)
    small["measured"] = factor_fits.predict_job(host, small)
    zero3["measured"] = factor_fits.predict_job(host, zero3)
    without = factor_fits.fit_factors(base, [_job(small)]).factors[2]
    assert "zero3_fetch_s" not in without
    fitted = factor_fits.fit_factors(base, [{**_job(small), "zero3": zero3}]).factors[2]
    assert fitted["zero3_fetch_s"] == pytest.approx(0.0008, rel=0.01)
    assert fitted["zero3_backward_s"] == pytest.approx(0.0003, rel=0.01)
    assert {k: v for k, v in fitted.items() if not k.startswith("zero3_")} == without


def test_zero3_hand_offs_are_tasks_of_the_passes_they_lengthen() -> None:
    """With the fitted hand-offs, a ZeRO-3 step without prefetch has a fetch task before each
    partitioned module's forward (each waits for its gather) and a release after each one's
    backward, inside the passes, so the forward grows by uses x fetch; other stages do not
    get them."""
    base = _base_profile()
    assert base.engine is not None
    size = _zero3_size(_size_from_run(SIM_RUN, 2, 1))
    # one micro-batch: its forward has no reduces of a backward before it to queue behind
    size["plan"]["config"].update(gradient_accumulation_steps=1, train_batch_size=128)
    factors = {"zero3_fetch_s": 0.0008, "zero3_backward_s": 0.0003}
    host = _with_factors(base, factors)
    bare = factor_fits.predict_job(base, size)
    got = factor_fits.predict_job(host, size)
    work = Workload.from_run(size["plan"], 64)
    cfg = load_config(size["plan"]["config"], world_size=2, check_supported=False)
    tasks = build_plan(work, cfg, Layout(1, 2), host).tasks
    fetches = [t for t in tasks if t.name.endswith("/fetch")]
    releases = [t for t in tasks if t.name.endswith("/release")]
    # the model's four blocks have two partitioned Linear layers each; the embedding and the
    # head stay whole (under the persistence threshold)
    assert len(fetches) == len(releases) == 8
    assert {t.kind for t in fetches} == {"forward"}
    assert {t.kind for t in releases} == {"backward"}
    assert got["forward"] == pytest.approx(bare["forward"] + 8 * 0.0008)
    assert got["backward"] >= bare["backward"] + 8 * 0.0003 - 1e-9
    zero2 = json.loads(json.dumps(size))
    zero2["plan"]["config"]["zero_optimization"]["stage"] = 2
    del zero2["plan"]["config"]["zero_optimization"]["stage3_prefetch_bucket_size"]
    assert not [t for t in build_plan(work, load_config(zero2["plan"]["config"], world_size=2,
                                                        check_supported=False),
                                      Layout(1, 2), host).tasks
                if t.name.endswith(("/fetch", "/release"))]


def _small_buckets(size: dict[str, Any], bucket: int = 15_000) -> dict[str, Any]:
    """A recorded size turned into the calibration job's small-bucket run of the same model."""
    run = json.loads(json.dumps(size))
    run["plan"]["config"]["zero_optimization"]["reduce_bucket_size"] = bucket
    return run


def test_bucket_hand_offs_are_fitted_from_the_jobs_small_bucket_run() -> None:
    """An engine that takes 0.4 ms to hand each full bucket to its reducer and 0.7 ms more per
    reduce than the channel: the job's small-bucket run, as it would measure them, gives both
    back, and the sizes' factors come out as they are, though the sizes hand off their own
    buckets too."""
    base = _base_profile()
    assert base.engine is not None
    # the sizes with the job's large buckets (two), the small-bucket run with one per layer
    small = _small_buckets(_size_from_run(SIM_RUN, 2, 1), 25 << 20)
    large = _scaled(small, 4)
    truth = {"forward": 1.3, "forward_s": 0.001, "backward": 1.6, "backward_s": 0.0005,
             "optimizer": 1.1, "micro_batch_s": small["micro_batch_gap_s"], "step_s": 0.001,
             "bucket_s": 0.0004, "reduce_s": 0.0007}
    host = _with_factors(base, truth)
    buckets = _small_buckets(small)
    for size in (small, large, buckets):
        size["measured"] = factor_fits.predict_job(host, size)
    fitted = factor_fits.fit_factors(base, [{**_job(small, large), "buckets": buckets}])
    assert fitted.factors[2] == pytest.approx(truth, rel=0.02)
    without = factor_fits.fit_factors(base, [_job(small, large)]).factors[2]
    assert "bucket_s" not in without and "reduce_s" not in without


def test_bucket_hand_offs_are_tasks_of_the_backward_before_each_reduce() -> None:
    """With the fitted figures, each bucket's reduce starts after a hand-off task of the
    backward, and takes reduce_s longer; the forward is as it was, and one rank (nothing to
    reduce) gets neither."""
    base = _base_profile()
    assert base.engine is not None
    size = _small_buckets(_size_from_run(SIM_RUN, 2, 1))
    host = _with_factors(base, {"bucket_s": 0.0004, "reduce_s": 0.0007})
    work = Workload.from_run(size["plan"], 64)
    cfg = load_config(size["plan"]["config"], world_size=2, check_supported=False)
    tasks = build_plan(work, cfg, Layout(1, 2), host).tasks
    bare = {t.name: t for t in build_plan(work, cfg, Layout(1, 2), base).tasks}
    reduces = [t for t in tasks if t.kind == "reduce"]
    hand_offs = {t.name.split("/")[2]: i for i, t in enumerate(tasks)
                 if t.name.endswith("/hand_off")}
    # ZeRO-1 with two micro-batches: the buckets are reduced after the last one's backward
    assert len(reduces) == len(hand_offs) > 3
    assert all(tasks[i].kind == "backward" and tasks[i].name.startswith("backward/mb1/")
               and tasks[i].duration == 0.0004 for i in hand_offs.values())
    for reduce in reduces:
        assert hand_offs[reduce.name.split("/")[1]] in reduce.deps
        assert reduce.duration == pytest.approx(bare[reduce.name].duration + 0.0007)
    assert [t.duration for t in tasks if t.kind == "forward"] == \
        [t.duration for t in bare.values() if t.kind == "forward"]
    one = load_config({**size["plan"]["config"], "train_batch_size": 128}, world_size=1,
                      check_supported=False)
    assert not [t for t in build_plan(work, one, Layout(1, 1), host).tasks
                if t.name.endswith("/hand_off") or t.kind == "reduce"]
