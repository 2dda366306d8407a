"""Outliers first (tui.outliers, tui.rank_order and the app's keys): the robust slow-rank
threshold, the table's sorting, filters and node groups on a synthetic 256-rank recording, the
header counts and the table's top rows in the first frame (there and on a real 4-rank run whose
rank 1 got stuck), the rank detail view, and the grouped event log."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import msgpack
import pytest

from helpers import DATA
from tui.app import MonitorApp
from tui.event_log import EventLog, rank_ranges
from tui.header import JobHeader
from tui.outliers import find_outliers, slow_threshold
from tui.rank_detail import RankDetail
from tui.rank_order import NodeGroup, TableOptions, rank_rows, table_rows
from tui.rank_table import RankTable
from tui.state import RunState
from tui.timeline import Timeline
from tui_helpers import (
    BIG_RANKS,
    BIG_SLOW,
    BIG_STUCK,
    RANKS_PER_NODE,
    StillSource,
    big_records,
    big_step_s,
    replay,
    replayed,
    screen_text,
    write_recording,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]
BIG_SIZE = (160, 50)


def big_state() -> RunState:
    state = RunState()
    for record in big_records():
        state.apply(record)
    return state


# ----------------------------------------------------------------------------- the threshold
def test_slow_threshold_is_the_larger_of_three_mads_and_ten_percent_over_the_median() -> None:
    tight = [1.0, 1.0, 1.0, 1.0, 1.05, 1.5]  # MAD 0: the 10 % floor decides
    assert slow_threshold(tight) == (1.0, pytest.approx(1.1))
    spread = [1.0, 1.2, 1.4, 1.6, 1.8, 3.0]  # median 1.5, MAD 0.3: 3 MADs decide
    median = statistics.median(spread)
    mad = statistics.median(abs(t - median) for t in spread)
    assert slow_threshold(spread) == (median, pytest.approx(median + 3 * mad))
    assert slow_threshold([1.0, 9.0]) is None  # two ranks have no robust median


def test_outliers_of_the_256_rank_run_are_the_stuck_and_the_slow_rank() -> None:
    found = find_outliers(big_state())
    median = statistics.median(big_step_s(r) for r in range(BIG_RANKS))
    assert found.ranks() == [BIG_STUCK, BIG_SLOW]
    assert found.slow == {BIG_SLOW: pytest.approx(big_step_s(BIG_SLOW) / median)}
    assert (found.count("failed"), found.count("stuck"), found.count("slow")) == (0, 1, 1)


# ----------------------------------------------------------------------------- order and filters
def reference_worst_first(state: RunState) -> list[int]:
    """Stuck, then slow, then the rest by step time, longest first, ties by rank."""
    rest = sorted((r for r in state.ranks if r not in (BIG_STUCK, BIG_SLOW)),
                  key=lambda r: (-big_step_s(r), r))
    return [BIG_STUCK, BIG_SLOW, *rest]


def test_table_sorts_worst_first_by_default_and_by_any_column() -> None:
    state = big_state()
    found = find_outliers(state)
    assert table_rows(state, found, TableOptions()) == reference_worst_first(state)
    assert table_rows(state, found, TableOptions(sort="rank")) == list(range(BIG_RANKS))
    assert table_rows(state, found, TableOptions(sort="rank", reverse=True)) == \
        list(range(BIG_RANKS))[::-1]
    # the step column puts the rank furthest behind first: the stuck one, at step 3
    assert table_rows(state, found, TableOptions(sort="step"))[0] == BIG_STUCK
    by_time = table_rows(state, found, TableOptions(sort="step_s"))
    assert by_time == sorted(state.ranks, key=lambda r: (-big_step_s(r), r))
    assert table_rows(state, found, TableOptions(sort="step_s", reverse=True)) == \
        sorted(state.ranks, key=lambda r: (big_step_s(r), r))
    # every column has an order, and each is a permutation of the ranks
    options = TableOptions()
    for _ in range(12):
        options = options.next_sort()
        assert sorted(rank_rows(table_rows(state, found, options))) == list(range(BIG_RANKS))


def test_table_filters_by_status_node_and_text() -> None:
    state = big_state()
    found = find_outliers(state)
    rows = lambda **kw: table_rows(state, found, TableOptions(**kw))  # noqa: E731
    assert rows(status="outliers") == [BIG_STUCK, BIG_SLOW]
    assert rows(status="stuck") == [BIG_STUCK]
    assert rows(status="slow") == [BIG_SLOW]
    assert rows(status="failed") == []
    node = f"node{BIG_SLOW // RANKS_PER_NODE:02d}"
    first = BIG_SLOW // RANKS_PER_NODE * RANKS_PER_NODE
    assert sorted(rows(node=node)) == list(range(first, first + RANKS_PER_NODE))
    assert rows(node=node)[0] == BIG_SLOW
    assert rows(text="137") == [137]  # a number is a rank, not every rank containing it
    assert sorted(rows(text=node)) == sorted(rows(node=node))
    assert rows(text="stuck") == [BIG_STUCK]
    assert rows(text="nothing matches this") == []


def test_grouped_by_node_the_worst_node_leads_with_its_aggregates() -> None:
    state = big_state()
    found = find_outliers(state)
    rows = table_rows(state, found, TableOptions(by_node=True))
    groups = [r for r in rows if isinstance(r, NodeGroup)]
    assert len(groups) == BIG_RANKS // RANKS_PER_NODE
    stuck_node = f"node{BIG_STUCK // RANKS_PER_NODE:02d}"
    slow_node = f"node{BIG_SLOW // RANKS_PER_NODE:02d}"
    assert [g.node for g in groups[:2]] == [stuck_node, slow_node]
    members = rows[1:1 + RANKS_PER_NODE]
    assert members[0] == BIG_STUCK and len(members) == RANKS_PER_NODE
    times = [big_step_s(r) for r in range(BIG_SLOW // 8 * 8, BIG_SLOW // 8 * 8 + 8)]
    slow_line = groups[1].text
    assert slow_line.startswith(f"node {slow_node}: 8 ranks, step 6, ")
    assert f"max {max(times):.3f}s" in slow_line and slow_line.endswith("1 slow")
    assert "step 3-6" in groups[0].text and groups[0].text.endswith("1 stuck")
    assert rank_rows(rows) != reference_worst_first(state)  # grouped, not just sorted
    assert sorted(rank_rows(rows)) == list(range(BIG_RANKS))


# ----------------------------------------------------------------------------- on screen
async def test_first_frame_shows_the_stuck_and_slow_rank_in_header_and_table_top() -> None:
    app = MonitorApp(StillSource(), state=big_state())
    async with app.run_test(size=BIG_SIZE) as pilot:
        await pilot.pause()
        header = app.query_one(JobHeader).text.plain
        assert "world 256  0 failed  1 stuck  1 slow" in header
        assert app.query_one(RankTable).order[:2] == [BIG_STUCK, BIG_SLOW]
        lines = screen_text(app).splitlines()
        # the header's two lines, the column names, then the rows
        assert lines[3].split()[0] == str(BIG_STUCK) and "STUCK" in lines[3]
        assert lines[4].split()[0] == str(BIG_SLOW) and "SLOW 1.40x median" in lines[4]
        assert app.selected_rank == BIG_STUCK  # the worst rank is picked


async def test_keys_sort_filter_group_jump_and_open_a_rank(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.msgpack"
    write_recording(path, big_records())
    app = MonitorApp(replay(path))
    async with app.run_test(size=BIG_SIZE) as pilot:
        await replayed(pilot, app)
        table = app.query_one(RankTable)
        reference = reference_worst_first(app.state)
        assert table.order == reference
        await pilot.press("s")  # by rank
        assert table.order == list(range(BIG_RANKS))
        await pilot.press("S")
        assert table.order == list(range(BIG_RANKS))[::-1]
        assert "rank▲" in screen_text(app)
        await pilot.press("s")  # by step: furthest behind first
        assert table.order[0] == BIG_STUCK
        await pilot.press("f")  # outliers only
        assert sorted(table.order) == sorted([BIG_STUCK, BIG_SLOW])
        assert "2 of 256 ranks, showing outliers" in screen_text(app)
        await pilot.press("escape")
        assert len(table.order) == BIG_RANKS
        await pilot.press("slash", *"node03", "enter")
        assert sorted(table.order) == list(range(24, 32))
        await pilot.press("escape", "n")  # the first node
        assert sorted(table.order) == list(range(0, 8))
        await pilot.press("escape", "g")
        assert isinstance(table.rows[0], NodeGroup) and len(table.order) == BIG_RANKS
        await pilot.press("g")
        # o walks the outliers, worst first, and round again
        # from an outlier, the next one; from any other rank, the worst
        before = app.selected_rank
        first = BIG_SLOW if before == BIG_STUCK else BIG_STUCK
        picked = []
        for _ in range(3):
            await pilot.press("o")
            picked.append(app.selected_rank)
        assert picked == [first, BIG_STUCK + BIG_SLOW - first, first]
        if picked[0] == BIG_STUCK:
            await pilot.press("o")
        await pilot.press("enter")
        assert isinstance(app.screen, RankDetail)
        await pilot.pause()
        detail = str(app.screen.text)
        median = statistics.median(big_step_s(r) for r in range(BIG_RANKS))
        assert detail.startswith(f"rank {BIG_SLOW} on node node17")
        assert f"({big_step_s(BIG_SLOW) / median:.2f}x the median" in detail
        await pilot.press("escape")
        assert not isinstance(app.screen, RankDetail)
        assert app.selected_rank == BIG_SLOW


async def test_the_timeline_takes_its_width_when_switched_to_on_a_finished_replay(
        tmp_path: Path) -> None:
    path = tmp_path / "telemetry.msgpack"
    from tui_helpers import synthetic_records

    write_recording(path, synthetic_records())
    app = MonitorApp(replay(path))
    async with app.run_test(size=(150, 40)) as pilot:
        await replayed(pilot, app)
        await pilot.press("t")
        await pilot.pause()
        timeline = app.query_one(Timeline)
        # no redraw forced, no new record: the first drawing after the switch must fit
        widths = {strip.cell_length for strip in timeline.drawn_lines() if strip.cell_length > 60}
        assert widths and timeline.size.width - 4 <= max(widths) < timeline.size.width, widths


async def test_events_of_256_ranks_are_grouped_and_filtered() -> None:
    app = MonitorApp(StillSource(), state=big_state())
    async with app.run_test(size=BIG_SIZE) as pilot:
        await pilot.press("t", "t")
        log = app.query_one(EventLog)
        lines = log.lines()
        assert lines[0].split(" | ")[1:] == ["ranks 0-255", "rank_joined", "256 ranks joined"]
        assert len(lines) == 2 and "rank_stuck" in lines[1]
        await pilot.press("f")  # problems only
        assert [line.split(" | ")[2] for line in log.lines()] == ["rank_stuck"]
        await pilot.press("f")  # lifecycle only
        assert [line.split(" | ")[2] for line in log.lines()] == ["rank_joined"]
        await pilot.press("f", "slash", *"201", "enter")
        assert [line.split(" | ")[1] for line in log.lines()] == [f"rank {BIG_STUCK}"]


def test_rank_ranges_are_short() -> None:
    assert rank_ranges([3, 0, 1, 2, 7, 9, 10]) == "0-3, 7, 9-10"
    assert rank_ranges([5]) == "5"


# ----------------------------------------------------------------------------- a real run
RECORDED_4 = DATA / "telemetry_run4" / "telemetry.msgpack"


def recorded_4_records() -> list[dict[str, Any]]:
    """The real 4-rank run (tests/make_telemetry_run.py --nproc 4), read with msgpack alone:
    rank 1 freezes after step 25, is declared stuck, and the job is torn down."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(RECORDED_4.read_bytes())
    return list(unpacker)


