"""The monitor's plots (tui.plots): each series is the per-step mean over the ranks (memory: the
largest rank's), drawn with axes; the step-time histogram names the median and the slow-rank
threshold of tui.outliers."""

from __future__ import annotations

import statistics

import pytest

from tui.app import MonitorApp
from tui.plots import PlotsView, SeriesPlot, StepTimeHistogram
from tui.state import MEMORY, RunState
from tui_helpers import (
    BIG_RANKS,
    StillSource,
    big_records,
    big_step_s,
    synthetic_records,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def test_each_series_is_the_mean_over_the_ranks_of_each_complete_step() -> None:
    state = RunState()
    records = synthetic_records()
    for record in records:
        state.apply(record)
    steps = [r for r in records if r["kind"] == "step"]
    for name in ("loss", "lr", "grad_norm", "samples_per_s", "comm_share"):
        expected = [(s, statistics.mean(r[name] for r in steps if r["step"] == s))
                    for s in sorted({r["step"] for r in steps})]
        assert state.history(name) == [(s, pytest.approx(v)) for s, v in expected], name
    assert state.history(MEMORY) == [(s, 512 << 20) for s, _ in state.history("loss")]


async def test_the_plots_view_draws_every_series_with_axes_and_the_step_time_spread() -> None:
    state = RunState()
    for record in big_records():
        state.apply(record)
    app = MonitorApp(StillSource(), state=state)
    async with app.run_test(size=(180, 50)) as pilot:
        while app.view != "plots":
            await pilot.press("t")
        await pilot.pause()
        view = app.query_one(PlotsView)
        plots = {p.series: p for p in view.query(SeriesPlot)}
        assert set(plots) == {"loss", "lr", "grad_norm", "samples_per_s", MEMORY, "comm_share"}
        losses = state.history("loss")
        # the newest step waits for every rank, and the stuck one never reports step 6
        assert plots["loss"].points == losses and len(losses) == 5
        assert plots["loss"].label.startswith(f"loss {losses[-1][1]:.4f}  (min ")
        drawn = plots["loss"].plt.build()
        assert "step" in drawn and "┤" in drawn  # an x label and a y axis with ticks
        times = [big_step_s(r) for r in range(BIG_RANKS)]
        median = statistics.median(times)
        limit = max(median + 3 * statistics.median(abs(t - median) for t in times),
                    1.1 * median)
        histogram = view.query_one(StepTimeHistogram)
        assert histogram.label == (f"step time over {BIG_RANKS} ranks: median {median:.3f}s "
                                   f"(green), slow beyond {limit:.3f}s (red): 1 rank")
        assert sorted(histogram.times) == sorted(times)


def test_a_long_series_is_thinned_evenly_keeping_both_ends() -> None:
    from tui.plots import thin

    points = [(s, float(s * s)) for s in range(1, 601)]
    kept = thin(points, 200)
    assert len(kept) == 200 and kept[0] == points[0] and kept[-1] == points[-1]
    steps = [s for s, _ in kept]
    gaps = {b - a for a, b in zip(steps, steps[1:])}
    assert gaps <= {3, 4} and steps == sorted(steps)
    assert all(v == s * s for s, v in kept)
    assert thin(points[:50], 200) == points[:50]
