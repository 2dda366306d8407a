"""Prices a laid-out step (``sims.graph``): each task's seconds from its stage's costs
(``sims.stage_costs``), giving the task list the executor (``sims.executor``) runs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sims import costs
from sims.graph import OVERHEADS, GraphColumns, GraphTask, bare_pipeline
from sims.stage_costs import StageCosts
from sims.task_table import SimTask, TaskColumns, TaskTable, first_use_ids


def task_seconds(task: GraphTask, stage: StageCosts) -> tuple[float, float | None, float | None]:
    """``task``'s seconds, and its interference and slowdown where they differ from the plan's
    (a reduce over the shared-memory channel)."""
    match task.cost:
        case "forward" | "backward":
            return stage.pass_seconds(task.cost, task.arg), None, None
        case "send":
            return stage.send_seconds(task.nbytes, task.arg), None, None
        case "reduce":
            return stage.reduce_seconds(task.nbytes)
        case "all_gather":
            return stage.collective("all_gather", task.nbytes), None, None
        case "tp":
            return stage.tp_seconds("forward" if task.arg == 0 else "backward"), None, None
        case "copy":
            return costs.copy_seconds(task.nbytes, stage.hw), None, None
        case "optimizer":
            return stage.optimizer_seconds(task.arg), None, None
        case "host_optimizer":
            return costs.optimizer_seconds(task.arg, stage.hw, on_host=True), None, None
        case which if which in OVERHEADS:
            overheads = stage.overheads()
            if which not in overheads:
                raise ValueError(f"task {task.name!r} of stage {task.stage} is the engine "
                                 f"overhead {which!r}, which these costs do not model as a "
                                 f"task (modelled: {sorted(overheads) or 'none'})")
            return overheads[which], None, None
    raise ValueError(f"task {task.name!r} has unknown cost {task.cost!r}")


def price(graph: Sequence[GraphTask], stages: Sequence[StageCosts]) -> tuple[SimTask, ...]:
    """The executor's tasks: ``graph`` with each task's time from ``stages[task.stage]``."""
    out = []
    for t in graph:
        seconds, interference, slowdown = task_seconds(t, stages[t.stage])
        out.append(SimTask(t.name, t.kind, t.resource, seconds * t.repeat, t.deps, t.stage,
                           t.flops,
                           t.nbytes, t.resource.startswith("comm:"), interference, slowdown))
    return tuple(out)


class PricedColumns:
    """A laid-out graph read for pricing, once for every pricing of it: the executor's task
    columns, and each task's price key (tasks of one stage with the same cost, argument and
    size cost the same), so that each key is priced once."""

    def __init__(self, graph: GraphColumns) -> None:
        self.graph = graph
        self.tasks = TaskColumns(graph.names, graph.kinds, graph.resources, graph.stages,
                                 graph.deps, graph.flops, graph.nbytes)
        # keys numbered as they first occur, with the first task of each
        key_of, first = first_use_ids(graph.stages, graph.costs, graph.args, graph.nbytes)
        self.key_of, self.first = key_of, first.tolist()
        self.repeats = np.array(graph.repeats, dtype=np.int64)

    def price(self, stages: Sequence[StageCosts]) -> TaskTable:
        """What ``price`` makes of the graph, as a task table."""
        nan = float("nan")
        seconds, shares, slowed = [], [], []
        for i in self.first:
            task = self.graph.task(i)
            s, share, slow = task_seconds(task, stages[task.stage])
            seconds.append(s)
            shares.append(nan if share is None else share)
            slowed.append(nan if slow is None else slow)
        key_of = self.key_of
        durations = np.array(seconds, dtype=np.float64)[key_of] * self.repeats
        return TaskTable(self.tasks, durations, np.array(shares, dtype=np.float64)[key_of],
                         np.array(slowed, dtype=np.float64)[key_of])


def pipeline_tasks(stages: int, micro_batches: int, forward_s: float, backward_s: float,
                   send_s: float = 0.0) -> tuple[SimTask, ...]:
    """A bare 1F1B pipeline (equal stages, no data parallelism) priced with fixed pass and send
    times: the textbook schedule whose bubble is (p-1)/(m+p-1) when sends are free."""
    seconds = {"forward": forward_s, "backward": backward_s, "send": send_s}
    return tuple(SimTask(t.name, t.kind, t.resource, seconds[t.cost], t.deps, t.stage,
                         collective=t.resource.startswith("comm:"))
                 for t in bare_pipeline(stages, micro_batches))
