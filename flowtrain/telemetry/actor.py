"""Telemetry of a training rank: ``TelemetryTap`` keeps each step's StepDone and spans on the
training thread, and ``TelemetryActor``, on the rank's event loop and its own timer, turns them
into "step", "spans" and "event" records at ``telemetry_hz`` and publishes them, never waiting."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from flowtrain.engine.parts import TelemetrySource, TimedEngine
from flowtrain.engine.stages import StepDone
from flowtrain.log import get_logger
from flowtrain.plan import names
from flowtrain.runtime.actor import Actor, ActorRef, handler
from flowtrain.telemetry.schema import (
    SCHEMA_VERSION,
    EventRecord,
    event_record,
    topic_of,
)

log = get_logger("flowtrain.telemetry")

MEMORY_REFRESH_S = 2.0  # the RSS is read at most every 2 s (~50 us a read)
MODEL_STATES_REFRESH_S = 10.0  # model-state sizes (a walk over the optimizer state, ~0.5 ms)
SPANS_MIN_GAP_S = 1.0  # a "spans" record at most once a second per rank (each is ~0.5 KB)
WINDOW_TIMINGS = 4  # a "step" record averages the timings of the window's last 4 steps
FLUSH_ASK_TIMEOUT = 0.5  # seconds the control client's goodbye waits for held records
COMM_CLASSES = ("reduce", "gather")  # spans of collectives, launch to completion
WAIT_CLASS = "comm"  # spans where the step waited for collectives (exposed communication)

Publish = Callable[[str, Mapping[str, Any]], bool]
Snapshot = tuple[float, list[tuple[str, float, float]]]  # (step start, spans), perf_counter times


@dataclass(frozen=True)
class FlushTelemetry:
    """Publish what the tap holds now, whatever the rate (asked before the rank says goodbye,
    so the last steps are not lost)."""


PHASE_KEYS = ("forward_s", "backward_s", "comm_s", "optimizer_s", "step_s")


@dataclass
class _Window:
    """The steps since the last published "step" record: how many, the newest one's StepDone,
    the spans of the last few (references; turned into timings only when the record is built),
    the skipped steps with the loss scale before each, and a step whose spans go out."""

    steps: int = 0
    last: StepDone | None = None
    snapshots: deque[Snapshot] = field(default_factory=lambda: deque(maxlen=WINDOW_TIMINGS))
    skips: list[tuple[StepDone, float | None]] = field(default_factory=list)
    # (step, its start, its spans, when they were taken): perf_counter times
    spans: tuple[int, float, list[tuple[str, float, float]], float] | None = None


class TelemetryTap:
    """The engine's ``after_step`` stage for telemetry. ``send_from_thread(StepDone)`` runs on
    the training thread right after the step's timer closed, so ``engine.timer.last_step`` is
    that step's (no race with the next step). It only keeps references, under a lock the actor
    takes once per record: about a microsecond, no message, no syscall.

    Why not a message per step to the actor: a send from the training thread wakes the event
    loop's thread at the step boundary, where training runs Python and holds the GIL, so the
    hand-off and the record building stall the next step (benchmarks/telemetry_overhead.py
    ``--noop`` shows what a message per step costs). Woken by its own timer, the actor mostly
    runs while training is inside a torch kernel that released the GIL, on another core."""

    def __init__(self, engine: TimedEngine, *, spans_every: int) -> None:
        if spans_every < 1:
            raise ValueError(f"telemetry spans_every must be at least 1 step, got {spans_every}")
        self.engine = engine
        self.spans_every = spans_every
        self.ref: ActorRef[Any] | None = None  # the actor's, set by attach()
        self.spans_due = True  # the first step's spans go out, then every spans_every
        self._spans_at = float("-inf")  # perf_counter time the last spans were taken
        self._scale: float | None = None  # the loss scale after the previous step
        self._lock = threading.Lock()
        self._window = _Window()

    @property
    def name(self) -> str:
        """The actor's name: the engine stops its stages by name (``destroy``)."""
        assert self.ref is not None, "TelemetryTap used before attach() gave it its actor"
        return self.ref.name

    def send_from_thread(self, msg: StepDone, *, timeout: float | None = None) -> None:
        snapshot = self.engine.timer.last_step
        with self._lock:
            w = self._window
            w.steps += 1
            w.last = msg
            w.snapshots.append(snapshot)
            if msg.skipped:
                w.skips.append((msg, self._scale))
            if self.spans_due or msg.step % self.spans_every == 0:
                self._spans(w, msg.step, snapshot)
        self._scale = msg.loss_scale

    def _spans(self, w: _Window, step: int, snapshot: Snapshot) -> None:
        """This step's spans go out if the last ones were taken at least SPANS_MIN_GAP_S ago;
        else the next step is asked again."""
        now = time.perf_counter()
        if now - self._spans_at >= SPANS_MIN_GAP_S:
            self._spans_at = now
            w.spans = (step, snapshot[0], snapshot[1], now)
            self.spans_due = False
        else:
            self.spans_due = True

    @property
    def holding(self) -> bool:
        return self._window.steps > 0

    def take(self) -> _Window | None:
        """The steps gathered since the last call (on the actor's loop), or None."""
        with self._lock:
            w, self._window = self._window, _Window()
        return w if w.steps else None


