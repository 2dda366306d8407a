"""The simulator's model of flowtrain's own work on a calibrated CPU host (the profile's
``engine`` section): its JSON and checks, the cost functions worked out by hand, the planner's
module ops, shared-memory reduces, optimizer step and pipeline hand-offs, --compare's pipeline
runs and reduce spans, and the calibration fits on synthetic measurements and recorded runs."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from flowtrain.config import load_config
from sims import calibrate, calibrate_engine, calibrate_jobs, costs
from sims.compare import measured_classes, predicted_classes, read_run
from sims.executor import SimTask, execute
from sims.hardware import BUILTIN_PROFILES, EngineCosts, HardwareProfile, Link, ProfileError
from sims.planner import Layout, Workload, build_plan

DATA = Path(__file__).parent / "data"
RUN = DATA / "sim_run"
PIPELINE_RUN = RUN / "pipeline"
GB = 1e9


def engine_costs(**changes: Any) -> EngineCosts:
    """Round numbers: forward 1 GFLOP/s at 1e3 FLOPs rising to 10 GFLOP/s at 1e7 (1 thread),
    twice that with 2 threads; backward half the forward's rate."""
    base = EngineCosts(
        pass_rates={1: {"forward": ((1e3, 1e9), (1e7, 1e10)),
                        "backward": ((1e3, 5e8), (1e7, 5e9))},
                    2: {"forward": ((1e3, 2e9), (1e7, 2e10)),
                        "backward": ((1e3, 1e9), (1e7, 1e10))}},
        optimizer=Link(1e-5, 20 * GB), slowdown={2: 1.1, 4: 2.0},
        memory_slowdown={2: 1.5, 4: 3.0},
        channel={"all_reduce": {2: Link(1e-4, 5 * GB)},
                 "reduce_scatter": {2: Link(2e-4, 8 * GB)}},
        channel_interference=0.5, p2p=Link(2e-4, 2 * GB),
        factors={2: {"forward": 1.25, "backward": 1.25, "optimizer": 2.0}})
    return dataclasses.replace(base, **changes)


def cpu_profile(**engine_changes: Any) -> HardwareProfile:
    """A 2-core CPU host: 10 GFLOP/s, 20 GB/s memory, gloo all-reduce of 1 ms + 1 GB/s."""
    return HardwareProfile(
        name="cpu-test", kind="cpu", devices_per_node=2, device_memory_bytes=2**33,
        peak_flops={"float32": 1e10}, memory_bandwidth=20 * GB,
        intra_node=Link(1e-4, 1 * GB), inter_node=Link(1e-4, 2 * GB),
        host_to_device=Link(1e-6, 10 * GB), efficiency=((1e3, 0.5), (1e7, 1.0)),
        collectives={"all_reduce": {2: Link(1e-3, 1 * GB)},
                     "all_gather": {2: Link(1e-3, 1 * GB)},
                     "reduce_scatter": {2: Link(1e-3, 1 * GB)}},
        comm_compute_interference=0.3, host_memory_bandwidth=20 * GB,
        engine=engine_costs(**engine_changes))


# ----------------------------------------------------------------------------- the profile

def test_engine_section_round_trips_and_hashes(tmp_path: Path) -> None:
    hw = cpu_profile(pipeline_op_s=3e-4)
    back = HardwareProfile.load(hw.save(tmp_path / "p.json"))
    assert back == hw and hash(back) == hash(hw)
    assert json.loads((tmp_path / "p.json").read_text())["engine"]["factors"] == \
        {"2": {"forward": 1.25, "backward": 1.25, "optimizer": 2.0}}
    assert hash(cpu_profile()) != hash(cpu_profile(channel_interference=0.25))


@pytest.mark.parametrize(("change", "message"), [
    (lambda e: e.pop("pass_rates"), "missing field 'engine.pass_rates'"),
    (lambda e: e.update(speed=1), "unknown field 'engine.speed'"),
    (lambda e: e["pass_rates"]["1"].pop("backward"),
     "'engine.pass_rates.1' must have exactly forward, backward curves"),
    (lambda e: e["channel"].update(all_gather={}), "unknown op 'all_gather'"),
    (lambda e: e["factors"]["2"].update(reduce=1.0), "'engine.factors.2' maps some of forward"),
    (lambda e: e.update(pipeline_op_s=-1.0), "field 'engine.pipeline_op_s' must be >= 0"),
    (lambda e: e["slowdown"].update(x=1.0), "'engine.slowdown' keys must be counts"),
])
def test_malformed_engine_sections_name_the_field(change: Any, message: str) -> None:
    data = cpu_profile().to_dict()
    change(data["engine"])
    with pytest.raises(ProfileError, match=message.replace("(", r"\(")):
        HardwareProfile.from_dict(data)


