"""The three health figures of a run, each held against the target a well-tuned job should reach.

Targets: FLOPs utilization above 60%, memory-bandwidth utilization above 75%, exposed
communication below 20% of step time. Each is the mean over the ranks' latest step records.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# (label, step-record field, target, higher is better). "mbu" is not in schema v1 yet: it is
# shown when a record carries it and reads "n/a" otherwise.
HEALTH_TARGETS: tuple[tuple[str, str, float, bool], ...] = (
    ("FLOPs util", "mfu", 0.60, True),
    ("mem-BW util", "mbu", 0.75, True),
    ("comm share", "comm_share", 0.20, False),
)


@dataclass(frozen=True)
class HealthFigure:
    """One figure, its target and whether the run meets it (None when the figure is missing)."""

    label: str
    field: str
    value: float | None
    target: float
    higher_is_better: bool

    @property
    def meets(self) -> bool | None:
        if self.value is None:
            return None
        return self.value > self.target if self.higher_is_better else self.value < self.target

    def text(self) -> str:
        sign = ">" if self.higher_is_better else "<"
        shown = "n/a" if self.value is None else f"{self.value * 100:.0f}%"
        return f"{self.label} {shown} ({sign}{self.target * 100:.0f}%)"


def health_figures(step_records: Iterable[dict[str, Any]]) -> list[HealthFigure]:
    """The figures from the latest step record of each rank; a field no rank reports is n/a."""
    records = list(step_records)
    figures = []
    for label, name, target, higher in HEALTH_TARGETS:
        values = [float(r[name]) for r in records if isinstance(r.get(name), (int, float))]
        value = sum(values) / len(values) if values else None
        figures.append(HealthFigure(label, name, value, target, higher))
    return figures
