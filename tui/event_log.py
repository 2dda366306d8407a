"""The run's events (overflows, skipped steps, stuck or failed ranks, checkpoints) in order,
timed from the start of the run and colored by how much they need a look."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from tui import format as fmt
from tui.state import EVENT_LIMIT, EventEntry, RunState

EVENT_STYLES = {
    "overflow": "yellow",
    "skipped_step": "yellow",
    "rank_stuck": "bold red",
    "rank_failed": "bold white on red",
    "checkpoint_saved": "green",
    "job_ended": "bold",
}


def event_cells(entry: EventEntry, start: float | None) -> tuple[Text, Text, Text, Text]:
    offset = entry.t - start if start is not None else None
    when = "+" + fmt.seconds(offset) if offset is not None else fmt.MISSING
    who = "job" if entry.rank < 0 else f"rank {entry.rank}"
    style = EVENT_STYLES.get(entry.event, "")
    return (Text(when, justify="right"), Text(who), Text(entry.event, style=style),
            Text(entry.message))


class EventLog(DataTable[Text]):
    """Appends the events it has not shown yet and follows the newest one."""

    DEFAULT_CSS = """
    EventLog {
        height: 1fr;
    }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", **kwargs)  # type: ignore[arg-type]
        self._shown = 0
        self._first = 0

    def on_mount(self) -> None:
        self.add_column("time", key="time")
        self.add_column("who", key="who")
        self.add_column("event", key="event")
        self.add_column("message", key="message")

    def show(self, state: RunState) -> None:
        total = state.events_total
        if total == self._shown:
            return
        # The state keeps only the newest events; older ones may have been dropped meanwhile.
        fresh = list(state.events)[-min(total - self._shown, len(state.events)):]
        start = state.job.started if state.job.started is not None else state.first_t
        for number, entry in enumerate(fresh, start=total - len(fresh)):
            self.add_row(*event_cells(entry, start), key=str(number))
        self._shown = total
        for number in range(self._first, total - EVENT_LIMIT):
            if str(number) in self.rows:
                self.remove_row(str(number))
        self._first = max(self._first, total - EVENT_LIMIT)
        self.move_cursor(row=self.row_count - 1)

    def lines(self) -> list[str]:
        """The log as plain lines (what the tests read)."""
        return [" | ".join(cell.plain for cell in self.get_row_at(i))
                for i in range(self.row_count)]
