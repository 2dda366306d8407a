"""The job header: world, the count of failed, stuck and slow ranks, step, elapsed, ETA, where
the data comes from, and the health figures colored by whether each meets its target."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from tui import format as fmt
from tui.health import HealthFigure
from tui.outliers import Outliers, find_outliers
from tui.state import RunState

GOOD_STYLE = "bold green"
BAD_STYLE = "bold red"
UNKNOWN_STYLE = "dim"
OUTLIER_STYLES = {"failed": "bold white on red", "stuck": "bold red", "slow": "bold yellow"}


def figure_style(figure: HealthFigure) -> str:
    """Green when the target is met, red when not, dim when the run does not report it."""
    meets = figure.meets
    return UNKNOWN_STYLE if meets is None else GOOD_STYLE if meets else BAD_STYLE


def header_text(state: RunState, source: str, found: Outliers | None = None) -> Text:
    """Two lines: the job, its outlier ranks and its progress; the health figures and where
    the data comes from. Each line is cut with an ellipsis rather than wrapped, so the figures
    keep their row."""
    found = find_outliers(state) if found is None else found
    job = state.job
    step = state.current_step()
    total = f"/{job.total_steps}" if job.total_steps else ""
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(f"job {job.job_id}", style="bold")
    text.append(f"  world {state.world_size()}")
    for kind, style in OUTLIER_STYLES.items():
        count = found.count(kind)
        # the counts keep their place when zero, so a rank turning bad does not shift the line
        text.append("  ")
        text.append(f"{count} {kind}", style=style if count else UNKNOWN_STYLE)
    text.append(f"  step {fmt.MISSING if step is None else step}{total}")
    text.append(f"  elapsed {fmt.seconds(state.elapsed())}")
    text.append(f"  ETA {fmt.seconds(state.eta())}")
    if state.ended:
        code = state.end_status.get("exit_code")
        if isinstance(code, int) and code != 0:
            # a failed job says so, not just that it ended
            status = state.end_status.get("status") or "failed"
            text.append(f"  job {status} (exit {code})", style="bold red")
        else:
            text.append("  job ended", style="bold")
    text.append("\n")
    for index, figure in enumerate(state.health()):
        if index:
            text.append("   ")
        text.append(figure.text(), style=figure_style(figure))
    text.append(f"   [{source}]", style="italic")
    return text


class JobHeader(Widget):
    """The two header lines. Redrawn in place (never laid out again) when their text changes,
    which happens several times a second on a live run."""

    DEFAULT_CSS = """
    JobHeader {
        height: 2;
        padding: 0 1;
        background: $panel;
    }
    """

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.text = Text()

    def show(self, state: RunState, source: str, found: Outliers | None = None) -> None:
        text = header_text(state, source, found)
        if text.plain != self.text.plain or text.spans != self.text.spans:
            self.text = text
            self.refresh()

    def render(self) -> Text:
        return self.text
