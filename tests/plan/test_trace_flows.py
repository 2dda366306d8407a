"""Traces in one layout (flowtrain.plan.trace_layout): flow arrows from every pipeline send to
its receive and between a collective's ranks, counter tracks of memory and loss scale, the
predicted step sharing the measured one's process and track names, and ``flowtrain trace
--with-prediction`` writing both into one file. Measured traces come from real recorded runs:
a 2-stage pipeline (tests/data/sim_run/pipeline) and a 2-rank data-parallel run with telemetry
(tests/data/telemetry_run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgpack
import pytest

from flowtrain.cli import main as cli_main
from flowtrain.telemetry.trace import PREDICTED_PID, build_trace
from helpers import DATA
from sim_helpers import PIPELINE_RUN
from sims.trace import run_prediction_trace

pytestmark = pytest.mark.timeout(120)
TELEMETRY_RUN = DATA / "telemetry_run"
# a builtin profile: the prediction's figures do not matter here, only its layout
CLUSTER = "h100-x8"


def recorded_spans(run: Path) -> dict[int, dict[int, list[tuple[str, float, float]]]]:
    """rank -> step -> spans, read from the spans files with json alone."""
    out: dict[int, dict[int, list[tuple[str, float, float]]]] = {}
    for path in sorted((run / "spans").glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out.setdefault(rank, {})[row["step"]] = [tuple(s) for s in row["spans"]]
    return out


def slices(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["ph"] == "X"]


def enclosing(events: list[dict[str, Any]], end: dict[str, Any]) -> dict[str, Any]:
    """The slice a flow end binds to: on its process and track, around its moment."""
    found = [e for e in slices(events) if e["pid"] == end["pid"] and e["tid"] == end["tid"]
             and e["ts"] <= end["ts"] <= e["ts"] + e["dur"]]
    assert len(found) == 1, (end, found)
    return found[0]


def flow_pairs(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(source slice, target slice) of every flow, checked to be one "s" and one "f" (bound
    to the enclosing slice) per id."""
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts.keys() == ends.keys()
    assert all(e["bp"] == "e" for e in ends.values())
    return [(enclosing(events, starts[i]), enclosing(events, ends[i])) for i in starts]


def test_every_pipeline_send_has_a_flow_to_its_receive() -> None:
    trace, summary = build_trace(PIPELINE_RUN)
    events = trace["traceEvents"]
    pairs = flow_pairs(events)
    recorded = recorded_spans(PIPELINE_RUN)
    for send, receive, src, dst in (("send_act", "recv_act", 0, 1),
                                    ("send_grad", "recv_grad", 1, 0)):
        expected = {(step, name.split("/")[1]) for step, spans in recorded[src].items()
                    for name, _, _ in spans if name.startswith(send + "/")}
        assert len(expected) == 6 * 4  # 6 steps of 4 micro-batches
        arrows = {(a["args"]["step"], a["name"].split("/")[1]) for a, b in pairs
                  if a["name"].startswith(send + "/") and a["pid"] == src and b["pid"] == dst
                  and b["name"] == f"{receive}/{a['name'].split('/')[1]}"
                  and b["args"]["step"] == a["args"]["step"]}
        assert arrows == expected
    assert summary["flows"] == len(pairs) == 2 * 6 * 4 and summary["stages"] == 2


def test_each_collective_has_flows_between_its_ranks() -> None:
    trace, _ = build_trace(TELEMETRY_RUN)
    pairs = flow_pairs(trace["traceEvents"])
    recorded = recorded_spans(TELEMETRY_RUN)
    both = {(step, name) for step in recorded[0].keys() & recorded[1].keys()
            for name, _, _ in recorded[0][step] if name.startswith("reduce/")
            and name in {n for n, _, _ in recorded[1][step]}}
    assert both
    arrows = {(a["args"]["step"], a["name"]) for a, b in pairs
              if a["name"] == b["name"] and {a["pid"], b["pid"]} == {0, 1}
              and a["args"]["step"] == b["args"]["step"]}
    assert arrows == both
    # the arrow leaves the rank that started the collective first
    for a, b in pairs:
        assert a["ts"] <= b["ts"]


def test_memory_and_loss_scale_are_counter_tracks_as_the_telemetry_recorded() -> None:
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed((TELEMETRY_RUN / "telemetry.msgpack").read_bytes())
    records = [r for r in unpacker if r["kind"] == "step"]
    trace, _ = build_trace(TELEMETRY_RUN)
    events = trace["traceEvents"]
    step_ends = {(e["pid"], e["args"]["step"]): e["ts"] + e["dur"] for e in slices(events)
                 if e["cat"] == "steps"}
    counters: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for e in events:
        if e["ph"] == "C":
            counters.setdefault((e["name"], e["pid"]), []).append(e)

    def counter(name: str, rank: int, at: float) -> dict[str, Any]:
        found = [e["args"] for e in counters[(name, rank)] if abs(e["ts"] - at) < 0.01]
        assert len(found) == 1, (name, rank, at)
        return found[0]

    checked = 0
    for record in records:
        at = step_ends.get((record["rank"], record["step"]))
        if at is None:
            continue  # a step the spans file does not hold
        scale = counter("loss scale", record["rank"], at)
        assert scale == {"loss scale": record["loss_scale"]}
        memory = counter("memory", record["rank"], at)
        assert memory["process_rss MiB"] == pytest.approx(record["mem"]["process_rss"] / 2**20,
                                                          abs=1e-3)
        checked += 1
    assert checked >= 40  # 2 ranks x 25 steps, less those without spans


