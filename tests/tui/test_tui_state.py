"""The monitor's run model (tui.state) and what its widgets make of it: stale and stuck ranks,
history averages, rank rows, health figures against their targets, timeline lanes."""

from __future__ import annotations

import pytest

from tui.header import BAD_STYLE, GOOD_STYLE, UNKNOWN_STYLE, figure_style
from tui.rank_table import row_cells
from tui.state import RunState
from tui.timeline import busy_share, lane_columns, lane_of
from tui_helpers import LAST_STEP, T0, make_record, step_record, synthetic_records

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


# ----------------------------------------------------------------------------- the model
def test_state_marks_a_silent_rank_stale_after_three_usual_intervals() -> None:
    state = RunState()
    for second in range(5):
        for rank in (0, 1):
            state.apply(make_record("heartbeat", rank, T0 + second, status="busy",
                                    busy_actor=None, pending_collective=None))
    for second in range(5, 9):
        state.apply(make_record("heartbeat", 0, T0 + second, status="busy", busy_actor=None,
                                pending_collective=None))
    state.now = T0 + 4 + 2.9  # rank 1 usually reports every 1 s; silent for 2.9 s
    assert state.ranks[1].status(state.now, state.ended) == "busy"
    state.now = T0 + 4 + 3.1
    assert state.ranks[1].status(state.now, state.ended) == "stale"
    assert state.ranks[0].status(state.now, state.ended) == "busy"


def test_state_stuck_event_marks_the_rank_until_it_steps_again() -> None:
    state = RunState()
    state.apply(step_record(1, 3, T0))
    state.apply(make_record("event", -1, T0 + 1, event="rank_stuck", message="silent",
                            data={"rank": 1}))
    assert state.ranks[1].status(T0 + 1, False) == "stuck"
    state.apply(step_record(1, 4, T0 + 2))
    assert state.ranks[1].status(T0 + 2, False) != "stuck"


def test_state_a_stuck_rank_that_finishes_shows_finished_one_killed_failed() -> None:
    state = RunState()
    for second in range(4):
        for rank in (0, 1, 2):
            state.apply(make_record("heartbeat", rank, T0 + second, status="busy",
                                    busy_actor=None, pending_collective=None))
    state.apply(make_record("event", -1, T0 + 5, event="rank_stuck", message="rank 1: silent",
                            data={"rank": 1}))
    state.apply(make_record("event", -1, T0 + 5, event="rank_stuck", message="rank 2: silent",
                            data={"rank": 2}))
    assert [state.ranks[r].status(T0 + 7, False) for r in (0, 1, 2)] == \
        ["stale", "stuck", "stuck"]  # rank 0: silent for 4 s at a 1 s rhythm
    state.apply(make_record("event", 0, T0 + 6, event="rank_finished", message="", data={}))
    state.apply(make_record("event", 1, T0 + 6, event="rank_finished", message="", data={}))
    state.apply(make_record("event", 2, T0 + 6, event="rank_exited",
                            message="rank 2 terminated by the launcher (SIGKILL)",
                            data={"exit_code": -9, "source": "exit", "failure": False}))
    later = T0 + 600  # long past three usual intervals: finished ranks are silent on purpose
    assert [state.ranks[r].status(later, False) for r in (0, 1, 2)] == \
        ["finished", "finished", "failed"]  # rank 2 was killed while stuck: the culprit
    assert row_cells(state.ranks[2], later, False)[-1] == \
        ("killed (was stuck, exit -9)", "bold white on red")
    # saying goodbye in the teardown does not clear it: killed afterwards, it failed too
    state.apply(make_record("event", 1, T0 + 8, event="rank_exited", message="killed",
                            data={"exit_code": -9, "source": "exit", "failure": False}))
    assert state.ranks[1].status(later, False) == "failed"
    state.ranks[1].exit_code = None  # (as before that exit, for the row checks below)
    cells = [dict(zip(("text", "style"), row_cells(state.ranks[r], later, False)[-1]))
             for r in (0, 1)]
    assert cells == [{"text": "finished", "style": ""},
                     {"text": "finished (was stuck)", "style": ""}]
    assert {spec for _, spec in row_cells(state.ranks[1], later, False)} == {""}  # not dimmed
    state.apply(make_record("event", 3, T0 + 7, event="rank_exited", message="rank 3 exited",
                            data={"exit_code": 0, "source": "exit", "failure": False}))
    assert state.ranks[3].status(later, False) == "exited"


