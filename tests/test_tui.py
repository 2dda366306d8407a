"""The monitor (tui/): its run model, replay and live sources, the screens driven headless with a
Pilot (replayed rows, stuck rank, events, keys, a damaged recording), text snapshots, the CLI."""

from __future__ import annotations

import asyncio
import html
import json
import math
import os
import re
import socket
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgpack
import pytest

from flowtrain.cli import main as cli_main
from flowtrain.control.coordinator import Coordinator
from flowtrain.telemetry import encode, write_live_endpoint
from tui.app import MonitorApp
from tui.cli import SECRET_ENV, MonitorInputError, resolve_source
from tui.event_log import EventLog
from tui.header import BAD_STYLE, GOOD_STYLE, UNKNOWN_STYLE, JobHeader, figure_style
from tui.rank_table import RankTable, row_cells
from tui.source import LiveSource, ReplaySource, parse_speed
from tui.state import RunState
from tui.timeline import Timeline, busy_share, lane_columns, lane_of

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

SNAPSHOTS = Path(__file__).parent / "snapshots"
# A real 2-rank run recorded by the telemetry tests (tests/make_telemetry_run.py).
RECORDED = Path(__file__).parent / "data" / "telemetry_run" / "telemetry.msgpack"
UPDATE_SNAPSHOTS = os.environ.get("FLOWTRAIN_UPDATE_SNAPSHOTS") == "1"
SIZE = (120, 34)
T0 = 1_800_000_000.0
LAST_STEP = 12
TOTAL_STEPS = 20


@pytest.fixture()
def anyio_backend() -> str:
    return "asyncio"  # Textual runs on asyncio


# ----------------------------------------------------------------------------- the recording
def _record(kind: str, rank: int, t: float, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "kind": kind, "rank": rank, "t": t, **fields}


def _step(rank: int, step: int, t: float) -> dict[str, Any]:
    scale = 65536.0 if step < 5 else 32768.0
    return _record(
        "step", rank, t, step=step, loss=3.0 - 0.1 * step + 0.001 * rank, lr=1e-3,
        loss_scale=scale, skipped=0 if step < 5 else 1, grad_norm=1.5, step_s=0.4,
        samples_per_s=80.0 + step - 2 * rank, tokens_per_s=None, forward_s=0.1,
        backward_s=0.2, comm_s=0.12, optimizer_s=0.04, overlap=0.5,
        comm_share=(0.30, 0.26)[rank], mfu=(0.70, 0.66)[rank],
        mem={"model_states": 1 << 20, "parameters": 1 << 19, "gradients": 1 << 19,
             "optimizer_state": 1 << 20, "process_rss": 512 << 20, "device_allocated": None})


def _spans(rank: int, step: int, t: float) -> dict[str, Any]:
    late = 0.04 * rank  # rank 1's reduces run late: the timeline should show it
    spans = [["forward/mb0", 0.0, 0.1], ["backward/mb0", 0.1, 0.3],
             ["reduce/bucket0", 0.2 + late, 0.32 + late], ["reduce/bucket1", 0.28, 0.36],
             ["comm/wait", 0.3, 0.36 + late], ["optimizer/step", 0.36 + late, 0.4 + late]]
    return _record("spans", rank, t, step=step, spans=spans, step_start=t - 0.4)


def synthetic_records() -> list[dict[str, Any]]:
    """A 2-rank run: 12 steps every 0.5 s, a step skipped for an overflow at step 5, then
    rank 1 falls silent (last heard at +7 s), rank 0 waits in a reduce and the coordinator
    reports rank 1 stuck at +10 s; the recording ends at +12 s."""
    records = [_record("job", -1, T0, job_id="20300115-080000-test", world_size=2,
                       run_dir="runs/20300115-080000-test", started=T0, total_steps=TOTAL_STEPS,
                       config_summary={"zero_stage": 2, "dtype": "fp16"})]
    records += [_record("event", rank, T0 + 0.5, event="rank_joined",
                        message=f"rank {rank} joined", data={}) for rank in (0, 1)]
    for step in range(1, LAST_STEP + 1):
        t = T0 + 1.0 + 0.5 * step
        for rank in (0, 1):
            records.append(_step(rank, step, t + 0.01 * rank))
            records.append(_spans(rank, step, t + 0.01 * rank))
        if step == 5:
            records.append(_record("event", 0, t + 0.02, event="skipped_step",
                                   message="step 5 skipped: gradient overflow, loss scale "
                                           "65536 -> 32768",
                                   data={"step": 5, "reason": "overflow",
                                         "loss_scale": 32768.0}))
    for second in range(2, 13):
        for rank in (0, 1):
            if rank == 1 and second > 7:
                continue
            waiting = second > 7
            records.append(_record("heartbeat", rank, T0 + second + 0.005,
                                   status="busy", busy_actor="reducer" if waiting else "trainer",
                                   pending_collective="reduce/bucket0" if waiting else None))
    records.append(_record("event", 1, T0 + 10.0, event="rank_stuck",
                           message="rank 1 silent for 3.0s, busy in backward",
                           data={"rank": 1, "silent_s": 3.0}))
    records.sort(key=lambda r: r["t"])
    return records


