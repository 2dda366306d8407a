"""The last step of each rank as a timeline: one lane per resource (compute, reduce, gather,
optimizer, waiting) with the spans drawn as horizontal bars, the picked rank in full and every
rank as one compact line below it, so a rank whose reduces run late is easy to spot."""

from __future__ import annotations

from typing import Any

from textual.strip import Strip

from tui import format as fmt
from tui.state import RankState, RunState
from tui.strip_view import StripView, line

# lane name, task-name prefixes (as the StepPlan names its tasks), bar character, style
LANES: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    ("compute", ("forward", "backward"), "█", "green"),
    ("reduce", ("reduce",), "▓", "blue"),
    ("gather", ("gather",), "▒", "cyan"),
    ("optimizer", ("optimizer",), "█", "magenta"),
    ("wait", ("comm",), "░", "yellow"),
)
OTHER = ("other", (), "·", "white")
LABEL_WIDTH = 10
SHARE_WIDTH = 6
DRAW_ORDER = (4, 1, 2, 3, 0, 5)  # wait, reduce, gather, optimizer, compute, other


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


def runs(chars: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Adjacent cells of the same character and style joined into one piece."""
    out: list[tuple[str, str]] = []
    for char, spec in chars:
        if out and out[-1][1] == spec:
            out[-1] = (out[-1][0] + char, spec)
        else:
            out.append((char, spec))
    return out


def detail_lines(rank: RankState, width: int) -> list[Strip]:
    """The picked rank's lanes, a busy share per lane and a time axis."""
    duration = step_duration(rank)
    if not rank.spans:
        return [line((f"rank {rank.rank}", "bold"), (": no spans yet", "dim"))]
    lines = [line((f"rank {rank.rank}", "bold"),
                  (f"  step {rank.spans_step}  {fmt.seconds(duration)}  "
                   f"{len(rank.spans)} spans", ""))]
    bar_width = max(10, width - LABEL_WIDTH - SHARE_WIDTH - 2)
    columns = lane_columns(rank.spans, duration, bar_width)
    for index, (name, _, char, spec) in enumerate(lanes_with_other()):
        if index == len(LANES) and not any(columns[index]):
            continue
        bar = "".join(char if hit else " " for hit in columns[index])
        share = busy_share(rank.spans, index, duration) * 100
        lines.append(line((f"{name:<{LABEL_WIDTH}}", ""), (bar, spec), (f" {share:>4.0f}%", "")))
    middle = fmt.seconds(duration / 2)
    end = fmt.seconds(duration)
    axis = "0s".ljust(bar_width // 2 - len(middle) // 2) + middle
    lines.append(line((" " * LABEL_WIDTH + axis.ljust(bar_width - len(end)) + end, "dim")))
    return lines


def compact_line(rank: RankState, width: int, selected: bool) -> Strip:
    """One rank on one line: each column shows the lane drawn on top there."""
    step = rank.spans_step if rank.spans else "-"
    label = f"{'>' if selected else ' '}r{rank.rank:<4} s{step:<6}"[:LABEL_WIDTH + 4]
    duration = step_duration(rank)
    bar_width = max(10, width - LABEL_WIDTH - 4 - 10)
    columns = lane_columns(rank.spans, duration, bar_width)
    lanes = lanes_with_other()
    cells = []
    for column in range(bar_width):
        # Communication lanes are drawn over compute: exposed communication is the news.
        hit = next((i for i in DRAW_ORDER if columns[i][column]), None)
        cells.append((" ", "") if hit is None else (lanes[hit][2], lanes[hit][3]))
    total = fmt.seconds(duration) if rank.spans else fmt.MISSING
    return line((label.ljust(LABEL_WIDTH + 4), "bold" if selected else ""), *runs(cells),
                (f" {total:>8}", ""))


def legend() -> Strip:
    return line(("all ranks, last step  ", "bold"),
                *((f"{char} {name}  ", spec) for name, _, char, spec in LANES))


class Timeline(StripView):
    """Rebuilt from the state only when the picked rank, a rank's last spans, the order or the
    width changed; scrolls when the ranks do not fit. The ranks follow the rank table's order
    (worst first) when one is given."""

    DEFAULT_CSS = """
    Timeline {
        padding: 0 1;
    }
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._key: tuple[object, ...] = ()
        self._shown: tuple[RunState, int | None, list[int] | None] | None = None
        # rank -> (what its line was drawn from, the line): at 1,024 ranks, drawing every
        # line again for each picked rank took most of a second
        self._compact: dict[int, tuple[tuple[object, ...], Strip]] = {}
        self._head: list[Strip] = []
        self._ranks: list[int] = []
        self._state: RunState | None = None
        self._width = 0
        self._selected: int | None = None

    def show(self, state: RunState, selected: int | None, order: list[int] | None = None
             ) -> None:
        self._shown = (state, selected, order)
        if self.size.width <= 0:
            return  # hidden or not laid out yet: drawn on the resize that shows it
        width = max(40, self.size.width - 1)
        ranks = order if order else sorted(state.ranks)
        key = (selected, width, tuple(ranks),
               tuple((r, s.spans_step, len(s.spans)) for r, s in state.ranks.items()))
        if key == self._key:
            return
        self._key = key
        if not state.ranks:
            self._head, self._ranks = [line(("no ranks yet", "dim"))], []
            self.set_extent(self._head[0].cell_length, 1)
            return
        head: list[Strip] = []
        picked = state.ranks.get(selected) if selected is not None else None
        if picked is not None:
            head += detail_lines(picked, width)
            head.append(Strip.blank(0))
        head.append(legend())
        # the ranks' lines are drawn when they scroll into view (line_at): 1,024 of them
        # would cost a switch to this view most of its time
        self._head, self._ranks, self._state, self._width = head, ranks, state, width
        self._selected = selected
        self.lines = []
        self.set_extent(max(strip.cell_length for strip in head) if head else width,
                        len(head) + len(ranks))

    def line_at(self, index: int) -> Strip | None:
        if index < len(self._head):
            return self._head[index]
        index -= len(self._head)
        if self._state is None or index >= len(self._ranks):
            return None
        number = self._ranks[index]
        rank = self._state.ranks.get(number)
        if rank is None:
            return None
        return self._compact_line(rank, self._width, number == self._selected)

    def _compact_line(self, rank: RankState, width: int, selected: bool) -> Strip:
        key = (rank.spans_step, len(rank.spans), width, selected)
        cached = self._compact.get(rank.rank)
        if cached is None or cached[0] != key:
            cached = self._compact[rank.rank] = (key, compact_line(rank, width, selected))
        return cached[1]

    def on_resize(self) -> None:
        # A view switched in is laid out after the switch: the width known at the switch was
        # none, and a finished replay sends no new record to draw again at the real width.
        if self._shown is not None:
            self.show(*self._shown)

    def drawn_lines(self) -> list[Strip]:
        """Every line, on screen or not (for tests)."""
        found = (self.line_at(i) for i in range(len(self._head) + len(self._ranks)))
        return [strip for strip in found if strip is not None]

    def text(self) -> str:
        """What the timeline reads, line by line (for tests)."""
        return "\n".join(strip.text for strip in self.drawn_lines())