# ----------------------------------------------------------------------------- cost functions

def test_pass_seconds_interpolate_rates_and_keep_a_floor() -> None:
    hw = cpu_profile()
    # 1e5 FLOPs is halfway in log between 1e3 and 1e7: 5.5 GFLOP/s with one thread
    assert costs.pass_seconds("forward", 1e5, 1, hw) == pytest.approx(1e5 / 5.5e9)
    assert costs.pass_seconds("backward", 1e7, 2, hw) == pytest.approx(1e7 / 1e10)
    # smaller than the smallest op measured: that op's time, 1e3 / 1e9
    assert costs.pass_seconds("forward", 10.0, 1, hw) == pytest.approx(1e-6)
    assert costs.pass_seconds("forward", 0.0, 1, hw) == pytest.approx(1e-6)
    # 3 threads were not measured: the 2-thread curve; more than 2 does not help
    assert costs.pass_seconds("forward", 1e7, 3, hw) == pytest.approx(1e7 / 2e10)
    with pytest.raises(ValueError, match="no engine costs"):
        costs.pass_seconds("forward", 1e5, 1, BUILTIN_PROFILES["h100-x8"])


def test_slowdown_measured_nearest_and_oversubscribed() -> None:
    hw = cpu_profile()
    assert costs.rank_threads(1, hw) == 2 and costs.rank_threads(4, hw) == 1
    assert costs.compute_slowdown(2, hw) == 1.1
    assert costs.compute_slowdown(4, hw, memory=True) == 3.0
    # 8 ranks: nearest measured is 4 (2.0 at 4 / 2 = 2x oversubscribed), 8 / 2 = 4x: 4.0
    assert costs.compute_slowdown(8, hw) == pytest.approx(2.0 * 4 / 2)
    # no measurements: threads in use over cores, at least 1
    bare = dataclasses.replace(hw, engine=None)
    assert costs.compute_slowdown(1, bare) == 1.0 and costs.compute_slowdown(6, bare) == 3.0
    assert costs.compute_slowdown(6, BUILTIN_PROFILES["h100-x8"]) == 1.0


def test_channel_seconds_measured_and_scaled_to_other_rank_counts() -> None:
    hw = cpu_profile()
    assert costs.channel_seconds("all_reduce", 1e6, 2, hw) == pytest.approx(1e-4 + 1e6 / 5e9)
    # 4 ranks: 2-rank latency, per-byte time x (4 + 1) / (2 + 1)
    assert costs.channel_seconds("all_reduce", 1e6, 4, hw) == \
        pytest.approx(1e-4 + 1e6 / 5e9 * 5 / 3)
    assert costs.channel_seconds("all_reduce", 1e6, 1, hw) == 0.0
    no_channel = cpu_profile(channel={})
    assert costs.channel_seconds("all_reduce", 1e6, 2, no_channel) is None


def test_optimizer_and_send_use_the_engines_kernel_and_send() -> None:
    hw = cpu_profile()
    # 10 calls of 10 us + 1e6 x 28 B at 20 GB/s, streaming 1.5x slower
    assert costs.optimizer_seconds(10**6, hw, calls=10, memory_slowdown=1.5) == \
        pytest.approx(10 * 1e-5 + 28e6 / 20e9 * 1.5)
    assert costs.p2p_seconds(1e6, hw, inter_node=False) == pytest.approx(2e-4 + 1e6 / 2e9)
    bare = dataclasses.replace(hw, engine=None)
    assert costs.p2p_seconds(1e6, bare, inter_node=False) == pytest.approx(1e-4 + 1e6 / 1e9)
    assert costs.optimizer_seconds(10**6, bare) == pytest.approx(28e6 / 20e9)


def test_a_tasks_own_interference_wins_over_the_plans() -> None:
    tasks = [SimTask("a", "comm", "comm:dp", 2.0, collective=True),
             SimTask("b", "comm", "comm:dp", 2.0, (0,), collective=True, interference=0.25),
             SimTask("c", "comm", "comm:dp", 2.0, (1,), collective=True, interference=0.0)]
    timeline = execute(tasks, interference=0.5)
    extra = {t.name: b - a for t, a, b in timeline.spans()[timeline.planned:]}
    assert extra == {"interference/a": 1.0, "interference/b": 0.5}
    with pytest.raises(ValueError, match="task 'x' has interference 2"):
        execute([SimTask("x", "comm", "comm:dp", 1.0, collective=True, interference=2.0)])


