"""Chrome/Perfetto trace JSON of a simulated step: one process per pipeline stage, one track
(thread) per resource, so a predicted step opens in chrome://tracing or ui.perfetto.dev beside
a measured one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sims.executor import RESOURCES, Timeline


def trace_events(timeline: Timeline, *, label: str = "flowtrain simulate") -> dict[str, Any]:
    """The trace as a dict: complete ("X") events in microseconds, plus the metadata events that
    name each stage's process and each resource's track."""
    tracks: dict[tuple[int, str], int] = {}
    for task in timeline.tasks:
        tracks.setdefault((task.stage, task.resource), 0)
    ordered = sorted(tracks, key=lambda k: (k[0], RESOURCES.index(k[1])
                                            if k[1] in RESOURCES else len(RESOURCES), k[1]))
    events: list[dict[str, Any]] = []
    for stage in sorted({s for s, _ in ordered}):
        events.append({"name": "process_name", "ph": "M", "pid": stage, "tid": 0,
                       "args": {"name": f"stage {stage}" if timeline.stages > 1 else label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": stage, "tid": 0,
                       "args": {"sort_index": stage}})
    for tid, key in enumerate(ordered, start=1):
        tracks[key] = tid
        stage, resource = key
        events.append({"name": "thread_name", "ph": "M", "pid": stage, "tid": tid,
                       "args": {"name": resource}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": stage, "tid": tid,
                       "args": {"sort_index": tid}})
    for task, a, b in zip(timeline.tasks, timeline.start, timeline.end):
        args: dict[str, Any] = {}
        if task.flops:
            args["flops"] = task.flops
        if task.bytes:
            args["bytes"] = task.bytes
        events.append({"name": task.name, "cat": task.kind, "ph": "X",
                       "ts": round(a * 1e6, 3), "dur": round((b - a) * 1e6, 3),
                       "pid": task.stage, "tid": tracks[(task.stage, task.resource)],
                       "args": args})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"generator": label, "step_time_s": timeline.step_time}}


def write_trace(timeline: Timeline, path: str | os.PathLike[str], *,
                label: str = "flowtrain simulate") -> Path:
    """Writes the trace JSON to ``path`` (parent folders are created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace_events(timeline, label=label), separators=(",", ":")))
    return out
