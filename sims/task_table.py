"""A step's tasks as the executor reads them: ``SimTask`` one by one, or a ``TaskTable`` of
columns. A priced plan of a few hundred thousand tasks stays in columns (the fast executor and
the step's figures read arrays); its ``SimTask`` objects are made only when something reads the
table task by task (a trace, a comparison with a measured run)."""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, overload

import numpy as np

# the executor's name for the compute time a collective takes (a companion of the collective)
INTERFERENCE_KIND = "interference"


@dataclass(frozen=True, slots=True)
class SimTask:
    """One task of the step on a representative rank of pipeline stage ``stage``."""

    name: str
    kind: str
    resource: str
    duration: float  # seconds
    deps: tuple[int, ...] = ()  # indices into the plan's task list
    stage: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    # A collective: on CPU hosts its progress also takes a share of the compute resource.
    collective: bool = False
    # That share for this collective when it differs from the plan's (None: the plan's), e.g.
    # a CPU host's shared-memory channel, whose summing is the rank's own CPU work.
    interference: float | None = None
    # How much longer the collective takes while its stage computes (the cores are shared
    # both ways on CPU hosts), when it differs from the plan's (None: the plan's).
    slowdown: float | None = None


def value_codes(values: Sequence[Hashable]) -> tuple[np.ndarray, list[Any]]:
    """Each value's number among the distinct ``values``, numbered in order of first
    occurrence, and those distinct values."""
    distinct = {v: i for i, v in enumerate(dict.fromkeys(values))}
    return np.fromiter(map(distinct.__getitem__, values), dtype=np.int64,
                       count=len(values)), list(distinct)


def first_use_ids(*columns: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray]:
    """Numbers the distinct rows of ``columns`` (equal where every column's values are) in
    order of first occurrence: each row's number, and the row each number first occurs in."""
    n = len(columns[0])
    key = np.zeros(n, dtype=np.int64)
    for column in columns:
        codes, distinct = value_codes(column)
        # kept dense before each widening, so the combined key never overflows
        key = np.unique(key, return_inverse=True)[1].reshape(n) * len(distinct) + codes
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")
    rank = np.empty(len(order), dtype=np.int64)
    rank[order] = np.arange(len(order), dtype=np.int64)
    return rank[inverse.reshape(n)], first[order]


class TaskColumns:
    """What a step's tasks are, without their durations: names, kinds, resources, stages,
    dependencies, sizes, and which are collectives. Several pricings of one laid-out step share
    it, and with it the arrays derived from it (resource ids, the children of each task)."""

    def __init__(self, names: Sequence[str], kinds: Sequence[str], resources: Sequence[str],
                 stages: Sequence[int], deps: Sequence[tuple[int, ...]],
                 flops: Sequence[float], nbytes: Sequence[float],
                 collective: Sequence[bool] | None = None) -> None:
        self.names, self.kinds, self.resources = names, kinds, resources
        self.stage_list, self.deps, self.flops, self.nbytes = stages, deps, flops, nbytes
        self.stages = np.array(stages, dtype=np.int64)
        codes, distinct = value_codes(resources)
        self.resource_codes, self.resource_names = codes, distinct
        if collective is None:
            self.collective = np.array([r.startswith("comm:") for r in distinct],
                                       dtype=np.bool_)[codes]
        else:
            self.collective = np.array(collective, dtype=np.bool_)
        self.collective_list: Sequence[bool] = collective if collective is not None else \
            self.collective.tolist()
        self._derived: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.names)

    def edges(self) -> tuple[np.ndarray, np.ndarray]:
        """(dependency count of each task, every dependency in task order, flattened)."""
        if "edges" not in self._derived:
            counts = np.fromiter(map(len, self.deps), dtype=np.int64, count=len(self.deps))
            flat = np.fromiter(chain.from_iterable(self.deps), dtype=np.int64,
                               count=int(counts.sum()))
            self._derived["edges"] = (counts, flat)
        return self._derived["edges"]

    def bad_dependency(self) -> np.ndarray:
        """The first task that depends on itself or on no task of the table (empty: none)."""
        if "bad" not in self._derived:
            counts, flat = self.edges()
            owner = np.repeat(np.arange(len(self.deps), dtype=np.int64), counts)
            self._derived["bad"] = \
                owner[(flat < 0) | (flat >= len(self.deps)) | (flat == owner)][:1]
        return self._derived["bad"]

    def children(self) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, tasks): the tasks waiting for task ``i`` are
        ``tasks[offsets[i]:offsets[i + 1]]``, in task order."""
        if "children" not in self._derived:
            counts, flat = self.edges()
            owners = np.repeat(np.arange(len(self.deps), dtype=np.int64), counts)
            offsets = np.zeros(len(self.deps) + 1, dtype=np.int64)
            np.cumsum(np.bincount(flat, minlength=len(self.deps)), out=offsets[1:])
            self._derived["children"] = (offsets, owners[np.argsort(flat, kind="stable")])
        return self._derived["children"]

    def resource_ids(self) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """Each task's resource id, ids numbered in order of first use, and the (stage,
        resource) of each id."""
        if "resources" not in self._derived:
            of, first = first_use_ids(self.stage_list, self.resources)
            self._derived["resources"] = (of, [(self.stage_list[i], self.resources[i])
                                               for i in first.tolist()])
        return self._derived["resources"]

    def kind_mask(self, kinds: tuple[str, ...]) -> np.ndarray:
        """Whether each task's kind is one of ``kinds``."""
        key = "kinds:" + ",".join(kinds)
        if key not in self._derived:
            wanted = frozenset(kinds)
            self._derived[key] = np.fromiter((k in wanted for k in self.kinds),
                                             dtype=np.bool_, count=len(self.kinds))
        return self._derived[key]


