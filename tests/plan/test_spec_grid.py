"""One spec, two executors, over a grid: ZeRO 0-3 x ``reduce_scatter`` on/off x gradient
accumulation 1/2 x ``overlap_comm`` x optimizer offload, and pipeline and tensor parallelism of
2. At every point the step plan the training spec lays out (``flowtrain.plan.spec.plan_step``
over the engine's parameters and buckets) holds the same tasks, name for name and count for
count, as the plan ``flowtrain simulate`` builds for the same model and config. A sample of
the points is launched for real on 2 ranks: the spans each rank records are those tasks too,
and the reduces of ``flowtrain simulate --config ... --trace`` are the run's reduces."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from flowtrain.cli import main as cli_main
from flowtrain.config import load_config
from flowtrain.engine.parts import EngineParts
from flowtrain.engine.strategy import param_groups, stage3_buckets
from flowtrain.plan import StepPlan, names
from flowtrain.plan.spec import TrainingSpec, plan_step, resolve
from flowtrain.plan.stage3 import stage3_uses
from helpers import DATA, launch
from sims.compare import read_run
from sims.hardware import get_profile
from sims.planner import SimPlan, build_plan
from sims.workload import Layout, Workload
from spec_grid_model import GRID, SEQ, Point, config, factory, key

WORKER = DATA / "spec_grid_worker.py"
# launched for real: ZeRO-2 with reduce_scatter false and accumulation 2 (once a step, by
# all-reduce), its reduce-scattering twin (every micro-batch), and one point of each other
# stage, offload among them
LAUNCHED = [(2, False, 2, True, False), (2, True, 2, False, False), (0, True, 2, False, False),
            (1, True, 2, True, False), (3, True, 2, True, False), (2, True, 1, False, True)]


def param_specs(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...], str, int]]:
    """The engine's record of its trainable parameters (FlowtrainEngine._param_specs)."""
    return [(n, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.element_size())
            for n, p in model.named_parameters() if p.requires_grad]


def spec_plan(spec: TrainingSpec, cfg: Any, stage: int = 0,
              params: list[tuple[str, tuple[int, ...], str, int]] | None = None) -> StepPlan:
    """The plan the spec lays out for a rank of pipeline stage ``stage``, with the buckets the
    engine builds: ZeRO-3's a unit per module (``stage3_buckets``), gathered as the engine's
    fetcher replays one micro-batch's uses."""
    model = factory()
    trainable = [p for p in model.parameters() if p.requires_grad]
    specs = params if params is not None else param_specs(model)
    optimizer = torch.optim.Adam(trainable)
    groups = param_groups(optimizer, trainable) if spec.zero_stage and params is None else None
    # ZeRO ranks of one host keeping its one copy of the parameters in shared memory read it
    # where they are: no gathers (ZeroOptimizer.share_params)
    shared = spec.shares_host_params(shm_channel=spec.host.data_channel == "shm")
    if spec.zero_stage != 3 or spec.dp == 1:
        return plan_step(spec, specs, groups=groups, stage=stage)
    parts = EngineParts(spec=spec, module=model, trainable=trainable,
                        param_specs=specs, grid=None, dp_group=None, world_size=spec.dp,
                        dp_rank=0, model_parallel=False, spawn=lambda actor: None)
    buckets = stage3_buckets(parts, groups)
    if shared:
        return plan_step(spec, specs, groups=groups, buckets=buckets, stage=stage)
    order = [b.index for b in buckets if b.partitioned]
    trace = order + order[::-1]
    uses = stage3_uses(trace, {b.index: b.numel for b in buckets},
                       prefetch_numel=spec.stage3.prefetch_numel,
                       max_live_numel=spec.stage3.max_live_numel,
                       max_reuse_distance=spec.stage3.max_reuse_distance)
    return plan_step(spec, specs, groups=groups, buckets=buckets, stage=stage,
                     stage3=(uses, trace))


def simulated(cfg: Any, layout: Layout) -> SimPlan:
    """The plan `flowtrain simulate --config` lays out for the grid's model (as a launched
    run's plan.json describes it)."""
    work = Workload.from_run({"param_specs": [list(p) for p in param_specs(factory())],
                              "forward_flops_per_micro_batch": 1e6, "config": {}},
                             cfg.train_micro_batch_size_per_gpu, name="grid")
    return build_plan(work, cfg, layout, get_profile("h100-x8"))


def counted(plan: StepPlan) -> collections.Counter[str]:
    return collections.Counter(plan.task_names())


def timed(plan: StepPlan) -> collections.Counter[str]:
    """The plan's tasks that an executor times: all but its waits (a receive, the wait for
    the reduces), which are what is left between the others."""
    return collections.Counter(t.name for t in plan.tasks if t.kind not in ("recv", "wait"))


def priced(sim: SimPlan, stage: int) -> collections.Counter[str]:
    """The plan tasks that the simulator's priced tasks of ``stage`` belong to (it cuts a pass
    into pieces named below it), each once: plan task names are unique in a step."""
    return collections.Counter({n for t in sim.tasks if t.stage == stage
                                for n in [names.plan_task_of(t.name)] if n is not None})


