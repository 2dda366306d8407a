"""The Telemetry actor every launched rank runs at the engine's ``after_step`` point: it turns
StepDone and the step timer's spans into "step", "spans" and "event" records and publishes them,
rate-limited, through the rank's control client without ever making training wait."""

from __future__ import annotations

import time
from collections.abc import Callable
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from flowtrain.engine.stages import StepDone
from flowtrain.log import get_logger
from flowtrain.runtime.actor import Actor, ActorRef, handler
from flowtrain.telemetry.schema import SCHEMA_VERSION, event_record, topic_of

log = get_logger("flowtrain.telemetry")

MEMORY_REFRESH_S = 2.0  # sizes change slowly, and reading them costs ~100 us
SPANS_MIN_GAP_S = 1.0  # a "spans" record at most once a second per rank (each is ~0.5 KB)
WINDOW_TIMINGS = 4  # a "step" record averages the timings of the window's last 4 steps
FLUSH_ASK_TIMEOUT = 0.5  # seconds the control client's goodbye waits for held records
HELD_CHECK_S = 0.5  # how often a held step is looked at when no further step comes
COMM_PREFIXES = ("reduce/", "gather/")  # spans of collectives, launch to completion
WAIT_PREFIX = "comm/"  # spans where the step waited for collectives (exposed communication)

Publish = Callable[[str, dict[str, Any]], bool]


@dataclass(frozen=True)
class FlushTelemetry:
    """Publish the step record the rate limit is holding back (at the end of training, or
    when steps stopped coming)."""


PHASE_KEYS = ("forward_s", "backward_s", "comm_s", "optimizer_s", "step_s")


