"""The container of a step's task graph (``sims.graph`` lays the tasks out): each
task unpriced, with what decides its time, and the graph that collects every stage's tasks and
resolves their references to tasks of later stages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any


@dataclass(frozen=True, slots=True)
class GraphTask:
    """One task of a stage's step, unpriced: ``cost`` (one of ``sims.graph``'s
    ``COSTS`` or ``OVERHEADS``) and ``arg`` say what its time depends on."""

    name: str
    kind: str
    resource: str
    cost: str
    stage: int = 0
    deps: tuple[int, ...] = ()  # indices into the graph's task list
    flops: float = 0.0
    nbytes: float = 0.0
    arg: int = -1
    # the stage's model chunk (interleaved schedule) a pass or send belongs to; None otherwise
    chunk: int | None = None
    # how many times the cost is paid in a row (a pass's TP collectives, one set per layer)
    repeat: int = 1


@dataclass(frozen=True)
class GraphColumns:
    """A resolved graph's tasks as columns, one tuple per ``GraphTask`` field (``deps`` with
    each task's references to later stages' tasks resolved): what the simulator prices a step
    of hundreds of thousands of tasks from without a ``GraphTask`` per task."""

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    resources: tuple[str, ...]
    costs: tuple[str, ...]
    stages: tuple[int, ...]
    deps: tuple[tuple[int, ...], ...]
    flops: tuple[float, ...]
    nbytes: tuple[float, ...]
    args: tuple[int, ...]
    chunks: tuple[int | None, ...]
    repeats: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.names)

    def task(self, i: int) -> GraphTask:
        return GraphTask(self.names[i], self.kinds[i], self.resources[i], self.costs[i],
                         self.stages[i], self.deps[i], self.flops[i], self.nbytes[i],
                         self.args[i], self.chunks[i], self.repeats[i])

    def tasks(self) -> tuple[GraphTask, ...]:
        return tuple(map(GraphTask, self.names, self.kinds, self.resources, self.costs,
                         self.stages, self.deps, self.flops, self.nbytes, self.args,
                         self.chunks, self.repeats))


class TaskGraph:
    """Collects the tasks of every stage; dependencies on tasks of later stages are given by
    (stage, name) and resolved once every task exists. A task is kept as a row of
    ``GraphTask``'s fields until the graph is read."""

    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []
        self.index: dict[tuple[int, str], int] = {}
        self.forward_refs: list[tuple[int, tuple[int, str]]] = []

    @property
    def tasks(self) -> list[GraphTask]:
        """The tasks laid out so far (their references to later stages not resolved)."""
        return [GraphTask(*row) for row in self.rows]

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, stage: int, name: str, kind: str, resource: str, cost: str,
            deps: Sequence[int | None] = (), refs: Sequence[tuple[int, str]] = (), *,
            arg: int = -1, flops: float = 0.0, nbytes: float = 0.0,
            chunk: int | None = None, repeat: int = 1) -> int:
        i = len(self.rows)
        if len(deps) == 1:
            own: tuple[int, ...] = () if deps[0] is None else (deps[0],)
        else:
            own = tuple(dict.fromkeys(d for d in deps if d is not None))
        self.rows.append((name, kind, resource, cost, stage, own, flops, nbytes, arg, chunk,
                          repeat))
        self.index[(stage, name)] = i
        if refs:
            self.forward_refs += [(i, ref) for ref in refs]
        return i

    def columns(self) -> GraphColumns:
        """The graph's tasks, each task's references resolved (after its own dependencies)."""
        rows = self.rows
        fields = [tuple(map(itemgetter(k), rows)) for k in range(11)]
        deps = list(fields[5])
        try:
            targets = list(map(self.index.__getitem__, (ref for _, ref in self.forward_refs)))
        except KeyError:
            ref = next(r for _, r in self.forward_refs if r not in self.index)
            raise KeyError(f"the plan refers to task {ref[1]!r} of stage {ref[0]}, which "
                           f"was never built") from None
        for (i, _), j in zip(self.forward_refs, targets):
            deps[i] = deps[i] + (j,)
        fields[5] = tuple(deps)
        return GraphColumns(*fields)

    def resolve(self) -> tuple[GraphTask, ...]:
        return self.columns().tasks()
