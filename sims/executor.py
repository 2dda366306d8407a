"""Discrete-event execution of a step's task graph in virtual time, and the figures read off the
resulting timeline (step time, busy time per resource, exposed communication, pipeline bubble).

Each resource (per pipeline stage: ``compute``, ``comm:dp``, ``comm:tp``, ``comm:pp``,
``copy:h2d``, ``copy:d2h``, ``host``) runs one task at a time; when it frees, it starts the ready
task that comes first in plan order. Data-parallel and tensor-parallel ranks do the same work at
the same time, so one representative rank per pipeline stage stands for all of them and a
1,024-rank step costs about what an 8-rank one does.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from sims.task_table import INTERFERENCE_KIND, SimTask, TaskTable

RESOURCES = ("compute", "comm:dp", "comm:tp", "comm:pp", "copy:h2d", "copy:d2h", "host")
# Resources whose busy time is useful work rather than data movement: communication that runs
# while one of these is busy is hidden; the rest is exposed.
WORK_RESOURCES = ("compute", "host")
# Task kinds that make up forward and backward passes (with their blocking TP all-reduces);
# whatever else a stage's compute does not do inside the pipeline window counts as bubble.
PASS_KINDS = ("forward", "backward", "tp")


@dataclass(frozen=True)
class Timeline:
    """Where every task ran: ``start[i]``/``end[i]`` belong to ``tasks[i]``. Tasks past the
    plan's own (``planned`` of them) are the compute time that collectives took on CPU hosts."""

    tasks: Sequence[SimTask]  # a tuple, or a TaskTable read task by task on demand
    start: tuple[float, ...]
    end: tuple[float, ...]
    planned: int

    @property
    def step_time(self) -> float:
        return max(self.end, default=0.0)

    @property
    def stages(self) -> int:
        if isinstance(self.tasks, TaskTable):
            return self.tasks.stage_count()
        return 1 + max((t.stage for t in self.tasks), default=0)

    def spans(self) -> list[tuple[SimTask, float, float]]:
        return list(zip(self.tasks, self.start, self.end))


@dataclass(frozen=True)
class StepFigures:
    """The figures of one simulated step, per representative rank (averaged over stages)."""

    step_time: float
    resource_seconds: dict[str, float]  # busy seconds per resource name
    comm_seconds: float  # time with any communication or copy in flight
    exposed_comm_seconds: float  # ... of which no compute or host work ran alongside
    overlap_pct: float | None  # share of communication time hidden behind work (None: no comm)
    bubble_pct: float  # pipeline stages' idle share of the forward/backward window (0 when pp=1)
    per_stage_busy: tuple[dict[str, float], ...] = field(default=())


def execute(tasks: Sequence[SimTask], *, interference: float = 0.0,
            slowdown: float = 1.0) -> Timeline:
    """Runs ``tasks`` in virtual time and returns where each ran.

    ``interference`` (a CPU host's ``comm_compute_interference``, a GPU's overlap slowdown):
    every collective also puts that fraction of its duration (its own ``interference`` when
    set) on its stage's compute resource, as a task that becomes ready when the collective
    starts and ranks right behind it in plan order.

    ``slowdown`` (a CPU host's ``compute_comm_slowdown``): the other side of sharing the cores.
    While its stage's compute runs (anything but the collectives' own interference tasks), a
    collective progresses at 1 / ``slowdown`` (its own ``slowdown`` when set) of its speed
    alone; its duration is its time alone.

    Where no collective is slowed so (GPU profiles), the schedule is fixed once each task
    starts, and a compiled list scheduler (``sims.schedule_kernels``) runs it over the task
    table's arrays, with the same rules and results as ``execute_reference``, which runs the
    rest.
    """
    _check_factors(interference, slowdown)
    if isinstance(tasks, TaskTable) and not len(tasks.companions):
        table = tasks
        _check_table(table)
    else:
        given = tuple(tasks)
        for i, task in enumerate(given):
            _check_task(i, task, len(given))
        table = TaskTable.from_tasks(given)
    columns, durations = table.columns, table.durations
    factor = np.where(np.isnan(table.slowdown), slowdown, table.slowdown)
    if np.any(columns.collective & (durations > 0) & (factor > 1.0)):
        return execute_reference(table, interference=interference, slowdown=slowdown)
    return _execute_fixed(table, interference)


