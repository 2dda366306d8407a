"""What the monitor (tui/) tests share: a synthetic 2-rank recording, the recorded real run,
the headless screen read back as text, and the text snapshots in tests/snapshots."""

from __future__ import annotations

import asyncio
import html
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from flowtrain.telemetry import encode
from tui.app import MonitorApp
from tui.rank_table import RankTable
from tui.source import ReplaySource
from tui.state import RunState

SNAPSHOTS = Path(__file__).parent / "snapshots"
# A real 2-rank run recorded by the telemetry tests (tests/make_telemetry_run.py).
RECORDED = Path(__file__).parent / "data" / "telemetry_run" / "telemetry.msgpack"
UPDATE_SNAPSHOTS = os.environ.get("FLOWTRAIN_UPDATE_SNAPSHOTS") == "1"
SIZE = (120, 34)
T0 = 1_800_000_000.0
LAST_STEP = 12
TOTAL_STEPS = 20


class StillSource:
    """A source with nothing more to say: the state the app is given is all there is."""

    paused = False

    async def run(self, state: RunState) -> None:
        return None

    def set_paused(self, paused: bool) -> None:
        self.paused = paused

    def describe(self) -> str:
        return "test"


def make_record(kind: str, rank: int, t: float, **fields: Any) -> dict[str, Any]:
    return {"v": 1, "kind": kind, "rank": rank, "t": t, **fields}


def step_record(rank: int, step: int, t: float) -> dict[str, Any]:
    scale = 65536.0 if step < 5 else 32768.0
    return make_record(
        "step", rank, t, step=step, loss=3.0 - 0.1 * step + 0.001 * rank, lr=1e-3,
        loss_scale=scale, skipped=0 if step < 5 else 1, grad_norm=1.5, step_s=0.4,
        samples_per_s=80.0 + step - 2 * rank, tokens_per_s=None, forward_s=0.1,
        backward_s=0.2, comm_s=0.12, optimizer_s=0.04, overlap=0.5,
        comm_share=(0.30, 0.26)[rank], mfu=(0.70, 0.66)[rank],
        mem={"model_states": 1 << 20, "parameters": 1 << 19, "gradients": 1 << 19,
             "optimizer_state": 1 << 20, "process_rss": 512 << 20, "device_allocated": None})


def spans_record(rank: int, step: int, t: float) -> dict[str, Any]:
    late = 0.04 * rank  # rank 1's reduces run late: the timeline should show it
    spans = [["forward/mb0", 0.0, 0.1], ["backward/mb0", 0.1, 0.3],
             ["reduce/bucket0", 0.2 + late, 0.32 + late], ["reduce/bucket1", 0.28, 0.36],
             ["comm/wait", 0.3, 0.36 + late], ["optimizer/step", 0.36 + late, 0.4 + late]]
    return make_record("spans", rank, t, step=step, spans=spans, step_start=t - 0.4)


def synthetic_records() -> list[dict[str, Any]]:
    """A 2-rank run: 12 steps every 0.5 s, a step skipped for an overflow at step 5, then
    rank 1 falls silent (last heard at +7 s), rank 0 waits in a reduce and the coordinator
    reports rank 1 stuck at +10 s; the recording ends at +12 s."""
    records = [make_record("job", -1, T0, job_id="20300115-080000-test", world_size=2,
                           run_dir="runs/20300115-080000-test", started=T0, total_steps=TOTAL_STEPS,
                           config_summary={"zero_stage": 2, "dtype": "fp16"})]
    records += [make_record("event", rank, T0 + 0.5, event="rank_joined",
                            message=f"rank {rank} joined", data={}) for rank in (0, 1)]
    for step in range(1, LAST_STEP + 1):
        t = T0 + 1.0 + 0.5 * step
        for rank in (0, 1):
            records.append(step_record(rank, step, t + 0.01 * rank))
            records.append(spans_record(rank, step, t + 0.01 * rank))
        if step == 5:
            records.append(make_record("event", 0, t + 0.02, event="skipped_step",
                                       message="step 5 skipped: gradient overflow, loss scale "
                                               "65536 -> 32768",
                                       data={"step": 5, "reason": "overflow",
                                             "loss_scale": 32768.0}))
    for second in range(2, 13):
        for rank in (0, 1):
            if rank == 1 and second > 7:
                continue
            waiting = second > 7
            records.append(make_record("heartbeat", rank, T0 + second + 0.005,
                                       status="busy",
                                       busy_actor="reducer" if waiting else "trainer",
                                       pending_collective="reduce/bucket0" if waiting else None))
    records.append(make_record("event", 1, T0 + 10.0, event="rank_stuck",
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



# ----------------------------------------------------------------------------- many ranks
BIG_RANKS = 256
RANKS_PER_NODE = 8
BIG_SLOW = 137  # 1.4x the others' step time
BIG_STUCK = 201  # stops after step 3 and is declared stuck
BIG_STEPS = 6
BASE_STEP_S = 0.4


def big_step_s(rank: int) -> float:
    """A rank's step time: within 2 % of BASE_STEP_S, 1.4 times it for the slow rank."""
    if rank == BIG_SLOW:
        return BASE_STEP_S * 1.4
    return BASE_STEP_S * (1 + 0.004 * ((rank * 37) % 11 - 5))


def big_records(ranks: int = BIG_RANKS) -> list[dict[str, Any]]:
    """A synthetic ``ranks``-rank run on nodes of 8 (``node00``, ...): every rank joins,
    steps BIG_STEPS times, except BIG_STUCK which stops after step 3 and is declared stuck."""
    records = [make_record("job", -1, T0, job_id="20300115-090000-big", world_size=ranks,
                           run_dir="runs/big", started=T0, total_steps=100, config_summary={})]
    for rank in range(ranks):
        records.append(make_record("event", rank, T0 + 0.1 + rank * 1e-4, event="rank_joined",
                                   message=f"rank {rank} joined",
                                   data={"host": f"node{rank // RANKS_PER_NODE:02d}",
                                         "pid": 1000 + rank, "local_rank": rank % 8}))
    for step in range(1, BIG_STEPS + 1):
        t = T0 + 1.0 + 0.5 * step
        for rank in range(ranks):
            if rank == BIG_STUCK and step > 3:
                continue
            record = step_record(rank % 2, step, t + rank * 1e-5)
            record.update(rank=rank, step_s=big_step_s(rank), loss=3.0 - 0.1 * step)
            records.append(record)
    records.append(make_record("event", -1, T0 + 1.0 + 0.5 * BIG_STEPS + 0.2,
                               event="rank_stuck", message=f"rank {BIG_STUCK}: no heartbeat",
                               data={"rank": BIG_STUCK}))
    return records