@pytest.mark.parametrize("moment", ["stuck", "ended"])
async def test_a_real_4_rank_run_shows_its_stuck_rank_first(moment: str) -> None:
    records = recorded_4_records()
    stuck = next(i for i, r in enumerate(records) if r.get("event") == "rank_stuck")
    culprit = records[stuck]["rank"]
    # while the job waits on it, and after the teardown killed it
    shown = records[:stuck + 1] if moment == "stuck" else records
    state = RunState()
    for record in shown:
        state.apply(record)
    app = MonitorApp(StillSource(), state=state)
    async with app.run_test(size=BIG_SIZE) as pilot:
        await pilot.pause()
        header = app.query_one(JobHeader).text.plain
        table = app.query_one(RankTable)
        assert table.order[0] == culprit
        first_row = screen_text(app).splitlines()[3]
        assert first_row.split()[0] == str(culprit)
        if moment == "stuck":
            assert "world 4  0 failed  1 stuck  0 slow" in header
            assert "STUCK" in first_row
        else:
            exit_code = next(r for r in records if r.get("event") == "rank_exited"
                             and r["rank"] == culprit)["data"]["exit_code"]
            assert "world 4  1 failed  0 stuck  0 slow" in header
            assert f"killed (was stuck, exit {exit_code})" in first_row
        await pilot.press("s")  # by rank
        assert table.order == [0, 1, 2, 3]
        await pilot.press("escape", "f")  # outliers only
        assert table.order == [culprit]


async def test_question_mark_lists_every_key_the_monitor_binds() -> None:
    from tui.app import KEYS_HELP

    app = MonitorApp(StillSource(), state=big_state())
    shown: list[str] = []
    async with app.run_test(size=BIG_SIZE) as pilot:
        app.notify = lambda message, **_: shown.append(str(message))  # type: ignore[method-assign]
        await pilot.press("question_mark")
    assert shown == [KEYS_HELP.replace(" | ", "\n")]
    names = {"question_mark": "?", "slash": "/", "plus": "+", "minus": "-",
             "equals_sign": "+"}
    for binding in MonitorApp.BINDINGS:
        keys = str(getattr(binding, "key", "")).split(",")
        assert any(names.get(k, k) in shown[0] for k in keys), binding