def write_recording(path: Path, records: list[dict[str, Any]]) -> list[int]:
    """Writes the stream and returns each record's end offset."""
    ends, blob = [], b""
    for record in records:
        blob += encode(record)  # validates against the schema as it writes
        ends.append(len(blob))
    path.write_bytes(blob)
    return ends


@pytest.fixture()
def recording(tmp_path: Path) -> Path:
    path = tmp_path / "run" / "telemetry.msgpack"
    path.parent.mkdir()
    write_recording(path, synthetic_records())
    return path


def replay(path: Path, speed: float = math.inf) -> ReplaySource:
    return ReplaySource(path, speed)


async def wait_for(pilot: Any, predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("the screen did not get there in time")
        await pilot.pause(0.02)


async def replayed(pilot: Any, app: MonitorApp) -> None:
    """Waits for the replay to end and the screen to catch up with it."""
    await wait_for(pilot, lambda: getattr(app.source, "done", False))
    app.redraw(force=True)
    await pilot.pause()


def row(app: MonitorApp, rank: int) -> dict[str, str]:
    return app.query_one(RankTable).cells_of(rank)


def screen_text(app: MonitorApp) -> str:
    """The screen as plain text, read back from the SVG screenshot (Textual's public export):
    each text run sits at column x / character width of line N."""
    svg = app.export_screenshot()
    width, height = app.size
    lines = [[" "] * width for _ in range(height)]
    pattern = re.compile(r'<text [^>]*x="([\d.]+)"[^>]*textLength="([\d.]+)"[^>]*'
                         r'line-(\d+)\)"[^>]*>(.*?)</text>')
    for x, length, line, raw in pattern.findall(svg):
        text = html.unescape(raw).replace("\xa0", " ")
        char = float(length) / len(text)
        column = round(float(x) / char)
        for offset, ch in enumerate(text):
            if int(line) < height and column + offset < width:
                lines[int(line)][column + offset] = ch
    return "\n".join("".join(chars).rstrip() for chars in lines) + "\n"


def check_snapshot(name: str, text: str) -> None:
    path = SNAPSHOTS / f"{name}.txt"
    if UPDATE_SNAPSHOTS or not path.exists():
        if not UPDATE_SNAPSHOTS:
            pytest.fail(f"no snapshot {path}; run with FLOWTRAIN_UPDATE_SNAPSHOTS=1 to write it")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return
    expected = path.read_text(encoding="utf-8")
    assert text == expected, f"screen differs from {path} (FLOWTRAIN_UPDATE_SNAPSHOTS=1 " \
                             f"rewrites it):\n{text}"


# ----------------------------------------------------------------------------- the model
def test_state_marks_a_silent_rank_stale_after_three_usual_intervals() -> None:
    state = RunState()
    for second in range(5):
        for rank in (0, 1):
            state.apply(_record("heartbeat", rank, T0 + second, status="busy",
                                busy_actor=None, pending_collective=None))
    for second in range(5, 9):
        state.apply(_record("heartbeat", 0, T0 + second, status="busy", busy_actor=None,
                            pending_collective=None))
    state.now = T0 + 4 + 2.9  # rank 1 usually reports every 1 s; silent for 2.9 s
    assert state.ranks[1].status(state.now, state.ended) == "busy"
    state.now = T0 + 4 + 3.1
    assert state.ranks[1].status(state.now, state.ended) == "stale"
    assert state.ranks[0].status(state.now, state.ended) == "busy"


def test_state_stuck_event_marks_the_rank_until_it_steps_again() -> None:
    state = RunState()
    state.apply(_step(1, 3, T0))
    state.apply(_record("event", -1, T0 + 1, event="rank_stuck", message="silent",
                        data={"rank": 1}))
    assert state.ranks[1].status(T0 + 1, False) == "stuck"
    state.apply(_step(1, 4, T0 + 2))
    assert state.ranks[1].status(T0 + 2, False) != "stuck"


def test_state_a_stuck_rank_that_finishes_shows_finished_and_never_goes_stale() -> None:
    state = RunState()
    for second in range(4):
        for rank in (0, 1, 2):
            state.apply(_record("heartbeat", rank, T0 + second, status="busy",
                                busy_actor=None, pending_collective=None))
    state.apply(_record("event", -1, T0 + 5, event="rank_stuck", message="rank 1: silent",
                        data={"rank": 1}))
    state.apply(_record("event", -1, T0 + 5, event="rank_stuck", message="rank 2: silent",
                        data={"rank": 2}))
    assert [state.ranks[r].status(T0 + 7, False) for r in (0, 1, 2)] == \
        ["stale", "stuck", "stuck"]  # rank 0: silent for 4 s at a 1 s rhythm
    state.apply(_record("event", 0, T0 + 6, event="rank_finished", message="", data={}))
    state.apply(_record("event", 1, T0 + 6, event="rank_finished", message="", data={}))
    state.apply(_record("event", 2, T0 + 6, event="rank_exited",
                        message="rank 2 terminated by the launcher (SIGKILL)",
                        data={"exit_code": -9, "source": "exit", "failure": False}))
    later = T0 + 600  # long past three usual intervals: finished ranks are silent on purpose
    assert [state.ranks[r].status(later, False) for r in (0, 1, 2)] == \
        ["finished", "finished", "stuck"]  # rank 2 was killed while stuck: the culprit
    cells = [dict(zip(("text", "style"), row_cells(state.ranks[r], later, False)[-1]))
             for r in (0, 1)]
    assert cells == [{"text": "finished", "style": ""},
                     {"text": "finished (was stuck)", "style": ""}]
    assert {spec for _, spec in row_cells(state.ranks[1], later, False)} == {""}  # not dimmed
    state.apply(_record("event", 3, T0 + 7, event="rank_exited", message="rank 3 exited",
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
    state.apply(_record("event", -1, state.now, event="job_ended", message="done", data={}))
    assert state.eta() is None


def test_rank_rows_dim_silent_ranks_and_mark_stuck_ones() -> None:
    state = RunState()
    for second in range(4):
        state.apply(_step(0, second + 1, T0 + second))
        state.apply(_step(1, second + 1, T0 + second))
    state.apply(_step(0, 5, T0 + 10))
    fresh = row_cells(state.ranks[0], state.now, state.ended)
    silent = row_cells(state.ranks[1], state.now, state.ended)
    assert {spec for _, spec in fresh} == {""}
    assert silent[-1] == ("stale", "yellow")
    assert {spec for _, spec in silent[:-1]} == {"dim"}
    state.apply(_record("event", 1, T0 + 10, event="rank_stuck", message="", data={}))
    stuck = row_cells(state.ranks[1], state.now, state.ended)
    assert stuck[-1] == ("STUCK", "bold red")


def test_health_figures_hold_each_value_against_its_target() -> None:
    state = RunState()
    state.apply(_step(0, 1, T0))
    state.apply(_step(1, 1, T0))
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
        # rank 1 was declared stuck, then said goodbye in the teardown (rank_finished)
        assert row(app, 1)["status"] == "finished (was stuck)"
        assert row(app, 0)["status"] == "finished"
        header = app.query_one(JobHeader).text.plain
        job = records[0]
        assert f"step {last_step(records, 0)['step']}/{job['total_steps']}" in header
        assert "job ended" in header and "ETA -" in header
        # No mfu in this run (CPU): n/a; exposed communication is a few percent: under 20%.
        comm = statistics.mean(last_step(records, r)["comm_share"] for r in (0, 1))
        assert "FLOPs util n/a (>60%)" in header
        assert f"comm share {comm * 100:.0f}% (<20%)" in header
        await pilot.press("t", "t")
        log = app.query_one(EventLog).lines()
        events = [r for r in records if r["kind"] == "event"]
        assert len(log) == len(events)
        assert [line.split(" | ")[2] for line in log] == [r["event"] for r in events]
        stuck_line = log[events.index(stuck[0])]
        assert stuck_line.split(" | ")[1] == "rank 1" and "no heartbeat" in stuck_line
        assert any("step 1 skipped" in line for line in log)


async def test_replay_shows_a_stuck_rank_finished_once_it_says_goodbye(tmp_path: Path) -> None:
    records = synthetic_records()
    stuck_at = records[-1]["t"]
    path = tmp_path / "telemetry.msgpack"
    write_recording(path, records)
    app = MonitorApp(replay(path))
    async with app.run_test(size=SIZE) as pilot:
        await replayed(pilot, app)
        assert row(app, 1)["status"] == "STUCK"
    finished = _record("event", -1, stuck_at + 1, event="rank_finished",
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
        assert app.view == "overview"
        await pilot.press("plus")
        assert source.speed == 10.0
        await pilot.press("plus", "plus")
        assert math.isinf(source.speed)
        await pilot.press("minus")
        assert source.speed == 10.0
        assert app.selected_rank == 1
        await pilot.click(RankTable, offset=(4, 1))  # the row under the header: rank 0
        assert app.selected_rank == 0
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
@pytest.mark.parametrize("view", ["overview", "timeline", "events"])
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


# ----------------------------------------------------------------------------- the command
def _run_dir(base: Path, name: str, started: float, status: str = "succeeded",
             telemetry: bool = True) -> Path:
    run = base / "runs" / name
    run.mkdir(parents=True)
    (run / "job.json").write_text(json.dumps({"job_id": name, "start_time": started,
                                              "status": status}))
    if telemetry:
        write_recording(run / "telemetry.msgpack", synthetic_records())
    return run


def test_monitor_without_argument_replays_the_newest_run(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    _run_dir(tmp_path, "20300101-000000-aaaa", started=100.0)
    newest = _run_dir(tmp_path, "20300101-000001-bbbb", started=200.0)
    monkeypatch.chdir(tmp_path)
    source = resolve_source(None, parse_speed("10"))
    assert isinstance(source, ReplaySource)
    assert source.path == newest / "telemetry.msgpack" and source.speed == 10.0


def test_monitor_subscribes_live_only_when_the_run_is_running_and_its_endpoint_answers(
        tmp_path: Path) -> None:
    run = _run_dir(tmp_path, "20300101-000000-live", started=1.0, status="running")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        write_live_endpoint(run, endpoint, b"x" * 32)
        live = resolve_source(str(run))
        assert isinstance(live, LiveSource) and live.endpoint == endpoint
        assert live.history == run / "telemetry.msgpack"  # what was sent before joining
    # The launcher died without updating job.json: nobody answers, so the recording replays.
    assert isinstance(resolve_source(str(run)), ReplaySource)


def test_monitor_endpoint_needs_the_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(MonitorInputError, match=SECRET_ENV):
        resolve_source("tcp://127.0.0.1:5555")
    monkeypatch.setenv(SECRET_ENV, "zz")
    with pytest.raises(MonitorInputError, match="hex digits"):
        resolve_source("tcp://127.0.0.1:5555")
    monkeypatch.setenv(SECRET_ENV, "ab" * 32)
    assert isinstance(resolve_source("tcp://127.0.0.1:5555"), LiveSource)


@pytest.mark.parametrize("args, expected", [
    (["monitor", "{tmp}/missing"], "run directory {tmp}/missing does not exist"),
    (["monitor", "{tmp}/runs/20300101-000000-none"], "has no telemetry.msgpack to replay"),
    (["monitor", "--speed", "3", "{tmp}"], "invalid choice: '3'"),
])
def test_monitor_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], expected: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    _run_dir(tmp_path, "20300101-000000-none", started=1.0, telemetry=False)
    code = cli_main([a.format(tmp=tmp_path) for a in args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("flowtrain monitor: error: ")
    assert expected.format(tmp=tmp_path) in err


def test_monitor_command_replays_the_run_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[MonitorApp] = []
    monkeypatch.setattr(MonitorApp, "run", lambda app: started.append(app))
    assert cli_main(["monitor", str(RECORDED.parent), "--speed", "max"]) == 0
    (app,) = started
    assert isinstance(app.source, ReplaySource)
    assert app.source.path == RECORDED and math.isinf(app.source.speed)


async def test_live_source_shows_the_recording_first_and_each_record_once(tmp_path: Path) -> None:
    records = synthetic_records()
    history = tmp_path / "telemetry.msgpack"
    write_recording(history, records[:40])

    async def feed() -> Any:
        for record in records[30:]:  # joined 10 records before the recording's end
            yield record
        await asyncio.Event().wait()

    state = RunState()
    source = LiveSource("tcp://127.0.0.1:1", b"k" * 32, history=history, feed=feed)
    task = asyncio.create_task(source.run(state))
    try:
        while state.records < len(records):
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
    finally:
        task.cancel()
    assert state.records == len(records)
    assert state.job.total_steps == TOTAL_STEPS  # the job record only the recording had
    assert all(totals.ranks == 2 for totals in state.steps.values())
