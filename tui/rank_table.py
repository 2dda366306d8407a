"""One row per rank: its latest step figures, heartbeat age and status; silent ranks are dimmed
and stuck, failed or slow ones marked, so the odd rank out stands out in a table of 1,024. The
order, filters and node groups come from ``tui.rank_order``.

Rows are Strips rebuilt only when their text changes (see ``tui.strip_view``); the header row
stays put while the rows scroll.
"""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.strip import Strip

from tui import format as fmt
from tui.outliers import Outliers
from tui.rank_order import NodeGroup, Row, TableOptions, table_rows
from tui.state import RankState, RunState
from tui.strip_view import StripView, line

# key, header, width, right-aligned
COLUMNS: tuple[tuple[str, str, int, bool], ...] = (
    ("rank", "rank", 5, True), ("step", "step", 7, True), ("step_s", "step time", 10, True),
    ("rate", "samples/s", 10, True), ("loss", "loss", 9, True), ("mem", "memory", 10, True),
    ("overlap", "overlap", 8, True), ("scale", "loss scale", 11, True),
    ("age", "heartbeat", 10, True), ("status", "status", 30, False),
)
# the width to scroll over: the figures' columns and the usual status ("busy (reducer)"; a
# longer one is cut rather than giving every table a horizontal scroll bar)
ROW_WIDTH = sum(width + 1 for _, _, width, _ in COLUMNS[:-1]) + 20
STATUS_STYLES = {"stuck": "bold red", "failed": "bold white on red", "stale": "yellow",
                 "slow": "bold yellow"}
# Silent, stuck and failed ranks have figures that are no longer current: shown dimmed.
DIMMED = ("stale", "stuck", "failed")
HEADER_STYLE = "bold"
SELECTED_STYLE = "reverse"
GROUP_STYLE = "bold cyan"
GROUP_OUTLIER_STYLE = "bold red"
SORTED_MARK = ("▼", "▲")  # worst first, best first

Cells = tuple[tuple[str, str], ...]


def row_cells(rank: RankState, now: float, ended: bool, slow: float | None = None) -> Cells:
    """The row of one rank as ``(text, style)`` cells, in COLUMNS order; ``slow`` is its step
    time over the median when it is a slow outlier."""
    record = rank.step or {}
    status = rank.status(now, ended)
    hb = rank.heartbeat or {}
    status_text = status
    if status == "stuck":
        status_text = "STUCK"
    elif status == "failed" and rank.killed_while_stuck():
        status_text = f"killed (was stuck, exit {rank.exit_code})"
    elif slow is not None and status not in ("failed", "stale"):
        status_text = f"SLOW {slow:.2f}x median ({status})"
        status = "slow"
    elif status == "finished" and rank.stuck_reason:
        status_text = "finished (was stuck)"
    elif status == "stale" and hb.get("pending_collective"):
        status_text = f"stale (in {hb['pending_collective']})"
    elif status in ("busy", "idle", "ok") and hb.get("busy_actor"):
        status_text = f"{status} ({hb['busy_actor']})"
    values = (
        str(rank.rank), fmt.MISSING if record.get("step") is None else str(record["step"]),
        fmt.seconds(record.get("step_s")), fmt.rate(record.get("samples_per_s")),
        fmt.loss(record.get("loss")), fmt.memory(record.get("mem")),
        fmt.share(record.get("overlap")), fmt.scale(record.get("loss_scale")),
        fmt.age(rank.age(now)),
    )
    base = "dim" if status in DIMMED else ""
    return (*((v, base) for v in values), (status_text, STATUS_STYLES.get(status, base)))


def render_row(cells: Cells, selected: bool = False) -> Strip:
    parts = []
    last = len(COLUMNS) - 1
    for index, ((text, spec), (_, _, width, right)) in enumerate(zip(cells, COLUMNS)):
        text = text[:width]
        # The last column is not padded: the row is only as wide as what it says.
        cell = text if index == last else (text.rjust(width) if right else text.ljust(width)) + " "
        parts.append((cell, f"{spec} {SELECTED_STYLE}".strip() if selected else spec))
    return line(*parts)


