"""How a launch ended: every failure observed (error files, coordinator events, exits, node
reports), the root cause (the earliest), and the report printed for the user."""

from __future__ import annotations

import signal
import socket
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from flowtrain.errors import RankFailure, read_error_file
from flowtrain.launch.rundir import RunDir
from flowtrain.launch.supervisor import ABORTED_EXIT, Child, Supervisor, describe_exit, signal_name

_FAILURE_FIELDS = {f.name for f in fields(RankFailure)}


@dataclass
class Record:
    """One observed failure. Secondary ones (a rank that was told to stop, a node launcher whose
    ranks already reported) are the root cause only when nothing primary was seen."""

    failure: RankFailure
    label: str
    source: str  # "error file", "coordinator", "exit", "node", "launcher"
    secondary: bool = False


@dataclass
class Outcome:
    status: str  # "succeeded", "failed", "interrupted"
    exit_code: int
    records: list[Record] = field(default_factory=list)
    root_cause: Record | None = None
    ranks: list[dict[str, Any]] = field(default_factory=list)  # end state of every rank / node
    exit_text: dict[int, str] = field(default_factory=dict)  # rank -> how its process ended


def _exit_record(child: Child) -> Record:
    code = child.exit_code if child.exit_code is not None else -signal.SIGKILL
    if child.node is not None:
        failure = RankFailure(rank=-1, kind="node", message=f"node launcher {describe_exit(child)}",
                              timestamp=child.exit_time, host=child.host, pid=child.pid)
        return Record(failure, child.label, "exit", secondary=bool(
            child.node_result and child.node_result.get("failures")))
    kind = "signal" if code < 0 else ("aborted" if code == ABORTED_EXIT else "exit")
    failure = RankFailure(rank=child.rank if child.rank is not None else -1, kind=kind,
                          message=describe_exit(child), timestamp=child.exit_time,
                          host=child.host, pid=child.pid)
    return Record(failure, child.label, "exit", secondary=kind == "aborted")


_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "CollectiveTimeout", "ShmTimeout", "lost the coordinator")


def _is_peer_loss(failure: RankFailure) -> bool:
    text = f"{failure.message}\n{failure.traceback[-2000:]}"
    return any(marker in text for marker in _PEER_LOSS)


def choose_root(records: list[Record]) -> Record | None:
    """Sorts ``records`` by time and returns the root cause: the earliest primary failure.

    A rank whose collective broke because a peer died can report before the launcher sees that
    death; such consequences are marked secondary whenever a failure of another kind exists."""
    records.sort(key=lambda r: r.failure.timestamp)
    if any(not _is_peer_loss(r.failure) for r in records):
        for r in records:
            if _is_peer_loss(r.failure):
                r.secondary = True
    primary = [r for r in records if not r.secondary]
    chosen = primary or records
    return chosen[0] if chosen else None


def collect_outcome(sup: Supervisor, rd: RunDir, *, started: float, join_timeout: float) -> Outcome:
    from flowtrain.control.coordinator import JoinTimeout, RankFailed

    records: list[Record] = []
    ranks: list[dict[str, Any]] = []
    exit_text: dict[int, str] = {}
    for child in sup.children:
        if child.rank is not None:
            exit_text[child.rank] = describe_exit(child)
            ranks.append({"rank": child.rank, "host": child.host, "pid": child.pid,
                          "exit_code": child.exit_code, "state": describe_exit(child)})
            failure = read_error_file(rd.rank_error(child.rank))
            if failure is not None and failure.timestamp >= started - 1.0:
                records.append(Record(failure, f"rank {failure.rank}", "error file"))
        if child.node_result:
            for raw in child.node_result.get("failures", []):
                secondary = bool(raw.get("secondary"))
                failure = RankFailure(**{k: v for k, v in raw.items() if k in _FAILURE_FIELDS})
                label = f"rank {failure.rank}" if failure.rank >= 0 else child.label
                records.append(Record(failure, label, "node", secondary))
            for state in child.node_result.get("ranks", []):
                ranks.append(state)
                exit_text[int(state["rank"])] = str(state["state"])
        if sup.is_failure(child):
            records.append(_exit_record(child))
    for when, event in sup.coordinator_events:
        if isinstance(event, RankFailed):
            records.append(Record(event.failure, f"rank {event.rank}", "coordinator"))
        elif isinstance(event, JoinTimeout):
            for rank in event.missing:
                failure = RankFailure(rank=rank, kind="lost", timestamp=when, message=(
                    f"did not join the coordinator within {join_timeout:g} s"))
                records.append(Record(failure, f"rank {rank}", "coordinator"))
    if sup.interrupted is not None and sup.teardown_time is not None:
        name = signal_name(sup.interrupted)
        records.append(Record(RankFailure(rank=-1, kind="interrupted", timestamp=sup.teardown_time,
                                          message=f"the launcher received {name}",
                                          host=socket.gethostname()), "launcher", "launcher"))
    if sup.parent_lost and sup.teardown_time is not None:
        records.append(Record(RankFailure(rank=-1, kind="lost", timestamp=sup.teardown_time,
                                          message="lost the launcher that started this node"),
                              "launcher", "launcher"))
    ranks.sort(key=lambda r: int(r.get("rank", -1)))
    root = choose_root(records)
    if sup.interrupted is not None:
        status, code = "interrupted", 128 + sup.interrupted
    elif records:
        status, code = "failed", 1
    else:
        status, code = "succeeded", 0
    return Outcome(status, code, records, root, ranks, exit_text)


def _traceback_for(outcome: Outcome, root: Record) -> str:
    if root.failure.traceback:
        return root.failure.traceback
    for record in outcome.records:
        if record.failure.rank == root.failure.rank and record.failure.traceback:
            return record.failure.traceback
    return ""


def format_report(outcome: Outcome, *, job_id: str, run_dir: Path) -> str:
    """The text printed at the end of a failed job (empty after a success)."""
    root = outcome.root_cause
    if outcome.status == "succeeded" or root is None:
        return ""
    f = root.failure
    bar = "=" * 72
    lines = [bar, f"flowtrain launch: job {job_id} {outcome.status}",
             "Root cause (first observed failure):"]
    when = time.strftime("%H:%M:%S", time.localtime(f.timestamp)) + f"{f.timestamp % 1:.3f}"[1:]
    where = ", ".join(p for p in (f"host {f.host}" if f.host else "",
                                  f"pid {f.pid}" if f.pid else "") if p)
    subject = root.label + (f" ({where})" if where else "")
    if f.kind == "stuck":
        lines.append(f"  {subject} is stuck: {f.message}")
    else:
        lines.append(f"  {subject}: {f.message}")
    lines.append(f"  kind: {f.kind}" + (f", actor {f.actor}" if f.actor else "") +
                 f", at {when}, seen by {root.source}")
    if f.rank >= 0 and f.rank in outcome.exit_text:
        lines.append(f"  process: {outcome.exit_text[f.rank]}")
    tb = _traceback_for(outcome, root)
    if tb:
        lines.append("  traceback:")
        lines.extend("    " + line for line in tb.rstrip().splitlines())
    others = [r for r in outcome.ranks if int(r.get("rank", -1)) != f.rank]
    if others:
        lines.append("Other ranks:")
        for state in others:
            pid = f" (pid {state['pid']})" if state.get("pid") else ""
            lines.append(f"  rank {state['rank']}{pid}: {state['state']}")
    lines.append(f"run directory: {run_dir}")
    lines.append(bar)
    return "\n".join(lines)
