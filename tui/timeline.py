"""The last step of each rank as a timeline: one lane per resource (compute, reduce, gather,
optimizer, waiting) with the spans drawn as horizontal bars, the picked rank in full and every
rank as one compact line below it, so a rank whose reduces run late is easy to spot."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from tui import format as fmt
from tui.state import RankState, RunState

# lane name, task-name prefixes (as the StepPlan names its tasks), bar character, style
LANES: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("compute", ("forward", "backward"), "█", "green"),
    ("reduce", ("reduce",), "▓", "blue"),
    ("gather", ("gather",), "▒", "cyan"),
    ("optimizer", ("optimizer",), "█", "magenta"),
    ("wait", ("comm/wait", "comm"), "░", "yellow"),
)
OTHER = ("other", (), "·", "white")
LABEL_WIDTH = 10
SHARE_WIDTH = 6


def lane_of(task: str) -> int:
    """The lane index of a task name; unknown names go to the last ("other") lane."""
    for index, (_, prefixes, _, _) in enumerate(LANES):
        if any(task == p or task.startswith(p + "/") for p in prefixes):
            return index
    return len(LANES)


def lanes_with_other() -> tuple[tuple[str, tuple[str, ...], str, str], ...]:
    return (*LANES, OTHER)


def lane_columns(spans: list[tuple[str, float, float]], duration: float, width: int
                 ) -> list[list[bool]]:
    """For each lane, which of ``width`` columns (equal slices of the step) a span touches."""
    lanes = [[False] * width for _ in lanes_with_other()]
    if duration <= 0 or width <= 0:
        return lanes
    for name, start, end in spans:
        first = max(0, min(width - 1, int(start / duration * width)))
        last = max(first, min(width - 1, int(max(start, end - 1e-12) / duration * width)))
        row = lanes[lane_of(name)]
        for column in range(first, last + 1):
            row[column] = True
    return lanes


def busy_share(spans: list[tuple[str, float, float]], lane: int, duration: float) -> float:
    """The fraction of the step the lane was busy (overlapping spans counted once)."""
    intervals = sorted((s, e) for n, s, e in spans if lane_of(n) == lane and e > s)
    busy, reach = 0.0, float("-inf")
    for start, end in intervals:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / duration if duration > 0 else 0.0


def step_duration(rank: RankState) -> float:
    return max((end for _, _, end in rank.spans), default=0.0)


def detail_text(rank: RankState, width: int) -> Text:
    """The picked rank's lanes, a share per lane and a time axis."""
    duration = step_duration(rank)
    out = Text()
    out.append(f"rank {rank.rank}", style="bold")
    if not rank.spans:
        out.append(": no spans yet\n", style="dim")
        return out
    out.append(f"  step {rank.spans_step}  {fmt.seconds(duration)}  {len(rank.spans)} spans\n")
    bar_width = max(10, width - LABEL_WIDTH - SHARE_WIDTH - 2)
    columns = lane_columns(rank.spans, duration, bar_width)
    for index, (name, _, char, style) in enumerate(lanes_with_other()):
        if index == len(LANES) and not any(columns[index]):
            continue
        out.append(f"{name:<{LABEL_WIDTH}}")
        out.append("".join(char if hit else " " for hit in columns[index]), style=style)
        out.append(f" {busy_share(rank.spans, index, duration) * 100:>4.0f}%\n")
    middle = fmt.seconds(duration / 2)
    end = fmt.seconds(duration)
    axis = "0s".ljust(bar_width // 2 - len(middle) // 2) + middle
    out.append(" " * LABEL_WIDTH + axis.ljust(bar_width - len(end)) + end + "\n", style="dim")
    return out


def compact_line(rank: RankState, width: int, selected: bool) -> Text:
    """One rank on one line: each column shows the busiest-ranked lane there."""
    label = f"{'>' if selected else ' '}r{rank.rank:<4} s{rank.spans_step if rank.spans else '-':<6}"
    out = Text(label[:LABEL_WIDTH + 4].ljust(LABEL_WIDTH + 4), style="bold" if selected else "")
    duration = step_duration(rank)
    bar_width = max(10, width - LABEL_WIDTH - 4 - 10)
    columns = lane_columns(rank.spans, duration, bar_width)
    for column in range(bar_width):
        # Communication lanes are drawn over compute: exposed communication is the news.
        for index in (4, 1, 2, 3, 0, 5):
            if columns[index][column]:
                _, _, char, style = lanes_with_other()[index]
                out.append(char, style=style)
                break
        else:
            out.append(" ")
    out.append(f" {fmt.seconds(duration) if rank.spans else fmt.MISSING:>8}\n")
    return out


class Timeline(Widget):
    """Redrawn from the state when the picked rank or its last step changes."""

    DEFAULT_CSS = """
    Timeline {
        height: auto;
        padding: 0 1;
    }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._state: RunState | None = None
        self._selected: int | None = None
        self._key: tuple[object, ...] = ()

    def show(self, state: RunState, selected: int | None) -> None:
        key = (selected, tuple((r, s.spans_step, len(s.spans)) for r, s in state.ranks.items()))
        self._state, self._selected = state, selected
        if key != self._key:
            self._key = key
            self.refresh(layout=True)

    def render(self) -> Text:
        state = self._state
        if state is None or not state.ranks:
            return Text("no ranks yet", style="dim")
        width = max(40, self.size.width - 2)
        selected = state.ranks.get(self._selected) if self._selected is not None else None
        out = Text()
        if selected is not None:
            out.append_text(detail_text(selected, width))
            out.append("\n")
        out.append("all ranks, last step  ", style="bold")
        for name, _, char, style in LANES:
            out.append(f"{char} {name}  ", style=style)
        out.append("\n")
        for number in sorted(state.ranks):
            out.append_text(compact_line(state.ranks[number], width, number == self._selected))
        out.rstrip()
        return out
