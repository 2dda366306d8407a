"""Loss and throughput over the run's steps, as labelled sparklines (one value per step:
the loss and the job-wide samples/s, each averaged over the ranks that reported the step)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline

from tui import format as fmt
from tui.state import RunState

PLOT_EVERY_S = 1.0


def series_label(name: str, values: Sequence[float], show: Callable[[float], str]) -> str:
    """``loss 2.3012 (min 1.9, max 4.1, 120 steps)``; what a sparkline alone cannot say. A
    diverged run's NaN or inf values are counted, not ranked: min and max are the finite
    values'."""
    if not values:
        return f"{name}: no complete step yet"
    finite = [v for v in values if math.isfinite(v)]
    last = values[-1]
    current = show(last) if math.isfinite(last) else str(last)
    spread = f"min {show(min(finite))}, max {show(max(finite))}, " if finite else ""
    bad = len(values) - len(finite)
    return (f"{name} {current}  ({spread}{len(values)} steps"
            + (f", {bad} not finite" if bad else "") + ")")


def plottable(values: Sequence[float]) -> list[float]:
    """The finite values (a sparkline scales to its data's range, which NaN or inf would
    break)."""
    return [v for v in values if math.isfinite(v)]


class HistoryPlots(Vertical):
    """Two sparklines under their labels; the data is replaced only when the history grew."""

    DEFAULT_CSS = """
    HistoryPlots {
        height: 8;
    }
    HistoryPlots Label {
        padding: 0 1;
        color: $text-muted;
    }
    HistoryPlots Sparkline {
        height: 2;
        margin: 0 1;
    }
    """

    def __init__(self, every_s: float = PLOT_EVERY_S, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.every_s = every_s
        self._shown: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
        self._last = -math.inf

    def compose(self) -> ComposeResult:
        yield Label(series_label("loss", [], fmt.loss), id="loss-label")
        yield Sparkline([], id="loss-plot")
        yield Label(series_label("samples/s", [], fmt.rate), id="rate-label")
        yield Sparkline([], id="rate-plot")

    def show(self, state: RunState, force: bool = False) -> None:
        """Redraws at most every ``every_s`` seconds unless forced: a curve over hundreds of
        steps gains nothing from 5 redraws a second, and they would slow the key presses."""
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        losses = tuple(state.loss_history())
        rates = tuple(state.throughput_history())
        if (losses, rates) == self._shown:
            return
        self._shown = (losses, rates)
        self.query_one("#loss-label", Label).update(series_label("loss", losses, fmt.loss))
        self.query_one("#loss-plot", Sparkline).data = plottable(losses)
        self.query_one("#rate-label", Label).update(series_label("samples/s", rates, fmt.rate))
        self.query_one("#rate-plot", Sparkline).data = plottable(rates)
