"""``flowtrain trace``: the measured task spans of a run (``spans/rank<R>.jsonl``) as one
Chrome/Perfetto trace, one process per rank and one track per kind of work, ranks on one clock
(the layout of ``flowtrain.plan.trace_layout``, which predicted traces share), with flow arrows
from each pipeline send to its receive and between a collective's ranks, and counter tracks of
each rank's memory and loss scale where the telemetry recorded them. ``--with-prediction`` lays
the simulator's step over it in the same file."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowtrain.plan import names
from flowtrain.plan.trace_layout import (
    SENDS,
    TrackLanes,
    flow_events,
    process_events,
    slice_event,
    track_of,
)
from flowtrain.telemetry.files import TELEMETRY_FILE, TelemetryDamage, find_run, read_records

TRACE_FILE = "trace.json"
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl$")
MIB = 1 << 20
# the memory figures of a step record drawn as counters, in MiB
MEMORY_COUNTERS = ("model_states", "process_rss", "device_allocated")
# a predicted rank's process sorts right after the measured one, under its own pid
PREDICTED_PID = 1_000_000
PREDICTED_SUFFIX = " (predicted)"

Span = tuple[str, float, float]


class TraceInputError(ValueError):
    """The run directory has nothing a trace can be made of; the message says what is missing."""


def read_spans(path: Path) -> tuple[list[tuple[int, list[Span]]], int]:
    """The steps of one rank's spans file in file order, and how many lines were unreadable
    (a rank killed mid-write leaves a cut last line)."""
    steps: list[tuple[int, list[Span]]] = []
    bad = 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
                spans = [(str(n), float(a), float(b)) for n, a, b in row["spans"]]
                steps.append((int(row["step"]), spans))
            except (ValueError, KeyError, TypeError):
                bad += 1
    return steps, bad


def read_telemetry(run_dir: Path) -> tuple[dict[int, dict[int, float]],
                                            dict[int, dict[int, dict[str, Any]]]]:
    """From telemetry.msgpack (if any): rank -> {step: unix start} of the "spans" records, and
    rank -> {step: step record}."""
    anchors: dict[int, dict[int, float]] = {}
    steps: dict[int, dict[int, dict[str, Any]]] = {}
    path = run_dir / TELEMETRY_FILE
    if not path.is_file():
        return anchors, steps
    try:
        for record in read_records(path):
            if record["kind"] == "spans":
                anchors.setdefault(record["rank"], {})[record["step"]] = \
                    float(record["step_start"])
            elif record["kind"] == "step":
                steps.setdefault(record["rank"], {})[record["step"]] = dict(record)
    except TelemetryDamage:
        pass  # the records read before the damage still place their steps
    return anchors, steps


def step_anchors(run_dir: Path) -> dict[int, dict[int, float]]:
    """rank -> {step: unix start} from the "spans" records of telemetry.msgpack (if any)."""
    return read_telemetry(run_dir)[0]


def pipeline_stages(run_dir: Path, spans: list[list[Span]], ranks: int) -> int:
    """The run's pipeline stages: as its stage records say (stages/stage<S>.json), else, when
    its ranks send activations, one stage per rank; else 1."""
    for path in sorted((run_dir / "stages").glob("stage*.json")):
        try:
            stages = json.loads(path.read_text(encoding="utf-8")).get("stages")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(stages, int) and stages > 0:
            return stages
    sends = any(names.task_class(n) in SENDS for step in spans for n, _, _ in step)
    return ranks if sends else 1


def counter_events(rank: int, at_s: float, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The rank's memory (MiB) and loss scale at ``at_s``, as counter ("C") events."""
    ts = round(at_s * 1e6, 3)
    out = []
    mem = record.get("mem")
    if isinstance(mem, dict):
        values = {f"{key} MiB": round(mem[key] / MIB, 3) for key in MEMORY_COUNTERS
                  if isinstance(mem.get(key), (int, float))}
        if values:
            out.append({"ph": "C", "name": "memory", "pid": rank, "ts": ts, "args": values})
    scale = record.get("loss_scale")
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        out.append({"ph": "C", "name": "loss scale", "pid": rank, "ts": ts,
                    "args": {"loss scale": float(scale)}})
    return out


