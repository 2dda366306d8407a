"""Wall-clock spans of each step (forward, backward, exposed communication, optimizer), for the
throughput log and, with the same task names as the StepPlan, for comparison with the simulator."""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

PHASES = ("forward", "backward", "comm", "optimizer")


class StepTimer:
    """Sums each phase's time per step and keeps the last steps for averages."""

    def __init__(self, history: int = 1000, synchronize: bool = False) -> None:
        self._current = dict.fromkeys(PHASES, 0.0)
        self._steps: deque[dict[str, float]] = deque(maxlen=history)
        self._step_start = time.perf_counter()
        self._synchronize = synchronize and torch.cuda.is_available()
        self.spans: list[tuple[str, float, float]] = []  # this step's, by task name
        self.last_step: tuple[float, list[tuple[str, float, float]]] = (0.0, [])

    @contextlib.contextmanager
    def span(self, phase: str, name: str | None = None) -> Iterator[None]:
        """Times ``phase`` (for the breakdown) and records a span named ``name`` (a StepPlan
        task name; the phase when omitted)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._synchronize:
                torch.cuda.synchronize()
            end = time.perf_counter()
            self._current[phase] += end - start
            self.spans.append((name or phase, start, end))

    def record_spans(self, spans: Sequence[tuple[str, float, float]]) -> None:
        self.spans.extend(spans)

    def end_step(self) -> None:
        now = time.perf_counter()
        self._current["step_s"] = now - self._step_start
        self._steps.append(self._current)
        self.last_step = (self._step_start, self.spans)
        self.spans = []
        self._current = dict.fromkeys(PHASES, 0.0)
        self._step_start = now

    def breakdown(self, last: int) -> dict[str, float]:
        """Mean seconds per step of each phase over the last ``last`` steps."""
        steps = list(self._steps)[-max(1, last):]
        if not steps:
            return {}
        keys = PHASES + ("step_s",)
        return {(k if k == "step_s" else f"{k}_s"): sum(s.get(k, 0.0) for s in steps) / len(steps)
                for k in keys}


def completion_stamp(work: Any) -> list[float]:
    """A list that gets the time ``work`` completes from its completion callback: a
    ``concurrent.futures.Future`` (the shared-memory channel) or a torch.distributed work
    handle's future. A span then ends when the collective did, not when its owner next looked
    at it (a reduce drained after the backward it overlapped, a prefetched gather awaited when
    its module runs). Stays empty where the handle has no callback (gloo's reduce-scatter)."""
    stamp: list[float] = []

    def note(_: Any) -> None:
        stamp.append(time.perf_counter())

    try:
        if hasattr(work, "add_done_callback"):
            work.add_done_callback(note)
        else:
            work.get_future().add_done_callback(note)
    except (RuntimeError, AttributeError):
        pass
    return stamp


def stamped_end(stamp: list[float]) -> float:
    """When a stamped collective finished: its completion callback's time, else now."""
    return stamp[0] if stamp else time.perf_counter()
