"""Chrome/Perfetto trace JSON of a simulated step in the layout of a measured one
(``flowtrain.plan.trace_layout``): each pipeline stage is the process of its first rank
(``rank R``), its tasks on the tracks their names belong to, with flow arrows from each send to
its receive, so a predicted step opens in ui.perfetto.dev beside, or over, a measured one."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flowtrain.plan.trace_layout import (
    TrackLanes,
    pair_flows,
    process_events,
    slice_event,
    track_of,
)
from sims.executor import Timeline

PREDICTED_STEP = "step (predicted)"


def trace_events(timeline: Timeline, *, label: str = "flowtrain simulate",
                 ranks_per_stage: int = 1) -> dict[str, Any]:
    """The trace as a dict: complete ("X") events in microseconds, the metadata events that
    name each rank's process and track, and a flow along every dependency between stages (a
    send to the pass that waits for it: the simulator has no receive task, the pass's start is
    the receive). Stage s is drawn as rank s x ``ranks_per_stage`` (data- and tensor-parallel
    ranks of a stage run alike)."""
    events: list[dict[str, Any]] = []
    slices: list[dict[str, Any]] = []
    order = sorted(range(len(timeline.tasks)),
                   key=lambda i: (timeline.start[i], timeline.end[i]))
    lanes: dict[int, TrackLanes] = {}
    for stage in sorted({task.stage for task in timeline.tasks}):
        rank = stage * ranks_per_stage
        events += process_events(rank)
        lanes[stage] = TrackLanes(rank, events)
        ends = [b for t, b in zip(timeline.tasks, timeline.end) if t.stage == stage]
        stage_end = max(ends, default=0.0)
        slices.append(slice_event(PREDICTED_STEP, rank,
                                  lanes[stage].tid("steps", 0.0, stage_end), 0.0, stage_end,
                                  None, "steps"))
    drawn: dict[int, dict[str, Any]] = {}
    for i in order:
        task, a, b = timeline.tasks[i], timeline.start[i], timeline.end[i]
        event = slice_event(task.name, task.stage * ranks_per_stage,
                            lanes[task.stage].tid(track_of(task.name), a, b), a, b, None)
        event["args"] = {"resource": task.resource, "kind": task.kind}
        if task.flops:
            event["args"]["flops"] = task.flops
        if task.bytes:
            event["args"]["bytes"] = task.bytes
        slices.append(event)
        drawn[i] = event
    flows = pair_flows((drawn[d], drawn[i]) for i in order for d in timeline.tasks[i].deps
                       if d in drawn and timeline.tasks[d].stage != timeline.tasks[i].stage)
    return {"traceEvents": events + slices + flows, "displayTimeUnit": "ms",
            "otherData": {"generator": label, "step_time_s": timeline.step_time}}


def write_trace(timeline: Timeline, path: str | os.PathLike[str], *,
                label: str = "flowtrain simulate", ranks_per_stage: int = 1) -> Path:
    """Writes the trace JSON to ``path`` (parent folders are created)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace_events(timeline, label=label,
                                           ranks_per_stage=ranks_per_stage),
                              separators=(",", ":")))
    return out


def run_prediction_trace(run_dir: str | os.PathLike[str], cluster: str = "this-host"
                         ) -> dict[str, Any]:
    """The predicted step of a launched run's plan (``flowtrain trace --with-prediction``)."""
    from sims.compare import predict_run

    _, prediction = predict_run(run_dir, cluster, flag="--with-prediction")
    return trace_events(prediction.timeline, label=f"{prediction.model} (simulated)",
                        ranks_per_stage=prediction.dp * prediction.tp)
