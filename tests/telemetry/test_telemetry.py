"""Telemetry: the schema, telemetry.msgpack and its damage reports, the coordinator's records,
step timings and trace placement against hand-computed values, the progress line, and one real
2-rank launch watched live, recorded, traced and summarised on a pipe."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Any

import anyio
import msgpack
import pytest
import zmq
import zmq.asyncio

from flowtrain import telemetry as T
from flowtrain.cli import main as cli_main
from flowtrain.control import Coordinator, FrameCodec, Kind
from flowtrain.telemetry.actor import step_timings
from flowtrain.telemetry.launcher import ProgressLine, parse_total_steps
from flowtrain.telemetry.trace import place_steps
from helpers import DATA, LAUNCH, REPO, child_env

SECRET = b"telemetry-test-secret-0123456789"
WORKER = DATA / "telemetry_worker.py"
STEPS = 30
MEM = {"model_states": 10, "parameters": 4, "gradients": 4, "optimizer_state": 2,
       "process_rss": 1000, "device_allocated": None}


def step_record(step: int, rank: int = 0, loss: float | None = 0.5) -> dict[str, Any]:
    return {"v": 1, "kind": "step", "rank": rank, "t": 1000.0 + step, "step": step, "loss": loss,
            "lr": 0.01, "loss_scale": 1.0, "skipped": 0, "grad_norm": None, "step_s": 0.1,
            "samples_per_s": 80.0, "tokens_per_s": None, "forward_s": 0.02, "backward_s": 0.04,
            "comm_s": 0.01, "optimizer_s": 0.01, "overlap": 0.75, "comm_share": 0.1,
            "mfu": None, "mem": dict(MEM)}


def sample_records() -> list[dict[str, Any]]:
    """One record of every kind."""
    return [
        T.job_record(job_id="j1", world_size=2, run_dir="/r", started=999.0, total_steps=None,
                     config_summary={"mode": "local"}, t=999.5),
        step_record(1),
        {"v": 1, "kind": "spans", "rank": 1, "t": 1001.0, "step": 1, "step_start": 1000.9,
         "spans": [["forward/mb0", 0.0, 0.01], ["reduce/bucket0", 0.02, 0.05]]},
        T.event_record("rank_stuck", "rank 1: no heartbeat", rank=1, data={"missed_beats": 5},
                       t=1002.0),
        {"v": 1, "kind": "heartbeat", "rank": 0, "t": 1003.0, "status": "busy",
         "busy_actor": "actor A handling B", "pending_collective": None},
    ]


# -- schema -----------------------------------------------------------------------------------


def test_every_kind_round_trips_through_encode_and_decode() -> None:
    for record in sample_records():
        data = T.encode(record)
        assert data == msgpack.packb(record, use_bin_type=True)  # plain msgpack, nothing added
        assert T.decode(data) == record
        assert T.topic_of(record) == f"telemetry.{record['kind']}"


@pytest.mark.parametrize("change,message", [
    ({"kind": "metrics"}, "field 'kind' is 'metrics', expected one of job, step, spans, event, "
                          "heartbeat"),
    ({"v": 2}, "field 'v' (schema version) is 2; this reader knows version 1"),
    ({"loss": "0.5"}, "step record: field 'loss' is '0.5', expected a number or null"),
    ({"step": -1}, "step record: field 'step' is -1, expected an integer >= 0"),
    ({"skipped": True}, "step record: field 'skipped' is True, expected an integer >= 0"),
    ({"overlap": 1.5}, "step record: field 'overlap' is 1.5, expected a number from 0 to 1 "
                       "or null"),
    ({"mem": {**MEM, "gradients": -3}}, "step record: mem['gradients'] is -3, expected a byte "
                                        "count (an integer >= 0)"),
])
def test_validate_names_the_field_the_value_and_the_right_form(change: dict[str, Any],
                                                               message: str) -> None:
    record = step_record(3) | change
    with pytest.raises(T.TelemetryError) as err:
        T.validate(record)
    assert str(err.value) == message
    with pytest.raises(T.TelemetryError):
        T.encode(record)  # a bad record fails at its writer


def test_validate_reports_a_missing_field_and_a_bad_span() -> None:
    record = step_record(3)
    del record["mem"]
    with pytest.raises(T.TelemetryError, match=r"^step record has no field 'mem' \(a map of "):
        T.validate(record)
    spans = {"v": 1, "kind": "spans", "rank": 0, "t": 1.0, "step": 1, "step_start": 1.0,
             "spans": [["forward/mb0", 0.2, 0.1]]}
    with pytest.raises(T.TelemetryError, match=r"spans\[0\] is \['forward/mb0', 0.2, 0.1\], "
                                               r"expected \[task name, start_s, end_s\]"):
        T.validate(spans)


# -- telemetry.msgpack ------------------------------------------------------------------------


def write_records(path: Path, records: list[dict[str, Any]]) -> None:
    recorder = T.TelemetryRecorder(path, flush_interval=0.01)
    for record in records:
        recorder.append(record)
    recorder.close()


def test_recorder_file_reads_back_in_order(tmp_path: Path) -> None:
    records = sample_records() + [step_record(s, rank=s % 2) for s in range(2, 200)]
    path = tmp_path / "telemetry.msgpack"
    write_records(path, records)
    assert path.read_bytes() == b"".join(msgpack.packb(r, use_bin_type=True) for r in records)
    assert list(T.read_records(path)) == records
    assert T.load_records(path) == (records, None)


def test_truncated_file_yields_the_good_records_then_the_damage_offset(tmp_path: Path) -> None:
    records = sample_records()
    sizes = [len(msgpack.packb(r, use_bin_type=True)) for r in records]
    path = tmp_path / "telemetry.msgpack"
    write_records(path, records)
    data = path.read_bytes()
    path.write_bytes(data[:-7])  # the writer died inside the last record
    seen: list[dict[str, Any]] = []
    with pytest.raises(T.TelemetryDamage) as err:
        for record in T.read_records(path):
            seen.append(record)
    assert seen == records[:-1]
    assert (err.value.offset, err.value.records_read) == (sum(sizes[:-1]), len(records) - 1)
    assert err.value.reason == f"the file ends inside a record ({sizes[-1] - 7} bytes after " \
                               f"the last whole record)"


def test_garbage_in_the_middle_stops_the_read_where_it_starts(tmp_path: Path) -> None:
    good = [step_record(s) for s in range(1, 6)]
    head = b"".join(msgpack.packb(r, use_bin_type=True) for r in good[:3])
    tail = b"".join(msgpack.packb(r, use_bin_type=True) for r in good[3:])
    path = tmp_path / "telemetry.msgpack"
    for garbage, reason in ((b"\xc1\x00\x01", "bytes that are not msgpack"),
                            (msgpack.packb([1, 2, 3]), "not a telemetry record: a telemetry "
                                                       "record is a map, got list")):
        path.write_bytes(head + garbage + tail)
        records, damage = T.load_records(path)
        assert records == good[:3]
        assert damage is not None
        assert (damage.offset, damage.records_read) == (len(head), 3)
        assert damage.reason.startswith(reason), damage.reason


def test_tail_returns_whole_records_as_a_writer_appends_them(tmp_path: Path) -> None:
    path = tmp_path / "telemetry.msgpack"
    first, second = (msgpack.packb(step_record(s), use_bin_type=True) for s in (1, 2))
    tail = T.TelemetryTail(path)
    assert tail.poll() == []  # no file yet
    path.write_bytes(first + second[:10])
    assert tail.poll() == [step_record(1)]
    with open(path, "ab") as f:
        f.write(second[10:])
    assert tail.poll() == [step_record(2)]
    assert (tail.offset, tail.count) == (len(first) + len(second), 2)


def test_find_run_picks_the_newest_run_by_start_time(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    for name, start in (("b-older", 100.0), ("a-newer", 200.0)):
        (runs / name).mkdir(parents=True)
        (runs / name / "job.json").write_text(json.dumps({"start_time": start}))
    (runs / "not-a-run").mkdir()
    assert T.find_run(runs) == runs / "a-newer"
    assert T.find_run(runs / "b-older") == runs / "b-older"
    with pytest.raises(FileNotFoundError, match="holds no run directory"):
        T.find_run(runs / "not-a-run")


# -- what the numbers mean ----------------------------------------------------------------------


def test_step_timings_overlap_is_hidden_share_of_collective_time() -> None:
    spans = [("forward/mb0", 0.1, 0.3), ("backward/mb0", 0.3, 1.0),
             ("reduce/bucket0", 0.5, 0.8), ("reduce/bucket1", 0.7, 1.3),  # overlapping
             ("comm/wait", 1.0, 1.3), ("optimizer/step", 1.3, 1.5)]
    got = step_timings([(n, a + 50, b + 50) for n, a, b in spans], 50.0)
    busy = 1.3 - 0.5  # union of the reduce spans
    expected = {"forward_s": 0.2, "backward_s": 0.7, "comm_s": 0.3, "optimizer_s": 0.2,
                "step_s": 1.5, "overlap": 1 - 0.3 / busy}
    assert got == pytest.approx(expected)
    assert step_timings([("forward/mb0", 0.0, 0.1)], 0.0)["overlap"] is None  # one rank


def test_tap_takes_spans_at_the_first_step_and_multiples_at_most_once_a_second(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from flowtrain.engine.stages import StepDone
    from flowtrain.telemetry import actor

    clock = [100.0]
    monkeypatch.setattr(actor.time, "perf_counter", lambda: clock[0])
    engine = SimpleNamespace(timer=SimpleNamespace(last_step=(0.0, [])))
    tap = actor.TelemetryTap(engine, spans_every=5)
    taken = []
    for step in range(1, 31):  # 0.3 s a step: every multiple of 5 is >= 1 s after the last
        clock[0] = 100.0 + 0.3 * step
        tap.send_from_thread(StepDone(step, False, 1.0, 0.1, None, 1.0))
        w = tap.take()
        if w is not None and w.spans is not None:
            taken.append(w.spans[0])
    assert taken == [1, 5, 10, 15, 20, 25, 30]
    tap = actor.TelemetryTap(engine, spans_every=5)
    taken = []
    for step in range(1, 31):  # 0.15 s a step: a multiple held back by the gap (5, 10, ...)
        clock[0] = 200.0 + 0.15 * step  # goes out with the first later step 1 s after the last
        tap.send_from_thread(StepDone(step, False, 1.0, 0.1, None, 1.0))
        w = tap.take()
        if w is not None and w.spans is not None:
            taken.append(w.spans[0])
    assert taken == [1, 8, 15, 22, 29]


def test_place_steps_shares_the_time_between_anchors_and_lays_the_rest_end_to_end() -> None:
    steps = [(s, [("forward/mb0", 0.2, 0.5), ("optimizer/step", 0.5, 1.0)]) for s in range(4)]
    assert place_steps(steps, {0: 10.0, 3: 16.0}) == [10.0, 12.0, 14.0, 16.0]
    assert place_steps(steps, {1: 5.0}) == [4.0, 5.0, 6.0, 7.0]
    assert place_steps(steps, {}) == [0.0, 1.0, 2.0, 3.0]


# -- the progress line ------------------------------------------------------------------------


def test_progress_line_rewrites_one_line_on_a_terminal_and_stays_out_of_the_way() -> None:
    out = StringIO()
    line = ProgressLine(out, 100, live=True)
    line.update(step_record(10) | {"loss": 0.25, "samples_per_s": 1234.5})
    assert out.getvalue() == "\r\x1b[2Kstep 10/100 (10%) | loss 0.25 | 1,234.5 samples/s"
    with line.hold():
        out.write("[rank0]: hello\n")
    assert out.getvalue().endswith("\r\x1b[2K[rank0]: hello\n\r\x1b[2Kstep 10/100 (10%) | "
                                   "loss 0.25 | 1,234.5 samples/s")
    line.finish()
    assert out.getvalue().endswith("samples/s\n")


def test_progress_line_plain_mode_prints_at_most_once_per_interval_and_the_last() -> None:
    out = StringIO()
    line = ProgressLine(out, None, live=False, plain_interval=3600)
    for step in range(1, 6):
        line.update(step_record(step, loss=step / 10))
    line.finish()
    assert out.getvalue() == ("progress: step 1 | loss 0.1 | 80.0 samples/s\n"
                              "progress: step 5 | loss 0.5 | 80.0 samples/s\n")
    with pytest.raises(ValueError, match="--total-steps must be a whole number of optimizer "
                                         "steps, got 'ten'"):
        parse_total_steps("ten", "--total-steps")


def test_launcher_side_records_everything_and_ends_the_live_line_on_a_failure(
        tmp_path: Path) -> None:
    from flowtrain.telemetry.launcher import JobTelemetry

    out = StringIO()
    job = JobTelemetry(tmp_path, job_id="j", world_size=2, total_steps=None, config_summary={},
                       started=5.0, progress=ProgressLine(out, None, live=True))
    stuck = T.event_record("rank_stuck", "rank 1: no heartbeat", rank=1, t=7.0)
    for record in (step_record(1), stuck, step_record(2)):
        job.on_record(record)
    job.child_exited(1, "rank 1", -9, "killed by SIGKILL", True)
    job.close(status="failed", exit_code=1, message="rank 1: no heartbeat")
    records, damage = T.load_records(tmp_path / T.TELEMETRY_FILE)
    assert damage is None
    assert records[:3] == [step_record(1), stuck, step_record(2)]
    assert (records[3]["event"], records[3]["rank"], records[3]["data"]) == \
        ("rank_failed", 1, {"exit_code": -9, "source": "exit", "failure": True})
    assert records[4]["event"] == "job_ended" and records[4]["data"] == {
        "status": "failed", "exit_code": 1, "root_cause": "rank 1: no heartbeat"}
    assert job.job_record["started"] == 5.0 and len(records) == 5  # job record: coordinator's
    line = "\r\x1b[2Kstep {} | loss 0.5 | 80.0 samples/s"
    assert out.getvalue() == line.format(1) + "\n" + line.format(2) + "\n"


# -- the coordinator ---------------------------------------------------------------------------


async def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)
    assert predicate(), what


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_coordinator_stamps_publishes_records_rejects_bad_ones_and_reports_stuck() -> None:
    records: list[dict[str, Any]] = []
    job = T.job_record(job_id="j", world_size=1, run_dir="/r", started=1.0, total_steps=3,
                       config_summary={})
    coordinator = Coordinator(world_size=1, secret=SECRET, heartbeat_interval=0.1,
                              heartbeat_misses=3, on_telemetry=records.append, job_record=job)
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"rank0")
    dealer.setsockopt(zmq.LINGER, 0)
    codec = FrameCodec(SECRET, "rank0")
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(coordinator.serve)
            subscriber = T.Subscriber(coordinator.pub_endpoint, SECRET, ["telemetry.step"])
            dealer.connect(coordinator.endpoint)
            await dealer.send_multipart(codec.encode(Kind.HELLO, {"rank": 0, "world_size": 1}))
            await dealer.recv_multipart()  # WELCOME
            live = None
            with anyio.fail_after(10):  # PUB drops what precedes the subscription: resend
                while live is None:
                    await dealer.send_multipart(codec.encode(
                        Kind.TELEMETRY, {"topic": "telemetry.step", "body": step_record(7, 5)}))
                    live = await subscriber.arecv(0.1)
            assert live == step_record(7, rank=0)  # the verified sender, not the body's 5
            bad = step_record(8)
            del bad["loss"]
            await dealer.send_multipart(codec.encode(
                Kind.TELEMETRY, {"topic": "telemetry.step", "body": bad}))
            await wait_for(lambda: coordinator.rejected.counts["malformed"] == 1, 5,
                           "the record without a loss is rejected")
            # rank 0 now falls silent: the coordinator must call it stuck, as a record too
            await wait_for(lambda: any(r.get("event") == "rank_stuck" for r in records), 5,
                           "rank_stuck event")
            subscriber.close()
            tg.cancel_scope.cancel()
    finally:
        dealer.close(linger=0)
        context.term()
    assert records[0] == job
    assert records[1]["event"] == "rank_joined" and records[1]["rank"] == 0
    assert all(r["step"] != 8 for r in records if r["kind"] == "step")
    stuck = next(r for r in records if r.get("event") == "rank_stuck")
    assert stuck["rank"] == 0 and stuck["data"]["missed_beats"] >= 3
    assert stuck["message"].startswith("rank 0: no heartbeat for ")


@pytest.mark.anyio
@pytest.mark.timeout(30)
async def test_job_ended_is_published_live_and_recorded_last(tmp_path: Path) -> None:
    from flowtrain.telemetry.launcher import JobTelemetry

    job = JobTelemetry(tmp_path, job_id="j", world_size=1, total_steps=None, config_summary={},
                       started=5.0)
    coordinator = Coordinator(world_size=1, secret=SECRET, on_telemetry=job.on_record,
                              job_record=job.job_record)
    async with anyio.create_task_group() as tg:
        await tg.start(coordinator.serve)
        job.advertise(coordinator, SECRET)
        assert T.live_endpoint(tmp_path) is not None
        subscriber = T.Subscriber(coordinator.pub_endpoint, SECRET, ["telemetry.event"])
        with anyio.fail_after(10):  # PUB drops what precedes the subscription: send until seen
            while await subscriber.arecv(0.1) is None:
                coordinator.publish_record(T.event_record("rank_joined", "rank 0 joined",
                                                          rank=0))
        job.close(status="failed", exit_code=1, message="rank 0: no heartbeat")
        job.close(status="succeeded", exit_code=0, message=None)  # once only
        with anyio.fail_after(10):
            live = await subscriber.arecv(5.0)
            while live is not None and live["event"] != "job_ended":
                live = await subscriber.arecv(5.0)
        subscriber.close()
        tg.cancel_scope.cancel()
    assert live is not None, "job_ended did not arrive live"
    assert live["rank"] == -1 and live["data"] == {
        "status": "failed", "exit_code": 1, "root_cause": "rank 0: no heartbeat"}
    records, damage = T.load_records(tmp_path / T.TELEMETRY_FILE)
    assert damage is None and records[0] == job.job_record
    assert records[-1] == live  # recorded once, last, as published
    assert [r.get("event") for r in records].count("job_ended") == 1
    assert T.live_endpoint(tmp_path) is None  # the job no longer advertises a live endpoint


# -- a real launch ------------------------------------------------------------------------------


@dataclass
class LiveRun:
    run_dir: Path
    stdout: str
    live: list[dict[str, Any]]  # records the subscriber received, with their arrival time
    arrived: list[float]
    reported: dict[int, list[dict[str, Any]]]  # rank -> what the worker saw each step


@pytest.fixture(scope="module")
def live_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    base = tmp_path_factory.mktemp("live")
    run_dir, out = base / "run", base / "out"
    out.mkdir()
    cmd = [*LAUNCH, "--nproc-per-node", "2",
           "--run-dir", str(run_dir), "--total-steps", str(STEPS), "--trace", str(WORKER),
           str(out), "--steps", str(STEPS), "--sleep", "0.02", "--hz", "1000",
           "--spans-every", "5"]
    with open(base / "stdout", "w") as stdout, open(base / "stderr", "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=stdout, stderr=stderr)
        try:
            live, arrived = _watch(proc, run_dir)
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    if code != 0:
        raise AssertionError(f"launch failed ({code}):\n{(base / 'stderr').read_text()[-6000:]}")
    reported = {r: json.loads((out / f"rank{r}.json").read_text())["steps"] for r in (0, 1)}
    yield LiveRun(run_dir, (base / "stdout").read_text(), live, arrived, reported)


def _watch(proc: subprocess.Popen[bytes], run_dir: Path) -> tuple[list[dict[str, Any]],
                                                                  list[float]]:
    """Subscribes as soon as the launcher advertises its endpoint; collects until the job ends."""
    deadline = time.monotonic() + 90
    endpoint = None
    while endpoint is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no live endpoint in {run_dir} (launcher exit {proc.poll()})")
        endpoint = T.live_endpoint(run_dir)
        time.sleep(0.02)
    live: list[dict[str, Any]] = []
    arrived: list[float] = []
    with T.Subscriber(*endpoint) as subscriber:
        while time.monotonic() < deadline:
            record = subscriber.recv(0.2)
            if record is not None:
                live.append(record)
                arrived.append(time.time())
            elif proc.poll() is not None:
                break
    return live, arrived


@pytest.mark.timeout(180)
def test_live_step_records_from_both_ranks_carry_the_losses_they_reported(
        live_run: LiveRun) -> None:
    for rank in (0, 1):
        steps = {r["step"]: r for r in live_run.live if r["kind"] == "step" and r["rank"] == rank}
        reported = {s["step"]: s for s in live_run.reported[rank]}
        assert sorted(steps) == list(range(1, STEPS + 1)), f"rank {rank} steps seen live"
        for step, record in steps.items():
            assert record["loss"] == pytest.approx(reported[step]["loss"], rel=1e-6, abs=0)
            assert record["skipped"] == 0 and record["lr"] == 0.01
            assert record["step_s"] >= record["forward_s"] + record["backward_s"] > 0
            assert 0.0 <= record["overlap"] <= 1.0  # two ranks: collectives ran
            assert record["mem"]["parameters"] == 448 * 4  # the test Net, fp32
    delays = [got - r["t"] for r, got in zip(live_run.live, live_run.arrived)
              if r["kind"] == "step"]
    assert max(delays) < 3.0, f"a step record took {max(delays):.2f} s to arrive"


@pytest.mark.timeout(180)
def test_recording_holds_what_was_published_live(live_run: LiveRun) -> None:
    recorded, damage = T.load_records(live_run.run_dir / T.TELEMETRY_FILE)
    assert damage is None
    # the coordinator validates what the ranks send: nothing may have been refused
    assert "control frame rejected" not in (live_run.run_dir / "launcher.jsonl").read_text()
    assert recorded[0]["kind"] == "job" and recorded[0]["total_steps"] == STEPS
    assert recorded[-1]["event"] == "job_ended" and recorded[-1]["data"]["status"] == "succeeded"
    # the subscriber joined before the ranks: it saw every rank record the file holds
    for kind in ("step", "spans"):
        live = [r for r in live_run.live if r["kind"] == kind]
        assert live == [r for r in recorded if r["kind"] == kind], kind
    live_events = [r for r in live_run.live if r["kind"] == "event"]
    assert live_events and all(r in recorded for r in live_events)
    # the job's end is published before the coordinator stops: a live monitor sees it
    assert live_run.live[-1] == recorded[-1]
    events = [(r["event"], r["rank"]) for r in recorded if r["kind"] == "event"]
    for expected in (("rank_joined", 0), ("rank_joined", 1), ("engine_started", 0),
                     ("rank_finished", 0), ("rank_finished", 1)):
        assert expected in events
    for rank in (0, 1):  # the first step, then multiples of 5 at most once a second
        spans = [r for r in recorded if r["kind"] == "spans" and r["rank"] == rank]
        assert spans[0]["step"] == 1
        for a, b in zip(spans, spans[1:]):
            assert b["t"] - a["t"] >= 0.99
            # a multiple of 5 held back by the 1 s gap goes out with a later step, before the
            # next multiple: on a slow host the 30 steps outlast the gap and e.g. 26 goes out
            multiple = b["step"] - b["step"] % 5
            assert a["step"] < multiple <= b["step"], (a["step"], b["step"])


@pytest.mark.timeout(180)
def test_trace_has_a_process_per_rank_and_the_plan_task_names(live_run: LiveRun,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert cli_main(["trace", str(live_run.run_dir), "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    assert (live_run.run_dir / "trace.json").read_text() == out.read_text()  # launch --trace
    events = trace["traceEvents"]
    assert {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"} == \
        {0: "rank 0", 1: "rank 1"}
    for rank in (0, 1):
        lines = (live_run.run_dir / "spans" / f"rank{rank}.jsonl").read_text().splitlines()
        recorded = {name for line in lines for name, _, _ in json.loads(line)["spans"]}
        traced = {e["name"] for e in events if e["ph"] == "X" and e["pid"] == rank
                  and not e["name"].startswith("step ")}
        assert traced == recorded
        assert {"forward/mb0", "backward/mb0", "comm/wait", "optimizer/step"} <= traced
        assert all(re.fullmatch(r"reduce/bucket\d+", n) for n in traced - {
            "forward/mb0", "backward/mb0", "comm/wait", "optimizer/step"})
        tracks = {e["args"]["name"] for e in events if e["name"] == "thread_name"
                  and e["pid"] == rank}
        assert {"steps", "compute", "reduce", "comm wait"} <= tracks
    # ranks share one clock: a collective ends at nearly the same moment on both ranks
    def wait_end(rank: int, step: int) -> float:
        return max(e["ts"] + e["dur"] for e in events if e["pid"] == rank and e["ph"] == "X"
                   and e["name"] == "comm/wait" and e["args"]["step"] == step)
    gaps = sorted(abs(wait_end(0, s) - wait_end(1, s)) for s in range(1, STEPS + 1))
    assert trace["otherData"]["ranks_aligned"] is True
    assert gaps[len(gaps) // 2] < 50_000, f"ranks {gaps} us apart"


@pytest.mark.timeout(180)
def test_progress_is_plain_lines_when_stdout_is_not_a_terminal(live_run: LiveRun) -> None:
    assert "\r" not in live_run.stdout
    lines = [line for line in live_run.stdout.splitlines() if line.startswith("progress: ")]
    last = live_run.reported[0][-1]
    assert lines[0].startswith("progress: step 1/30 (3%) | loss ")
    assert lines[-1].startswith(f"progress: step 30/30 (100%) | loss {last['loss']:.4g} | ")
    assert lines[-1].endswith("ETA 0:00:00")


def test_recorded_run_for_the_monitor_is_whole_and_tells_its_story() -> None:
    run = DATA / "telemetry_run"
    records, damage = T.load_records(run / T.TELEMETRY_FILE)
    assert damage is None
    assert records[0]["kind"] == "job" and records[-1]["event"] == "job_ended"
    assert json.loads((run / "job.json").read_text())["job_id"] == records[0]["job_id"]
    events = [r for r in records if r["kind"] == "event"]
    assert any(e["event"] == "skipped_step" and e["data"]["reason"] == "overflow" for e in events)
    assert [e["rank"] for e in events if e["event"] == "rank_stuck"] == [1]
    assert {r["rank"] for r in records if r["kind"] == "step"} == {0, 1}
    assert max(r["skipped"] for r in records if r["kind"] == "step") >= 1


def test_threads_left_behind_are_none() -> None:
    # The recorder's flush thread ends with close(): none may leak from the tests above.
    names = [t.name for t in threading.enumerate() if t.name == "flowtrain-telemetry-recorder"]
    assert names == []