# ----------------------------------------------------------------------------- the planner

def _work() -> Workload:
    """Two modules: a (8x4 weight + 8 bias, 40 elements), b (2x8 weight, 16 elements)."""
    return Workload("tiny", (("a.weight", (8, 4), "float32", 4), ("a.bias", (8,), "float32", 4),
                             ("b.weight", (2, 8), "float32", 4)), 1e5)


def _cfg(world: int, **extra: Any) -> Any:
    return load_config({"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, **extra},
                       world_size=world, check_supported=False)


def _spans(plan: Any) -> dict[str, tuple[float, float]]:
    return {t.name: (a, b) for t, a, b in execute(plan.tasks).spans()}


def test_passes_are_one_op_per_module_at_the_ranks_threads_and_factors() -> None:
    hw = cpu_profile()
    # 2 x 1e5 FLOPs of the micro-batch shared by element count: a 40/56, b 16/56
    flops = {"a": 2e5 * 40 / 56, "b": 2e5 * 16 / 56}

    def expected(kind: str, threads: int, scale: float) -> float:
        mult = 2 if kind == "backward" else 1
        return scale * sum(costs.pass_seconds(kind, mult * f, threads, hw)
                           for f in flops.values())

    one = build_plan(_work(), _cfg(1), Layout(1, 1), hw).tasks
    by_name = {t.name: t for t in one}
    # one rank of a 2-core host: 2 threads, no slowdown, the nearest job factor (2 ranks)
    assert by_name["forward/mb0"].duration == pytest.approx(expected("forward", 2, 1.25))
    assert by_name["backward/mb0"].duration == pytest.approx(expected("backward", 2, 1.25))
    two = {t.name: t for t in build_plan(_work(), _cfg(2), Layout(1, 2), hw).tasks}
    assert two["forward/mb0"].duration == pytest.approx(expected("forward", 1, 1.1 * 1.25))


def test_reduces_go_over_the_shared_memory_channel_where_the_engine_uses_it() -> None:
    hw = cpu_profile()
    plan = build_plan(_work(), _cfg(2), Layout(1, 2), hw)
    [reduce] = [t for t in plan.tasks if t.kind == "reduce"]
    nbytes = 56 * 4
    # the channel's all-reduce, then the 1/dp multiply over the bucket (2 x bytes, memory bound,
    # 1.5x slower with 2 ranks streaming)
    assert reduce.duration == pytest.approx(costs.channel_seconds("all_reduce", nbytes, 2, hw)
                                            + 2 * nbytes / 20e9 * 1.5)
    assert reduce.interference == 0.5
    # data_channel "torch" (and pipelines, several nodes) use gloo: the plan's interference
    gloo = build_plan(_work(), _cfg(2, flowtrain={"data_channel": "torch"}), Layout(1, 2), hw)
    [reduce] = [t for t in gloo.tasks if t.kind == "reduce"]
    assert reduce.duration == pytest.approx(1e-3 + nbytes / 1e9 + 2 * nbytes / 20e9 * 1.5)
    assert reduce.interference is None


def test_optimizer_step_as_the_engine_runs_it() -> None:
    hw = cpu_profile()
    kernel, bandwidth = 1e-5, 20e9

    def optimizer(cfg: Any) -> float:
        [task] = [t for t in build_plan(_work(), cfg, Layout(1, 2), hw).tasks
                  if t.kind == "optimizer"]
        return task.duration

    # stage 0 without clipping: one kernel call per parameter over all 56 elements, the
    # buckets zeroed (4 B each); memory 1.5x slower, then the 2-rank job's optimizer factor 2
    stage0 = (3 * kernel + 56 * 28 / bandwidth * 1.5 + 56 * 4 / bandwidth * 1.5) * 2.0
    assert optimizer(_cfg(2, gradient_clipping=0.0)) == pytest.approx(stage0)
    # ZeRO 1: one call per bucket shard (28 of 56 elements), whole buckets zeroed; clipping
    # adds a norm pass and a scaling pass over the shard (12 B per element), and the global
    # norm's all-reduce of 8 bytes over gloo (1 ms + 1 GB/s)
    zero1 = (1 * kernel + 28 * 28 / bandwidth * 1.5 + (56 * 4 + 28 * 12) / bandwidth * 1.5) * 2 \
        + 1e-3 + 8 / 1e9
    assert optimizer(_cfg(2, zero_optimization={"stage": 1}, gradient_clipping=1.0)) == \
        pytest.approx(zero1)


def test_zero2_backward_also_adds_each_gradient_into_a_pooled_bucket() -> None:
    hw = cpu_profile()
    zero1 = {t.name: t.duration for t in build_plan(
        _work(), _cfg(2, zero_optimization={"stage": 1}), Layout(1, 2), hw).tasks}
    zero2 = {t.name: t.duration for t in build_plan(
        _work(), _cfg(2, zero_optimization={"stage": 2}), Layout(1, 2), hw).tasks}
    assert zero2["backward/mb0"] - zero1["backward/mb0"] == \
        pytest.approx(56 * 16 / 20e9 * 1.5)


def test_a_data_parallel_collective_slows_where_more_ranks_share_the_host() -> None:
    """pp 2 x dp 2 on the 2-core test host: each stage's data-parallel all-reduce (gloo, 2
    ranks) runs with 4 ranks on the host, slower by the 4-rank over the 2-rank compute
    slowdown (2.0 / 1.1), plus the beside-the-engine time; dp over every rank is unchanged."""
    hw = cpu_profile(factors={4: {"gloo_s": 1e-4}})
    work = Workload("two layers", (("l.0.weight", (64, 64), "float32", 4),
                                   ("l.1.weight", (64, 64), "float32", 4)), 1e5)
    plan = build_plan(work, _cfg(2, gradient_accumulation_steps=2), Layout(1, 4, pp=2), hw)
    [reduce] = [t for t in plan.tasks if t.kind == "reduce" and t.stage == 0]
    nbytes = 64 * 64 * 4
    # then the 1/dp multiply over the bucket: 2 x bytes, memory bound (3x slower with 4 ranks)
    scale = 2 * nbytes / 20e9 * 3.0
    assert reduce.duration == pytest.approx(
        costs.collective_seconds("all_reduce", nbytes, 2, hw) * 2.0 / 1.1 + 1e-4 + scale)
    flat = build_plan(work, _cfg(4, flowtrain={"data_channel": "torch"}), Layout(1, 4), hw)
    [reduce] = [t for t in flat.tasks if t.kind == "reduce"][:1]
    assert reduce.duration == pytest.approx(
        costs.collective_seconds("all_reduce", 2 * nbytes, 4, hw) + 1e-4 + 2 * scale)


def test_pipeline_hand_offs_are_tasks_of_their_own() -> None:
    hw = cpu_profile(pipeline_op_s=1e-3, factors={})
    work = Workload.from_stages(json.loads(json.dumps([
        {"param_specs": [["l.0.weight", [8, 4], "float32", 4]],
         "forward_flops_per_micro_batch": 2e5, "output_bytes_per_micro_batch": 4000},
        {"param_specs": [["l.1.weight", [2, 8], "float32", 4]],
         "forward_flops_per_micro_batch": 1e5, "output_bytes_per_micro_batch": 80}])), 2)
    assert work.stage_flops_per_sample == (1e5, 5e4)
    plan = build_plan(work, _cfg(1, gradient_accumulation_steps=2), Layout(1, 2, pp=2), hw)
    assert "activation size unknown" not in " ".join(plan.notes)
    spans = _spans(plan)
    # stage 1's forward of micro-batch 0 waits for the activations (stage 0's 4000 B per
    # micro-batch over the calibrated send), then for its hand-off
    send = spans["send_act/mb0"]
    assert send[1] - send[0] == pytest.approx(2e-4 + 4000 / 2e9)
    handoff = [(t, a, b) for t, a, b in execute(plan.tasks).spans()
               if t.stage == 1 and t.name == "handoff/forward/mb0"]
    assert handoff[0][1] == pytest.approx(send[1])
    assert handoff[0][2] - handoff[0][1] == pytest.approx(1e-3)
    timeline = execute(plan.tasks)
    classes = predicted_classes(timeline)
    passes = [b - a for t, a, b in timeline.spans() if t.kind in ("forward", "backward")]
    # forward and backward are their own compute, as the engine's spans are
    assert classes["forward"] + classes["backward"] == pytest.approx(sum(passes) / 2)
    with pytest.raises(ValueError, match="split into 2 pipeline stages"):
        build_plan(work, _cfg(1), Layout(1, 3, pp=3), hw)
    # 4 ranks (2 stages x 2 data parallel) on the 2-core host: the hand-offs measured on 2
    # ranks take 2.0 / 1.1 as long (the ranks' compute slowdown), the stages broadcast the
    # loss, and clipping sums the norm over all 4 ranks
    four = {t.name: t for t in build_plan(work, _cfg(2, gradient_accumulation_steps=2),
                                          Layout(1, 4, pp=2), hw).tasks}
    assert four["handoff/forward/mb0"].duration == pytest.approx(1e-3 * 2.0 / 1.1)
    broadcast = costs.collective_seconds("broadcast", 4, 2, hw)
    assert four["overhead/loss-broadcast"].duration == pytest.approx(broadcast)
    no_clip = {t.name: t for t in build_plan(
        work, _cfg(2, gradient_accumulation_steps=2, gradient_clipping=0.0),
        Layout(1, 4, pp=2), hw).tasks}
    assert four["optimizer/step"].duration - no_clip["optimizer/step"].duration > \
        costs.collective_seconds("all_reduce", 8, 4, hw)


def test_a_pipeline_stage_is_priced_with_its_own_census() -> None:
    # norms cost 1 ms a call + 1 ns an element forward, twice that backward (1 thread, 1 rank)
    norm = {"forward": Link(1e-3, 1e9), "backward": Link(2e-3, 5e8)}
    hw = cpu_profile(pipeline_op_s=0.0, factors={}, op_costs={1: {"norm": norm}})
    stages = [{"param_specs": [["l.0.weight", [8, 4], "float32", 4]],
               "forward_flops_per_micro_batch": 2e5, "output_bytes_per_micro_batch": 4000},
              {"param_specs": [["l.1.weight", [2, 8], "float32", 4]],
               "forward_flops_per_micro_batch": 1e5, "output_bytes_per_micro_batch": 80}]
    bare = Workload.from_stages(stages, 2)
    assert bare.stage_census == ()
    # stage 1 alone ran norms: 3 calls over 400 elements in a micro-batch of 2 samples
    census = {"matmul_flops": 1e5, "attention_flops": 0.0, "attention_calls": 0,
              "ops": {"norm": [3, 400]}}
    work = Workload.from_stages([stages[0], {**stages[1], "forward_ops_per_micro_batch": census}],
                                2)
    assert work.stage_census[1]["op_census"] == (("norm", 3.0, 200.0),)

    def passes(w: Workload) -> dict[str, float]:
        plan = build_plan(w, _cfg(1, gradient_accumulation_steps=2), Layout(1, 2, pp=2), hw)
        return {t.name + f"@{t.stage}": t.duration for t in plan.tasks
                if t.kind in ("forward", "backward")}

    with_census, without = passes(work), passes(bare)
    assert with_census.keys() == without.keys()
    for name, seconds in with_census.items():
        # a micro-batch of 2 samples: 3 calls over 400 elements on stage 1, nothing on stage
        # 0; x1.1, the compute slowdown of 2 ranks sharing the host
        extra = 0.0 if name.endswith("@0") else 1.1 * (
            3 * (1e-3 if "forward" in name else 2e-3) + 400 / (1e9 if "forward" in name else 5e8))
        assert seconds - without[name] == pytest.approx(extra, abs=1e-12), name


# ----------------------------------------------------------------------------- --compare

def test_a_reduce_counts_from_its_launch_until_the_collective_completes() -> None:
    tasks = (SimTask("forward/mb0", "forward", "compute", 1.0),
             SimTask("backward/mb0/layer1", "backward", "compute", 1.0, (0,)),
             SimTask("reduce/bucket0", "reduce", "comm:dp", 0.5, (1,), collective=True),
             SimTask("backward/mb0/layer0", "backward", "compute", 2.0, (1,)),
             SimTask("reduce/bucket1", "reduce", "comm:dp", 0.5, (3, 2), collective=True))
    classes = predicted_classes(execute(tasks))
    # bucket 0: ready at 2, done at 2.5 (the reducer stamps the completion callback's time,
    # not the time it drains the reduce after the backward); bucket 1: 4-4.5
    assert classes["reduce"] == pytest.approx(0.5 + 0.5)
    assert classes["backward"] == pytest.approx(3.0)


def test_compare_on_a_recorded_pipeline_run(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from flowtrain.cli import main

    profile = cpu_profile().save(tmp_path / "cpu.json")
    run = read_run(PIPELINE_RUN)
    assert [s["stage"] for s in run.stages] == [0, 1]
    assert main(["simulate", "--compare", str(PIPELINE_RUN), "--cluster", str(profile),
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["prediction"]["pp"], data["prediction"]["dp"]) == (2, 1)
    rows = {r["class"]: r for r in data["classes"]}
    # the forward class: per rank (one stage each), the median over steps 2-6 of the summed
    # forward spans, then the mean of the two stages
    medians = []
    for rank in (0, 1):
        lines = (PIPELINE_RUN / "spans" / f"rank{rank}.jsonl").read_text().splitlines()[1:]
        sums = sorted(sum(b - a for n, a, b in json.loads(line)["spans"]
                          if n.startswith("forward/")) for line in lines)
        medians.append(sums[len(sums) // 2])
    assert rows["forward"]["measured_s"] == pytest.approx(sum(medians) / 2)
    assert rows["step"]["predicted_s"] == pytest.approx(data["prediction"]["step_time_s"])
    assert data["prediction"]["notes"] == []
    main(["simulate", "--compare", str(PIPELINE_RUN), "--cluster", str(profile)])
    assert ", 2 pipeline stages, ZeRO stage 0" in capsys.readouterr().out.splitlines()[0]


def test_a_missing_stage_record_is_named(tmp_path: Path) -> None:
    import shutil

    run = tmp_path / "run"
    shutil.copytree(PIPELINE_RUN, run)
    (run / "stages" / "stage1.json").unlink()
    with pytest.raises(ValueError, match="no record of pipeline stage 1 of 2"):
        read_run(run)
    (run / "stages" / "stage0.json").write_text('{"stage": 0}')
    with pytest.raises(ValueError, match="lacks 'stages'"):
        read_run(run)


# ----------------------------------------------------------------------------- calibration

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
    engine, skipped = calibrate_engine.fit_engine(_synthetic_engine_measurements())
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
    with pytest.raises(calibrate.CalibrationError, match="'engine.optimizer' is empty"):
        calibrate.fit_profile(broken)
    broken["engine"]["optimizer"] = [{"numel": 4}]
    with pytest.raises(calibrate.CalibrationError, match=r"'engine.optimizer\[0\].seconds'"):
        calibrate.fit_profile(broken)


def _size_from_run(run_dir: Path, ranks: int, pp: int) -> dict[str, Any]:
    """A recorded run as `measure_jobs` records one size of a calibration job."""
    record = read_run(run_dir)
    measured, steps = measured_classes(record)
    size = {"ranks": ranks, "pp": pp, "plan": record.plan, "stages": list(record.stages),
            "measured": measured, "steps": steps}
    if pp > 1:
        size["gap_per_op_s"] = calibrate_jobs.gap_per_op(record.steps)
    else:
        size["micro_batch_gap_s"] = calibrate_jobs.micro_batch_gap(record.steps)
    return size


def _job(*sizes: dict[str, Any]) -> dict[str, Any]:
    return {"ranks": sizes[0]["ranks"], "pp": sizes[0]["pp"], "sizes": list(sizes),
            "others_cores": 0.0}


def test_overheads_read_off_a_jobs_spans_by_hand() -> None:
    step = [("forward/mb0", 0.0, 1.0), ("backward/mb0", 1.5, 3.0), ("forward/mb1", 3.1, 4.0),
            ("backward/mb1", 4.3, 6.0), ("optimizer/step", 6.5, 7.0)]
    # gaps between each forward and its backward: 0.5 and 0.3; the first step is left out
    assert calibrate_jobs.micro_batch_gap({0: [[], step, step, step]}) == pytest.approx(0.4)
    pipe = [("forward/mb0", 0.0, 1.0), ("send_act/mb0", 1.2, 1.3), ("recv_grad/mb0", 1.3, 2.0),
            ("backward/mb0", 2.4, 4.0), ("optimizer/step", 5.0, 6.0)]
    # from 0 to 4: spans cover 3.4, gaps 0.6 (1.0-1.2 and 2.0-2.4) over 4 spans
    assert calibrate_jobs.gap_per_op({0: [pipe, pipe]}) == pytest.approx(0.15)


def _base_profile() -> HardwareProfile:
    sample = json.loads((DATA / "calibration_sample.json").read_text())
    return calibrate.fit_profile({**sample, "engine": _synthetic_engine_measurements()})


def test_engine_factors_make_the_calibration_jobs_come_out_as_measured() -> None:
    base = _base_profile()
    assert base.engine is not None and base.engine.factors == {}
    # a data-parallel job (the recorded ZeRO-1 run) and the recorded pipeline run
    jobs = [_job(_size_from_run(RUN, 2, 1)), _job(_size_from_run(PIPELINE_RUN, 2, 2))]
    fitted = dataclasses.replace(base, engine=calibrate_jobs.fit_factors(base, jobs))
    size = jobs[0]["sizes"][0]
    again = calibrate_jobs.predict_job(fitted, size)
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
    assert calibrate_jobs.predict_job(fitted, pipeline)["step"] == \
        pytest.approx(pipeline["measured"]["step"], rel=1e-3)
    # fitting through fit_profile gives the same profile, and it survives JSON
    sample = json.loads((DATA / "calibration_sample.json").read_text())
    whole = calibrate.fit_profile({**sample, "engine": {**_synthetic_engine_measurements(),
                                                        "jobs": jobs}})
    assert whole == fitted
    assert HardwareProfile.from_dict(json.loads(json.dumps(whole.to_dict()))) == whole


@pytest.mark.parametrize("scales", [(4,), (2, 4)], ids=["two sizes", "three sizes"])
def test_job_sizes_split_a_factor_from_a_time_per_step(scales: tuple[int, ...]) -> None:
    base = _base_profile()
    small = _size_from_run(RUN, 2, 1)
    larger = []
    for scale in scales:
        large = json.loads(json.dumps(small))
        large["plan"]["config"]["train_micro_batch_size_per_gpu"] *= scale
        large["plan"]["config"]["train_batch_size"] *= scale
        large["plan"]["forward_flops_per_micro_batch"] *= scale
        larger.append(large)
    # an engine whose forwards take 1.5x what the isolated measurements predict plus 2 ms per
    # step, its backwards 1.8x plus 1 ms (its optimizer 1.2x, 1 ms more per step): what its two
    # sizes would measure
    assert base.engine is not None
    truth = {"forward": 1.5, "forward_s": 0.002, "backward": 1.8, "backward_s": 0.001,
             "optimizer": 1.2,
             "micro_batch_s": small["micro_batch_gap_s"], "step_s": 0.001}
    host = dataclasses.replace(base, engine=dataclasses.replace(base.engine,
                                                                factors={2: truth}))
    for size in (small, *larger):
        size["measured"] = calibrate_jobs.predict_job(host, size)
    fitted = calibrate_jobs.fit_factors(base, [_job(small, *larger)]).factors[2]
    assert fitted == pytest.approx(truth, rel=0.01)


def _run_of(steps: tuple[float, ...], others: float, zero3: float | None = None
            ) -> dict[str, Any]:
    record: dict[str, Any] = {"ranks": 2, "pp": 1, "others_cores": others, "gloo": [],
                              "sizes": [{"measured": {"step": s}} for s in steps]}
    if zero3 is not None:
        record["zero3"] = {"measured": {"step": zero3}}
    return record


def test_each_job_size_keeps_its_fastest_quiet_run() -> None:
    runs = [_run_of((10.0, 22.0, 40.0), 0.0, zero3=30.0),
            _run_of((15.0, 20.0, 41.0), 0.05, zero3=28.0),
            _run_of((9.0, 18.0, 35.0), 0.5, zero3=20.0),  # fastest, but others were busy
            _run_of((11.0, 21.0, 39.0), 0.02)]
    kept = calibrate_jobs.keep_fastest(runs, busy_cores=0.1)
    assert [size["measured"]["step"] for size in kept["sizes"]] == [10.0, 20.0, 39.0]
    assert kept["size_runs"] == [0, 1, 3]
    assert kept["zero3"]["measured"]["step"] == 28.0
    # the rest from the quiet run with the shortest steps in all (10 + 22 + 40 = 72 against
    # 76 and 71): the last
    assert kept["others_cores"] == 0.02
    assert runs[0]["sizes"][0]["measured"]["step"] == 10.0  # the runs are left as they were
    # no quiet run: the fastest of all
    busy = [_run_of((12.0, 30.0), 0.4), _run_of((14.0, 25.0), 0.3)]
    kept = calibrate_jobs.keep_fastest(busy, busy_cores=0.1)
    assert [size["measured"]["step"] for size in kept["sizes"]] == [12.0, 25.0]
    with pytest.raises(ValueError, match="at least one run"):
        calibrate_jobs.keep_fastest([], busy_cores=0.1)


def test_gloo_calls_beside_a_live_engine_take_what_the_job_measured() -> None:
    base = _base_profile()
    model = [("all_reduce", 65536), ("all_gather", 4 << 20), ("reduce_scatter", 4 << 20)]
    gloo = [{"op": op, "ranks": 2, "bytes": nbytes,
             "seconds": costs.collective_seconds(op, nbytes, 2, base) + extra}
            for (op, nbytes), extra in zip(model, (0.001, 0.002, 0.004))]
    job = {**_job(_size_from_run(RUN, 2, 1)), "gloo": gloo}
    engine = calibrate_jobs.fit_factors(base, [job])
    assert engine.factors[2]["gloo_s"] == pytest.approx(0.002)
    hw = dataclasses.replace(base, engine=engine)
    cfg = _cfg(2, flowtrain={"data_channel": "torch"})
    [reduce] = [t for t in build_plan(_work(), cfg, Layout(1, 2), hw).tasks
                if t.kind == "reduce"]
    scale_pass = 2 * 56 * 4 / hw.memory_bandwidth * costs.compute_slowdown(2, hw, memory=True)
    assert reduce.duration == pytest.approx(costs.collective_seconds("all_reduce", 56 * 4, 2, hw)
                                            + 0.002 + scale_pass)


def test_a_measured_layer_pass_is_the_engines() -> None:
    timed = calibrate_engine.time_pass((8, 16, 16), 0.02)
    assert timed["flops"] == 2 * 8 * 16 * 16
    assert 0 < timed["forward_s"] < 0.01 and 0 < timed["backward_s"] < 0.01
    # 4 MiB of weights: one copy of the layer
    op = calibrate_engine.LinearPass(2, 1024, 1024)
    arrived: list[int] = []
    op.buckets.on_bucket_ready = arrived.append
    op.both()
    op.close()
    # the engine's bucket hooks saw both parameters land: each bucket (the engine's plan puts
    # a small first bucket ahead) reported ready once
    assert sorted(arrived) == list(range(len(op.buckets.plan))) and arrived
    assert math.isfinite(float(op.layer.weight.grad.sum()))
    # a small layer cycles through copies holding 4 MiB of weights, as a model's layers do
    small = calibrate_engine.LinearPass(4, 8, 8)
    used = [id(small.layer) for _ in range(3) if small.forward() is not None]
    assert len(small.layers) == 16 and len(set(used)) == 3
    small.close()


def test_the_demo_factory_is_the_model_make_demo_trains(monkeypatch: pytest.MonkeyPatch) -> None:
    examples = Path(__file__).parents[1] / "examples"
    monkeypatch.syspath_prepend(str(examples))
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
    from sims.probe import profile_probe_seconds

    base = _base_profile()
    job = _job(_size_from_run(RUN, 2, 1))
    assert calibrate_jobs.job_speed(base, job) == 1.0
    job["probe_s"] = 1.3 * profile_probe_seconds(base)
    assert calibrate_jobs.job_speed(base, job) == pytest.approx(1.3)
    assert calibrate_jobs.fit_factors(base, [job]) == \
        calibrate_jobs.fit_factors(base, [{k: v for k, v in job.items() if k != "probe_s"}])


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
    small = _size_from_run(RUN, 2, 1)
    truth = {"forward": 1.3, "forward_s": 0.0, "backward": 1.6, "backward_s": 0.0,
             "optimizer": 1.1, "micro_batch_s": small["micro_batch_gap_s"], "step_s": 0.001,
             "zero3_fetch_s": 0.0008, "zero3_backward_s": 0.0003}
    host = dataclasses.replace(base, engine=dataclasses.replace(base.engine,
                                                                factors={2: truth}))
    zero3 = _zero3_size(small)
    small["measured"] = calibrate_jobs.predict_job(host, small)
    zero3["measured"] = calibrate_jobs.predict_job(host, zero3)
    without = calibrate_jobs.fit_factors(base, [_job(small)]).factors[2]
    assert "zero3_fetch_s" not in without
    fitted = calibrate_jobs.fit_factors(base, [{**_job(small), "zero3": zero3}]).factors[2]
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
    size = _zero3_size(_size_from_run(RUN, 2, 1))
    # one micro-batch: its forward has no reduces of a backward before it to queue behind
    size["plan"]["config"].update(gradient_accumulation_steps=1, train_batch_size=128)
    factors = {"zero3_fetch_s": 0.0008, "zero3_backward_s": 0.0003}
    host = dataclasses.replace(base, engine=dataclasses.replace(base.engine,
                                                                factors={2: factors}))
    bare = calibrate_jobs.predict_job(base, size)
    got = calibrate_jobs.predict_job(host, size)
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