def step_timings(spans: list[tuple[str, float, float]], start: float) -> dict[str, Any]:
    """Phase seconds of one step from its task spans, and the share of communication hidden
    behind compute: ``overlap = 1 - exposed comm / total collective time``, where exposed comm
    is the step's comm/wait spans and collective time the union of its reduce/gather spans.
    ``overlap`` is None when the step ran no collective (one rank)."""
    sums = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    exposed = 0.0
    collectives: list[tuple[float, float]] = []
    end = start
    for name, a, b in spans:
        end = max(end, b)
        head = names.task_class(name)
        if head in sums:
            sums[head] += b - a
        elif head == WAIT_CLASS:
            exposed += b - a
        elif head in COMM_CLASSES:
            collectives.append((a, b))
    busy = _union_length(collectives)
    overlap = None if busy <= 0 else min(1.0, max(0.0, 1.0 - exposed / busy))
    return {"forward_s": sums["forward"], "backward_s": sums["backward"], "comm_s": exposed,
            "optimizer_s": sums["optimizer"], "step_s": end - start, "overlap": overlap}


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


class TelemetryActor(Actor):
    """Publishes one rank's telemetry from what ``tap`` gathered. ``publish(topic, record)``
    must not wait (it returns False when the record was dropped); the actor runs on the rank's
    event loop, where it is called."""

    mailbox_size = 16  # only FlushTelemetry comes here (steps reach the tap)

    def __init__(self, engine: TelemetrySource, publish: Publish, *, rank: int, hz: float = 10.0,
                 spans_every: int = 10) -> None:
        if not hz > 0:
            raise ValueError(f"telemetry hz must be > 0 records per second, got {hz!r}")
        self.tap = TelemetryTap(engine, spans_every=spans_every)
        self.engine = engine
        self.publish_fn = publish
        self.rank = rank
        self.min_gap = 1.0 / hz
        self.published = 0
        self.dropped = 0
        self._stopping = False
        self._skipped = 0
        self._memory: dict[str, int] = {}
        self._mem_record: dict[str, Any] = {}
        self._memory_at = float("-inf")  # monotonic time of the last RSS read
        self._states_at = float("-inf")  # ... of the last model-state breakdown
        self._unit_health: dict[str, float | None] | None = None
        self._process: Any = None
        self._clock = 0.0  # time.time() - time.perf_counter(): spans are perf_counter times

    async def on_start(self) -> None:
        self._clock = time.time() - time.perf_counter()
        try:
            import psutil

            self._process = psutil.Process()
        except ImportError:  # pragma: no cover - psutil is a dependency
            self._process = None
        if self.rank == 0:
            self._publish(event_record("engine_started", "the training engine is ready",
                                       rank=self.rank, data=_engine_summary(self.engine)))
        self.runtime.start_soon(self._publish_due)

    async def on_stop(self) -> None:
        self._stopping = True
        self._flush()

    async def _publish_due(self) -> None:
        """Every ``1 / hz`` seconds: publishes what the tap gathered, if anything. On its own
        timer, not woken by the training thread (see the module's docstring)."""
        import anyio

        next_at = time.monotonic()
        while not self._stopping:
            now = time.monotonic()
            next_at = max(next_at + self.min_gap, now)  # a late wake-up does not bunch up
            await anyio.sleep(next_at - now)
            if self.tap.holding:
                self._flush()

    @handler
    async def flush(self, msg: FlushTelemetry) -> None:
        self._flush()

    # -- building records ------------------------------------------------------------------------

    def _flush(self) -> None:
        w = self.tap.take()
        if w is None:
            return
        for msg, before in w.skips:
            self._skipped += 1
            self._publish(self._skip_event(msg, before))
        if w.spans is not None:
            step, start, spans, taken = w.spans
            sent = self._publish({  # t: when the step ended and its spans were taken
                "v": SCHEMA_VERSION, "kind": "spans", "rank": self.rank, "t": taken + self._clock,
                "step": step, "step_start": start + self._clock,
                "spans": [[name, round(a - start, 7), round(b - start, 7)]
                          for name, a, b in spans]})
            if not sent:
                self.tap.spans_due = True
        assert w.last is not None
        self._publish(self._step_record(w.last, w))

    def _step_record(self, msg: StepDone, w: _Window) -> dict[str, Any]:
        timings = [step_timings(spans, start) for start, spans in w.snapshots]  # 1 to 4
        phases = {k: sum(t[k] for t in timings) / len(timings) for k in PHASE_KEYS}
        overlaps = [t["overlap"] for t in timings if t["overlap"] is not None]
        overlap = sum(overlaps) / len(overlaps) if overlaps else None
        step_s = phases["step_s"]
        batch = self.engine.spec.train_batch_size
        return {
            "v": SCHEMA_VERSION, "kind": "step", "rank": self.rank, "t": time.time(),
            "step": msg.step, "loss": _num(msg.loss), "lr": float(msg.lr),
            "loss_scale": float(msg.loss_scale), "skipped": self._skipped,
            "grad_norm": _num(msg.grad_norm),
            **phases,
            "samples_per_s": batch / step_s if batch and step_s > 0 else None,
            "tokens_per_s": None, "overlap": overlap,
            "comm_share": phases["comm_s"] / step_s if step_s > 0 else 0.0,
            **self._health(step_s, phases["comm_s"]), "mem": self._mem(),
        }

    def _health(self, step_s: float, comm_s: float) -> dict[str, Any]:
        """MFU and memory-bandwidth utilization (None without a known peak). Both are a fixed
        amount of work over the step time, so the engine's figures for a 1 s step are taken
        once (counting the step's bytes walks every parameter) and scaled."""
        unit = self._unit_health
        if unit is None:
            health = getattr(self.engine, "health", None)
            if health is None:
                return {"mfu": None, "mbu": None}
            figures = health.figures(1.0, 0.0)
            unit = {"mfu": figures["mfu"], "mbu": figures["mbu"]}
            if health.forward_flops is not None:  # counted at the first forward: final
                self._unit_health = unit
        if step_s <= 0:
            return {"mfu": None, "mbu": None}
        return {k: None if v is None else v / step_s for k, v in unit.items()}

    def _skip_event(self, msg: StepDone, before: float | None) -> EventRecord:
        fp16 = getattr(self.engine, "precision", None) == "fp16"
        change = f"; loss scale {before:g} -> {msg.loss_scale:g}" if before is not None else \
            f"; loss scale now {msg.loss_scale:g}"
        reason = "overflow" if fp16 else "unknown"
        text = (f"step {msg.step} skipped: "
                + ("inf/NaN in the fp16 gradients" if fp16 else "the optimizer did not step")
                + change)
        return event_record("skipped_step", text, rank=self.rank,
                            data={"step": msg.step, "reason": reason,
                                  "loss_scale": float(msg.loss_scale),
                                  "previous_loss_scale": before, "skipped": self._skipped})

    def _mem(self) -> dict[str, Any]:
        """The "mem" map: model states re-read every MODEL_STATES_REFRESH_S (they change only
        when the optimizer creates its state), the process's RSS (and the device's allocation)
        every MEMORY_REFRESH_S; a copy of the last map in between."""
        now = time.monotonic()
        if now - self._memory_at < MEMORY_REFRESH_S:
            return dict(self._mem_record)
        self._memory_at = now
        if now - self._states_at >= MODEL_STATES_REFRESH_S:
            try:
                self._memory = self.engine.memory_breakdown()
                self._states_at = now
            except RuntimeError:
                # The training thread changed the optimizer's state dict while it was walked
                # (its first step creates it); the next record tries again.
                self._memory_at = float("-inf")
        m = self._memory
        rss = int(self._process.memory_info().rss) if self._process is not None \
            else int(m.get("process_rss", 0))
        device = getattr(self.engine, "device", None)
        allocated = None
        if device is not None and device.type == "cuda":
            import torch

            allocated = int(torch.cuda.memory_allocated(device))
        self._mem_record = {"model_states": int(m.get("model_states", 0)),
                            "parameters": int(m.get("parameters", 0)),
                            "gradients": int(m.get("gradients", 0)),
                            "optimizer_state": int(m.get("optimizer_state", 0)),
                            "process_rss": rss, "device_allocated": allocated}
        return dict(self._mem_record)

    def _publish(self, record: Mapping[str, Any]) -> bool:
        # Not validated here: the coordinator validates every record it gets (in the launcher),
        # and the tests hold this actor's records to the schema there.
        try:
            sent = self.publish_fn(topic_of(record), record)
        except RuntimeError:
            sent = False  # the control client has closed: the rank is ending
        if sent:
            self.published += 1
        else:
            self.dropped += 1
        return sent


