"""``flowtrain monitor RUN --summary``: a finished (or running) job's recording as a plain-text or
JSON report, for a terminal that is not one (CI logs, pipes) or a script: how the job ended and
why, the outliers (failed, stuck and slow ranks first, as ``tui.outliers`` finds them), the
health figures against their targets, and the events grouped by kind. The exit status is the
job's own."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from tui.outliers import find_outliers
from tui.state import RunState

# the job's status as job.json records it -> the monitor's exit status when it has no code
STATUS_EXIT = {"succeeded": 0, "running": 0}


def read_state(recording: Path) -> tuple[RunState, str | None]:
    """The whole recording folded into a RunState, and the damage that stopped it, if any."""
    from flowtrain.telemetry import TelemetryDamage, read_records

    state = RunState()
    damage = None
    try:
        for record in read_records(recording):
            state.apply(dict(record))
    except TelemetryDamage as exc:
        damage = str(exc)
    return state, damage


def summary(run_dir: Path, recording: Path) -> dict[str, Any]:
    """The report's figures (``--json`` prints them as they are)."""
    state, damage = read_state(recording)
    job: dict[str, Any] = {}
    try:
        found = json.loads((run_dir / "job.json").read_text(encoding="utf-8"))
        job = found if isinstance(found, dict) else {}
    except (OSError, ValueError):
        pass
    found = find_outliers(state)
    statuses = dict(sorted(found.statuses.items()))
    outliers = []
    for rank in found.ranks():
        kind = found.kind(rank)
        entry: dict[str, Any] = {"rank": rank, "status": kind}
        if kind == "stuck":
            entry["reason"] = state.ranks[rank].stuck_reason
        elif kind == "failed" and state.ranks[rank].killed_while_stuck():
            entry["reason"] = f"killed while stuck: {state.ranks[rank].stuck_reason}"
        elif kind == "slow":
            entry["step_time_ratio"] = round(found.slow[rank], 2)
        outliers.append(entry)
    events = Counter(e.event for e in state.events)
    status = job.get("status") or ("ended" if state.ended else "running")
    exit_code = job.get("exit_code")
    if not isinstance(exit_code, int):
        exit_code = STATUS_EXIT.get(str(status), 1)
    return {
        "job_id": state.job.job_id if state.job else job.get("job_id"),
        "run_dir": str(run_dir), "status": status, "exit_code": exit_code,
        "root_cause": job.get("root_cause"), "world_size": state.world_size(),
        "steps": state.current_step(), "elapsed_s": state.elapsed(),
        "ranks": {"total": len(statuses), **Counter(statuses.values())},
        "outliers": outliers,
        "health": [{"figure": h.label, "value": h.value, "target": h.target,
                    "meets": h.meets} for h in state.health()],
        "events": dict(events.most_common()),
        "last_loss": losses[-1] if (losses := state.loss_history()) else None,
        "damage": damage,
    }


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The report as text, a fact a line."""
    lines = [f"job {report['job_id']} ({report['run_dir']}): {report['status']}, exit "
             f"{report['exit_code']}, {report['steps'] if report['steps'] is not None else 0} "
             f"steps on {report['world_size']} ranks"
             + (f" in {report['elapsed_s']:.1f} s" if report["elapsed_s"] else "")]
    cause = report.get("root_cause")
    if cause:
        lines.append(f"root cause: rank {cause.get('rank')}: {cause.get('message')}")
    counts = ", ".join(f"{n} {s}" for s, n in sorted(report["ranks"].items()) if s != "total")
    lines.append(f"ranks: {report['ranks']['total']} ({counts or 'none heard'})")
    if report["outliers"]:
        lines.append("outliers:")
        for o in report["outliers"]:
            extra = f" ({o['step_time_ratio']}x the median step)" if o["status"] == "slow" \
                else (f" ({o['reason']})" if o.get("reason") else "")
            lines.append(f"  rank {o['rank']}: {o['status']}{extra}")
    else:
        lines.append("outliers: none")
    health = "; ".join(_health_text(h) for h in report["health"])
    lines.append(f"health: {health}")
    if report["last_loss"] is not None:
        lines.append(f"last loss: {report['last_loss']:.4g}")
    if report["events"]:
        lines.append("events: " + ", ".join(f"{n} x {e}" for e, n in report["events"].items()))
    if report["damage"]:
        lines.append(f"recording: {report['damage']}")
    return lines


def _health_text(h: dict[str, Any]) -> str:
    shown = "n/a" if h["value"] is None else f"{100 * h['value']:.0f}%"
    verdict = "" if h["meets"] is None else (", met" if h["meets"] else ", missed")
    return f"{h['figure']} {shown} (target {100 * h['target']:.0f}%{verdict})"
