"""The run's figures over its steps as plots with axes (Plotext, through textual-plotext): loss,
learning rate, grad norm, throughput, memory and comm share, each the mean over the ranks that
reported the step (memory: the largest rank's), and the ranks' step times as a histogram with
the median and the slow-rank threshold marked. The overview shows loss and throughput; the
plots view shows them all."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Grid, Horizontal, Vertical
from textual.widget import Widget
from textual_plotext import PlotextPlot

from tui import format as fmt
from tui.outliers import Outliers, find_outliers, slow_threshold, step_times
from tui.state import MEMORY, RunState

PLOT_EVERY_S = 1.0
GIB = float(1 << 30)
HISTOGRAM_BINS = 30
# the most points a curve is drawn from: two braille dots per column of a plot up to 100
# columns wide show no more, and Plotext's drawing time grows with the points (600 steps took
# 20 ms a plot)
MAX_POINTS = 200


def _lr(value: Any) -> str:
    v = fmt.number(value)
    return fmt.MISSING if v is None else f"{v:.3g}"


# (title, series, how the title shows a value, factor from the recorded unit to the axis')
SERIES: tuple[tuple[str, str, Callable[[Any], str], float], ...] = (
    ("loss", "loss", fmt.loss, 1.0),
    ("learning rate", "lr", _lr, 1.0),
    ("grad norm", "grad_norm", fmt.loss, 1.0),
    ("samples/s", "samples_per_s", fmt.rate, 1.0),
    ("memory GiB (largest rank)", MEMORY, fmt.size, 1 / GIB),
    ("comm share %", "comm_share", fmt.share, 100.0),
)
OVERVIEW_SERIES = ("loss", "samples_per_s")


def series_label(name: str, values: Sequence[float], show: Callable[[float], str]) -> str:
    """``loss 2.3012 (min 1.9, max 4.1, 120 steps)``: the figures a plot's axes round off. A
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
    """The finite values (an axis scales to its data's range, which NaN or inf would break)."""
    return [v for v in values if math.isfinite(v)]


def thin(points: list[tuple[int, float]], most: int = MAX_POINTS) -> list[tuple[int, float]]:
    """At most ``most`` of the points, evenly spaced, the first and the last kept."""
    if len(points) <= most:
        return points
    last = len(points) - 1
    return [points[round(i * last / (most - 1))] for i in range(most)]


class PlotTitle(Widget):
    """A one-line title redrawn in place: a Label's update lays the whole screen out again,
    which for seven plots cost more than drawing them."""

    DEFAULT_CSS = """
    PlotTitle {
        width: 1fr;
        height: 1;
        padding: 0 1;
        color: $text-muted;
    }
    """

    def __init__(self, text: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.text = text

    def show(self, text: str) -> None:
        if text != self.text:
            self.text = text
            self.refresh()

    def render(self) -> Text:
        return Text(self.text, no_wrap=True, overflow="ellipsis")


class TitledPlot(Vertical):
    """A plot under a one-line title: Plotext drops a title wider than its plot, and the title
    carries the figures the axes round off."""

    DEFAULT_CSS = """
    TitledPlot {
        height: 1fr;
    }
    """

    def __init__(self, label: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.label = label

    def compose(self) -> ComposeResult:
        yield PlotTitle(self.label)
        yield PlotextPlot()

    @property
    def plt(self) -> Any:
        return self.query_one(PlotextPlot).plt

    def set_label(self, label: str) -> None:
        self.label = label
        self.query_one(PlotTitle).show(label)
        self.query_one(PlotextPlot).refresh()


class SeriesPlot(TitledPlot):
    """One series over the steps, titled with its last value and range."""

    def __init__(self, series: str, **kwargs: Any) -> None:
        title, _, show_value, factor = next(s for s in SERIES if s[1] == series)
        super().__init__(series_label(title, [], show_value), **kwargs)
        self.series, self.title, self.show_value, self.factor = series, title, show_value, factor
        self.points: list[tuple[int, float]] = []

    def on_mount(self) -> None:
        self._draw()

    def show_points(self, points: list[tuple[int, float]]) -> None:
        if points == self.points:
            return
        self.points = points
        self._draw()

    def _draw(self) -> None:
        plt = self.plt
        plt.clear_figure()
        plt.xlabel("step")
        finite = thin([(s, v * self.factor) for s, v in self.points if math.isfinite(v)])
        if finite:
            plt.plot([s for s, _ in finite], [v for _, v in finite], marker="braille")
        # the title shows the recorded value (bytes, a fraction) in its own format
        self.set_label(series_label(self.title, [v for _, v in self.points], self.show_value))


class StepTimeHistogram(TitledPlot):
    """How the ranks' latest step times spread, with the median and the slow threshold."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__("step time per rank: no step yet", **kwargs)
        self.times: tuple[float, ...] = ()

    def show_state(self, state: RunState, found: Outliers | None = None) -> None:
        times = tuple(sorted(step_times(state).values()))
        if times == self.times:
            return
        self.times = times
        found = find_outliers(state) if found is None else found
        plt = self.plt
        plt.clear_figure()
        plt.xlabel("step time (s)")
        plt.ylabel("ranks")
        threshold = slow_threshold(list(times))
        if not times:
            label = "step time per rank: no step yet"
        elif threshold is None:
            label = f"step time over {len(times)} ranks (too few for a slow threshold)"
        else:
            median, limit = threshold
            slow = len(found.slow)
            label = (f"step time over {len(times)} ranks: median {fmt.seconds(median)} "
                     f"(green), slow beyond {fmt.seconds(limit)} (red): {slow} "
                     f"rank{'s' * (slow != 1)}")
        if times:
            plt.hist(list(times), bins=min(HISTOGRAM_BINS, max(1, len(times))))
            if threshold is not None:
                plt.vline(threshold[0], "green")
                plt.vline(threshold[1], "red")
        self.set_label(label)


class HistoryPlots(Horizontal):
    """The overview's loss and throughput plots; drawn at most every ``every_s`` seconds."""

    DEFAULT_CSS = """
    HistoryPlots {
        height: 12;
    }
    """

    def __init__(self, every_s: float = PLOT_EVERY_S, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.every_s = every_s
        self._last = -math.inf

    def compose(self) -> ComposeResult:
        for series in OVERVIEW_SERIES:
            yield SeriesPlot(series, id=f"plot-{series}")

    def show(self, state: RunState, force: bool = False) -> None:
        """A curve over hundreds of steps gains nothing from 5 redraws a second, and they
        would slow the key presses: at most one a second unless forced."""
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        for plot in self.query(SeriesPlot):
            plot.show_points(state.history(plot.series))


class PlotsView(Grid):
    """Every series and the step-time histogram, three to a row."""

    DEFAULT_CSS = """
    PlotsView {
        grid-size: 3;
        height: 1fr;
    }
    """

    def __init__(self, every_s: float = PLOT_EVERY_S, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.every_s = every_s
        self._last = -math.inf

    def compose(self) -> ComposeResult:
        for _, series, _, _ in SERIES:
            yield SeriesPlot(series, id=f"all-{series}")
        yield StepTimeHistogram(id="step-time-histogram")

    def show(self, state: RunState, found: Outliers | None = None, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return
        self._last = now
        for plot in self.query(SeriesPlot):
            plot.show_points(state.history(plot.series))
        self.query_one(StepTimeHistogram).show_state(state, found)