def _check_factors(interference: float, slowdown: float) -> None:
    if not 0.0 <= interference <= 1.0:
        raise ValueError(f"interference must be a fraction from 0 to 1, got {interference!r}")
    if not slowdown >= 1.0:
        raise ValueError(f"slowdown must be a factor of at least 1, got {slowdown!r}")


def _check_task(i: int, task: SimTask, n: int) -> None:
    if task.duration < 0:
        raise ValueError(f"task {task.name!r} has a negative duration {task.duration!r}")
    if task.interference is not None and not 0.0 <= task.interference <= 1.0:
        raise ValueError(f"task {task.name!r} has interference {task.interference!r}; it "
                         f"must be a fraction from 0 to 1")
    if task.slowdown is not None and not task.slowdown >= 1.0:
        raise ValueError(f"task {task.name!r} has slowdown {task.slowdown!r}; it must be a "
                         f"factor of at least 1")
    for d in task.deps:
        if not 0 <= d < n or d == i:
            raise ValueError(f"task {task.name!r} depends on index {d}, which is not another "
                             f"task of the plan (0..{n - 1})")


def _check_table(table: TaskTable) -> None:
    """``_check_task`` over the table's arrays; the first task that fails it is named."""
    n = table.planned
    own, slowed = table.interference, table.slowdown
    bad = [np.flatnonzero(table.durations < 0)[:1],
           np.flatnonzero(~np.isnan(own) & ~((own >= 0.0) & (own <= 1.0)))[:1],
           np.flatnonzero(~np.isnan(slowed) & ~(slowed >= 1.0))[:1],
           table.columns.bad_dependency()]
    found = np.concatenate(bad)
    if len(found):
        i = int(found.min())
        _check_task(i, table[i], n)


def _row_resources(table: TaskTable) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """Each row's resource id (companions on their stage's compute), ids numbered in order of
    first use, and the (stage, resource) of each."""
    planned, keys = table.columns.resource_ids()
    if not len(table.companions):
        return planned, keys
    keys = list(keys)
    ids = {key: rid for rid, key in enumerate(keys)}
    stages = table.columns.stages[table.companions]
    compute = np.zeros(int(stages.max()) + 1, dtype=np.int64)
    for s in dict.fromkeys(stages.tolist()):  # in order of first use
        if (s, "compute") not in ids:
            ids[(s, "compute")] = len(keys)
            keys.append((s, "compute"))
        compute[s] = ids[(s, "compute")]
    return np.concatenate([planned, compute[stages]]), keys


def _execute_fixed(table: TaskTable, interference: float) -> Timeline:
    """``execute`` where every task runs at its own speed: the compiled list scheduler."""
    from sims.schedule_kernels import list_schedule

    columns, durations = table.columns, table.durations
    n = table.planned
    share = np.where(np.isnan(table.interference), interference, table.interference)
    parents = np.flatnonzero(columns.collective & (durations > 0) & (share > 0))
    table = table.with_companions(parents, durations[parents] * share[parents])
    total = len(table)
    resource, keys = _row_resources(table)
    priority = np.concatenate([2 * np.arange(n, dtype=np.int64), 2 * parents + 1])
    companion = np.full(total, -1, dtype=np.int64)
    companion[parents] = n + np.arange(len(parents), dtype=np.int64)
    offsets, children = columns.children()
    child_start = np.concatenate([offsets, np.full(total - n, offsets[-1], dtype=np.int64)])
    waiting = np.concatenate([columns.edges()[0], np.zeros(total - n, dtype=np.int64)])
    is_compute = np.array([r == "compute" for _, r in keys], dtype=np.bool_)
    start, end, finished, done = list_schedule(
        np.concatenate([durations, table.companion_durations]), resource, priority,
        child_start, children, waiting, companion, is_compute, len(keys), n)
    if done != total:
        _refuse_cycle(table, total - int(done), waiting, finished)
    return Timeline(table, tuple(start.tolist()), tuple(end.tolist()), n)