def differ(a: collections.Counter[str], b: collections.Counter[str]) -> str:
    return f"only in the first {sorted(a - b)}; only in the second {sorted(b - a)}"


@pytest.mark.parametrize("point", GRID, ids=key)
def test_the_spec_and_the_simulator_lay_out_the_same_step(point: Point) -> None:
    cfg = load_config(config(point), world_size=2)
    spec = resolve(cfg, dp=2, elem_size=4)
    mine = spec_plan(spec, cfg)
    sim = simulated(cfg, Layout(1, 2))
    assert counted(mine) == counted(sim.step_plans[0]), \
        differ(counted(mine), counted(sim.step_plans[0]))
    # and the tasks it prices are those tasks
    assert timed(mine) == priced(sim, 0), differ(timed(mine), priced(sim, 0))
    mine = counted(mine)
    # ZeRO 2-3 keeping a gradient shard reduce every micro-batch (named for it when there are
    # several), everything else once a step; reduce_scatter false keeps stage 2 whole
    stage, scatter, accumulation, _, _ = point
    every = stage == 3 or (stage == 2 and scatter)
    reduces = [n for n in mine if names.task_class(n) == "reduce"]
    assert reduces
    micro_batches = {names.micro_batch_of(n) for n in reduces}
    assert micro_batches == (set(range(accumulation)) if every and accumulation > 1 else {None})


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_model_parallel_points_lay_out_the_same_step(stage: int, tp: int, pp: int) -> None:
    raw = config((stage, True, 4, False, False))
    if tp > 1:
        raw["tensor_parallel"] = {"tp_size": tp}
    cfg = load_config(raw, world_size=2)
    layout = Layout(1, 2 * tp * pp, tp, pp)
    sim = simulated(cfg, layout)
    spec = resolve(cfg, dp=layout.dp, tp=tp, pp=pp, elem_size=4)
    assert len(sim.stages) == pp
    for s, laid in enumerate(sim.stages):
        # the stage's parameters as its ranks hold them (tensor-parallel shards)
        mine = spec_plan(spec, cfg, stage=s, params=list(laid.params))
        assert counted(mine) == counted(laid.step_plan), \
            differ(counted(mine), counted(laid.step_plan))
        assert timed(mine) == priced(sim, s), differ(timed(mine), priced(sim, s))


def test_zero2_without_reduce_scatter_reduces_once_a_step() -> None:
    cfg = load_config(config((2, False, 2, False, False)), world_size=2)
    spec = resolve(cfg, dp=2, elem_size=4)
    assert spec.reduction.op == "all_reduce" and not spec.reduction.every_micro_batch
    plan = simulated(cfg, Layout(1, 2)).step_plans[0]
    reduces = [n for n in plan.task_names() if names.task_class(n) == "reduce"]
    assert reduces and {names.micro_batch_of(n) for n in reduces} == {None}
    assert len(reduces) == len(plan.buckets)


# -- launched -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("grid") / "run"
    launch(2, WORKER, *(key(p) for p in LAUNCHED), run_dir=base, timeout=300)
    return base


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("point", LAUNCHED, ids=key)
def test_a_launched_run_records_the_spec_s_tasks(launched: Path, point: Point) -> None:
    record = read_run(launched / key(point))
    # the config as the run resolved it (its data channel: shared memory on one CPU host)
    cfg = load_config(record.plan["config"], world_size=2)
    spec = resolve(cfg, dp=2, elem_size=4)
    planned = counted(spec_plan(spec, cfg))
    if point[0] == 3:
        assert cfg.flowtrain.data_channel == "shm" and not any(
            names.task_class(n) == "gather" for n in planned)
    assert sorted(record.steps) == [0, 1]
    for rank, steps in record.steps.items():
        # the last step: the bucket order and ZeRO-3's prefetch trace are settled by then
        recorded = collections.Counter(name for name, _, _ in steps[-1])
        assert recorded == planned, f"rank {rank}: " + differ(recorded, planned)


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("point", [LAUNCHED[0], LAUNCHED[1]], ids=key)
def test_simulate_trace_lists_the_run_s_reduces(launched: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                point: Point) -> None:
    """`flowtrain simulate --config ... --trace` on the run's model and config: its reduce
    tasks are the ones each launched rank recorded."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(config(point)))
    trace = tmp_path / "trace.json"
    code = cli_main(["simulate", "--model", "spec_grid_model:factory", "--config", str(ds),
                     "--seq-len", str(SEQ), "--devices-per-node", "2", "--trace", str(trace)])
    out, err = capsys.readouterr()
    assert code == 0, err
    events = json.loads(trace.read_text())["traceEvents"]
    simulated_reduces = sorted(e["name"] for e in events
                               if e.get("ph") == "X" and names.task_class(e["name"]) == "reduce")
    record = read_run(launched / key(point))
    for rank, steps in record.steps.items():
        recorded = sorted(n for n, _, _ in steps[-1] if names.task_class(n) == "reduce")
        assert recorded == simulated_reduces, f"rank {rank}"
    if point == LAUNCHED[0]:  # reduce_scatter false: once a step, no micro-batch in the name
        assert all("/mb" not in n for n in simulated_reduces)
    else:
        assert {n.rsplit("/", 1)[-1] for n in simulated_reduces} == {"mb0", "mb1"}
