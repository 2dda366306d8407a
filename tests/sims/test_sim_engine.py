"""The simulator's model of flowtrain's own work on a calibrated CPU host (the profile's
``engine`` section): its JSON and checks, the cost functions worked out by hand, the planner's
module ops, shared-memory reduces, optimizer step and pipeline hand-offs, --compare's pipeline
runs and reduce spans (the calibration fits: test_sim_calibrate_jobs.py)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from sim_helpers import PIPELINE_RUN, cpu_profile, sim_config, tiny_workload
from sims import costs
from sims.compare import predicted_classes, read_run
from sims.executor import SimTask, execute
from sims.hardware import BUILTIN_PROFILES, HardwareProfile, Link, ProfileError
from sims.planner import Layout, Workload, build_plan

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

    one = build_plan(tiny_workload(), sim_config(1), Layout(1, 1), hw).tasks
    by_name = {t.name: t for t in one}
    # one rank of the profile's 2 cores: 2 threads, no slowdown, the nearest job factor
    # (2 ranks)
    assert by_name["forward/mb0"].duration == pytest.approx(expected("forward", 2, 1.25))
    assert by_name["backward/mb0"].duration == pytest.approx(expected("backward", 2, 1.25))
    two = {t.name: t for t in build_plan(tiny_workload(), sim_config(2), Layout(1, 2), hw).tasks}
    assert two["forward/mb0"].duration == pytest.approx(expected("forward", 1, 1.1 * 1.25))


def test_reduces_go_over_the_shared_memory_channel_where_the_engine_uses_it() -> None:
    hw = cpu_profile()
    plan = build_plan(tiny_workload(), sim_config(2), Layout(1, 2), hw)
    [reduce] = [t for t in plan.tasks if t.kind == "reduce"]
    nbytes = 56 * 4
    # the channel's all-reduce, then the 1/dp multiply over the bucket (2 x bytes, memory bound,
    # 1.5x slower with 2 ranks streaming)
    assert reduce.duration == pytest.approx(costs.channel_seconds("all_reduce", nbytes, 2, hw)
                                            + 2 * nbytes / 20e9 * 1.5)
    assert reduce.interference == 0.5
    # data_channel "torch" (and pipelines, several nodes) use gloo: the plan's interference
    gloo = build_plan(tiny_workload(), sim_config(2, flowtrain={"data_channel": "torch"}),
                      Layout(1, 2), hw)
    [reduce] = [t for t in gloo.tasks if t.kind == "reduce"]
    assert reduce.duration == pytest.approx(1e-3 + nbytes / 1e9 + 2 * nbytes / 20e9 * 1.5)
    assert reduce.interference is None


def test_zero3_gathers_nothing_where_the_host_shares_the_parameters() -> None:
    """ZeRO-3 over the shared-memory channel uses the host's one copy of the parameters
    (flowtrain.zero.stage3): the plan has no gathers; with zero_shared_params false, or over
    gloo, each use's gather is the data-parallel all-gather of the bucket."""
    hw = cpu_profile()
    work = Workload("two layers", (("l.0.weight", (64, 64), "float32", 4),
                                   ("l.1.weight", (64, 64), "float32", 4)), 1e5)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 4096}

    def gathers(**flowtrain: Any) -> list[float]:
        cfg = sim_config(2, zero_optimization=zero, flowtrain=flowtrain)
        return [t.duration for t in build_plan(work, cfg, Layout(1, 2), hw).tasks
                if t.kind == "gather"]

    assert gathers() == [] and gathers(data_channel="shm") == []
    nbytes = 64 * 64 * 4
    for own in (gathers(zero_shared_params=False), gathers(data_channel="torch")):
        assert own and all(d == pytest.approx(1e-3 + nbytes / 1e9, rel=0.05) for d in own), own


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_needs_no_all_gather_after_the_step_where_the_host_shares_the_parameters(
        stage: int) -> None:
    hw = cpu_profile()

    def allgathers(**flowtrain: Any) -> list[str]:
        cfg = sim_config(2, zero_optimization={"stage": stage}, flowtrain=flowtrain)
        return [t.name for t in build_plan(tiny_workload(), cfg, Layout(1, 2), hw).tasks
                if t.kind == "allgather"]

    assert allgathers() == []
    assert allgathers(zero_shared_params=False) and allgathers(data_channel="torch")