class TaskTable(Sequence[SimTask]):
    """A step's tasks: ``columns`` and each task's ``durations``, own ``interference`` and
    ``slowdown`` (NaN: the plan's). Rows past the columns' are ``companions``: the compute time
    (``companion_durations``) the collective of each index in ``companions`` takes from its
    stage (named ``interference/<its name>``), as the executor adds them."""

    def __init__(self, columns: TaskColumns, durations: np.ndarray,
                 interference: np.ndarray | None = None, slowdown: np.ndarray | None = None,
                 *, companions: np.ndarray | None = None,
                 companion_durations: np.ndarray | None = None,
                 objects: Sequence[SimTask] | None = None) -> None:
        self.columns = columns
        self.durations = durations
        n = len(columns)
        self.interference = interference if interference is not None else np.full(n, np.nan)
        self.slowdown = slowdown if slowdown is not None else np.full(n, np.nan)
        self.companions = companions if companions is not None else np.zeros(0, np.int64)
        self.companion_durations = companion_durations if companion_durations is not None \
            else np.zeros(0)
        self._objects: tuple[SimTask, ...] | None = \
            tuple(objects) if objects is not None else None

    @classmethod
    def from_tasks(cls, tasks: Sequence[SimTask]) -> TaskTable:
        """The columns of ``tasks`` (which the table then hands out as they are)."""
        tasks = tuple(tasks)
        columns = TaskColumns([t.name for t in tasks], [t.kind for t in tasks],
                              [t.resource for t in tasks], [t.stage for t in tasks],
                              [t.deps for t in tasks], [t.flops for t in tasks],
                              [t.bytes for t in tasks], [t.collective for t in tasks])
        nan = float("nan")
        return cls(columns, np.array([t.duration for t in tasks], dtype=np.float64),
                   np.array([nan if t.interference is None else t.interference for t in tasks],
                            dtype=np.float64),
                   np.array([nan if t.slowdown is None else t.slowdown for t in tasks],
                            dtype=np.float64), objects=tasks)

    @property
    def planned(self) -> int:
        """The plan's own tasks (the rows before the companions)."""
        return len(self.columns)

    def scaled(self, factor: float) -> TaskTable:
        """The same tasks, each ``factor`` times as long."""
        return TaskTable(self.columns, self.durations * factor, self.interference,
                         self.slowdown)

    def with_companions(self, companions: np.ndarray, durations: np.ndarray) -> TaskTable:
        """The plan's tasks followed by the companions of the collectives ``companions``."""
        objects = self._objects if self._objects is not None and not len(self.companions) \
            else None
        return TaskTable(self.columns, self.durations, self.interference, self.slowdown,
                         companions=companions, companion_durations=durations,
                         objects=objects[:self.planned] if objects is not None else None)

    def stage_array(self) -> np.ndarray:
        """Every row's stage, companions included."""
        return np.concatenate([self.columns.stages, self.columns.stages[self.companions]])

    def stage_count(self) -> int:
        stages = self.columns.stages
        return 1 + int(stages.max()) if len(stages) else 1

    # -- read task by task ---------------------------------------------------------------------

    def _all(self) -> tuple[SimTask, ...]:
        objects = self._objects
        if objects is None or len(objects) != len(self):
            c = self.columns
            if objects is None or len(objects) < self.planned:
                own = [None if x != x else x for x in self.interference.tolist()]
                slow = [None if x != x else x for x in self.slowdown.tolist()]
                planned = tuple(map(SimTask, c.names, c.kinds, c.resources,
                                    self.durations.tolist(), c.deps, c.stage_list, c.flops,
                                    c.nbytes, c.collective_list, own, slow))
            else:
                planned = tuple(objects[:self.planned])
            extra = tuple(SimTask(f"{INTERFERENCE_KIND}/{c.names[i]}", INTERFERENCE_KIND,
                                  "compute", d, (), c.stage_list[i])
                          for i, d in zip(self.companions.tolist(),
                                          self.companion_durations.tolist()))
            objects = self._objects = planned + extra
        return objects

    def __len__(self) -> int:
        return len(self.columns) + len(self.companions)

    @overload
    def __getitem__(self, index: int) -> SimTask: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[SimTask, ...]: ...

    def __getitem__(self, index: int | slice) -> SimTask | tuple[SimTask, ...]:
        return self._all()[index]

    def __iter__(self) -> Iterator[SimTask]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (TaskTable, tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TaskTable({len(self)} tasks)"