def tracks_by_class(events: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    """(process name, task class) -> the name of the track its slices are on."""
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["name"] == "thread_name"}
    return {(processes[e["pid"]], e["name"].split("/")[0].split(" ")[0]):
            threads[(e["pid"], e["tid"])].rstrip(" 0123456789") for e in slices(events)}


def test_predicted_and_measured_traces_share_process_and_track_names() -> None:
    measured, _ = build_trace(PIPELINE_RUN)
    predicted = run_prediction_trace(PIPELINE_RUN, CLUSTER)
    names = lambda t: {e["args"]["name"] for e in t["traceEvents"]  # noqa: E731
                       if e["name"] == "process_name"}
    assert names(measured) == names(predicted) == {"rank 0", "rank 1"}
    measured_tracks = tracks_by_class(measured["traceEvents"])
    predicted_tracks = tracks_by_class(predicted["traceEvents"])
    shared = measured_tracks.keys() & predicted_tracks.keys()
    classes = {c for _, c in shared}
    assert {"forward", "backward", "send_act", "send_grad", "optimizer", "step"} <= classes
    assert {k: measured_tracks[k] for k in shared} == {k: predicted_tracks[k] for k in shared}
    # the simulator has no receive task: each send flows to the pass on the next stage
    events = predicted["traceEvents"]
    arrows = {(a["name"], b["name"], a["pid"], b["pid"]) for a, b in flow_pairs(events)}
    sends = [e for e in slices(events) if e["name"].startswith("send_act/")]
    assert len(sends) == 4
    for send in sends:
        mb = send["name"].split("/")[1]
        assert (send["name"], f"forward/{mb}", 0, 1) in arrows


def test_trace_with_prediction_writes_both_into_one_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(PIPELINE_RUN, run)
    (run / "job.json").write_text(json.dumps({"job_id": "pipe", "status": "succeeded"}))
    out = tmp_path / "both.json"
    assert cli_main(["trace", str(run), "--with-prediction", "--cluster", CLUSTER,
                     "-o", str(out)]) == 0
    assert "with the predicted step" in capsys.readouterr().out
    events = json.loads(out.read_text())["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1", PREDICTED_PID: "rank 0 (predicted)",
                         PREDICTED_PID + 1: "rank 1 (predicted)"}
    order = {e["pid"]: e["args"]["sort_index"] for e in events
             if e["name"] == "process_sort_index"}
    assert sorted(order, key=order.__getitem__) == [0, PREDICTED_PID, 1, PREDICTED_PID + 1]
    # the predicted step starts where rank 0's last measured step starts
    last = max(e["ts"] for e in slices(events) if e["pid"] == 0 and e["cat"] == "steps")
    assert min(e["ts"] for e in slices(events) if e["pid"] >= PREDICTED_PID) == \
        pytest.approx(last, abs=0.01)
    ids = [e["id"] for e in events if e["ph"] == "s"]
    assert len(ids) == len(set(ids)) == 48 + 8  # measured and predicted flows kept apart


def test_interleaved_sends_find_the_receiving_chunk() -> None:
    """With model chunks, a send names the sender's chunk and the receive the receiver's
    (flowtrain.plan.names): the last stage's chunk c feeds chunk c+1 of stage 0, and stage
    0's gradient of chunk c goes back to chunk c-1 of the last stage."""
    from flowtrain.plan import names
    from flowtrain.plan.trace_layout import receive_of

    assert receive_of(names.pipe_op("send_act", 2, 0), 0, 2) == \
        (names.pipe_op("recv_act", 2, 0), 1)
    assert receive_of(names.pipe_op("send_act", 2, 0), 1, 2) == \
        (names.pipe_op("recv_act", 2, 1), 0)
    assert receive_of(names.pipe_op("send_grad", 3, 1), 0, 2) == \
        (names.pipe_op("recv_grad", 3, 0), 1)
    assert receive_of(names.pipe_op("send_grad", 3, 1), 1, 2) == \
        (names.pipe_op("recv_grad", 3, 1), 0)
    # without chunks nothing comes after the last stage or before the first
    assert receive_of(names.pipe_op("send_act", 0), 1, 2) is None
    assert receive_of(names.pipe_op("send_grad", 0), 0, 2) is None
    assert receive_of("forward/mb0", 0, 2) is None


def test_with_prediction_on_a_run_without_a_plan_says_what_is_missing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli_main(["trace", str(TELEMETRY_RUN), "--with-prediction", "--cluster", CLUSTER,
                     "-o", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"flowtrain trace: error: --with-prediction: "
                   f"{str(TELEMETRY_RUN / 'plan.json')!r} is missing; it is written by rank 0 "
                   f"of a run started with `flowtrain launch`")
    assert not (tmp_path / "t.json").exists()