def _refuse_cycle(tasks: Sequence[SimTask], left: int, waiting: Sequence[int] | np.ndarray,
                  finished: Sequence[bool] | np.ndarray) -> None:
    stuck = next(i for i in range(len(tasks)) if waiting[i] > 0)
    blocker = next(d for d in tasks[stuck].deps if not finished[d])
    raise ValueError(f"the plan's dependencies form a cycle: {left} tasks never became ready, "
                     f"e.g. {tasks[stuck].name!r} (stage {tasks[stuck].stage}) waits for "
                     f"{tasks[blocker].name!r}")


def execute_reference(tasks: Sequence[SimTask], *, interference: float = 0.0,
                      slowdown: float = 1.0) -> Timeline:
    """``execute`` in plain Python, event by event: the reference semantics, and the executor
    of steps whose collectives slow down while their stage computes (a CPU host's).

    Each resource runs one task at a time. At each instant every task that ends then finishes
    first; then each free resource starts its ready task that comes first in plan order (a
    collective's interference task right behind the collective), compute resources choosing
    after the others so that the interference of a collective starting then is among their
    choices."""
    _check_factors(interference, slowdown)
    all_tasks = list(tasks)
    n = len(all_tasks)
    for i, task in enumerate(all_tasks):
        _check_task(i, task, n)
    # Collectives slowed while their stage computes: index -> factor.
    stretch = {i: f for i, t in enumerate(all_tasks) if t.collective and t.duration > 0
               for f in [slowdown if t.slowdown is None else t.slowdown] if f > 1.0}

    # Companion compute tasks for collective interference, made ready when their collective starts.
    companion: dict[int, int] = {}
    for i in range(n):
        task = all_tasks[i]
        share = interference if task.interference is None else task.interference
        if task.collective and task.duration > 0 and share > 0:
            companion[i] = len(all_tasks)
            all_tasks.append(SimTask(f"{INTERFERENCE_KIND}/{task.name}", INTERFERENCE_KIND,
                                     "compute", task.duration * share, (), task.stage))
    total = len(all_tasks)

    # Resource ids, and each task's priority key: plan order, companions right behind theirs.
    resource_id: dict[tuple[int, str], int] = {}
    res_of = [0] * total
    for i, task in enumerate(all_tasks):
        key = (task.stage, task.resource)
        rid = resource_id.get(key)
        if rid is None:
            rid = resource_id[key] = len(resource_id)
        res_of[i] = rid
    priority = [2 * i for i in range(total)]
    for i, c in companion.items():
        priority[c] = 2 * i + 1

    waiting = [len(t.deps) for t in all_tasks]
    children: list[list[int]] = [[] for _ in range(total)]
    for i in range(n):
        for d in all_tasks[i].deps:
            children[d].append(i)
    ready: list[list[tuple[int, int]]] = [[] for _ in resource_id]
    busy = [False] * len(resource_id)
    # Compute picks its next task last at each instant, so that the interference of a collective
    # starting at the same time is among its choices.
    is_compute = [False] * len(resource_id)
    for (_, resource), rid in resource_id.items():
        is_compute[rid] = resource == "compute"
    start = [0.0] * total
    end = [0.0] * total
    finished = [False] * total
    done = 0
    # (time, task, version): a stretched collective's end moves when its stage's compute
    # starts or stops, and the events of its earlier versions are skipped
    events: list[tuple[float, int, int]] = []
    dirty: set[int] = set()
    durations = [t.duration for t in all_tasks]
    version = [0] * total
    running = [-1] * len(resource_id)  # the task each resource runs
    compute_of = {stage: rid for (stage, resource), rid in resource_id.items()
                  if resource == "compute"}
    # stretched collectives in flight per stage: task -> [work left (s alone), rate, since]
    in_flight: dict[int, dict[int, list[float]]] = {}
    touched: set[int] = set()  # stages whose compute or stretched collectives changed

    def computing(stage: int) -> bool:
        rid = compute_of.get(stage)
        return rid is not None and busy[rid] and \
            all_tasks[running[rid]].kind != INTERFERENCE_KIND

    def retime(stage: int) -> None:
        flights = in_flight.get(stage)
        if not flights:
            return
        busy_now = computing(stage)
        for i, f in flights.items():
            rate = 1.0 / stretch[i] if busy_now else 1.0
            if f[1] == rate:
                continue
            f[0] = max(0.0, f[0] - (now - f[2]) * f[1])
            f[1], f[2] = rate, now
            version[i] += 1
            heapq.heappush(events, (now + f[0] / rate, i, version[i]))

    for i in range(n):
        if waiting[i] == 0:
            heapq.heappush(ready[res_of[i]], (priority[i], i))
            dirty.add(res_of[i])

    now = 0.0
    while True:
        for phase in (False, True):
            for rid in sorted(r for r in dirty if is_compute[r] == phase):
                if busy[rid] or not ready[rid]:
                    continue
                _, i = heapq.heappop(ready[rid])
                busy[rid] = True
                running[rid] = i
                start[i] = now
                end[i] = now + durations[i]
                if i in stretch:
                    # timed by retime below, once this instant's compute is chosen
                    in_flight.setdefault(all_tasks[i].stage, {})[i] = [durations[i], 0.0, now]
                    touched.add(all_tasks[i].stage)
                else:
                    heapq.heappush(events, (end[i], i, 0))
                if is_compute[rid] and stretch:
                    touched.add(all_tasks[i].stage)
                partner = companion.get(i)
                if partner is not None:
                    heapq.heappush(ready[res_of[partner]], (priority[partner], partner))
                    dirty.add(res_of[partner])
        dirty.clear()
        for stage in touched:
            retime(stage)
        touched.clear()
        if not events:
            break
        # Every task that ends at this instant finishes before anything new is chosen, so the
        # choice sees all tasks that are ready at this time.
        now = events[0][0]
        while events and events[0][0] == now:
            _, i, v = heapq.heappop(events)
            if v != version[i] or finished[i]:
                continue  # a stretched collective's end that has moved since
            finished[i] = True
            done += 1
            end[i] = now
            rid = res_of[i]
            busy[rid] = False
            if i in stretch:
                del in_flight[all_tasks[i].stage][i]
            elif is_compute[rid] and stretch:
                touched.add(all_tasks[i].stage)
            dirty.add(rid)
            for child in children[i]:
                waiting[child] -= 1
                if waiting[child] == 0:
                    heapq.heappush(ready[res_of[child]], (priority[child], child))
                    dirty.add(res_of[child])
    if done != total:
        _refuse_cycle(all_tasks, total - done, waiting, finished)
    return Timeline(tuple(all_tasks), tuple(start), tuple(end), n)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            if b > out[-1][1]:
                out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _intersection(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """Length of the overlap of two sorted lists of disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        lo = max(xs[i][0], ys[j][0])
        hi = min(xs[i][1], ys[j][1])
        if hi > lo:
            total += hi - lo
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def step_figures(timeline: Timeline) -> StepFigures:
    """Reads a timeline's figures. Communication is anything on a ``comm:*`` or ``copy:*``
    resource; it is exposed where no ``compute`` or ``host`` task of the same stage runs beside
    it. The bubble (pipelines only) is the stages' mean idle share of the window from the step's
    start to the last backward anywhere, counting forward/backward compute and its blocking TP
    all-reduces as busy; with equal stage times and free communication it is (p-1)/(m+p-1).
    The interval sums run compiled (``sims.schedule_kernels``), in the order of
    ``step_figures_reference``, which they equal."""
    from sims.schedule_kernels import interval_figures

    tasks = timeline.tasks
    table = tasks if isinstance(tasks, TaskTable) else TaskTable.from_tasks(tasks)
    stages = timeline.stages
    resource, keys = _row_resources(table)
    category = np.array([1 if r.startswith(("comm:", "copy:")) else
                         2 if r in WORK_RESOURCES else 0 for _, r in keys], dtype=np.int8)
    is_pass = np.concatenate([table.columns.kind_mask(PASS_KINDS),
                              np.zeros(len(table.companions), dtype=np.bool_)])
    start = np.array(timeline.start, dtype=np.float64)
    stage = table.stage_array()
    busy_s, comm_s, exposed_s, passes_s, window = interval_figures(
        start, np.array(timeline.end, dtype=np.float64), stage, resource, category, is_pass,
        np.lexsort((start, stage)), stages, len(keys))
    busy: list[dict[str, float]] = [{} for _ in range(stages)]
    for (s, r), seconds in zip(keys, busy_s.tolist()):
        busy[s][r] = seconds
    comm_total = exposed_total = idle_share = 0.0
    for comm, exposed, passes in zip(comm_s.tolist(), exposed_s.tolist(), passes_s.tolist()):
        comm_total += comm
        exposed_total += exposed
        if window > 0:
            idle_share += 1.0 - passes / window
    return _figures(timeline.step_time, busy, comm_total, exposed_total, idle_share)


def step_figures_reference(timeline: Timeline) -> StepFigures:
    """``step_figures`` in plain Python, interval list by interval list."""
    stages = timeline.stages
    busy: list[dict[str, float]] = [{} for _ in range(stages)]
    comm: list[list[tuple[float, float]]] = [[] for _ in range(stages)]
    work: list[list[tuple[float, float]]] = [[] for _ in range(stages)]
    passes: list[list[tuple[float, float]]] = [[] for _ in range(stages)]
    window = 0.0
    for task, a, b in zip(timeline.tasks, timeline.start, timeline.end):
        s = task.stage
        busy[s][task.resource] = busy[s].get(task.resource, 0.0) + (b - a)
        if task.resource.startswith(("comm:", "copy:")):
            comm[s].append((a, b))
        elif task.resource in WORK_RESOURCES:
            work[s].append((a, b))
        if task.kind in PASS_KINDS:
            passes[s].append((a, b))
            window = max(window, b)
    comm_total = exposed_total = 0.0
    idle_share = 0.0
    for s in range(stages):
        c = _union(comm[s])
        length = _length(c)
        comm_total += length
        exposed_total += length - _intersection(c, _union(work[s]))
        if window > 0:
            idle_share += 1.0 - _length(_union(passes[s])) / window
    return _figures(timeline.step_time, busy, comm_total, exposed_total, idle_share)


def _figures(step_time: float, busy: list[dict[str, float]], comm_total: float,
             exposed_total: float, idle_share: float) -> StepFigures:
    stages = len(busy)
    names = sorted({r for d in busy for r in d}, key=_resource_order)
    mean_busy = {r: sum(d.get(r, 0.0) for d in busy) / stages for r in names}
    comm_mean, exposed_mean = comm_total / stages, exposed_total / stages
    overlap = None if comm_mean <= 0 else 100.0 * (1.0 - exposed_mean / comm_mean)
    bubble = 100.0 * idle_share / stages if stages > 1 else 0.0
    return StepFigures(step_time, mean_busy, comm_mean, exposed_mean, overlap, bubble,
                       tuple(busy))


def _resource_order(name: str) -> tuple[int, str]:
    return (RESOURCES.index(name) if name in RESOURCES else len(RESOURCES), name)