def place_steps(steps: list[tuple[int, list[Span]]], anchors: dict[int, float]) -> list[float]:
    """The start time of each step. Anchored steps (their start was published) stand where they
    were measured; between two anchors the steps are laid end to end and the time left over
    (data loading, user code between steps) is shared out evenly; before the first and after
    the last anchor they are laid end to end. Without anchors the first step starts at 0."""
    if not steps:
        return []
    lengths = [max((b for _, _, b in spans), default=0.0) for _, spans in steps]
    starts: list[float | None] = [anchors.get(step) for step, _ in steps]
    known = [i for i, s in enumerate(starts) if s is not None]
    if not known:
        starts[0] = 0.0
        known = [0]
    for left, right in zip(known, known[1:]):
        laid = sum(lengths[left:right])
        span = starts[right] - starts[left]  # type: ignore[operator]
        gap = max(0.0, (span - laid) / (right - left))
        for i in range(left + 1, right):
            starts[i] = starts[i - 1] + lengths[i - 1] + gap  # type: ignore[operator]
    for i in range(known[-1] + 1, len(steps)):
        starts[i] = starts[i - 1] + lengths[i - 1]  # type: ignore[operator]
    for i in range(known[0] - 1, -1, -1):
        starts[i] = starts[i + 1] - lengths[i]  # type: ignore[operator]
    return [float(s) for s in starts]  # type: ignore[arg-type]


