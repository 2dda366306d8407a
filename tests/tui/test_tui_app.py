"""The monitor driven headless with a Pilot: a recorded real run and synthetic recordings
replayed (rows, stuck rank, events, keys, pause, a damaged recording), the live source, the
text snapshots of each view, and live monitoring of a coordinator and a launcher."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from pathlib import Path
from typing import Any

import anyio
import msgpack
import pytest

from flowtrain.control.coordinator import Coordinator
from tui.app import MonitorApp
from tui.event_log import EventLog
from tui.header import JobHeader
from tui.rank_table import RankTable
from tui.source import LiveSource
from tui.state import RunState
from tui.timeline import Timeline
from tui_helpers import (
    LAST_STEP,
    RECORDED,
    SIZE,
    T0,
    check_snapshot,
    make_record,
    replay,
    replayed,
    row,
    screen_text,
    synthetic_records,
    wait_for,
    write_recording,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


# ----------------------------------------------------------------------------- replay on screen
def raw_records(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """The recording read with msgpack alone (not the code under test): records and the byte
    offset where each one ends."""
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(path.read_bytes())
    records, ends = [], []
    for record in unpacker:
        records.append(record)
        ends.append(unpacker.tell())
    return records, ends


def last_step(records: list[dict[str, Any]], rank: int) -> dict[str, Any]:
    return max((r for r in records if r["kind"] == "step" and r["rank"] == rank),
               key=lambda r: r["step"])


async def test_replay_of_a_recorded_run_shows_ranks_stuck_rank_events_and_health() -> None:
    records, _ = raw_records(RECORDED)
    stuck = [r for r in records if r["kind"] == "event" and r["event"] == "rank_stuck"]
    skipped = [r for r in records if r["kind"] == "event" and r["event"] == "skipped_step"]
    assert [r["rank"] for r in stuck] == [1] and skipped, "the recording changed its story"
    app = MonitorApp(replay(RECORDED))
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app)
        for rank in (0, 1):
            expected = last_step(records, rank)
            shown = row(app, rank)
            assert shown["step"] == str(expected["step"])
            assert shown["loss"] == f"{expected['loss']:.4f}"
            assert shown["scale"] == f"{expected['loss_scale']:g}"
        # rank 1 was declared stuck, said goodbye in the teardown (rank_finished), then was
        # killed with the job: it failed, and the failed rank heads the table
        exited = next(r for r in records if r.get("event") == "rank_exited" and r["rank"] == 1)
        assert row(app, 1)["status"] == \
            f"killed (was stuck, exit {exited['data']['exit_code']})"
        assert row(app, 0)["status"] == "finished"
        assert app.query_one(RankTable).order == [1, 0]
        header = app.query_one(JobHeader).text.plain
        job = records[0]
        assert f"step {last_step(records, 0)['step']}/{job['total_steps']}" in header
        # the recorded job failed (a rank stuck, the job torn down): the header says so
        ended = next(r for r in records if r.get("event") == "job_ended")
        assert f"job failed (exit {ended['data']['exit_code']})" in header and "ETA -" in header
        # No mfu in this run (CPU): n/a; exposed communication is a few percent: under 20%.
        comm = statistics.mean(last_step(records, r)["comm_share"] for r in (0, 1))
        assert "FLOPs util n/a (>60%)" in header
        assert f"comm share {comm * 100:.0f}% (<20%)" in header
        await pilot.press("t", "t")
        log = app.query_one(EventLog).lines()
        events = [r for r in records if r["kind"] == "event"]
        # what both ranks said alike is one line: a step both skipped, both joining, ...
        lines: dict[tuple[Any, ...], tuple[str, list[int]]] = {}
        for number, r in enumerate(events):
            alike = r["event"] in ("rank_joined", "rank_finished", "rank_exited",
                                   "skipped_step", "engine_started")
            key = (r["event"], r["data"].get("step"), r["data"].get("exit_code")) if alike \
                else (number,)
            lines.setdefault(key, (r["event"], []))[1].append(r["rank"])
        assert len(lines) < len(events)
        assert [line.split(" | ")[2] for line in log] == [name for name, _ in lines.values()]
        assert [line.split(" | ")[1] for line in log] == [
            "ranks 0-1" if len(set(ranks)) == 2 else "job" if ranks[0] < 0 else f"rank {ranks[0]}"
            for _, ranks in lines.values()]
        stuck_line = log[list(lines).index((events.index(stuck[0]),))]
        assert stuck_line.split(" | ")[1] == "rank 1" and "no heartbeat" in stuck_line
        assert any("2 ranks: step 1 skipped" in line for line in log)
        assert "2 ranks joined" in log[0]


async def test_replay_shows_a_stuck_rank_finished_once_it_says_goodbye(tmp_path: Path) -> None:
    records = synthetic_records()
    stuck_at = records[-1]["t"]
    path = tmp_path / "telemetry.msgpack"
    write_recording(path, records)
    app = MonitorApp(replay(path))
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app)
        assert row(app, 1)["status"] == "STUCK"
    finished = make_record("event", -1, stuck_at + 1, event="rank_finished",
                           message="rank 1 finished", data={"rank": 1})
    write_recording(path, [*records, finished])
    app = MonitorApp(replay(path))
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app)
        assert row(app, 1)["status"] == "finished (was stuck)"
        assert row(app, 0)["status"] == "busy (reducer)"  # rank 0 has not finished


async def test_pause_stops_the_replay_and_resume_goes_on(recording: Path) -> None:
    app = MonitorApp(replay(recording, speed=10.0), refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: (app.state.current_step() or 0) >= 2)
        await pilot.press("p")
        paused_at = app.state.current_step()
        assert paused_at is not None and paused_at < LAST_STEP - 2
        shown = row(app, 0)["step"]
        await pilot.pause(0.6)  # 6 s of recording at 10x: about 10 steps if it went on
        assert app.state.current_step() == paused_at
        assert row(app, 0)["step"] == shown
        assert "paused" in app.query_one(JobHeader).text.plain
        await pilot.press("p")
        await wait_for(pilot, lambda: (app.state.current_step() or 0) > (paused_at or 0) + 1)


async def test_keys_pick_ranks_switch_views_change_speed_and_quit(recording: Path) -> None:
    source = replay(recording, speed=2.0)
    app = MonitorApp(source)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: len(app.state.ranks) == 2 and app.selected_rank == 0)
        await pilot.press("r")
        assert app.selected_rank == 1
        assert app.query_one(RankTable).selected == 1
        await pilot.press("up")
        assert app.selected_rank == 0
        await pilot.press("t")
        assert app.view == "timeline"
        await pilot.press("down")
        assert app.selected_rank == 1
        await wait_for(pilot, lambda: app.state.ranks[1].spans_step is not None)
        app.redraw(force=True)
        await pilot.pause()
        assert "rank 1  step" in app.query_one(Timeline).text()
        await pilot.press("tab")
        assert app.view == "events"
        await pilot.press("tab")
        assert app.view == "plots"
        await pilot.press("tab")
        assert app.view == "overview"
        await pilot.press("plus")
        assert source.speed == 10.0
        await pilot.press("plus", "plus")
        assert math.isinf(source.speed)
        await pilot.press("minus")
        assert source.speed == 10.0
        table = app.query_one(RankTable)
        if app.selected_rank == table.order[0]:
            await pilot.press("r")
        assert app.selected_rank != table.order[0]
        await pilot.click(RankTable, offset=(4, 1))  # the row under the header: the top rank
        assert app.selected_rank == table.order[0]
        await pilot.press("q")
        await pilot.pause()
        assert not app.is_running


async def test_damaged_recording_shows_the_good_records_and_where_it_stopped(
        tmp_path: Path) -> None:
    records, ends = raw_records(RECORDED)
    # Cut 5 bytes into the record after rank 0's step 10.
    good = next(i for i, r in enumerate(records)
                if r["kind"] == "step" and r["rank"] == 0 and r["step"] == 10)
    cut = tmp_path / "telemetry.msgpack"
    cut.write_bytes(RECORDED.read_bytes()[:ends[good] + 5])
    app = MonitorApp(replay(cut))
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app)
        assert row(app, 0)["step"] == "10"
        rank1_steps = [r["step"] for r in records[:good + 1]
                       if r["kind"] == "step" and r["rank"] == 1]
        assert row(app, 1)["step"] == str(max(rank1_steps))
        notice = str(app.query_one("#notice").render())
        assert f"stopped at byte {ends[good]} after {good + 1} records" in notice
        assert "ends inside a record" in notice
        assert not app.query_one("#notice").has_class("hidden")


async def test_live_source_holds_records_while_paused() -> None:
    records = synthetic_records()
    gate = asyncio.Event()

    async def feed() -> Any:
        for record in records[:10]:
            yield record
        await gate.wait()
        for record in records[10:20]:
            yield record
        await asyncio.Event().wait()

    source = LiveSource("tcp://127.0.0.1:1", b"k" * 32, feed=feed)
    state = RunState()
    task = asyncio.create_task(source.run(state))
    try:
        while state.records < 10:
            await asyncio.sleep(0.01)
        source.set_paused(True)
        gate.set()
        await asyncio.sleep(0.1)
        assert state.records == 10
        assert "paused, 10 records held" in source.describe()
        source.set_paused(False)
        assert state.records == 20
    finally:
        task.cancel()


# ----------------------------------------------------------------------------- snapshots
@pytest.mark.parametrize("view", ["overview", "timeline", "events", "plots"])
async def test_snapshot(view: str) -> None:
    app = MonitorApp(replay(RECORDED))
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app)
        while app.view != view:
            await pilot.press("t")
        if view == "timeline":
            await pilot.press("r")
        app.redraw(force=True)
        await pilot.pause()
        check_snapshot(f"monitor_{view}", screen_text(app))


async def test_live_monitor_shows_what_the_coordinator_publishes() -> None:
    secret = b"s" * 32
    coordinator = Coordinator(world_size=2, secret=secret)
    shift = time.time() - (T0 + 12.0)  # the recording's last record lands "now"
    records = [dict(r, t=r["t"] + shift) for r in synthetic_records()]
    async with anyio.create_task_group() as tasks:
        await tasks.start(coordinator.serve)
        app = MonitorApp(LiveSource(coordinator.pub_endpoint, secret), refresh_s=0.05)
        async with app.run_test(size=SIZE) as pilot:
            # PUB drops what it sends before the subscription is through: repeat the job record
            # until it shows, then send the run.
            while app.state.job.world_size is None:
                coordinator.publish_record(records[0])
                await pilot.pause(0.05)
            for record in records[1:]:
                coordinator.publish_record(record)
            await wait_for(pilot, lambda: row(app, 1).get("status") == "STUCK")
            assert row(app, 0)["step"] == row(app, 1)["step"] == str(LAST_STEP)
            assert "live from tcp://" in app.query_one(JobHeader).text.plain
        tasks.cancel_scope.cancel()


async def test_live_monitor_shows_the_job_end_the_launcher_publishes(tmp_path: Path) -> None:
    from flowtrain.telemetry.launcher import JobTelemetry

    secret = b"s" * 32
    job = JobTelemetry(tmp_path, job_id="20300115-080000-test", world_size=2, total_steps=None,
                       config_summary={}, started=time.time())
    coordinator = Coordinator(world_size=2, secret=secret, on_telemetry=job.on_record)
    shift = time.time() - (T0 + 12.0)
    steps = [dict(r, t=r["t"] + shift) for r in synthetic_records() if r["kind"] == "step"]
    async with anyio.create_task_group() as tasks:
        await tasks.start(coordinator.serve)
        job.advertise(coordinator, secret)
        app = MonitorApp(LiveSource(coordinator.pub_endpoint, secret), refresh_s=0.05)
        async with app.run_test(size=SIZE) as pilot:
            while app.state.job.world_size is None:  # until the subscription is through
                coordinator.publish_record(job.job_record)
                await pilot.pause(0.05)
            for record in steps:
                coordinator.publish_record(record)
            coordinator.publish_record(dict(steps[0], rank=0, step=LAST_STEP + 1,
                                            t=time.time()))
            await wait_for(pilot, lambda: row(app, 0).get("step") == str(LAST_STEP + 1))
            assert "job ended" not in app.query_one(JobHeader).text.plain
            job.close(status="succeeded", exit_code=0, message=None)
            await wait_for(pilot, lambda: "job ended" in app.query_one(JobHeader).text.plain)
            app.state.now += 600  # long after: the ranks must not turn stale
            app.redraw(force=True)
            await pilot.pause()
            assert row(app, 0)["status"] == row(app, 1)["status"] == "ended"
        tasks.cancel_scope.cancel()


async def test_a_diverged_run_replays_with_its_nan_and_inf_losses(tmp_path: Path) -> None:
    records = synthetic_records()
    for r in records:  # steps 8 and after diverge: NaN, then inf
        if r["kind"] == "step" and r["step"] >= 8:
            r["loss"] = math.nan if r["step"] < 10 else math.inf
    path = tmp_path / "telemetry.msgpack"
    write_recording(path, records)
    app = MonitorApp(replay(path))
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app)
        text = screen_text(app)
        assert "loss inf" in text and "not finite" in text, text
        # the plot shows the finite steps; the monitor keeps working
        await pilot.press("t")
        await pilot.press("t")
        assert app.state.current_step() == LAST_STEP


def test_series_label_counts_what_is_not_finite() -> None:
    from tui.plots import plottable, series_label

    values = [3.0, 2.5, math.nan, math.inf]
    assert series_label("loss", values, lambda v: f"{v:.1f}") == \
        "loss inf  (min 2.5, max 3.0, 4 steps, 2 not finite)"
    assert plottable(values) == [3.0, 2.5]
    assert series_label("loss", [math.nan], str) == "loss nan  (1 steps, 1 not finite)"
