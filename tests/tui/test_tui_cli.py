"""`flowtrain monitor`: which run it replays or watches live, the endpoint's secret, bad input
as one line and exit 2, and the live source's history before live records."""

from __future__ import annotations

import asyncio
import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest

from flowtrain.cli import main as cli_main
from flowtrain.telemetry import write_live_endpoint
from tui.app import MonitorApp
from tui.cli import SECRET_ENV, MonitorInputError, resolve_source
from tui.source import LiveSource, ReplaySource, parse_speed
from tui.state import RunState
from tui_helpers import RECORDED, TOTAL_STEPS, synthetic_records, write_recording

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


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
    with socket.socket() as listener:  # something must answer for the monitor to subscribe
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
        assert isinstance(resolve_source(endpoint), LiveSource)


def test_monitor_refuses_an_endpoint_nothing_answers_at(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    import time

    monkeypatch.setenv(SECRET_ENV, "ab" * 32)
    started = time.monotonic()
    with pytest.raises(MonitorInputError, match="nothing answers at tcp://127.0.0.1:1"):
        resolve_source("tcp://127.0.0.1:1")
    assert time.monotonic() - started < 5
    for bad in ("tcp://", "tcp://127.0.0.1", "tcp://host:99999", "udp://h:1"):
        with pytest.raises(MonitorInputError, match="tcp://"):
            resolve_source(bad)


@pytest.mark.parametrize("args, expected", [
    (["monitor", "{tmp}/missing"], "run directory {tmp}/missing does not exist"),
    (["monitor", "{tmp}/runs/20300101-000000-none"], "has no telemetry.msgpack to"),
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
    import sys

    started: list[MonitorApp] = []
    monkeypatch.setattr(MonitorApp, "run", lambda app: started.append(app))
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # a terminal to draw on
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



def _summary_run(tmp_path: Path, records: list[dict[str, Any]], job: dict[str, Any]) -> Path:
    from tui_helpers import write_recording

    run = tmp_path / "runs" / "20300101-000000-sum"
    run.mkdir(parents=True)
    write_recording(run / "telemetry.msgpack", records)
    (run / "job.json").write_text(json.dumps(job))
    return run


def _steps(world: int, slow: int, stuck: int | None = None) -> list[dict[str, Any]]:
    from tui_helpers import T0, make_record, step_record

    records = [make_record("job", -1, T0, job_id="20300101-000000-sum", world_size=world,
                           run_dir="x", started=T0, total_steps=10, config_summary={})]
    for step in range(1, 6):
        for rank in range(world):
            record = step_record(rank % 2, step, T0 + step)
            record.update(rank=rank, step_s=0.4 * (1.5 if rank == slow else 1.0) *
                          (1 + 0.01 * rank))
            records.append(record)
    if stuck is not None:
        records.append(make_record("event", -1, T0 + 7, event="rank_stuck",
                                   message=f"rank {stuck} sent no heartbeat for 9 s",
                                   data={"rank": stuck}))
    records.append(make_record("event", -1, T0 + 9, event="job_ended", message="job failed",
                               data={}))
    return records


def test_summary_names_the_root_cause_the_outliers_and_exits_with_the_job(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = {"job_id": "20300101-000000-sum", "status": "failed", "exit_code": 1,
           "root_cause": {"rank": 5, "message": "killed by SIGKILL"}}
    run = _summary_run(tmp_path, _steps(8, slow=3, stuck=5), job)
    assert cli_main(["monitor", str(run), "--summary"]) == 1
    out = capsys.readouterr().out
    assert "failed, exit 1" in out
    assert "root cause: rank 5: killed by SIGKILL" in out
    assert "rank 5: stuck" in out and "rank 3: slow (1.4" in out
    assert "rank 2:" not in out  # the others are within the noise
    assert cli_main(["monitor", str(run), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert [(o["rank"], o["status"]) for o in report["outliers"]] == [(5, "stuck"), (3, "slow")]
    assert report["events"]["job_ended"] == 1


def test_without_a_terminal_the_monitor_prints_the_summary(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _summary_run(tmp_path, _steps(2, slow=-1), {"status": "succeeded", "exit_code": 0})
    # pytest's stdout is no terminal: no screen, no escape codes, and it returns
    assert cli_main(["monitor", str(run)]) == 0
    out = capsys.readouterr().out
    assert "succeeded, exit 0, 5 steps on 2 ranks" in out and "\x1b[" not in out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_summary_of_a_real_failed_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import subprocess

    from helpers import LAUNCH, REPO, child_env

    script = tmp_path / "fails.py"
    script.write_text("import os, flowtrain\nflowtrain.init_distributed()\n"
                      "if os.environ['RANK'] == '1':\n"
                      "    raise RuntimeError('rank one gives up')\n")
    run = tmp_path / "run"
    proc = subprocess.run([*LAUNCH, "--nproc-per-node", "2", "--run-dir", str(run),
                           str(script)], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode != 0
    code = cli_main(["monitor", str(run), "--summary"])
    out = capsys.readouterr().out
    assert code != 0, out
    assert "root cause: rank 1" in out and "rank one gives up" in out, out


def test_summary_names_a_rank_killed_while_stuck_as_failed(
        capsys: pytest.CaptureFixture[str]) -> None:
    import msgpack

    from tui_helpers import RECORDED

    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(RECORDED.read_bytes())
    stuck = next(r for r in unpacker if r.get("event") == "rank_stuck")
    assert cli_main(["monitor", str(RECORDED.parent), "--summary"]) == 1
    out = capsys.readouterr().out
    assert f"  rank {stuck['rank']}: failed (killed while stuck: {stuck['message']})" in out, out
    assert "ranks: 2 (1 failed, 1 finished)" in out
