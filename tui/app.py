"""``MonitorApp``: the header, a notice line and four views (overview, timeline, events, plots) over
one ``RunState`` that a live or replay source feeds from a worker. Outliers come first: the
header counts them, the table puts them on top, ``o`` walks them and Enter opens a rank.

Drawing is decoupled from the record rate: a timer redraws the visible view a few times a
second when the state moved, and a key press redraws at once, so 64 ranks at 10 Hz cost the
screen no more than 2 ranks do.
"""

from __future__ import annotations

from dataclasses import replace
from typing import ClassVar

from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.widgets import ContentSwitcher, Footer, Input, Static

from tui.event_log import EventLog
from tui.header import JobHeader
from tui.outliers import Outliers, find_outliers
from tui.plots import HistoryPlots, PlotsView
from tui.rank_detail import RankDetail
from tui.rank_order import Row, TableOptions, nodes, rank_rows, table_rows
from tui.rank_table import RankTable
from tui.source import ReplaySource, Source
from tui.state import RunState
from tui.timeline import Timeline

VIEWS = ("overview", "timeline", "events", "plots")
# what ? shows: the footer has room for the main keys only
KEYS_HELP = ("t/tab switch view (overview, timeline, events, plots) | r/down, up pick a rank | "
             "o next failed, stuck or slow rank | enter the picked rank's page | s sort by the "
             "next column, S reverse | f filter by status (events: by kind) | n by node | "
             "/ by text | g group by node | escape clear filters | p pause | +/- replay speed "
             "| ? this list | q quit")
REFRESH_S = 0.25