@dataclass
class _Window:
    """The steps since the last published "step" record: how many, and the spans of those read
    consistently (see _snapshot), kept as references and turned into timings only when the
    record is built, so a step that is not published costs next to nothing."""

    steps: int = 0
    snapshots: deque[tuple[float, list[tuple[str, float, float]]]] = field(
        default_factory=lambda: deque(maxlen=WINDOW_TIMINGS))


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
        head = name.split("/", 1)[0]
        if head in sums:
            sums[head] += b - a
        elif name.startswith(WAIT_PREFIX):
            exposed += b - a
        elif name.startswith(COMM_PREFIXES):
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
    """Publishes one rank's telemetry. ``publish(topic, record)`` must not wait (it returns False
    when the record was dropped); the actor runs on the rank's event loop, where it is called."""

    mailbox_size = 4096  # StepDone messages queue here if the loop is briefly busy

    def __init__(self, engine: Any, publish: Publish, *, rank: int, hz: float = 10.0,
                 spans_every: int = 10) -> None:
        if not hz > 0:
            raise ValueError(f"telemetry hz must be > 0 records per second, got {hz!r}")
        if spans_every < 1:
            raise ValueError(f"telemetry spans_every must be at least 1 step, got {spans_every}")
        self.engine = engine
        self.publish_fn = publish
        self.rank = rank
        self.min_gap = 1.0 / hz
        self.spans_every = spans_every
        self.published = 0
        self.dropped = 0
        self._window = _Window()
        self._held: StepDone | None = None  # the newest step not yet published
        self._last_sent = float("-inf")  # monotonic time of the last "step" record
        self._stopping = False
        self._skipped = 0
        self._last_scale: float | None = None
        self._spans_due = True  # the first step's spans go out, then every spans_every
        self._spans_sent = float("-inf")
        self._last_timings: dict[str, Any] | None = None
        self._memory: dict[str, int] = {}
        self._rss = 0
        self._memory_at = float("-inf")
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
        self.runtime.start_soon(self._watch_held)

    async def on_stop(self) -> None:
        self._stopping = True
        self._flush()

    async def _watch_held(self) -> None:
        """When steps come faster than the rate, the newest waits for the next one; if none
        comes (the run ended, or paused to evaluate), it goes out from here. One wake-up every
        HELD_CHECK_S instead of a timer per record keeps the per-step path short."""
        import anyio

        while not self._stopping:
            await anyio.sleep(max(HELD_CHECK_S, self.min_gap))
            if self._held is not None and time.monotonic() - self._last_sent >= self.min_gap:
                try:
                    await self.ref.send(FlushTelemetry(), timeout=1.0)
                except Exception:  # noqa: BLE001 - the actor stopped meanwhile
                    return

    @handler
    async def step_done(self, msg: StepDone) -> None:
        self._window.steps += 1
        now = time.monotonic()
        self._snapshot(msg.step, now)
        if msg.skipped:
            self._skipped += 1
            self._publish(self._skip_event(msg))
        self._last_scale = msg.loss_scale
        self._held = msg
        if now - self._last_sent >= self.min_gap:
            self._flush()

    @handler
    async def flush(self, msg: FlushTelemetry) -> None:
        self._flush()

    # -- building records ------------------------------------------------------------------------

    def _snapshot(self, step: int, now: float) -> None:
        """Keeps this step's spans when they can be read consistently. The handler runs on the
        loop thread while training goes on: ``timer.last_step`` belongs to step ``step`` only if
        the engine has not counted another step by the time it was read (the engine counts a
        step before it closes the step's timer)."""
        start, spans = self.engine.timer.last_step
        if self.engine.global_steps != step:
            return
        self._window.snapshots.append((start, spans))
        if step % self.spans_every == 0:
            self._spans_due = True
        if self._spans_due and now - self._spans_sent >= SPANS_MIN_GAP_S:
            self._spans_sent = now
            sent = self._publish({
                "v": SCHEMA_VERSION, "kind": "spans", "rank": self.rank, "t": time.time(),
                "step": step, "step_start": start + self._clock,
                "spans": [[name, round(a - start, 7), round(b - start, 7)]
                          for name, a, b in spans]})
            self._spans_due = not sent

    def _flush(self) -> None:
        msg = self._held
        if msg is None:
            return
        self._held = None
        record = self._step_record(msg, self._window)
        self._window = _Window()
        self._last_sent = time.monotonic()
        self._publish(record)

    def _step_record(self, msg: StepDone, w: _Window) -> dict[str, Any]:
        timings = [step_timings(spans, start) for start, spans in w.snapshots]
        if timings:
            phases = {k: sum(t[k] for t in timings) / len(timings) for k in PHASE_KEYS}
            overlaps = [t["overlap"] for t in timings if t["overlap"] is not None]
            overlap = sum(overlaps) / len(overlaps) if overlaps else None
            self._last_timings = dict(phases, overlap=overlap)
        elif self._last_timings is not None:  # no step of this window read consistently
            phases = {k: self._last_timings[k] for k in PHASE_KEYS}
            overlap = self._last_timings["overlap"]
        else:
            phases = dict.fromkeys(PHASE_KEYS, 0.0)
            overlap = None
        step_s = phases["step_s"]
        batch = getattr(self.engine.config, "train_batch_size", None)
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
        """MFU and memory-bandwidth utilization (None without a known peak)."""
        health = getattr(self.engine, "health", None)
        if health is None:
            return {"mfu": None, "mbu": None}
        figures = health.figures(step_s, comm_s)
        return {"mfu": figures["mfu"], "mbu": figures["mbu"]}

    def _skip_event(self, msg: StepDone) -> dict[str, Any]:
        fp16 = getattr(self.engine, "precision", None) == "fp16"
        before = self._last_scale
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
        now = time.monotonic()
        if now - self._memory_at >= MEMORY_REFRESH_S:
            try:
                self._memory = self.engine.memory_breakdown()
                self._memory_at = now
            except RuntimeError:
                # The training thread changed the optimizer's state dict while it was walked
                # (its first step creates it); the next record tries again.
                pass
            self._rss = int(self._process.memory_info().rss) if self._process is not None \
                else int(self._memory.get("process_rss", 0))
        m = self._memory
        rss = self._rss
        device = getattr(self.engine, "device", None)
        allocated = None
        if device is not None and device.type == "cuda":
            import torch

            allocated = int(torch.cuda.memory_allocated(device))
        return {"model_states": int(m.get("model_states", 0)),
                "parameters": int(m.get("parameters", 0)),
                "gradients": int(m.get("gradients", 0)),
                "optimizer_state": int(m.get("optimizer_state", 0)),
                "process_rss": rss, "device_allocated": allocated}

    def _publish(self, record: dict[str, Any]) -> bool:
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


def _engine_summary(engine: Any) -> dict[str, Any]:
    cfg = engine.config
    return {"precision": getattr(engine, "precision", None),
            "zero_stage": getattr(engine, "zero_stage", None),
            "world_size": getattr(engine, "world_size", None),
            "train_batch_size": cfg.train_batch_size,
            "micro_batch_size": cfg.train_micro_batch_size_per_gpu,
            "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
            "parameters": sum(p.numel() for p in getattr(engine, "trainable", []))}


def attach(engine: Any, *, force: bool = False) -> ActorRef[Any] | None:
    """Wires a TelemetryActor into ``engine`` at ``after_step`` and returns its reference.

    Does nothing (returns None) when the config switches telemetry off, or when no flowtrain
    launcher hosts the job (a plain ``python train.py`` or torchrun: nobody would record or
    watch); ``force`` attaches anyway, for benchmarks and tests in one process.
    """
    section = engine.config.flowtrain
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

    async def flush_before_goodbye() -> None:
        try:
            await ref.ask(FlushTelemetry(), timeout=FLUSH_ASK_TIMEOUT)
        except Exception:  # noqa: BLE001 - stopped with its engine (destroy); nothing is held
            pass

    control.before_close.append(flush_before_goodbye)
    return ref