def header_row(options: TableOptions, shown: int, total: int) -> Strip:
    """The column names, the sorted one marked, then how the table is sorted and filtered."""
    mark = SORTED_MARK[options.reverse]
    cells = tuple((label + mark if key == options.sort else label, HEADER_STYLE)
                  for key, label, _, _ in COLUMNS)
    strip = render_row(cells)
    said = ", ".join(part for part in (f"{shown} of {total} ranks" if shown != total else "",
                                       options.describe()) if part)
    return Strip([*strip, *line((f"   {said}", "dim"))]) if said else strip


def group_row(group: NodeGroup) -> Strip:
    return line((f"▸ {group.text}", GROUP_OUTLIER_STYLE if group.outliers else GROUP_STYLE))


class RankTable(StripView):
    """The rank table; the picked rank's row is drawn reversed."""

    class Picked(Message):
        """The user clicked a rank's row."""

        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    DEFAULT_CSS = """
    RankTable {
        padding: 0 1;
    }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(fixed_top=1, **kwargs)
        self.rows: list[Row] = []
        self.selected: int | None = None
        self._state: RunState | None = None
        self._found = Outliers()
        # rank -> (cells, picked) its strip was drawn from, and the strip
        self._strips: dict[int, tuple[tuple[Cells, bool], Strip]] = {}
        self._header: tuple[object, ...] = ()
        self._header_strip = Strip([])

    @property
    def order(self) -> list[int]:
        """The ranks shown, top to bottom."""
        return [r for r in self.rows if isinstance(r, int)]

    def show(self, state: RunState, selected: int | None, found: Outliers,
             options: TableOptions, rows: list[Row] | None = None) -> None:
        """Shows ``rows`` (``table_rows`` of the state when not given). Only the rows on screen
        are drawn, when the screen asks for them: with 1,024 ranks reporting at 10 Hz,
        building every row at each redraw cost more than the rest of the monitor."""
        rows = table_rows(state, found, options) if rows is None else rows
        moved = selected != self.selected or rows != self.rows
        self._state, self._found = state, found
        self.selected = selected
        self.rows = rows
        shown = len(rows) if not options.by_node else len(self.order)
        header_key = (options, shown, len(state.ranks))
        if header_key != self._header:
            self._header = header_key
            self._header_strip = header_row(options, shown, len([n for n in state.ranks
                                                                 if n >= 0]))
        self.set_extent(max(ROW_WIDTH, self._header_strip.cell_length), 1 + len(rows))
        if moved and selected in rows:
            # only when the pick or the order changed: a user scrolling with the wheel keeps
            # the rows they scrolled to
            self.show_line(1 + rows.index(selected))

    def line_at(self, index: int) -> Strip | None:
        if index == 0:
            return self._header_strip
        if self._state is None or index > len(self.rows):
            return None
        row = self.rows[index - 1]
        if isinstance(row, NodeGroup):
            return group_row(row)
        key = (self._cells(row), row == self.selected)
        cached = self._strips.get(row)
        if cached is None or cached[0] != key:
            cached = self._strips[row] = (key, render_row(*key))
        return cached[1]

    def _cells(self, rank: int) -> Cells:
        state = self._state
        if state is None or rank not in state.ranks:
            return ()
        return row_cells(state.ranks[rank], state.now, state.ended, self._found.slow.get(rank))

    def cells_of(self, rank: int) -> dict[str, str]:
        """What the rank's row reads, by column key; empty while the rank has no row yet."""
        return {key: text for (key, _, _, _), (text, _) in zip(COLUMNS, self._cells(rank))}

    def on_click(self, event: events.Click) -> None:
        index = event.y - self.fixed_top + self.scroll_offset.y
        if event.y >= self.fixed_top and 0 <= index < len(self.rows):
            picked = self.rows[index]
            if isinstance(picked, int):
                self.post_message(self.Picked(picked))