class MonitorApp(App[None]):
    """The monitor of one run; ``source`` decides whether it is live or a replay."""

    TITLE = "flowtrain monitor"
    # Nothing takes the focus at start, so the arrows reach the app and pick ranks.
    AUTO_FOCUS = None
    CSS = """
    #notice {
        height: auto;
        padding: 0 1;
        background: $error 30%;
    }
    #notice.hidden {
        display: none;
    }
    #views, #overview, #timeline, #events, #plots {
        height: 1fr;
    }
    #filter {
        dock: bottom;
        margin-bottom: 1;
    }
    #filter.hidden {
        display: none;
    }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "keys", "keys"),  # the footer has room for a few only
        Binding("p", "toggle_pause", "pause/resume"),
        Binding("r", "next_rank", "next rank"),
        Binding("up", "previous_rank", "rank up", show=False),
        Binding("down", "next_rank", "rank down", show=False),
        Binding("t", "next_view", "switch view"),
        # Tab would otherwise move the focus; here it switches views like t.
        Binding("tab", "next_view", "switch view", show=False, priority=True),
        Binding("plus,equals_sign", "faster", "faster"),
        Binding("minus", "slower", "slower"),
        Binding("o", "next_outlier", "next outlier"),
        Binding("enter", "rank_detail", "rank detail"),
        Binding("s", "next_sort", "sort"),
        Binding("S", "reverse_sort", "reverse sort", show=False),
        Binding("f", "next_filter", "filter"),
        Binding("n", "next_node", "node", show=False),
        Binding("g", "group_by_node", "by node", show=False),
        Binding("slash", "text_filter", "find", show=False),
        Binding("escape", "clear_filters", "clear filters", show=False),
    ]

    def __init__(self, source: Source, state: RunState | None = None,
                 refresh_s: float = REFRESH_S) -> None:
        super().__init__()
        self.source = source
        self.state = state if state is not None else RunState()
        self.view = VIEWS[0]
        self.selected_rank: int | None = None
        self._refresh_s = refresh_s
        self._drawn: tuple[object, ...] = ()
        self.source_error: str | None = None
        self._notice = ""
        self.options = TableOptions()
        # the outliers and table rows of the state version last drawn (a key press that does
        # not change the state reuses them)
        self._found: tuple[object, Outliers] | None = None
        self._rows: tuple[object, list[Row]] | None = None

    def compose(self) -> ComposeResult:
        yield JobHeader(id="header")
        yield Static("", id="notice", classes="hidden")
        with ContentSwitcher(initial=VIEWS[0], id="views"):
            with Vertical(id="overview"):
                yield RankTable(id="ranks")
                yield HistoryPlots(id="history")
            with Vertical(id="timeline"):
                yield Timeline(id="timeline-view")
            with Vertical(id="events"):
                yield EventLog(id="event-log")
            with Vertical(id="plots"):
                yield PlotsView(id="all-plots")
        yield Input(placeholder="show ranks (or events) matching ... (enter: apply, escape: "
                                "clear)", id="filter", classes="hidden")
        yield Footer()

    def on_mount(self) -> None:
        self.run_worker(self._feed(), name="source", exclusive=True, exit_on_error=False)
        self.set_interval(self._refresh_s, self.redraw)
        self.redraw(force=True)

    async def _feed(self) -> None:
        try:
            await self.source.run(self.state)
        except Exception as exc:  # shown on screen: the monitor outlives a broken source
            self.source_error = f"{type(exc).__name__}: {exc}"
        self.redraw(force=True)

    # ------------------------------------------------------------------ drawing
    def redraw(self, force: bool = False) -> None:
        """Brings the header, the notice and the visible view up to date with the state."""
        describe = self.source.describe()
        key = (self.state.version, self.state.now, describe, self.view, self.selected_rank,
               self.source_error, self.size, self.options)
        if key == self._drawn and not force:
            return
        stack = self.screen_stack  # empty once the app is closing, the timer not yet stopped
        if not stack:
            return
        if isinstance(stack[-1], RankDetail):
            stack[-1].show(self.state, self.outliers())
            return
        try:
            header = self.query_one(JobHeader)
        except NoMatches:
            return  # the app is closing: its widgets are gone, the timer not yet
        self._drawn = key
        found = self.outliers()
        header.show(self.state, describe, found)
        self._show_notice()
        rows = self.rows()
        if self.selected_rank is None and self.state.ranks:
            # the worst rank is picked first: Enter opens it, the timeline shows it
            self.selected_rank = (rank_rows(rows) or sorted(self.state.ranks))[0]
        if self.view == "overview":
            self.query_one(RankTable).show(self.state, self.selected_rank, found, self.options,
                                           rows)
            self.query_one(HistoryPlots).show(self.state, force=force)
        elif self.view == "timeline":
            self.query_one(Timeline).show(self.state, self.selected_rank, rank_rows(rows))
        elif self.view == "events":
            self.query_one(EventLog).show(self.state, self.options.text)
        else:
            self.query_one(PlotsView).show(self.state, found, force=force)

    def outliers(self) -> Outliers:
        """The state's outliers, found once per state version and moment."""
        key = (self.state.version, self.state.now, self.state.ended)
        if self._found is None or self._found[0] != key:
            self._found = (key, find_outliers(self.state))
        return self._found[1]

    def rows(self) -> list[Row]:
        """The rank table's rows as the options ask (also what the rank keys walk), sorted
        once per state version and options."""
        found = self.outliers()
        key = (self._found[0] if self._found else None, self.options)
        if self._rows is None or self._rows[0] != key:
            self._rows = (key, table_rows(self.state, found, self.options))
        return self._rows[1]

    def _show_notice(self) -> None:
        lines = []
        if self.state.damage is not None:
            lines.append(self.state.damage.text())
        if self.source_error is not None:
            lines.append(f"the data source stopped: {self.source_error}")
        text = "\n".join(lines)
        if text == self._notice:
            return  # an update lays the screen out again: only when the notice changes
        self._notice = text
        notice = self.query_one("#notice", Static)
        notice.update(text)
        notice.set_class(not lines, "hidden")

    # ------------------------------------------------------------------ actions
    def action_toggle_pause(self) -> None:
        self.source.set_paused(not self.source.paused)
        self.redraw(force=True)

    def action_next_view(self) -> None:
        self.view = VIEWS[(VIEWS.index(self.view) + 1) % len(VIEWS)]
        self.query_one(ContentSwitcher).current = self.view
        if self.view == "events":
            self.query_one(EventLog).focus()  # arrows scroll the log there
        else:
            self.set_focus(None)  # elsewhere arrows pick ranks
        self.redraw(force=True)

    def action_next_rank(self) -> None:
        self._step_rank(+1)

    def action_previous_rank(self) -> None:
        self._step_rank(-1)

    def _step_rank(self, delta: int) -> None:
        # the keys walk the ranks as the table shows them (worst first, filtered)
        ranks = rank_rows(self.rows()) or sorted(self.state.ranks)
        if not ranks:
            return
        if self.selected_rank not in ranks:
            self.selected_rank = ranks[0]
        else:
            index = ranks.index(self.selected_rank)
            self.selected_rank = ranks[(index + delta) % len(ranks)]
        self.redraw(force=True)

    def on_rank_table_picked(self, message: RankTable.Picked) -> None:
        self.selected_rank = message.rank
        self.redraw(force=True)

    def action_faster(self) -> None:
        if isinstance(self.source, ReplaySource):
            self.source.faster()
            self.redraw(force=True)

    def action_slower(self) -> None:
        if isinstance(self.source, ReplaySource):
            self.source.slower()
            self.redraw(force=True)

    def action_keys(self) -> None:
        self.notify(KEYS_HELP.replace(" | ", "\n"), title="keys", timeout=10)

    def action_next_outlier(self) -> None:
        """Picks the next failed, stuck or slow rank after the picked one, worst first."""
        found = self.outliers()
        ranks = found.ranks()
        if not ranks:
            self.notify("no failed, stuck or slow rank", timeout=2)
            return
        index = ranks.index(self.selected_rank) + 1 if self.selected_rank in ranks else 0
        self.selected_rank = ranks[index % len(ranks)]
        self.redraw(force=True)

    def action_rank_detail(self) -> None:
        if self.selected_rank is None or self.selected_rank not in self.state.ranks:
            return
        detail = RankDetail(self.selected_rank, self.state, self.outliers())
        self.push_screen(detail, callback=lambda _: self.redraw(force=True))

    def _set_options(self, options: TableOptions) -> None:
        self.options = options
        self.redraw(force=True)

    def action_next_sort(self) -> None:
        self._set_options(self.options.next_sort())

    def action_reverse_sort(self) -> None:
        self._set_options(replace(self.options, reverse=not self.options.reverse))

    def action_next_filter(self) -> None:
        if self.view == "events":
            self.query_one(EventLog).next_filter()
            self.redraw(force=True)
        else:
            self._set_options(self.options.next_status())

    def action_next_node(self) -> None:
        names = nodes(self.state)
        current = self.options.node
        index = names.index(current) + 1 if current in names else 0
        # after the last node comes "every node"
        self._set_options(replace(self.options, node=names[index] if index < len(names)
                                  else None))

    def action_group_by_node(self) -> None:
        self._set_options(replace(self.options, by_node=not self.options.by_node))

    def action_text_filter(self) -> None:
        field = self.query_one("#filter", Input)
        field.value = self.options.text
        field.remove_class("hidden")
        field.focus()

    def on_input_submitted(self, message: Input.Submitted) -> None:
        message.input.add_class("hidden")
        self._restore_focus()
        self._set_options(replace(self.options, text=message.value.strip()))

    def action_clear_filters(self) -> None:
        field = self.query_one("#filter", Input)
        if not field.has_class("hidden"):
            field.add_class("hidden")
            self._restore_focus()
        self.query_one(EventLog).set_filter("all")
        self._set_options(replace(self.options, status="all", node=None, text=""))

    def _restore_focus(self) -> None:
        if self.view == "events":
            self.query_one(EventLog).focus()
        else:
            self.set_focus(None)