def build_trace(run_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trace in Chrome's JSON object format, summary) for a run directory."""
    run = Path(run_dir)
    files = sorted(((int(m.group(1)), p) for p in (run / "spans").glob("rank*.jsonl")
                    if (m := _RANK_FILE.search(p.name))), key=lambda x: x[0])
    if not files:
        raise TraceInputError(f"{run} has no spans/rank<R>.jsonl; task spans are recorded by "
                              "ranks started with `flowtrain launch` that train through "
                              "flowtrain.initialize")
    anchors, records = read_telemetry(run)
    placed: list[tuple[int, list[tuple[int, list[Span]]], list[float]]] = []
    bad_lines = 0
    for rank, path in files:
        steps, bad = read_spans(path)
        bad_lines += bad
        if steps:
            placed.append((rank, steps, place_steps(steps, anchors.get(rank, {}))))
    if not placed:
        raise TraceInputError(f"the spans files of {run} hold no whole step")
    aligned = all(anchors.get(rank) for rank, _, _ in placed)
    origin = min(starts[0] for _, _, starts in placed)
    events: list[dict[str, Any]] = []
    slices: list[dict[str, Any]] = []
    for rank, steps, starts in placed:
        events += process_events(rank)
        lanes = TrackLanes(rank, events)
        for (step, spans), start in zip(steps, starts):
            base = start - origin
            end = max((b for _, _, b in spans), default=0.0)
            slices.append(slice_event(f"step {step}", rank, lanes.tid("steps", base, base + end),
                                      base, base + end, step, "steps"))
            for name, a, b in sorted(spans, key=lambda span: span[1]):
                tid = lanes.tid(track_of(name), base + a, base + b)
                slices.append(slice_event(name, rank, tid, base + a, base + b, step))
            if step in records.get(rank, {}):
                events += counter_events(rank, base + end, records[rank][step])
    world = max(rank for rank, _ in files) + 1
    stages = pipeline_stages(run, [spans for _, steps, _ in placed for _, spans in steps], world)
    flows = flow_events(slices, stages, max(1, world // stages))
    span_count = sum(1 for e in slices if not str(e["name"]).startswith("step "))
    summary = {"ranks": len(placed), "steps": max(len(s) for _, s, _ in placed),
               "spans": span_count, "aligned": aligned, "unreadable_lines": bad_lines,
               "flows": len(flows) // 2, "stages": stages}
    trace = {"traceEvents": events + slices + flows, "displayTimeUnit": "ms",
             "otherData": {"run_dir": str(run), "origin_unix_s": origin if aligned else None,
                           "ranks_aligned": aligned}}
    return trace, summary


def overlay(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any]:
    """Both traces in one: the predicted step's processes (same names, with " (predicted)")
    sort right under the measured ones, and the step starts where the measured run's last
    whole step of its first rank starts, so the two line up task by task."""
    events = measured["traceEvents"]
    steps = [e for e in events if e.get("ph") == "X" and e.get("cat") == "steps"]
    first = min((e["pid"] for e in steps), default=0)
    start = max((e["ts"] for e in steps if e["pid"] == first), default=0.0)
    flow_base = max((int(e["id"]) for e in events if e.get("ph") in ("s", "f")), default=0)
    out = [dict(e, args={"sort_index": 2 * int(e["args"]["sort_index"])})
           if e.get("name") == "process_sort_index" else e for e in events]
    for event in predicted["traceEvents"]:
        moved = dict(event, pid=PREDICTED_PID + int(event["pid"]))
        if "ts" in moved:
            moved["ts"] = round(float(moved["ts"]) + start, 3)
        if "id" in moved:
            moved["id"] = flow_base + int(moved["id"])
        if event.get("name") == "process_name":
            moved["args"] = {"name": str(event["args"]["name"]) + PREDICTED_SUFFIX}
        elif event.get("name") == "process_sort_index":
            moved["args"] = {"sort_index": 2 * int(event["args"]["sort_index"]) + 1}
        out.append(moved)
    other = dict(measured.get("otherData", {}))
    other["prediction"] = dict(predicted.get("otherData", {}), aligned_at_us=start)
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


def write_trace(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None,
                prediction: dict[str, Any] | None = None) -> tuple[Path, dict[str, Any]]:
    """Writes the trace (default ``<run_dir>/trace.json``), with ``prediction`` (a predicted
    step's trace) laid over it when given, and returns its path and summary."""
    trace, summary = build_trace(run_dir)
    if prediction is not None:
        trace = overlay(trace, prediction)
    path = Path(out) if out is not None else Path(run_dir) / TRACE_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(trace, separators=(",", ":")), encoding="utf-8")
    os.replace(tmp, path)
    return path, summary


# -- the `flowtrain trace` subcommand -----------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", nargs="?", default=None, metavar="RUN_DIR",
                   help="run directory (runs/<job id>); default: the newest run under ./runs")
    p.add_argument("-o", "--output", default=None, metavar="FILE",
                   help="where the trace goes (default: RUN_DIR/trace.json)")
    p.add_argument("--with-prediction", action="store_true",
                   help="also simulate the run's plan (plan.json) and write the predicted step "
                        "into the same file, each rank's predicted process under its measured "
                        "one, to overlay in Perfetto")
    p.add_argument("--cluster", default="this-host", metavar="PROFILE",
                   help="the hardware profile --with-prediction simulates on (as flowtrain "
                        "simulate --cluster; default: this-host)")


def run(ns: argparse.Namespace,
        predict: Callable[[Path], dict[str, Any]] | None = None) -> str:
    """Writes the trace; returns the line to print. ``predict`` makes the predicted trace of a
    run directory (the CLI passes the simulator's). FileNotFoundError/TraceInputError on input
    that cannot make a trace."""
    run_dir = find_run(ns.run)
    prediction = None
    if getattr(ns, "with_prediction", False):
        if predict is None:
            raise TraceInputError("--with-prediction needs the simulator (sims), which this "
                                  "caller did not pass")
        prediction = predict(run_dir)
    path, summary = write_trace(run_dir, ns.output, prediction)
    note = "" if summary["aligned"] else \
        " (no telemetry step starts: each rank's steps laid end to end from 0)"
    flows = f", {summary['flows']} flows" if summary["flows"] else ""
    predicted = ", with the predicted step" if prediction is not None else ""
    return (f"wrote {path}: {summary['ranks']} ranks, {summary['steps']} steps, "
            f"{summary['spans']} spans{flows}{predicted}{note}; open it in "
            "https://ui.perfetto.dev or chrome://tracing")
