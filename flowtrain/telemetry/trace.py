"""``flowtrain trace``: the measured task spans of a run (``spans/rank<R>.jsonl``) as one
Chrome/Perfetto trace, one process per rank and one track per resource, ranks on one clock."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from flowtrain.plan import names
from flowtrain.telemetry.files import TELEMETRY_FILE, TelemetryDamage, find_run, read_records

TRACE_FILE = "trace.json"
# Task-name prefix -> track. The order is the order of the tracks under each rank.
TRACKS = {"step": "steps", "forward": "compute", "backward": "compute", "optimizer": "compute",
          "reduce": "reduce", "gather": "gather", "offload": "offload", "comm": "comm wait"}
TRACK_ORDER = ("steps", "compute", "reduce", "gather", "offload", "comm wait")
_RANK_FILE = re.compile(r"rank(\d+)\.jsonl$")

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


def step_anchors(run_dir: Path) -> dict[int, dict[int, float]]:
    """rank -> {step: unix start} from the "spans" records of telemetry.msgpack (if any)."""
    anchors: dict[int, dict[int, float]] = {}
    path = run_dir / TELEMETRY_FILE
    if not path.is_file():
        return anchors
    try:
        for record in read_records(path):
            if record["kind"] == "spans":
                anchors.setdefault(record["rank"], {})[record["step"]] = \
                    float(record["step_start"])
    except TelemetryDamage:
        pass  # the anchors read before the damage still place their steps
    return anchors


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


def track_of(name: str) -> str:
    head = names.task_class(name)
    return TRACKS.get(head, head)


def build_trace(run_dir: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(trace in Chrome's JSON object format, summary) for a run directory."""
    run = Path(run_dir)
    files = sorted(((int(m.group(1)), p) for p in (run / "spans").glob("rank*.jsonl")
                    if (m := _RANK_FILE.search(p.name))), key=lambda x: x[0])
    if not files:
        raise TraceInputError(f"{run} has no spans/rank<R>.jsonl; task spans are recorded by "
                              "ranks started with `flowtrain launch` that train through "
                              "flowtrain.initialize")
    anchors = step_anchors(run)
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
    span_count = 0
    for rank, steps, starts in placed:
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank,
                       "args": {"sort_index": rank}})
        lanes = _Lanes(rank, events)
        for (step, spans), start in zip(steps, starts):
            base = start - origin
            end = max((b for _, _, b in spans), default=0.0)
            events.append(_complete(f"step {step}", "steps", rank,
                                    lanes.tid("steps", base, base + end), base, 0.0, end, step))
            for name, a, b in sorted(spans, key=lambda span: span[1]):
                track = track_of(name)
                events.append(_complete(name, track, rank, lanes.tid(track, base + a, base + b),
                                        base, a, b, step))
                span_count += 1
    summary = {"ranks": len(placed), "steps": max(len(s) for _, s, _ in placed),
               "spans": span_count, "aligned": aligned, "unreadable_lines": bad_lines}
    trace = {"traceEvents": events, "displayTimeUnit": "ms",
             "otherData": {"run_dir": str(run), "origin_unix_s": origin if aligned else None,
                           "ranks_aligned": aligned}}
    return trace, summary


class _Lanes:
    """Thread ids of one rank's tracks. Trace viewers need the slices of one thread to nest, but
    collectives overlap (several buckets reduce at once): an overlapping span goes to the next
    lane of its track ("reduce", "reduce 2", ...), and the lanes are reused as spans end."""

    def __init__(self, rank: int, events: list[dict[str, Any]]) -> None:
        self.rank = rank
        self.events = events
        self.lanes: dict[str, list[tuple[int, float]]] = {}  # track -> [(tid, last end)]
        self.next_extra = len(TRACK_ORDER)

    def tid(self, track: str, start: float, end: float) -> int:
        lanes = self.lanes.setdefault(track, [])
        for i, (tid, busy_until) in enumerate(lanes):
            if busy_until <= start + 1e-9:
                lanes[i] = (tid, end)
                return tid
        if not lanes and track in TRACK_ORDER:
            tid = TRACK_ORDER.index(track)
        else:
            tid = self.next_extra
            self.next_extra += 1
        name = track if not lanes else f"{track} {len(lanes) + 1}"
        # sort index: a track's lanes stay together, in the order of TRACK_ORDER
        order = (TRACK_ORDER.index(track) if track in TRACK_ORDER else len(TRACK_ORDER)) * 100 \
            + len(lanes)
        lanes.append((tid, end))
        self.events.append({"ph": "M", "name": "thread_name", "pid": self.rank, "tid": tid,
                            "args": {"name": name}})
        self.events.append({"ph": "M", "name": "thread_sort_index", "pid": self.rank,
                            "tid": tid, "args": {"sort_index": order}})
        return tid


def _complete(name: str, track: str, rank: int, tid: int, base: float, a: float, b: float,
              step: int) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": track, "pid": rank, "tid": tid,
            "ts": round((base + a) * 1e6, 3), "dur": round(max(0.0, b - a) * 1e6, 3),
            "args": {"step": step}}


def write_trace(run_dir: str | os.PathLike[str],
                out: str | os.PathLike[str] | None = None) -> tuple[Path, dict[str, Any]]:
    """Writes the trace (default ``<run_dir>/trace.json``) and returns its path and summary."""
    trace, summary = build_trace(run_dir)
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


def run(ns: argparse.Namespace) -> str:
    """Writes the trace; returns the line to print. FileNotFoundError/TraceInputError on input
    that cannot make a trace."""
    run_dir = find_run(ns.run)
    path, summary = write_trace(run_dir, ns.output)
    note = "" if summary["aligned"] else \
        " (no telemetry step starts: each rank's steps laid end to end from 0)"
    return (f"wrote {path}: {summary['ranks']} ranks, {summary['steps']} steps, "
            f"{summary['spans']} spans{note}; open it in https://ui.perfetto.dev or "
            "chrome://tracing")
