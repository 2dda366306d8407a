"""One plan, two executors: the spans a launched run records are, name for name, the tasks of
the step plan that ``flowtrain simulate`` builds for it with ``flowtrain.plan`` (data parallel,
ZeRO-3 with its per-micro-batch reduce-scatters and gathers, a 2-stage pipeline, the same
interleaved with two model chunks per stage, tensor x data parallel); and every task the
simulator prices belongs to one of those plan tasks."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest

from flowtrain.config import load_config
from flowtrain.plan import names
from flowtrain.plan.step_plan import StepPlan
from helpers import DATA, launch
from sims.compare import RunRecord, read_run
from sims.hardware import get_profile
from sims.planner import SimPlan, build_plan
from sims.workload import Layout, Workload

WORKER = DATA / "plan_names_worker.py"
# mode -> ranks launched, tensor-parallel size
MODES = {"dp": (2, 1), "zero3": (2, 1), "pipe": (2, 1), "interleaved": (2, 1), "tpdp": (4, 2)}

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]


def launch_run(mode: str, run_dir: Path) -> RunRecord:
    launch(MODES[mode][0], WORKER, mode, run_dir=run_dir, timeout=240)
    return read_run(run_dir)


def plan_of(record: RunRecord, mode: str) -> SimPlan:
    """The simulator's plan of the run, built as ``flowtrain simulate --compare`` builds it."""
    ranks, tp = MODES[mode]
    pp = len(record.stages) or 1
    layout = Layout(1, ranks, tp, pp)
    cfg = load_config(record.plan["config"], world_size=layout.dp, check_supported=False)
    micro_batch = cfg.train_micro_batch_size_per_gpu
    work = Workload.from_stages(record.stages, micro_batch) if record.stages else \
        Workload.from_run(record.plan, micro_batch)
    return build_plan(work, cfg, layout, get_profile("h100-x8"))


def stage_of_rank(rank: int, mode: str, record: RunRecord) -> int:
    """Ranks are numbered tensor-parallel fastest, then data parallel, then pipeline."""
    ranks, _ = MODES[mode]
    pp = len(record.stages) or 1
    return rank // (ranks // pp)


@pytest.fixture(scope="module", params=sorted(MODES))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> tuple[str, RunRecord, SimPlan]:
    mode = request.param
    record = launch_run(mode, tmp_path_factory.mktemp(mode) / "run")
    return mode, record, plan_of(record, mode)


def test_recorded_spans_are_the_plans_tasks(run: tuple[str, RunRecord, SimPlan]) -> None:
    mode, record, plan = run
    ranks, _ = MODES[mode]
    assert sorted(record.steps) == list(range(ranks))
    for rank, steps in record.steps.items():
        step_plan: StepPlan = plan.step_plans[stage_of_rank(rank, mode, record)]
        # the last step: the bucket order and ZeRO-3's prefetch trace are settled by then
        recorded = collections.Counter(name for name, _, _ in steps[-1])
        planned = collections.Counter(step_plan.task_names())
        assert recorded == planned, (
            f"{mode} rank {rank}: recorded but not planned {sorted(recorded - planned)}; "
            f"planned but not recorded {sorted(planned - recorded)}")


def test_the_simulated_tasks_refine_the_plan(run: tuple[str, RunRecord, SimPlan]) -> None:
    mode, _, plan = run
    for stage, step_plan in enumerate(plan.step_plans):
        planned = set(step_plan.task_names())
        priced = [t.name for t in plan.tasks if t.stage == stage]
        owners = {names.plan_task_of(n) for n in priced} - {None}
        assert owners <= planned, f"{mode} stage {stage}: {sorted(owners - planned)}"
        # every plan task the simulator can time is there (waits are what is left between)
        waits = {t.name for t in step_plan.tasks if t.kind in ("recv", "wait")}
        assert planned - waits <= owners, f"{mode} stage {stage}: {sorted(planned - owners)}"


def test_the_plan_is_the_one_the_engine_lays_its_buckets_by(
        run: tuple[str, RunRecord, SimPlan]) -> None:
    """A reduce span names a bucket of the engine's plan; the simulator planned the same
    buckets from the run's recorded parameters (data parallel ranks hold whole buckets)."""
    mode, record, plan = run
    recorded = {n for steps in record.steps.values() for n, _, _ in steps[-1]
                if names.task_class(n) == "reduce"}
    planned_buckets = {names.reduce(b.index) for sp in plan.step_plans for b in sp.buckets}
    assert {names.span_key(n) for n in recorded} <= planned_buckets
    if mode not in ("pipe", "interleaved"):
        assert len({names.span_key(n) for n in recorded}) == len(plan.step_plans[0].buckets) > 1
