"""The cost-free task graph (``sims.graph``) and its pricing (``sims.pricing``): the graph
carries no time, only what decides it; every task belongs to a task of the engine's step plan;
the engine's overheads are tasks only where the costs model them so; and the priced graph is
what ``build_plan`` hands the executor."""

from __future__ import annotations

import math
from typing import Any

import pytest

from flowtrain.plan import names
from flowtrain.plan.schedule import one_f_one_b
from flowtrain.plan.spec import resolve
from sim_helpers import cpu_profile, sim_config, tiny_workload
from sims.graph import COSTS, OVERHEADS, StageLayout, TaskGraph, bare_pipeline
from sims.hardware import get_profile
from sims.pricing import price, task_seconds
from sims.stage_costs import StageCosts
from sims.workload import Layout


def lay_out(cfg: Any, dp: int, overheads: tuple[str, ...] = (),
            param_gather_overlap: bool = False) -> tuple[StageLayout, TaskGraph]:
    work = tiny_workload()
    graph = TaskGraph()
    spec = resolve(cfg, dp=dp, elem_size=4).replace(bucket_numel=16, comm_dtype="float32")
    stage = StageLayout(graph, 0, params=list(work.params), spec=spec, forward_flops=1e5,
                        gpu=False,
                        act_bytes=0.0, send_bytes=0.0, recv_bytes=0.0, overheads=overheads,
                        param_gather_overlap=param_gather_overlap)
    stage.build()
    return stage, graph


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_graph_tasks_belong_to_the_step_plan(zero: int) -> None:
    cfg = sim_config(2, gradient_accumulation_steps=2, zero_optimization={"stage": zero})
    stage, graph = lay_out(cfg, dp=2)
    tasks = graph.resolve()
    assert {t.cost for t in tasks} <= set(COSTS)  # no overhead laid out unasked
    plan_names = set(stage.step_plan.task_names())
    for t in tasks:
        assert names.plan_task_of(t.name) in plan_names, t.name
    # every pass, reduce and gather of the plan has its piece(s) in the graph
    covered = {names.plan_task_of(t.name) for t in tasks}
    assert plan_names - covered <= {names.COMM_WAIT}


