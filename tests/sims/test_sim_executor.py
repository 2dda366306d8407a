"""The simulator's executor and planner against schedules worked out by hand and published
formulas: exact start/end times of a small DAG, the 1F1B bubble (p-1)/(m+p-1), overlap of
gradient reduces with backward, ZeRO-3 prefetch decisions, and symmetric-rank speed."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from flowtrain.config import load_config
from sims import pricing, stage_costs
from sims.executor import SimTask, execute, step_figures
from sims.planner import Layout, Workload, build_plan, one_f_one_b, pipeline_tasks, stage3_uses
from sims.trace import trace_events, write_trace


def _task(name: str, resource: str, duration: float, deps: tuple[int, ...] = (),
          kind: str = "x", collective: bool = False) -> SimTask:
    return SimTask(name, kind, resource, duration, deps, collective=collective)


def test_small_dag_schedule_by_hand() -> None:
    # compute: A 0-2; C and X both ready at 2, C is earlier in plan order -> C 2-5, X 5-6;
    # E waits for B and D -> 9-10. comm:dp: F 0-0.5, B 2-3, D (after C) 5-9.
    tasks = [
        _task("A", "compute", 2.0),
        _task("B", "comm:dp", 1.0, (0,)),
        _task("C", "compute", 3.0, (0,)),
        _task("D", "comm:dp", 4.0, (2,)),
        _task("E", "compute", 1.0, (1, 3)),
        _task("F", "comm:dp", 0.5),
        _task("X", "compute", 1.0),
    ]
    timeline = execute(tasks)
    assert list(zip(timeline.start, timeline.end)) == [
        (0.0, 2.0), (2.0, 3.0), (2.0, 5.0), (5.0, 9.0), (9.0, 10.0), (0.0, 0.5), (5.0, 6.0)]
    figures = step_figures(timeline)
    assert figures.step_time == 10.0
    assert figures.resource_seconds == {"compute": 7.0, "comm:dp": 5.5}
    # comm [0,.5] [2,3] [5,9] against work [0,6] [9,10]: hidden .5 + 1 + 1 of 5.5
    assert figures.comm_seconds == pytest.approx(5.5)
    assert figures.exposed_comm_seconds == pytest.approx(3.0)
    assert figures.overlap_pct == pytest.approx(100 * 2.5 / 5.5)
    assert figures.bubble_pct == 0.0


def test_collective_interference_takes_compute_time() -> None:
    tasks = [_task("allreduce", "comm:dp", 2.0, collective=True), _task("fwd", "compute", 1.0)]
    assert execute(tasks).end == (2.0, 1.0)
    # a quarter of the collective's 2 s lands on compute, ahead of the later task in plan order
    timeline = execute(tasks, interference=0.25)
    assert timeline.tasks[2].name == "interference/allreduce"
    assert list(zip(timeline.start, timeline.end)) == [(0.0, 2.0), (0.5, 1.5), (0.0, 0.5)]


def test_collectives_progress_slower_while_their_stage_computes() -> None:
    """Processor sharing, by hand: a 1 s (alone) all-reduce at half speed while compute runs.
    Compute busy throughout: it takes 2 s. Compute busy for its first 0.5 s: 0.25 s of its work
    is done then, the other 0.75 s at full speed, ending at 1.25 s. Another stage's compute
    does not slow it; its own interference task does not either."""
    slow = [_task("allreduce", "comm:dp", 1.0, collective=True), _task("fwd", "compute", 10.0)]
    assert execute(slow, slowdown=2.0).end == (2.0, 10.0)
    short = [_task("allreduce", "comm:dp", 1.0, collective=True), _task("fwd", "compute", 0.5)]
    assert execute(short, slowdown=2.0).end == pytest.approx((1.25, 0.5))
    # compute that starts halfway: 0.5 s alone, then the last 0.5 s of work at half speed
    late = [_task("a", "compute", 0.0), _task("allreduce", "comm:dp", 1.0, collective=True),
            _task("wait", "comm:pp", 0.5), _task("fwd", "compute", 10.0, (2,))]
    assert execute(late, slowdown=2.0).end[1] == pytest.approx(1.5)
    other = [_task("allreduce", "comm:dp", 1.0, collective=True),
             SimTask("fwd", "x", "compute", 10.0, stage=1)]
    assert execute(other, slowdown=2.0).end[0] == 1.0
    alone = [_task("allreduce", "comm:dp", 1.0, collective=True)]
    timeline = execute(alone, interference=0.5, slowdown=2.0)
    assert timeline.tasks[1].name == "interference/allreduce"
    assert timeline.end == (1.0, 0.5)
    # a task's own factor wins over the plan's; a non-collective is never slowed
    own = [SimTask("reduce", "x", "comm:dp", 1.0, collective=True, slowdown=4.0),
           _task("copy", "copy:h2d", 1.0), _task("fwd", "compute", 10.0)]
    assert execute(own, slowdown=2.0).end == (4.0, 1.0, 10.0)
    assert execute(own).end == (4.0, 1.0, 10.0)


def test_bad_plans_are_refused_with_the_task_named() -> None:
    with pytest.raises(ValueError, match="'b'.*waits for 'a'|'a'.*waits for 'b'"):
        execute([_task("a", "compute", 1.0, (1,)), _task("b", "compute", 1.0, (0,))])
    with pytest.raises(ValueError, match="'a' has a negative duration -1"):
        execute([_task("a", "compute", -1.0)])
    with pytest.raises(ValueError, match="'a' depends on index 5"):
        execute([_task("a", "compute", 1.0, (5,))])
    with pytest.raises(ValueError, match="interference must be a fraction from 0 to 1, got 2"):
        execute([], interference=2)
    with pytest.raises(ValueError, match="slowdown must be a factor of at least 1, got 0.5"):
        execute([], slowdown=0.5)
    with pytest.raises(ValueError, match="'r' has slowdown 0.5; it must be a factor of at least"):
        execute([SimTask("r", "x", "comm:dp", 1.0, collective=True, slowdown=0.5)])


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (8, 32), (3, 7)])
def test_1f1b_bubble_matches_formula(p: int, m: int) -> None:
    tf, tb = 1.0, 2.0
    timeline = execute(pipeline_tasks(p, m, tf, tb))
    figures = step_figures(timeline)
    assert figures.step_time == pytest.approx((m + p - 1) * (tf + tb))
    assert figures.bubble_pct == pytest.approx(100 * (p - 1) / (m + p - 1))
    # stage s starts its first forward after s forwards upstream
    firsts = {t.stage: a for t, a, _ in timeline.spans() if t.name == "forward/mb0"}
    assert firsts == {s: pytest.approx(s * tf) for s in range(p)}


def test_1f1b_order() -> None:
    assert one_f_one_b(4, 0, 5) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0),
                                    ("F", 4), ("B", 1), ("B", 2), ("B", 3), ("B", 4)]
    assert one_f_one_b(4, 3, 2) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]
    assert one_f_one_b(4, 1, 1) == [("F", 0), ("B", 0)]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2])
def test_pipeline_sends_lengthen_fill_and_drain(p: int, m: int) -> None:
    # With one or two micro-batches nothing stalls in between: the sends add to the fill and
    # the drain only, 2(p-1) of them on the critical path (p=2, m=2 by hand: s0 F0 0-1, F1 1-2;
    # s1 F0 1.25-2.25, B0 -4.25, F1 -5.25, B1 -7.25; s0 B0 4.5-6.5, B1 7.5-9.5).
    tf, tb, send = 1.0, 2.0, 0.25
    figures = step_figures(execute(pipeline_tasks(p, m, tf, tb, send)))
    assert figures.step_time == pytest.approx((m + p - 1) * (tf + tb) + 2 * (p - 1) * send)


# -- planner over a cost model whose figures are easy to add up by hand ------------------------

def fake_costs(monkeypatch: pytest.MonkeyPatch, fake: Any) -> None:
    """Prices every task of the plan (the stage's costs and the pricing that asks them) by
    ``fake`` instead of the cost model."""
    monkeypatch.setattr(pricing, "costs", fake)
    monkeypatch.setattr(stage_costs, "costs", fake)


def _fake_costs(reduce_s: float) -> Any:
    return SimpleNamespace(
        compute_seconds=lambda flops, nbytes, dtype, hw: flops / 1e12,
        collective_seconds=lambda op, nbytes, ranks, hw, nodes=1: reduce_s,
        p2p_seconds=lambda nbytes, hw, inter_node: 0.0,
        copy_seconds=lambda nbytes, hw: 0.0,
        optimizer_seconds=lambda numel, hw, on_host=False: 0.5)


def _fake_gpu() -> Any:
    """A GPU profile with nothing but its kind: the fake costs above price every task."""
    return SimpleNamespace(kind="gpu", kernels=None, gpu_kernels=None, engine=None,
                           comm_compute_interference=0.0, compute_comm_slowdown=1.0)


def _four_layers() -> Workload:
    params = tuple((f"layers.{i}.weight", (1000, 1000), "float32", 4) for i in range(4))
    return Workload("four", params, forward_flops_per_sample=4e12)  # 1 s of forward per layer


def _config(stage: int, gas: int = 1, dp: int = 2, **zero: Any) -> Any:
    return load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": gas,
                        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1_000_000,
                                              **zero}},
                       world_size=dp, check_supported=False)


@pytest.mark.parametrize("reduce_s,step,exposed,overlap", [
    # reduces (1 s) shorter than a layer's backward (2 s): each hides behind the next layer's
    # backward; only the last one (12-13) shows. Then the 0.5 s optimizer step.
    (1.0, 13.5, 1.0, 75.0),
    # reduces of 3 s cannot keep up: they run back to back from 6 to 18, compute ends at 12
    (3.0, 18.5, 6.0, 50.0),
])
def test_reduce_overlap_with_backward(monkeypatch: pytest.MonkeyPatch, reduce_s: float,
                                      step: float, exposed: float, overlap: float) -> None:
    fake_costs(monkeypatch, _fake_costs(reduce_s))
    plan = build_plan(_four_layers(), _config(0), Layout(1, 2), _fake_gpu())
    timeline = execute(plan.tasks)
    spans = {t.name: (a, b) for t, a, b in timeline.spans()}
    assert spans["forward/mb0"] == (0.0, 4.0)
    assert spans["backward/mb0/layer3"] == (4.0, 6.0)
    assert spans["reduce/bucket0"] == (6.0, 6.0 + reduce_s)  # layer 3's bucket, ready first
    figures = step_figures(timeline)
    assert figures.step_time == pytest.approx(step)
    assert figures.exposed_comm_seconds == pytest.approx(exposed)
    assert figures.overlap_pct == pytest.approx(overlap)


def test_zero_stages_add_the_engines_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_costs(monkeypatch, _fake_costs(1.0))
    hw = _fake_gpu()

    def names(cfg: Any) -> list[str]:
        return [t.name for t in build_plan(_four_layers(), cfg, Layout(1, 2), hw).tasks]

    stage1 = names(_config(1, gas=2))
    assert [n for n in stage1 if n.startswith("reduce/")] == [f"reduce/bucket{i}" for i in range(4)]
    assert [n for n in stage1 if n.startswith("allgather/")] == \
        [f"allgather/bucket{i}" for i in range(4)]
    stage2 = names(_config(2, gas=2))
    assert [n for n in stage2 if n.startswith("reduce/")] == \
        [f"reduce/bucket{i}/mb{k}" for k in range(2) for i in range(4)]
    offload = names(_config(2, offload_optimizer={"device": "cpu"}))
    assert [n for n in offload if "bucket0" in n and not n.startswith("reduce")] == [
        "copy/d2h/bucket0", "optimizer/step/bucket0", "copy/h2d/bucket0", "allgather/bucket0"]
    # ZeRO-3 with no prefetch: each layer is gathered before its forward and its backward
    stage3 = names(_config(3, stage3_prefetch_bucket_size=0, stage3_max_reuse_distance=0))
    gathers = [n for n in stage3 if n.startswith("gather/")]
    assert gathers == [f"gather/bucket{b}/fwd/mb0" for b in (3, 2, 1, 0)] + \
        [f"gather/bucket{b}/bwd/mb0" for b in (1, 2, 3)]  # layer 0 is used again at once


def test_stage3_prefetch_and_reuse_decisions() -> None:
    trace = [3, 2, 1, 0, 0, 1, 2, 3]  # forward then backward over four 10-element modules
    numel = {b: 10 for b in range(4)}
    no_prefetch = stage3_uses(trace, numel, prefetch_numel=0, max_live_numel=10**9,
                              max_reuse_distance=10**9)
    assert no_prefetch.launched == ((3,), (2,), (1,), (0,), (), (), (), ())  # all kept
    # 20 elements of prefetch, nothing kept: gathers run ahead; the last module is used again
    # at distance 0 so it stays
    window = stage3_uses(trace, numel, prefetch_numel=20, max_live_numel=10**9,
                         max_reuse_distance=0)
    assert window.launched == ((3, 2, 1), (0, 3), (2,), (1,), (), (), (), ())
    assert window.gathered_for == ((3,), (2,), (1,), (0,), (), (1,), (2,), (3,))
    # 25 elements of reuse distance keep modules 1 and 0 (20 and 0 elements away)
    reuse = stage3_uses(trace, numel, prefetch_numel=10, max_live_numel=10**9,
                        max_reuse_distance=25)
    assert reuse.gathered_for == ((3,), (2,), (1,), (0,), (), (), (2,), (3,))


def test_layout_checks_name_the_value() -> None:
    with pytest.raises(ValueError, match="tp 3 must divide the 8 devices per node"):
        Layout(1, 8, tp=3)
    with pytest.raises(ValueError, match="tp x pp = 16 must divide the world size 8"):
        Layout(1, 8, tp=2, pp=8)
    with pytest.raises(ValueError, match="nodes must be an integer > 0, got 0"):
        Layout(0, 8)
    layout = Layout(128, 8, tp=8, pp=8)
    assert (layout.world_size, layout.dp, layout.dp_nodes) == (1024, 16, 16)
    assert layout.pipe_link_inter_node(0)
    assert not Layout(1, 8, pp=2).pipe_link_inter_node(0)


def _llama_like(layers: int) -> Workload:
    h, f = 1024, 4096
    params: list[tuple[str, tuple[int, ...], str, int]] = [
        ("embed.weight", (32000, h), "bfloat16", 2)]
    for i in range(layers):
        params += [(f"layers.{i}.attn.weight", (3 * h, h), "bfloat16", 2),
                   (f"layers.{i}.mlp.weight", (f, h), "bfloat16", 2),
                   (f"layers.{i}.norm.weight", (h,), "bfloat16", 2)]
    return Workload("llama-like", tuple(params), 2e9 * layers, 2048, h, layers)


def test_symmetric_ranks_cost_what_few_ranks_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """One representative rank per stage: 1,024 ranks simulate about as fast as 16."""
    fake_costs(monkeypatch, _fake_costs(0.01))
    work = _llama_like(16)
    hw = _fake_gpu()

    def run(layout: Layout) -> tuple[float, int]:
        cfg = _config(1, gas=16, dp=layout.dp)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            plan = build_plan(work, cfg, layout, hw)
            step_figures(execute(plan.tasks))
            best = min(best, time.perf_counter() - t0)
        return best, len(plan.tasks)

    small_s, small_tasks = run(Layout(2, 8, tp=2, pp=4))  # 16 ranks, dp 2
    big_s, big_tasks = run(Layout(128, 8, tp=2, pp=4))  # 1,024 ranks, dp 128
    assert big_tasks <= 1.2 * small_tasks
    assert big_s < 2.0 * small_s + 0.05, (big_s, small_s)


def test_trace_has_the_measured_layout_a_track_per_kind_of_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowtrain.plan.trace_layout import track_of

    fake_costs(monkeypatch, _fake_costs(0.5))
    plan = build_plan(_llama_like(4), _config(1, gas=4, dp=2), Layout(1, 8, tp=2, pp=2),
                      _fake_gpu())
    timeline = execute(plan.tasks)
    path = write_trace(timeline, tmp_path / "out" / "trace.json", ranks_per_stage=4)
    data = json.loads(path.read_text())
    events = data["traceEvents"]
    # stage s is the process of its first rank, s x (dp 2 x tp 2), named as measured ranks are
    assert {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"} == \
        {0: "rank 0", 4: "rank 4"}
    tracks = {(e["pid"], e["args"]["name"].rstrip(" 0123456789")) for e in events
              if e["ph"] == "M" and e["name"] == "thread_name"}
    used = {(t.stage * 4, track_of(t.name)) for t in timeline.tasks} | {(0, "steps"),
                                                                       (4, "steps")}
    assert tracks == used
    assert {t for _, t in used} >= {"compute", "reduce", "tensor parallel", "pipeline"}
    spans = [e for e in events if e["ph"] == "X" and e["cat"] != "steps"]
    assert len(spans) == len(timeline.tasks)
    last = max(e["ts"] + e["dur"] for e in spans)
    assert last == pytest.approx(timeline.step_time * 1e6, rel=1e-6)
    # each cross-stage dependency (a send and the pass waiting for it) is a flow
    crossing = sum(1 for t in timeline.tasks for d in t.deps
                   if timeline.tasks[d].stage != t.stage)
    assert crossing and sum(1 for e in events if e["ph"] == "s") == crossing
    assert trace_events(timeline)["otherData"]["step_time_s"] == timeline.step_time
