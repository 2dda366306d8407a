"""Predicted against measured, per task class: reads a run directory's ``plan.json`` and
``spans/rank*.jsonl`` (written by the engine of a launched run) and sums both sides the way the
engine times its spans, so the simulator's error is known task class by task class."""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowtrain.plan import names
from sims.executor import Timeline

if TYPE_CHECKING:
    from sims.prediction import Prediction

CLASSES = ("forward", "backward", "reduce", "gather", "optimizer", "step")
# What the engine's ``optimizer/step`` span covers besides the update itself: the offload copies
# and the post-step all-gather of whole buckets run inside it.
_AFTER_STEP = ("optimizer", "allgather", "copy")
# Task kinds of the engine's own work outside any span: a pass after one starts at its end.
_BETWEEN_PASSES = ("overhead", "handoff")


@dataclass(frozen=True)
class RunRecord:
    """A run directory's plan and measured steps: ``steps[rank]`` lists that rank's steps, each a
    list of (name, start_s, end_s) from the step's start."""

    path: Path
    plan: dict[str, Any]
    steps: dict[int, list[list[tuple[str, float, float]]]]
    # a pipeline run's stages/stage{s}.json, in stage order (empty for other runs)
    stages: tuple[dict[str, Any], ...] = ()


def read_run(run_dir: str | Path, flag: str = "--compare") -> RunRecord:
    """Reads ``run_dir``; a missing or malformed file is a ValueError naming it (and ``flag``,
    the option that asked for the run)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ValueError(f"{flag}: run directory {str(root)!r} does not exist")
    plan_path = root / "plan.json"
    try:
        plan = json.loads(plan_path.read_text())
    except OSError:
        raise ValueError(f"{flag}: {str(plan_path)!r} is missing; it is written by rank 0 "
                         f"of a run started with `flowtrain launch`") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: {str(plan_path)!r} is not valid JSON (line {exc.lineno}: "
                         f"{exc.msg})") from None
    for key in ("config", "world_size", "param_specs", "forward_flops_per_micro_batch"):
        if not isinstance(plan, dict) or key not in plan:
            raise ValueError(f"{flag}: {str(plan_path)!r} lacks {key!r}; expected the keys "
                             f"v, config, world_size, param_specs, forward_flops_per_micro_batch")
    if plan.get("v") != 1:
        raise ValueError(f"{flag}: {str(plan_path)!r} has schema version {plan.get('v')!r}; "
                         f"this flowtrain reads version 1")
    steps: dict[int, list[list[tuple[str, float, float]]]] = {}
    for path in sorted((root / "spans").glob("rank*.jsonl")):
        rank_text = path.stem.removeprefix("rank")
        if not rank_text.isdigit():
            continue
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                rows.append([(str(n), float(a), float(b)) for n, a, b in record["spans"]])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                raise ValueError(f"{flag}: {str(path)!r} line {number} is not a span record "
                                 f'{{"v": 1, "step": N, "spans": [[name, start_s, end_s], ...]}}'
                                 ) from None
        if rows:
            steps[int(rank_text)] = rows
    if not steps:
        raise ValueError(f"{flag}: no measured spans in {str(root / 'spans')!r} "
                         f"(rank*.jsonl); the run recorded no complete step")
    return RunRecord(root, plan, steps, _read_stages(root, flag))


_STAGE_KEYS = ("stage", "stages", "param_specs", "forward_flops_per_micro_batch",
               "output_bytes_per_micro_batch")


def _read_stages(root: Path, flag: str) -> tuple[dict[str, Any], ...]:
    """A pipeline run's per-stage records (each stage's first rank writes one); every stage
    must be there, since a missing one would leave its parameters out of the prediction."""
    records: dict[int, dict[str, Any]] = {}
    for path in sorted((root / "stages").glob("stage*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{flag}: {str(path)!r} is not a readable stage record: "
                             f"{exc}") from None
        missing = [k for k in _STAGE_KEYS if not isinstance(record, dict) or k not in record]
        if missing:
            raise ValueError(f"{flag}: {str(path)!r} lacks {missing[0]!r}; expected the "
                             f"keys {', '.join(_STAGE_KEYS)}")
        records[int(record["stage"])] = record
    if not records:
        return ()
    stages = int(next(iter(records.values()))["stages"])
    absent = [s for s in range(stages) if s not in records]
    if absent:
        raise ValueError(f"{flag}: {str(root / 'stages')!r} has no record of pipeline "
                         f"stage {absent[0]} of {stages}; each stage's first rank writes one "
                         f"at its first forward")
    return tuple(records[s] for s in range(stages))


def _class_of(name: str) -> str:
    return names.task_class(name)


def measured_classes(run: RunRecord) -> tuple[dict[str, float], int]:
    """Seconds per class in one step: the median over steps (the first left out when there are
    more, as it builds plans and compiles kernels), averaged over ranks. ``step`` is the window
    from the first span's start to the last one's end. Also returns the steps used per rank."""
    per_rank: list[dict[str, float]] = []
    used = 0
    for rows in run.steps.values():
        chosen = rows[1:] if len(rows) > 1 else rows
        used = max(used, len(chosen))
        sums: dict[str, list[float]] = {c: [] for c in CLASSES}
        for spans in chosen:
            totals = dict.fromkeys(CLASSES, 0.0)
            seen: set[str] = set()
            for name, a, b in spans:
                c = _class_of(name)
                if c in totals and c != "step":
                    totals[c] += b - a
                    seen.add(c)
            totals["step"] = max(b for _, _, b in spans) - min(a for _, a, _ in spans)
            for c in CLASSES:
                if c in seen or c == "step":
                    sums[c].append(totals[c])
        per_rank.append({c: statistics.median(v) for c, v in sums.items() if v})
    out: dict[str, float] = {}
    for c in CLASSES:
        values = [r[c] for r in per_rank if c in r]
        if values:
            out[c] = sum(values) / len(values)
    return out, used


def predicted_classes(timeline: Timeline) -> dict[str, float]:
    """The same sums over a simulated step, averaged over pipeline stages as the measured ones
    are over ranks: a forward or backward pass runs from the end of the pass before it (so
    waits inside it, like ZeRO-3 gathers, count, as they do in the engine's span), or on a
    pipeline stage from its own first task (the engine times the wait for a neighbour's
    activations or gradients as a separate recv span); a reduce or gather from when its data
    was ready (launch) to its end, queueing included; the optimizer from its first task to the
    end of the post-step work."""
    stages = timeline.stages
    out: dict[str, float] = {}
    for stage in range(stages):
        for c, seconds in _stage_classes(timeline, stage, own_start=stages > 1).items():
            out[c] = out.get(c, 0.0) + seconds / stages
    out["step"] = timeline.step_time
    return out


def _stage_classes(timeline: Timeline, stage: int, own_start: bool) -> dict[str, float]:
    tasks, start, end = timeline.tasks, timeline.start, timeline.end
    out: dict[str, float] = {}
    passes: dict[str, list[float]] = {}
    for i, t in enumerate(tasks):
        if t.stage == stage and t.kind in ("forward", "backward"):
            key = names.span_key(t.name)
            span = passes.setdefault(key, [start[i], end[i]])
            span[0], span[1] = min(span[0], start[i]), max(span[1], end[i])
    # the engine's own work between passes (the loss, the step's bookkeeping, pipeline
    # hand-offs) is in no span: a pass after it starts where it ends
    marks: list[tuple[float, str | None, float]] = [
        (end[i], None, 0.0) for i, t in enumerate(tasks)
        if t.stage == stage and t.kind in _BETWEEN_PASSES]
    previous = 0.0
    for finish, mark_key, first in sorted(marks + [(finish, key, first) for key, (first, finish)
                                                   in passes.items()], key=lambda m: m[0]):
        if mark_key is not None:
            c = _class_of(mark_key)
            out[c] = out.get(c, 0.0) + finish - (max(previous, first) if own_start else previous)
        previous = finish
    for i, t in enumerate(tasks):
        if t.stage == stage and t.kind in ("reduce", "gather"):
            ready = max((end[d] for d in t.deps if tasks[d].kind not in ("reduce", "gather")),
                        default=0.0)
            # the engine's reducer stamps a reduce's end from the collective's completion
            # callback, and its start at launch: when its data was ready
            finish = end[i]
            out[t.kind] = out.get(t.kind, 0.0) + finish - min(ready, start[i])
    post = [i for i, t in enumerate(tasks[:timeline.planned]) if t.stage == stage and
            t.kind in _AFTER_STEP and names.micro_batch_of(t.name) is None]
    # the step starts with the optimizer, or with an offloaded gradient's copy down
    first_step = [i for i in post if tasks[i].kind == "optimizer" or
                  tasks[i].resource == "copy:d2h"]
    if first_step:
        out["optimizer"] = max(end[i] for i in post) - min(start[i] for i in first_step)
    return out


def comparison_rows(predicted: dict[str, float], measured: dict[str, float]
                    ) -> list[dict[str, Any]]:
    """One row per class present on either side; error % is (predicted - measured) / measured."""
    rows = []
    for c in CLASSES:
        p, m = predicted.get(c), measured.get(c)
        if p is None and m is None:
            continue
        error = None if p is None or not m else 100.0 * (p - m) / m
        rows.append({"class": c, "predicted_s": p, "measured_s": m, "error_pct": error})
    return rows


def predict_run(run_dir: Any, cluster: str = "this-host", *, nodes: int = 1,
                devices_per_node: int | None = None, ns: argparse.Namespace | None = None,
                flag: str = "--compare") -> tuple[RunRecord, Prediction]:
    """(the run's RunRecord, the prediction of its plan): a launched run's ``plan.json`` (and a
    pipeline's stage records) planned on ``cluster``'s profile with the run's world layout.
    ``ns`` carries --host-speed when a command has it. SimulateError on a run it cannot read."""
    from sims.planner import Workload
    from sims.prediction import (
        SimulateError,
        host_speed_factor,
        load_profile,
        make_layout,
        predict,
        validated_config,
    )

    try:
        record = read_run(run_dir, flag)
    except ValueError as exc:
        raise SimulateError(str(exc)) from None
    hw = load_profile(cluster)
    speed = host_speed_factor(ns, hw) if ns is not None else 1.0
    world = int(record.plan["world_size"])
    if world % nodes:
        raise SimulateError(f"--nodes {nodes} does not divide the run's world size {world}")
    pp = len(record.stages) or 1  # a pipeline run records each stage
    layout = make_layout(nodes, devices_per_node or world // nodes, 1, pp)
    if layout.world_size != world:
        raise SimulateError(f"--nodes {nodes} x --devices-per-node {layout.devices_per_node}"
                            f" = {layout.world_size} ranks, but the run had {world}")
    cfg = validated_config(record.plan["config"], layout.dp, f"{record.path / 'plan.json'} config")
    micro_batch = cfg.micro_batch
    work = Workload.from_stages(record.stages, micro_batch, name=record.path.name) \
        if record.stages else Workload.from_run(record.plan, micro_batch, name=record.path.name)
    prediction = predict(None, cfg, layout, hw, cluster=cluster, workload=work,
                         host_speed=speed)
    empty = [name for name, shape, _, _ in work.params if 0 in shape]
    if empty:
        prediction.notes.append(
            f"plan.json lists {len(empty)} of {len(work.params)} parameters with no elements "
            f"(first: {empty[0]}); ZeRO-3 placeholders recorded instead of the full shapes "
            f"make the prediction miss those parameters")
    return record, prediction