def test_optimizer_step_as_the_engine_runs_it() -> None:
    hw = cpu_profile()
    kernel, bandwidth = 1e-5, 20e9

    def optimizer(cfg: Any) -> float:
        [task] = [t for t in build_plan(tiny_workload(), cfg, Layout(1, 2), hw).tasks
                  if t.kind == "optimizer"]
        return task.duration

    # stage 0 without clipping: one kernel call per parameter over all 56 elements, the
    # buckets zeroed (4 B each); memory 1.5x slower, then the 2-rank job's optimizer factor 2
    stage0 = (3 * kernel + 56 * 28 / bandwidth * 1.5 + 56 * 4 / bandwidth * 1.5) * 2.0
    assert optimizer(sim_config(2, gradient_clipping=0.0)) == pytest.approx(stage0)
    # ZeRO 1: one call per bucket shard (28 of 56 elements), whole buckets zeroed; clipping
    # adds a norm pass and a scaling pass over the shard (12 B per element), and the global
    # norm's all-reduce of 8 bytes over gloo (1 ms + 1 GB/s)
    zero1 = (1 * kernel + 28 * 28 / bandwidth * 1.5 + (56 * 4 + 28 * 12) / bandwidth * 1.5) * 2 \
        + 1e-3 + 8 / 1e9
    assert optimizer(sim_config(2, zero_optimization={"stage": 1}, gradient_clipping=1.0)) == \
        pytest.approx(zero1)


def test_zero2_backward_also_adds_each_gradient_into_a_pooled_bucket() -> None:
    hw = cpu_profile()
    zero1 = {t.name: t.duration for t in build_plan(
        tiny_workload(), sim_config(2, zero_optimization={"stage": 1}), Layout(1, 2), hw).tasks}
    zero2 = {t.name: t.duration for t in build_plan(
        tiny_workload(), sim_config(2, zero_optimization={"stage": 2}), Layout(1, 2), hw).tasks}
    assert zero2["backward/mb0"] - zero1["backward/mb0"] == \
        pytest.approx(56 * 16 / 20e9 * 1.5)


def test_a_data_parallel_collective_slows_where_more_ranks_share_the_host() -> None:
    """pp 2 x dp 2 on the 2-core test host: each stage's data-parallel all-reduce (gloo, 2
    ranks) runs with 4 ranks on the host, slower by the 4-rank over the 2-rank compute
    slowdown (2.0 / 1.1), plus the beside-the-engine time; dp over every rank is unchanged."""
    hw = cpu_profile(factors={4: {"gloo_s": 1e-4}})
    work = Workload("two layers", (("l.0.weight", (64, 64), "float32", 4),
                                   ("l.1.weight", (64, 64), "float32", 4)), 1e5)
    plan = build_plan(work, sim_config(2, gradient_accumulation_steps=2), Layout(1, 4, pp=2), hw)
    [reduce] = [t for t in plan.tasks if t.kind == "reduce" and t.stage == 0]
    nbytes = 64 * 64 * 4
    # then the 1/dp multiply over the bucket: 2 x bytes, memory bound (3x slower with 4 ranks)
    scale = 2 * nbytes / 20e9 * 3.0
    assert reduce.duration == pytest.approx(
        costs.collective_seconds("all_reduce", nbytes, 2, hw) * 2.0 / 1.1 + 1e-4 + scale)
    flat = build_plan(work, sim_config(4, flowtrain={"data_channel": "torch"}), Layout(1, 4), hw)
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
    plan = build_plan(work, sim_config(1, gradient_accumulation_steps=2), Layout(1, 2, pp=2), hw)
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
        build_plan(work, sim_config(1), Layout(1, 3, pp=3), hw)
    # 4 ranks (2 stages x 2 data parallel) on the profile's 2 cores: the hand-offs measured on 2
    # ranks take 2.0 / 1.1 as long (the ranks' compute slowdown), the stages broadcast the
    # loss, and clipping sums the norm over all 4 ranks
    four = {t.name: t for t in build_plan(work, sim_config(2, gradient_accumulation_steps=2),
                                          Layout(1, 4, pp=2), hw).tasks}
    assert four["handoff/forward/mb0"].duration == pytest.approx(1e-3 * 2.0 / 1.1)
    broadcast = costs.collective_seconds("broadcast", 4, 2, hw)
    assert four["overhead/loss-broadcast"].duration == pytest.approx(broadcast)
    no_clip = {t.name: t for t in build_plan(
        work, sim_config(2, gradient_accumulation_steps=2, gradient_clipping=0.0),
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
        plan = build_plan(w, sim_config(1, gradient_accumulation_steps=2), Layout(1, 2, pp=2), hw)
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
