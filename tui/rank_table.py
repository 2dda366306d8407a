"""One row per rank: its latest step figures, heartbeat age and status; silent ranks are dimmed
and stuck or failed ones marked, so the odd rank out stands out in a table of 64."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from tui import format as fmt
from tui.state import RankState, RunState

COLUMNS: tuple[tuple[str, str], ...] = (
    ("rank", "rank"), ("step", "step"), ("step_s", "step time"), ("rate", "samples/s"),
    ("loss", "loss"), ("mem", "memory"), ("overlap", "overlap"), ("scale", "loss scale"),
    ("age", "heartbeat"), ("status", "status"),
)
STATUS_STYLES = {"stuck": "bold red", "failed": "bold white on red", "stale": "yellow"}
# Silent, stuck and failed ranks have figures that are no longer current: shown dimmed.
DIMMED = ("stale", "stuck", "failed")


def row_cells(rank: RankState, now: float, ended: bool) -> list[Text]:
    """The row of one rank as styled cells."""
    record = rank.step or {}
    status = rank.status(now, ended)
    hb = rank.heartbeat or {}
    status_text = status
    if status == "stuck":
        status_text = "STUCK"
    elif status == "stale" and hb.get("pending_collective"):
        status_text = f"stale (in {hb['pending_collective']})"
    elif status in ("busy", "idle", "ok") and hb.get("busy_actor"):
        status_text = f"{status} ({hb['busy_actor']})"
    values = [
        str(rank.rank), fmt.MISSING if record.get("step") is None else str(record["step"]),
        fmt.seconds(record.get("step_s")), fmt.rate(record.get("samples_per_s")),
        fmt.loss(record.get("loss")), fmt.memory(record.get("mem")),
        fmt.share(record.get("overlap")), fmt.scale(record.get("loss_scale")),
        fmt.age(rank.age(now)),
    ]
    base = "dim" if status in DIMMED else ""
    cells = [Text(v, style=base, justify="right") for v in values]
    cells.append(Text(status_text, style=STATUS_STYLES.get(status, base)))
    return cells


class RankTable(DataTable[Text]):
    """The per-rank table; cells are rewritten only when their text or style changed, which
    keeps a 64-rank table cheap to refresh several times a second."""

    DEFAULT_CSS = """
    RankTable {
        height: 1fr;
    }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)  # type: ignore[arg-type]
        self._shown: dict[int, list[Text]] = {}

    def on_mount(self) -> None:
        for key, label in COLUMNS:
            self.add_column(label, key=key)

    def show(self, state: RunState) -> None:
        added = False
        for number in sorted(state.ranks):
            cells = row_cells(state.ranks[number], state.now, state.ended)
            previous = self._shown.get(number)
            if previous is None:
                self.add_row(*cells, key=str(number))
                added = True
            else:
                for (key, _), old, new in zip(COLUMNS, previous, cells):
                    if old.plain != new.plain or old.style != new.style:
                        self.update_cell(str(number), key, new)
            self._shown[number] = cells
        if added:
            # Ranks can first appear out of order (rank 5's record before rank 2's).
            self.sort("rank", key=lambda cell: int(cell.plain))

    def rank_at_cursor(self) -> int | None:
        if not self.row_count:
            return None
        row_key, _ = self.coordinate_to_cell_key(self.cursor_coordinate)
        return None if row_key.value is None else int(row_key.value)

    def select_rank(self, rank: int) -> None:
        if str(rank) in self.rows:
            self.move_cursor(row=self.get_row_index(str(rank)))

    def status_of(self, rank: int) -> str:
        """What the status cell reads (for tests and the benchmark)."""
        return self._shown[rank][-1].plain