def _num(value: float | None) -> float | None:
    return None if value is None else float(value)


def _engine_summary(engine: TelemetrySource) -> dict[str, Any]:
    spec = engine.spec
    return {"precision": getattr(engine, "precision", None),
            "zero_stage": getattr(engine, "zero_stage", None),
            "world_size": getattr(engine, "world_size", None),
            "train_batch_size": spec.train_batch_size,
            "micro_batch_size": spec.micro_batch_size,
            "gradient_accumulation_steps": spec.gradient_accumulation_steps,
            "parameters": sum(p.numel() for p in getattr(engine, "trainable", []))}


def attach(engine: TelemetrySource, *, force: bool = False) -> ActorRef[Any] | None:
    """Wires telemetry into ``engine``: a TelemetryActor on the rank's loop, and its tap at
    ``after_step`` (``ref._actor.tap`` is the stage the engine calls). Returns the actor's
    reference.

    Does nothing (returns None) when the config switches telemetry off, or when no flowtrain
    launcher hosts the job (a plain ``python train.py`` or torchrun: nobody would record or
    watch); ``force`` attaches anyway, for benchmarks and tests in one process.
    """
    section = engine.spec.host
    if not section.telemetry:
        return None
    from flowtrain.runtime.rank import current_rank

    rank = current_rank()
    control = getattr(rank, "control", None)
    if control is None or not (force or rank.env.launched):
        return None
    actor = TelemetryActor(engine, control.publish_nowait, rank=rank.env.rank,
                           hz=section.telemetry_hz, spans_every=section.telemetry_spans_every)
    ref = engine.add_stage(actor, at="after_step")
    actor.tap.ref = ref
    # The engine calls the tap at after_step in the actor's place (no message per step).
    points = engine.stages["after_step"]
    points[points.index(ref)] = actor.tap

    async def flush_before_goodbye() -> None:
        try:
            await ref.ask(FlushTelemetry(), timeout=FLUSH_ASK_TIMEOUT)
        except Exception:  # noqa: BLE001 - stopped with its engine (destroy); nothing is held
            pass

    control.before_close.append(flush_before_goodbye)
    return ref