def test_overheads_are_laid_out_only_when_asked() -> None:
    cfg = sim_config(2, gradient_accumulation_steps=2,
                     zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    _, bare = lay_out(cfg, dp=2)
    _, full = lay_out(cfg, dp=2, overheads=("loss", "step", "fetch", "release",
                                            "bucket_hand_off"))
    extra = [t for t in full.resolve() if t.cost in OVERHEADS]
    assert {t.cost for t in extra} == {"loss", "step", "fetch", "release", "bucket_hand_off"}
    assert len(full.tasks) - len(bare.tasks) == len(extra)
    assert [t.name for t in full.resolve() if t.cost not in OVERHEADS] == \
        [t.name for t in bare.resolve()]
    with pytest.raises(ValueError, match="unknown engine overheads.*'nap'"):
        lay_out(cfg, dp=2, overheads=("nap",))


def test_pricing_refuses_an_overhead_the_costs_do_not_model() -> None:
    # a GPU profile folds the engine's overheads into the passes: a graph that lays one out
    # as a task of its own was built for other costs
    cfg = sim_config(2, zero_optimization={"stage": 1})
    _, graph = lay_out(cfg, dp=2, overheads=("loss",))
    gpu = StageCosts(0, layout=Layout(1, 2), hw=get_profile("h100-x8"),
                     spec=resolve(cfg, dp=2, elem_size=4), params=list(tiny_workload().params),
                     recompute="none")
    loss = next(t for t in graph.resolve() if t.cost == "loss")
    with pytest.raises(ValueError, match="engine overhead 'loss'.*modelled: none"):
        task_seconds(loss, gpu)


def test_price_keeps_the_graph_and_asks_each_task_its_stage() -> None:
    hw = cpu_profile(factors={2: {"forward": 1.25, "backward": 1.25, "optimizer": 2.0,
                                  "micro_batch_s": 1e-3, "step_s": 2e-3, "bucket_s": 1e-4}})
    cfg = sim_config(2, gradient_accumulation_steps=2, zero_optimization={"stage": 2})
    work = tiny_workload()
    costs = StageCosts(0, layout=Layout(1, 2), hw=hw, spec=resolve(cfg, dp=2, elem_size=4),
                       params=list(work.params), recompute="none")
    assert costs.overheads()  # a calibrated CPU host models some overheads as tasks
    stage, graph = lay_out(cfg, dp=2, overheads=tuple(costs.overheads()))
    weights = [math.prod(p[1]) for p in work.params]
    costs.price_passes(stage.segments, stage.buckets, stage_flops=work.forward_flops_per_sample,
                       work=work, weights=weights, total_weight=sum(weights), dtype="float32",
                       act_bytes=0.0)
    tasks = graph.resolve()
    assert any(g.cost in OVERHEADS for g in tasks)
    priced = price(tasks, [costs])
    assert [(t.name, t.kind, t.resource, t.deps, t.bytes) for t in priced] == \
        [(g.name, g.kind, g.resource, g.deps, g.nbytes) for g in tasks]
    for g, t in zip(tasks, priced):
        if g.cost == "reduce":
            assert (t.duration, t.interference, t.slowdown) == costs.reduce_seconds(g.nbytes)
        elif g.cost in OVERHEADS:
            assert t.duration == costs.overheads()[g.cost]
        elif g.cost in ("forward", "backward"):
            per_segment = costs.forward_s if g.cost == "forward" else costs.backward_s
            assert t.duration == (per_segment[g.arg] if g.arg >= 0 else sum(per_segment))
            assert t.duration > 0
        assert t.collective == t.resource.startswith("comm:")


def test_bare_pipeline_runs_each_stage_in_1f1b_order() -> None:
    tasks = bare_pipeline(3, 4)
    for s in range(3):
        passes = [(t.cost[0].upper(), int(t.name.split("mb")[1])) for t in tasks
                  if t.stage == s and t.cost in ("forward", "backward")]
        assert passes == one_f_one_b(3, s, 4)
    sends = [t for t in tasks if t.cost == "send"]
    assert len(sends) == 2 * 2 * 4  # each inner boundary: activations down, gradients back
    assert all(t.deps for t in sends)


@pytest.mark.parametrize("zero", [1, 2])
def test_overlapped_parameter_gathers_come_before_the_forward_that_reads_them(zero: int) -> None:
    cfg = sim_config(2, gradient_accumulation_steps=2, zero_optimization={"stage": zero})
    stage, after = lay_out(cfg, dp=2)
    _, ahead = lay_out(cfg, dp=2, param_gather_overlap=True)
    late, early = after.resolve(), ahead.resolve()
    # the same tasks by name (the plan's), only laid out elsewhere
    assert sorted(t.name for t in late if t.kind != "forward") == \
        sorted(t.name for t in early if t.kind != "forward")
    step = next(i for i, t in enumerate(late) if t.name == names.OPTIMIZER_STEP)
    assert all(step in t.deps for t in late if t.kind == "allgather")
    gathers = {i: t for i, t in enumerate(early) if t.kind == "allgather"}
    assert gathers and all(not set(t.deps) - set(gathers) for t in gathers.values())
    # each bucket is gathered before the first micro-batch's first segment that uses it
    seg_of = {i: j for j, seg in enumerate(stage.segments) for i in seg.params}
    first = {t.arg: t for t in early
             if t.kind == "forward" and t.name.startswith(names.forward(0))}
    for i, t in gathers.items():
        bucket = next(b for b in stage.buckets if names.allgather(b.index) == t.name)
        segment = min(seg_of[slot.index] for slot in bucket.slots)
        assert i in first[segment].deps
    # no parameter gather at all without ZeRO, or on one rank
    _, plain = lay_out(sim_config(2, zero_optimization={"stage": 0}), dp=2,
                       param_gather_overlap=True)
    assert not any(t.kind == "allgather" for t in plain.resolve())


def test_fsdp_units_are_blocks_prefetched_one_ahead() -> None:
    # a two-layer model: embedding, two blocks of a norm and two linears each, a head
    params = [("embed.weight", (16, 8), "float32", 4)]
    for layer in range(2):
        params += [(f"layers.{layer}.norm.weight", (8,), "float32", 4),
                   (f"layers.{layer}.attn.weight", (8, 8), "float32", 4),
                   (f"layers.{layer}.mlp.weight", (8, 8), "float32", 4)]
    params.append(("head.weight", (16, 8), "float32", 4))
    cfg = sim_config(2, zero_optimization={"stage": 3})

    def layout(fsdp: bool) -> StageLayout:
        spec = resolve(cfg, dp=2, elem_size=4).replace(
            gradient_accumulation_steps=1, micro_batch_size=2, bucket_numel=10**6,
            comm_dtype="float32")
        stage = StageLayout(TaskGraph(), 0, params=params, spec=spec, forward_flops=1e5,
                            gpu=True, act_bytes=0.0, send_bytes=0.0, recv_bytes=0.0, fsdp=fsdp)
        stage.build()
        return stage

    modules, blocks = layout(False), layout(True)
    # DeepSpeed: a unit per module, small ones kept whole; FSDP: a flat unit per block
    assert len(modules.segments) == 8
    assert [s.label for s in blocks.segments] == ["embed", names.layer(0), names.layer(1), "head"]
    assert all(b.partitioned for b in blocks.buckets)
    assert sorted(i for b in blocks.buckets for i in (s.index for s in b.slots)) == \
        list(range(len(params)))
    # each forward use starts the next unit's gather, never two ahead
    assert blocks.uses is not None
    forward = blocks.trace[:len(blocks.segments)]
    launched_at = {}
    for pos, launched in enumerate(blocks.uses.launched[:len(forward)]):
        for unit in launched:
            launched_at.setdefault(unit, pos)
    assert [launched_at[u] for u in forward] == [0, 0, 1, 2]


def test_a_blocking_send_holds_the_stage_until_it_completes() -> None:
    cfg = sim_config(1, gradient_accumulation_steps=4)
    work = tiny_workload()

    def lay_out_pipeline(blocking: bool) -> tuple[Any, ...]:
        graph = TaskGraph()
        for s in range(2):
            spec = resolve(cfg, dp=1, pp=2, elem_size=4).replace(
                gradient_accumulation_steps=4, micro_batch_size=2, bucket_numel=16,
                comm_dtype="float32")
            StageLayout(graph, s, params=[work.params[2 * s]], spec=spec, forward_flops=1e5,
                        gpu=True, act_bytes=8.0, send_bytes=8.0, recv_bytes=8.0,
                        blocking_p2p=blocking).build()
        return graph.resolve()

    for blocking in (False, True):
        tasks = lay_out_pipeline(blocking)
        sends = {i for i, t in enumerate(tasks) if t.stage == 0 and t.kind == "send"}
        waits = [t for t in tasks if t.stage == 0 and t.kind in ("forward", "backward")
                 and sends & set(t.deps)]
        # blocking: each of stage 0's four sends holds the pass after it; otherwise none does
        assert len(waits) == (len(sends) if blocking else 0) and len(sends) == 4