def test_state_history_averages_loss_and_throughput_over_complete_steps() -> None:
    state = RunState()
    for record in synthetic_records():
        state.apply(record)
    losses = state.loss_history()
    assert len(losses) == LAST_STEP
    assert losses[-1] == pytest.approx(3.0 - 0.1 * LAST_STEP + 0.0005)
    assert state.throughput_history()[0] == pytest.approx(80.0 + 1 - 1)
    # ETA: 12 of 20 steps in the 12 s since the job started; 8 left at that pace.
    assert state.eta() == pytest.approx(8 * (state.now - T0) / 12)
    state.apply(make_record("event", -1, state.now, event="job_ended", message="done", data={}))
    assert state.eta() is None


def test_rank_rows_dim_silent_ranks_and_mark_stuck_ones() -> None:
    state = RunState()
    for second in range(4):
        state.apply(step_record(0, second + 1, T0 + second))
        state.apply(step_record(1, second + 1, T0 + second))
    state.apply(step_record(0, 5, T0 + 10))
    fresh = row_cells(state.ranks[0], state.now, state.ended)
    silent = row_cells(state.ranks[1], state.now, state.ended)
    assert {spec for _, spec in fresh} == {""}
    assert silent[-1] == ("stale", "yellow")
    assert {spec for _, spec in silent[:-1]} == {"dim"}
    state.apply(make_record("event", 1, T0 + 10, event="rank_stuck", message="", data={}))
    stuck = row_cells(state.ranks[1], state.now, state.ended)
    assert stuck[-1] == ("STUCK", "bold red")


def test_health_figures_hold_each_value_against_its_target() -> None:
    state = RunState()
    state.apply(step_record(0, 1, T0))
    state.apply(step_record(1, 1, T0))
    mfu, mbu, comm = state.health()
    assert mfu.value == pytest.approx(0.68) and mfu.meets is True
    assert figure_style(mfu) == GOOD_STYLE
    assert mbu.value is None and mbu.meets is None and "n/a" in mbu.text()
    assert figure_style(mbu) == UNKNOWN_STYLE
    assert comm.value == pytest.approx(0.28) and comm.meets is False
    assert figure_style(comm) == BAD_STYLE


def test_timeline_lanes_follow_task_names_and_overlaps_count_once() -> None:
    assert [lane_of(n) for n in ("forward/mb0", "backward/mb3", "reduce/bucket2",
                                 "gather/bucket0", "optimizer/step", "comm/wait", "mystery")] \
        == [0, 0, 1, 2, 3, 4, 5]
    spans = [("reduce/a", 0.0, 0.5), ("reduce/b", 0.25, 0.75), ("forward/mb0", 0.0, 1.0)]
    assert busy_share(spans, 1, 1.0) == pytest.approx(0.75)
    columns = lane_columns(spans, 1.0, 4)
    assert columns[1] == [True, True, True, False]
    assert columns[0] == [True, True, True, True]


def test_a_job_record_with_an_absurd_world_size_is_refused_with_a_message() -> None:
    import tracemalloc

    from tui.state import MAX_WORLD_SIZE

    state = RunState()
    tracemalloc.start()
    state.apply({"v": 1, "kind": "job", "rank": -1, "t": 1.0, "job_id": "x",
                 "world_size": 10**7})
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 10 * 2**20  # no row per announced rank
    assert state.job.world_size is None and not state.ranks
    assert any(e.event == "bad_job_record" and "10000000" in e.message and
               f"{MAX_WORLD_SIZE:,}" in e.message for e in state.events)
    state.apply({"v": 1, "kind": "job", "rank": -1, "t": 2.0, "job_id": "y", "world_size": 4})
    assert state.job.world_size == 4 and sorted(state.ranks) == [0, 1, 2, 3]


def test_a_failed_job_says_so_in_the_header() -> None:
    from tui.header import header_text

    state = RunState()
    state.apply({"v": 1, "kind": "job", "rank": -1, "t": 1.0, "job_id": "x", "world_size": 2})
    state.apply({"v": 1, "kind": "event", "rank": -1, "t": 2.0, "event": "job_ended",
                 "message": "job failed (exit code 1)",
                 "data": {"status": "failed", "exit_code": 1, "root_cause": "boom"}})
    assert "job failed (exit 1)" in header_text(state, "replay").plain
    ok = RunState()
    ok.apply({"v": 1, "kind": "event", "rank": -1, "t": 2.0, "event": "job_ended",
              "message": "job succeeded", "data": {"status": "succeeded", "exit_code": 0}})
    assert "job ended" in header_text(ok, "replay").plain
