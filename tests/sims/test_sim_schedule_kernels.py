"""The compiled list scheduler and interval sums (``sims.schedule_kernels``, behind
``sims.executor.execute`` and ``step_figures``) against the plain-Python reference executor
they replace where collectives run at their own speed: the same start and end of every task,
to the last bit, on random task graphs full of ties and on real pipeline, interleaved and
ZeRO-3 plans; and a step laid out once and priced on other hardware is the step built there."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from sims.executor import (
    SimTask,
    Timeline,
    execute,
    execute_reference,
    step_figures,
    step_figures_reference,
)
from sims.planner import build_plan, lay_out
from sims.task_table import TaskTable
from sims.workload import Workload

RESOURCES = ("compute", "comm:dp", "comm:tp", "comm:pp", "copy:h2d", "host", "other")


def random_tasks(rng: random.Random, n: int, stages: int) -> list[SimTask]:
    """A random DAG whose durations collide often (ties at an instant, zero-length tasks)."""
    out = []
    for i in range(n):
        deps = tuple(sorted(rng.sample(range(i), min(i, rng.randint(0, 3)))))
        resource = rng.choice(RESOURCES)
        duration = rng.choice([0.0, 0.25, 0.5, 1.0, 1.0, 2.0, rng.random()])
        out.append(SimTask(f"t{i}", rng.choice(("forward", "backward", "tp", "send")), resource,
                           duration, deps, rng.randrange(stages),
                           collective=resource.startswith("comm:") or rng.random() < 0.05,
                           interference=rng.choice((None, None, 0.0, 0.3, 1.0))))
    return out


def assert_same(fast: Timeline, reference: Timeline) -> None:
    assert fast.start == reference.start
    assert fast.end == reference.end
    assert fast.planned == reference.planned
    assert [(t.name, t.resource, t.stage, t.duration) for t in fast.tasks] == \
        [(t.name, t.resource, t.stage, t.duration) for t in reference.tasks]
    assert step_figures(fast) == step_figures_reference(reference)


def test_random_graphs_run_as_the_reference_runs_them() -> None:
    rng = random.Random(20240611)
    for _ in range(200):
        tasks = random_tasks(rng, rng.randint(0, 60), rng.randint(1, 3))
        interference = rng.choice((0.0, 0.25, 0.5, 1.0))
        fast = execute(tasks, interference=interference)
        assert isinstance(fast.tasks, TaskTable)
        assert_same(fast, execute_reference(tasks, interference=interference))
        # the figures of a timeline of plain tasks, as the reference executor returns it
        reference = execute_reference(tasks, interference=interference)
        assert step_figures(reference) == step_figures_reference(reference)


def test_stretched_collectives_are_run_by_the_reference() -> None:
    tasks = [SimTask("reduce", "reduce", "comm:dp", 2.0, collective=True),
             SimTask("fwd", "forward", "compute", 1.0)]
    timeline = execute(tasks, slowdown=2.0)
    assert not isinstance(timeline.tasks, TaskTable)
    # 1 s at half speed beside the forward, then 1.5 s alone
    assert timeline.end == execute_reference(tasks, slowdown=2.0).end == (2.5, 1.0)


def test_refusals_name_the_same_task() -> None:
    cases = [
        [SimTask("a", "x", "compute", 1.0, (1,)), SimTask("b", "x", "compute", 1.0, (0,))],
        [SimTask("a", "x", "compute", 1.0), SimTask("b", "x", "compute", -1.0)],
        [SimTask("a", "x", "compute", 1.0), SimTask("b", "x", "compute", 1.0, (1,))],
        [SimTask("a", "x", "compute", 1.0, (7,)), SimTask("b", "x", "compute", -2.0)],
        [SimTask("r", "x", "comm:dp", 1.0, collective=True, interference=1.5)],
    ]
    for tasks in cases:
        with pytest.raises(ValueError) as reference:
            execute_reference(tasks)
        with pytest.raises(ValueError, match=str(reference.value).replace("(", r"\(")
                           .replace(")", r"\)").replace(".", r"\.")):
            execute(tasks)


# -- real plans --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def published() -> Any:
    import sim_published

    return {r["id"]: r for r in sim_published.load_runs()}, sim_published


@pytest.mark.parametrize("run_id", [
    "mlm24-119b",  # 1F1B, ZeRO-1, 4 stages
    "tt-l31-405b-512gpu-3d-fp8-interleaved",  # interleaved, ZeRO-3 over a pipeline
    "lf-mpt7b-h100-8",  # ZeRO-3 gathers and per-micro-batch reduce-scatters
    "nemo2407-llama3-8b-8gpu",  # context parallel, data parallel only
])
def test_published_plans_run_as_the_reference_runs_them(published: Any, run_id: str) -> None:
    runs, module = published
    model, cfg, layout, hw, options = module.prepare(runs[run_id])
    work = Workload.from_model(model, cfg.precision)
    step = lay_out(work, cfg, layout, hw, options)
    for kernels in (hw.kernels, *hw.kernels.bounds()):
        other = dataclasses.replace(hw, kernels=kernels)
        plan = step.price(other)
        # priced on the laid-out step, or built from scratch there: the same tasks
        built = build_plan(work, cfg, layout, other, options)
        assert list(plan.tasks) == list(built.tasks)
        fast = execute(plan.tasks, interference=plan.interference)
        assert_same(fast, execute_reference(list(plan.tasks), interference=plan.interference))
