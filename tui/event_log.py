"""The run's events (overflows, skipped steps, stuck or failed ranks, checkpoints) in order,
timed from the start of the run and colored by how much they need a look. What every rank says
alike is one line: 64 ranks joining read "64 ranks joined", a step all ranks skipped is one
step. ``f`` cycles a filter (problems, lifecycle) and the monitor's text filter applies too."""

from __future__ import annotations

from dataclasses import dataclass, field

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
# lifecycle event -> what a group of ranks did, for "64 ranks joined"
LIFECYCLE = {"rank_joined": "joined", "engine_started": "started the engine",
             "rank_finished": "finished", "rank_exited": "exited"}
# events every rank reports about the same step: one line per step
PER_STEP = ("skipped_step", "overflow", "checkpoint_saved")
PROBLEMS = ("rank_stuck", "rank_failed", "job_ended", "join_timeout", "overflow",
            "skipped_step", "bad_job_record")
EVENT_FILTERS = ("all", "problems", "lifecycle")


def group_key(entry: EventEntry, number: int) -> tuple[object, ...]:
    """Events with the same key share a line; a stuck or failed rank always has its own."""
    if entry.event in LIFECYCLE and entry.rank >= 0:
        # exits differ by how they ended: a clean exit and a kill are not one line
        return (entry.event, entry.data.get("exit_code"), entry.data.get("failure"))
    if entry.event in PER_STEP and isinstance(entry.data.get("step"), int):
        return (entry.event, entry.data["step"])
    return ("single", number)


def rank_ranges(ranks: list[int]) -> str:
    """``0-63``, ``1, 4-6``: a sorted rank list in short."""
    values = sorted(set(ranks))
    parts: list[str] = []
    start = previous = values[0]
    for value in [*values[1:], None]:
        if value is not None and value == previous + 1:
            previous = value
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if value is not None:
            start = previous = value
    return ", ".join(parts)


@dataclass
class EventGroup:
    """One line of the log: its first event and the ranks that reported it."""

    number: int
    first: EventEntry
    ranks: list[int] = field(default_factory=list)

    def message(self) -> str:
        count = len(set(self.ranks))
        if count <= 1:
            return self.first.message
        if self.first.event in LIFECYCLE:
            how = LIFECYCLE[self.first.event]
            code = self.first.data.get("exit_code")
            return f"{count} ranks {how}" + (f" (exit {code})" if code is not None else "")
        return f"{count} ranks: {self.first.message}"

    def who(self) -> str:
        if self.first.rank < 0:
            return "job"
        return f"rank {self.ranks[0]}" if len(set(self.ranks)) == 1 \
            else f"ranks {rank_ranges(self.ranks)}"

    def passes(self, kind: str, text: str) -> bool:
        event = self.first.event
        if kind == "problems" and event not in PROBLEMS:
            return False
        if kind == "lifecycle" and event not in LIFECYCLE:
            return False
        needle = text.lower().strip()
        return not needle or needle in f"{event} {self.who()} {self.message()}".lower()


def event_cells(group: EventGroup, start: float | None) -> tuple[Text, Text, Text, Text]:
    entry = group.first
    offset = entry.t - start if start is not None else None
    when = "+" + fmt.seconds(offset) if offset is not None else fmt.MISSING
    style = EVENT_STYLES.get(entry.event, "")
    return (Text(when, justify="right"), Text(group.who()), Text(entry.event, style=style),
            Text(group.message()))


class EventLog(DataTable[Text]):
    """Adds a line per new group, updates a group's line as more ranks join it, and follows the
    newest line; a filter change rebuilds the lines."""

    DEFAULT_CSS = """
    EventLog {
        height: 1fr;
    }
    """

    COLUMNS = ("time", "who", "event", "message")

    def __init__(self, **kwargs: object) -> None:
        super().__init__(cursor_type="row", **kwargs)  # type: ignore[arg-type]
        self._seen = 0
        self._groups: dict[tuple[object, ...], EventGroup] = {}
        self._start: float | None = None
        self.kind = "all"
        self._text = ""
        self._rebuild = False

    def on_mount(self) -> None:
        for name in self.COLUMNS:
            self.add_column(name, key=name)

    def next_filter(self) -> None:
        self.set_filter(EVENT_FILTERS[(EVENT_FILTERS.index(self.kind) + 1)
                                      % len(EVENT_FILTERS)])

    def set_filter(self, kind: str) -> None:
        if kind not in EVENT_FILTERS:
            raise ValueError(f"event filter {kind!r}: expected one of {EVENT_FILTERS}")
        self._rebuild = self._rebuild or kind != self.kind
        self.kind = kind

    def show(self, state: RunState, text: str = "") -> None:
        if text != self._text:
            self._text, self._rebuild = text, True
        self._start = state.job.started if state.job.started is not None else state.first_t
        changed = self._take(state)
        if self._rebuild:
            self._rebuild = False
            self.clear()
            changed = list(self._groups.values())
        elif not changed:
            return
        for group in changed:
            key = str(group.number)
            if not group.passes(self.kind, self._text):
                continue
            cells = event_cells(group, self._start)
            if key in self.rows:
                for column, cell in zip(self.COLUMNS, cells):
                    self.update_cell(key, column, cell)
            else:
                self.add_row(*cells, key=key)
        self.move_cursor(row=self.row_count - 1)

    def _take(self, state: RunState) -> list[EventGroup]:
        """Folds the events not seen yet into groups; returns the groups that changed."""
        total = state.events_total
        # The state keeps only the newest events; older ones may have been dropped meanwhile.
        fresh = list(state.events)[-min(total - self._seen, len(state.events)):] \
            if total > self._seen else []
        changed: dict[int, EventGroup] = {}
        for number, entry in enumerate(fresh, start=total - len(fresh)):
            key = group_key(entry, number)
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = EventGroup(number, entry)
            group.ranks.append(entry.rank)
            changed[group.number] = group
        self._seen = total
        while len(self._groups) > EVENT_LIMIT:
            oldest = next(iter(self._groups))
            dropped = self._groups.pop(oldest)
            changed.pop(dropped.number, None)
            if str(dropped.number) in self.rows:
                self.remove_row(str(dropped.number))
        return list(changed.values())

    def lines(self) -> list[str]:
        """The log as plain lines (what the tests read)."""
        return [" | ".join(cell.plain for cell in self.get_row_at(i))
                for i in range(self.row_count)]
