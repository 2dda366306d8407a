"""One row per rank: its latest step figures, heartbeat age and status; silent ranks are dimmed
and stuck or failed ones marked, so the odd rank out stands out in a table of 64.

Rows are Strips rebuilt only when their text changes (see ``tui.strip_view``); the header row
stays put while the rows scroll.
"""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.strip import Strip

from tui import format as fmt
from tui.state import RankState, RunState
from tui.strip_view import StripView, line

# key, header, width, right-aligned
COLUMNS: tuple[tuple[str, str, int, bool], ...] = (
    ("rank", "rank", 5, True), ("step", "step", 7, True), ("step_s", "step time", 10, True),
    ("rate", "samples/s", 10, True), ("loss", "loss", 9, True), ("mem", "memory", 10, True),
    ("overlap", "overlap", 8, True), ("scale", "loss scale", 11, True),
    ("age", "heartbeat", 10, True), ("status", "status", 30, False),
)
STATUS_STYLES = {"stuck": "bold red", "failed": "bold white on red", "stale": "yellow"}
# Silent, stuck and failed ranks have figures that are no longer current: shown dimmed.
DIMMED = ("stale", "stuck", "failed")
HEADER_STYLE = "bold"
SELECTED_STYLE = "reverse"

Cells = tuple[tuple[str, str], ...]


def row_cells(rank: RankState, now: float, ended: bool) -> Cells:
    """The row of one rank as ``(text, style)`` cells, in COLUMNS order."""
    record = rank.step or {}
    status = rank.status(now, ended)
    hb = rank.heartbeat or {}
    status_text = status
    if status == "stuck":
        status_text = "STUCK"
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


HEADER = render_row(tuple((label, HEADER_STYLE) for _, label, _, _ in COLUMNS))


class RankTable(StripView):
    """The per-rank table; the picked rank's row is drawn reversed."""

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
        self.order: list[int] = []
        self.selected: int | None = None
        self._cells: dict[int, Cells] = {}
        self._strips: dict[int, Strip] = {}

    def show(self, state: RunState, selected: int | None) -> None:
        restyle = selected != self.selected or len(state.ranks) != len(self.order)
        changed = restyle
        self.selected = selected
        self.order = sorted(state.ranks)
        for number in self.order:
            cells = row_cells(state.ranks[number], state.now, state.ended)
            if restyle or self._cells.get(number) != cells:
                self._cells[number] = cells
                self._strips[number] = render_row(cells, number == selected)
                changed = True
        if changed:
            self.set_lines([HEADER, *(self._strips[n] for n in self.order)])
            if selected in self.order:
                self.show_line(1 + self.order.index(selected))

    def cells_of(self, rank: int) -> dict[str, str]:
        """What the rank's row reads, by column key; empty while the rank has no row yet."""
        cells = self._cells.get(rank, ())
        return {key: text for (key, _, _, _), (text, _) in zip(COLUMNS, cells)}

    def on_click(self, event: events.Click) -> None:
        index = event.y - self.fixed_top + self.scroll_offset.y
        if event.y >= self.fixed_top and 0 <= index < len(self.order):
            self.post_message(self.Picked(self.order[index]))
