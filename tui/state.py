"""The monitor's model of one run, built from telemetry records (schema v1) by live or replay.

Widgets only read a ``RunState``; sources only call ``apply`` and set ``now``. Keeping the model
free of Textual lets the tests and the benchmark drive it without an app.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tui.health import HealthFigure, health_figures

SCHEMA_VERSION = 1
# A rank is stale once it has been silent for this many of its usual reporting intervals.
STALE_FACTOR = 3.0
# Until a rank has shown its rhythm (a few gaps), silence longer than this marks it stale.
DEFAULT_INTERVAL_S = 5.0
# Records published together (a step and its spans) arrive microseconds apart; such gaps say
# nothing about how often the rank reports and would make every rank look stale at once.
BURST_GAP_S = 1e-3
HISTORY_STEPS = 600
# the most ranks a job record may announce: the monitor keeps a row per rank, and a damaged or
# hostile record's 10**7 would take the machine's memory before the first frame
MAX_WORLD_SIZE = 1 << 20
EVENT_LIMIT = 5000


@dataclass
class JobInfo:
    """The job header, from the launcher's ``job`` record."""

    job_id: str = "?"
    world_size: int | None = None
    run_dir: str | None = None
    started: float | None = None
    total_steps: int | None = None
    config_summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EventEntry:
    """One line of the event log."""

    t: float
    rank: int
    event: str
    message: str
    data: dict[str, Any]


@dataclass(frozen=True)
class DamageNotice:
    """Where a damaged recording stopped: the replay shows everything before ``offset``."""

    offset: int
    records_read: int
    reason: str

    def text(self) -> str:
        return (f"recording damaged: replay stopped at byte {self.offset} after "
                f"{self.records_read} records ({self.reason})")


@dataclass
class RankState:
    """What the monitor knows about one rank: its latest records and how regularly it reports."""

    rank: int
    step: dict[str, Any] | None = None
    heartbeat: dict[str, Any] | None = None
    spans_step: int | None = None
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    last_seen: float | None = None
    gaps: deque[float] = field(default_factory=lambda: deque(maxlen=32))
    stuck: bool = False
    stuck_reason: str = ""  # kept after the rank moves or finishes: it was stuck once
    # declared stuck and no step since: saying goodbye in the teardown does not undo it
    stalled: bool = False
    failed: bool = False
    finished: bool = False  # said goodbye to the coordinator (rank_finished)
    exited: bool = False  # its process ended without a failure (rank_exited)
    exit_code: int | None = None  # the process's, from rank_exited (negative: a signal)
    host: str | None = None  # the node it joined from (rank_joined)

    def heard(self, t: float) -> None:
        if self.last_seen is not None:
            gap = t - self.last_seen
            if gap > BURST_GAP_S:
                self.gaps.append(gap)
        if self.last_seen is None or t > self.last_seen:
            self.last_seen = t

    def usual_interval(self) -> float:
        """The median gap between this rank's reports (robust to one slow step)."""
        if len(self.gaps) < 2:
            return DEFAULT_INTERVAL_S
        return statistics.median(self.gaps)

    def age(self, now: float) -> float | None:
        return None if self.last_seen is None else max(0.0, now - self.last_seen)

    def killed_while_stuck(self) -> bool:
        """Declared stuck, never stepped again, and its process ended with an error or a
        signal: the job was torn down around it, whatever goodbye it managed."""
        return self.stalled and self.exit_code not in (None, 0)

    def status(self, now: float, ended: bool) -> str:
        """``failed``, ``finished``, ``stuck``, ``exited``, ``ended`` (the job ended), ``stale``,
        or the heartbeat's own status. A rank that finished or exited is silent on purpose:
        never stale; one killed while stuck failed, one that exited while stuck stays stuck."""
        if self.failed or self.killed_while_stuck():
            return "failed"
        if self.finished:
            return "finished"
        if self.stuck:
            return "stuck"
        if self.exited:
            return "exited"
        if ended:
            return "ended"
        age = self.age(now)
        if age is not None and age > STALE_FACTOR * self.usual_interval():
            return "stale"
        if self.heartbeat is not None:
            return str(self.heartbeat.get("status") or "ok")
        return "ok" if self.step is not None else "waiting"


