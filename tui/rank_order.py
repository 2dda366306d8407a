"""Which ranks the rank table shows, in what order: sorted by any column (worst first by
default: failed, stuck, slow, then the slowest step), filtered by status, node and text, and
optionally grouped by node under a line of per-node aggregates. Pure functions of the state,
so that the keys that walk the ranks and the table agree, and tests need no screen."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tui import format as fmt
from tui.outliers import Outliers
from tui.state import RankState, RunState

STATUS_FILTERS = ("all", "outliers", "failed", "stuck", "slow")
UNKNOWN_NODE = "?"


def _step_s(rank: RankState) -> float | None:
    return fmt.number((rank.step or {}).get("step_s"))


def _memory(rank: RankState) -> float | None:
    mem = (rank.step or {}).get("mem")
    if not isinstance(mem, dict):
        return None
    device = fmt.number(mem.get("device_allocated"))
    return device if device is not None else fmt.number(mem.get("process_rss"))


def _field(name: str) -> Callable[[RankState], float | None]:
    return lambda rank: fmt.number((rank.step or {}).get(name))


# column key -> (its value, whether a bigger value is worse): each column sorts worst first
SORT_KEYS: dict[str, tuple[Callable[[RankState], float | None], bool]] = {
    "step": (_field("step"), False),  # the rank furthest behind first
    "step_s": (_step_s, True),
    "rate": (_field("samples_per_s"), False),
    "loss": (_field("loss"), True),
    "mem": (_memory, True),
    "overlap": (_field("overlap"), False),
    "scale": (_field("loss_scale"), False),
}
# "status" is the default order (worst first); "rank" and "age" are handled apart
SORT_COLUMNS = ("status", "rank", "step", "step_s", "rate", "loss", "mem", "overlap", "scale",
                "age")


@dataclass(frozen=True)
class TableOptions:
    """How the user asked to see the table."""

    sort: str = "status"
    reverse: bool = False
    status: str = "all"  # one of STATUS_FILTERS
    node: str | None = None
    text: str = ""
    by_node: bool = False

    def next_sort(self) -> TableOptions:
        index = SORT_COLUMNS.index(self.sort) if self.sort in SORT_COLUMNS else -1
        return replace(self, sort=SORT_COLUMNS[(index + 1) % len(SORT_COLUMNS)], reverse=False)

    def next_status(self) -> TableOptions:
        index = STATUS_FILTERS.index(self.status) if self.status in STATUS_FILTERS else -1
        return replace(self, status=STATUS_FILTERS[(index + 1) % len(STATUS_FILTERS)])

    def describe(self) -> str:
        """``showing stuck, node n3, matching "12", by node``: the filters in force (the
        sorted column carries its own mark)."""
        parts = []
        if self.status != "all":
            parts.append(f"showing {self.status}")
        if self.node is not None:
            parts.append(f"node {self.node}")
        if self.text:
            parts.append(f'matching "{self.text}"')
        if self.by_node:
            parts.append("by node")
        return ", ".join(parts)


@dataclass(frozen=True)
class NodeGroup:
    """A node's line above its ranks when grouped: its name and aggregates."""

    node: str
    text: str
    outliers: int


Row = int | NodeGroup


def node_of(rank: RankState) -> str:
    return rank.host or UNKNOWN_NODE


def nodes(state: RunState) -> list[str]:
    return sorted({node_of(r) for n, r in state.ranks.items() if n >= 0})


def sort_key(state: RunState, found: Outliers, options: TableOptions
             ) -> Callable[[int], tuple[Any, ...]]:
    """Worst first for the chosen column; ranks without a value go last either way, and ties
    fall back to the rank number."""
    sign = 1 if options.reverse else -1

    def worst(number: int) -> tuple[Any, ...]:
        step_s = _step_s(state.ranks[number])
        severity = found.severity(number)
        if options.reverse:
            severity = -severity
        return (severity, step_s is None, sign * (step_s or 0.0), number)

    if options.sort == "status":
        return worst
    if options.sort == "rank":
        return lambda number: (-number if options.reverse else number,)
    if options.sort == "age":
        def age(number: int) -> tuple[Any, ...]:
            value = state.ranks[number].age(state.now)
            return (value is None, sign * (value or 0.0), number)
        return age
    value_of, bigger_is_worse = SORT_KEYS[options.sort]
    direction = sign if bigger_is_worse else -sign

    def by_value(number: int) -> tuple[Any, ...]:
        value = value_of(state.ranks[number])
        return (value is None, direction * (value or 0.0), number)
    return by_value


def matches(state: RunState, found: Outliers, number: int, options: TableOptions) -> bool:
    rank = state.ranks[number]
    if options.status == "outliers" and found.kind(number) is None:
        return False
    if options.status not in ("all", "outliers") and found.kind(number) != options.status:
        return False
    if options.node is not None and node_of(rank) != options.node:
        return False
    if options.text:
        needle = options.text.lower().strip()
        if needle.isdigit():  # a number names a rank, not every rank whose number holds it
            return number == int(needle)
        haystack = f"rank {number} {node_of(rank)} {found.statuses.get(number, '')} " \
                   f"{found.kind(number) or ''} {rank.stuck_reason}".lower()
        return needle in haystack
    return True


def group_line(node: str, members: list[int], state: RunState, found: Outliers) -> NodeGroup:
    """``node n3: 8 ranks, step 24-25, step time median 0.105s max 0.160s, 1 stuck``."""
    steps = [s for s in (fmt.number((state.ranks[n].step or {}).get("step")) for n in members)
             if s is not None]
    times = [t for t in (_step_s(state.ranks[n]) for n in members) if t is not None]
    parts = [f"node {node}: {len(members)} rank{'s' if len(members) != 1 else ''}"]
    if steps:
        low, high = int(min(steps)), int(max(steps))
        parts.append(f"step {low}" if low == high else f"step {low}-{high}")
    if times:
        parts.append(f"step time median {fmt.seconds(statistics.median(times))} "
                     f"max {fmt.seconds(max(times))}")
    kinds = [found.kind(n) for n in members]
    counts = [f"{kinds.count(k)} {k}" for k in ("failed", "stuck", "slow") if k in kinds]
    parts += counts
    return NodeGroup(node, ", ".join(parts), sum(1 for k in kinds if k is not None))


def table_rows(state: RunState, found: Outliers, options: TableOptions) -> list[Row]:
    """The rows to draw, in order: rank numbers, and a NodeGroup above each node's ranks when
    grouped (nodes with outliers first, the worst node on top)."""
    key = sort_key(state, found, options)
    shown = sorted((n for n in state.ranks if n >= 0 and matches(state, found, n, options)),
                   key=key)
    if not options.by_node:
        return list(shown)
    members: dict[str, list[int]] = {}
    for number in shown:
        members.setdefault(node_of(state.ranks[number]), []).append(number)
    # shown is sorted: each node's first member is its worst, so nodes follow that order
    rows: list[Row] = []
    for node, ranks in members.items():
        rows.append(group_line(node, ranks, state, found))
        rows += ranks
    return rows


def rank_rows(rows: list[Row]) -> list[int]:
    return [r for r in rows if isinstance(r, int)]
