"""Which ranks stand out (failed, stuck, slow) and how bad each is: one place that the header,
the rank table, the "next outlier" key and ``--summary`` all read, so they never disagree.

A slow rank is one whose step time lies beyond a robust threshold over the ranks' median: more
than ``SLOW_MADS`` median absolute deviations above it, and at least ``SLOW_RATIO`` times it
(the second keeps a tight group of ranks, whose MAD is tiny, from naming noise)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from tui.state import RunState

SLOW_MADS = 3.0
SLOW_RATIO = 1.1
# A slow rank needs company to be slow against: with fewer ranks there is no robust median.
MIN_RANKS_FOR_SLOW = 3
# worst first: the order of the rank table's default sort and of the summary's outliers
SEVERITY = {"failed": 0, "stuck": 1, "slow": 2}
UNREMARKABLE = len(SEVERITY)


def step_times(state: RunState) -> dict[int, float]:
    """Rank -> the step time of its latest step record, for the ranks that reported one."""
    out = {}
    for number, rank in state.ranks.items():
        value = rank.step.get("step_s") if rank.step is not None else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            out[number] = float(value)
    return out


def slow_threshold(times: list[float]) -> tuple[float, float] | None:
    """(median, limit): a step time over ``limit`` is slow; None with too few ranks."""
    if len(times) < MIN_RANKS_FOR_SLOW:
        return None
    median = statistics.median(times)
    mad = statistics.median(abs(t - median) for t in times)
    return median, max(median + SLOW_MADS * mad, median * SLOW_RATIO)


@dataclass
class Outliers:
    """Each rank's status and the outlier ranks of one moment of the run."""

    statuses: dict[int, str] = field(default_factory=dict)
    slow: dict[int, float] = field(default_factory=dict)  # rank -> step time / median
    median_step_s: float | None = None

    def __post_init__(self) -> None:
        # each outlier's kind, found once: the table asks for every rank at each redraw
        self.kinds: dict[int, str] = {}
        for rank, status in self.statuses.items():
            if status in ("failed", "stuck"):
                self.kinds[rank] = status
            elif rank in self.slow:
                self.kinds[rank] = "slow"

    def kind(self, rank: int) -> str | None:
        """``failed``, ``stuck`` or ``slow`` for an outlier rank, else None."""
        return self.kinds.get(rank)

    def severity(self, rank: int) -> int:
        kind = self.kinds.get(rank)
        return UNREMARKABLE if kind is None else SEVERITY[kind]

    def count(self, kind: str) -> int:
        return sum(1 for k in self.kinds.values() if k == kind)

    def ranks(self) -> list[int]:
        """The outlier ranks, worst first (failed, stuck, then slow by how slow)."""
        return sorted(self.kinds, key=lambda r: (self.severity(r), -self.slow.get(r, 0.0), r))


def find_outliers(state: RunState) -> Outliers:
    """Every rank's status now, and the slow ones against the ranks' median step time."""
    times = step_times(state)
    threshold = slow_threshold(list(times.values()))
    slow: dict[int, float] = {}
    median = None
    if threshold is not None:
        median, limit = threshold
        slow = {r: t / median for r, t in times.items() if t > limit}
    statuses = {r: s.status(state.now, state.ended) for r, s in state.ranks.items() if r >= 0}
    return Outliers(statuses, slow, median)