# step-record field -> the series the plots draw over steps (the mean over the ranks that
# reported the step); "memory" is the largest rank's device memory, else its resident set
SERIES_FIELDS = ("loss", "lr", "grad_norm", "samples_per_s", "comm_share")
MEMORY = "memory"


@dataclass
class StepTotals:
    """One optimizer step over the ranks that have reported it so far."""

    ranks: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    memory_max: float | None = None

    def add(self, record: dict[str, Any]) -> None:
        self.ranks += 1
        for name in SERIES_FIELDS:
            value = record.get(name)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.sums[name] = self.sums.get(name, 0.0) + float(value)
                self.counts[name] = self.counts.get(name, 0) + 1
        mem = record.get("mem")
        if isinstance(mem, dict):
            used = mem.get("device_allocated")
            if not isinstance(used, (int, float)):
                used = mem.get("process_rss")
            if isinstance(used, (int, float)) and not isinstance(used, bool):
                self.memory_max = float(used) if self.memory_max is None \
                    else max(self.memory_max, float(used))

    def mean(self, name: str) -> float | None:
        if name == MEMORY:
            return self.memory_max
        count = self.counts.get(name, 0)
        return self.sums[name] / count if count else None


class RunState:
    """Everything the screens show, updated one telemetry record at a time."""

    def __init__(self) -> None:
        self.job = JobInfo()
        self.ranks: dict[int, RankState] = {}
        self.events: deque[EventEntry] = deque(maxlen=EVENT_LIMIT)
        self.events_total = 0
        self.steps: dict[int, StepTotals] = {}
        self.now: float = 0.0
        self.first_t: float | None = None
        self.ended = False
        # what the job_ended record says: status ("succeeded", "failed", ...) and exit code
        self.end_status: dict[str, Any] = {}
        self.damage: DamageNotice | None = None
        self.records = 0
        self.rejected = 0
        # Bumped on every change, so widgets can skip redrawing when nothing moved.
        self.version = 0

    # ---------------------------------------------------------------- updates
    def apply(self, record: dict[str, Any]) -> None:
        """Folds one record in; a record that does not follow schema v1 is counted and ignored,
        since a monitor that dies on one odd record would hide the run it is watching."""
        kind = record.get("kind")
        t = record.get("t")
        rank = record.get("rank")
        if record.get("v") != SCHEMA_VERSION or not isinstance(t, (int, float)) \
                or not isinstance(rank, int) or not isinstance(kind, str):
            self.rejected += 1
            return
        t = float(t)
        self.records += 1
        self.version += 1
        if self.first_t is None:
            self.first_t = t
        self.now = max(self.now, t)
        if kind == "job":
            self._on_job(record)
            return
        if kind == "event":
            self._on_event(record, t, rank)
            return
        if rank < 0:
            return
        state = self.rank(rank)
        state.heard(t)
        if kind == "step":
            self._on_step(state, record)
        elif kind == "spans":
            spans = record.get("spans") or []
            state.spans = [(str(s[0]), float(s[1]), float(s[2])) for s in spans if len(s) >= 3]
            state.spans_step = record.get("step")
        elif kind == "heartbeat":
            state.heartbeat = record

    def rank(self, rank: int) -> RankState:
        state = self.ranks.get(rank)
        if state is None:
            state = self.ranks[rank] = RankState(rank)
        return state

    def _on_job(self, record: dict[str, Any]) -> None:
        summary = record.get("config_summary")
        world = record.get("world_size")
        if world is not None and (isinstance(world, bool) or not isinstance(world, int)
                                  or not 0 < world <= MAX_WORLD_SIZE):
            self.events.append(EventEntry(
                float(record.get("t", self.now)), -1, "bad_job_record",
                f"the job record's world_size {world!r} is not a rank count from 1 to "
                f"{MAX_WORLD_SIZE:,}; ignored: ranks appear as they report", {}))
            self.events_total += 1
            world = None
        self.job = JobInfo(
            job_id=str(record.get("job_id", "?")),
            world_size=world,
            run_dir=record.get("run_dir"),
            started=record.get("started"),
            total_steps=record.get("total_steps"),
            config_summary=summary if isinstance(summary, dict) else {},
        )
        for rank in range(self.job.world_size or 0):
            self.rank(rank)

    def _on_step(self, state: RankState, record: dict[str, Any]) -> None:
        state.step = record
        # A rank that reports a new step is moving again, whatever was said about it before.
        state.stuck = state.stalled = False
        step = record.get("step")
        if not isinstance(step, int):
            return
        totals = self.steps.get(step)
        if totals is None:
            totals = self.steps[step] = StepTotals()
            while len(self.steps) > HISTORY_STEPS:
                del self.steps[min(self.steps)]
        totals.add(record)

    def _on_event(self, record: dict[str, Any], t: float, rank: int) -> None:
        data = record.get("data") if isinstance(record.get("data"), dict) else {}
        assert isinstance(data, dict)
        name = str(record.get("event", "?"))
        # The coordinator reports about a rank as rank -1; the rank concerned is in data.
        subject = data.get("rank", rank)
        subject = subject if isinstance(subject, int) else rank
        self.events.append(EventEntry(t, subject, name, str(record.get("message", "")), data))
        self.events_total += 1
        if subject >= 0 and name in ("rank_stuck", "rank_failed", "rank_finished",
                                     "rank_exited"):
            target = self.rank(subject)
            if name == "rank_stuck":
                target.stuck = target.stalled = True
                target.stuck_reason = str(record.get("message", ""))
            elif name == "rank_failed":
                target.failed = True
            elif name == "rank_finished":
                target.finished = True
                target.stuck = False  # it answered after all: no longer stuck
            else:
                target.exited = True
                code = data.get("exit_code")
                target.exit_code = code if isinstance(code, int) else None
        if name == "rank_joined" and subject >= 0 and isinstance(data.get("host"), str):
            self.rank(subject).host = data["host"]
        if name == "job_ended":
            self.ended = True
            self.end_status = {k: data[k] for k in ("status", "exit_code", "root_cause")
                               if k in data}

    # ---------------------------------------------------------------- derived
    def current_step(self) -> int | None:
        steps = [r.step.get("step") for r in self.ranks.values() if r.step is not None]
        known = [s for s in steps if isinstance(s, int)]
        return max(known) if known else None

    def world_size(self) -> int:
        return self.job.world_size or len([r for r in self.ranks if r >= 0])

    def elapsed(self) -> float | None:
        start = self.job.started if self.job.started is not None else self.first_t
        return None if start is None else max(0.0, self.now - start)

    def eta(self) -> float | None:
        """Seconds left at the pace so far; None without a step count or any progress."""
        step, elapsed, total = self.current_step(), self.elapsed(), self.job.total_steps
        if self.ended or step is None or elapsed is None or not total or step <= 0 \
                or elapsed <= 0:
            return None
        return max(0, total - step) * elapsed / step

    def history(self, name: str) -> list[tuple[int, float]]:
        """(step, value) of a series (SERIES_FIELDS or MEMORY) over the complete steps."""
        out = []
        for step, totals in self._complete_steps():
            value = totals.mean(name)
            if value is not None:
                out.append((step, value))
        return out

    def loss_history(self) -> list[float]:
        return [v for _, v in self.history("loss")]

    def throughput_history(self) -> list[float]:
        # samples_per_s is job-wide (train batch / step time) on every rank: averaged, not
        # summed, so that a slower rank still shows.
        return [v for _, v in self.history("samples_per_s")]

    def _complete_steps(self) -> list[tuple[int, StepTotals]]:
        # The newest step is left out until every rank has reported it, or the throughput
        # line would dip each time only some ranks are in.
        items = sorted(self.steps.items())
        expected = self.world_size()
        if items and items[-1][1].ranks < expected and not self.ended:
            items = items[:-1]
        return items

    def health(self) -> list[HealthFigure]:
        latest = [r.step for r in self.ranks.values() if r.step is not None]
        return health_figures(latest)
