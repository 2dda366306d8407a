"""The launcher's side of telemetry: it records every record the coordinator publishes into the
run directory, advertises the live endpoint, and shows rank 0's progress on the console."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from flowtrain.telemetry.files import (
    LIVE_FILE,
    TELEMETRY_FILE,
    TelemetryRecorder,
    write_live_endpoint,
)
from flowtrain.telemetry.schema import event_record, job_record

TOTAL_STEPS_ENV = "FLOWTRAIN_TOTAL_STEPS"
PLAIN_INTERVAL = 10.0  # seconds between progress lines when stdout is not a terminal
RATE_WINDOW = 20  # step records the ETA's rate is measured over
CLEAR = "\r\x1b[2K"
# After these the launcher logs a teardown on stderr: the live line ends first so the log
# starts on a line of its own.
FAILURE_EVENTS = frozenset({"rank_failed", "rank_stuck", "join_timeout"})


def parse_total_steps(value: str | None, source: str) -> int | None:
    """``--total-steps`` or FLOWTRAIN_TOTAL_STEPS as a step count; ValueError naming the source."""
    if value is None or value == "":
        return None
    try:
        steps = int(value)
    except ValueError:
        raise ValueError(f"{source} must be a whole number of optimizer steps, got {value!r}") \
            from None
    if steps < 1:
        raise ValueError(f"{source} must be at least 1 optimizer step, got {steps}")
    return steps


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"


class ProgressLine:
    """Rank 0's progress: one line rewritten in place on a terminal, or a plain line every
    ``plain_interval`` seconds otherwise (logs and pipes keep a readable history). Other
    writers to the same terminal wrap their output in ``hold()`` so the line never mixes in."""

    def __init__(self, out: TextIO, total_steps: int | None, *, live: bool | None = None,
                 plain_interval: float = PLAIN_INTERVAL) -> None:
        self.out = out
        self.total_steps = total_steps
        self.live = _isatty(out) if live is None else live
        self.plain_interval = plain_interval
        self.lock = threading.RLock()
        self.last: Mapping[str, Any] | None = None
        self.lines = 0  # plain lines printed
        self._shown = ""  # text on the terminal now (live mode)
        self._printed_step: int | None = None
        self._printed_at = float("-inf")
        self._rates: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW)
        self._broken = False

    def format(self, record: Mapping[str, Any]) -> str:
        step = record["step"]
        parts = [f"step {step}/{self.total_steps} ({100 * step / self.total_steps:.0f}%)"
                 if self.total_steps else f"step {step}"]
        loss = record.get("loss")
        parts.append(f"loss {loss:.4g}" if isinstance(loss, float) and not math.isnan(loss)
                     else f"loss {loss}")
        if record.get("samples_per_s"):
            parts.append(f"{record['samples_per_s']:,.1f} samples/s")
        if record.get("skipped"):
            parts.append(f"skipped {record['skipped']}")
        eta = self._eta(step)
        if eta is not None:
            parts.append(f"ETA {_duration(eta)}")
        return " | ".join(parts)

    def _eta(self, step: int) -> float | None:
        if not self.total_steps or len(self._rates) < 2:
            return None
        (t0, s0), (t1, s1) = self._rates[0], self._rates[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return max(0, self.total_steps - step) * (t1 - t0) / (s1 - s0)

    def update(self, record: Mapping[str, Any]) -> None:
        """Takes one of rank 0's step records."""
        with self.lock:
            self.last = record
            self._rates.append((time.monotonic(), int(record["step"])))
            if self.live:
                self._draw(self.format(record))
            elif time.monotonic() - self._printed_at >= self.plain_interval:
                self._print(record)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Around another write to the terminal: the line is cleared first, redrawn after."""
        with self.lock:
            shown = self._shown
            if shown:
                self._write(CLEAR)
                self._shown = ""
            try:
                yield
            finally:
                if shown:
                    self._draw(shown)

    def finish(self) -> None:
        """The job ended: the live line stays as the last line; plain mode prints the last
        record if it has not been printed."""
        with self.lock:
            if self.live and self._shown:
                self._write("\n")
                self._shown = ""
            elif not self.live and self.last is not None and \
                    self.last["step"] != self._printed_step:
                self._print(self.last)

    def _print(self, record: Mapping[str, Any]) -> None:
        self._write(f"progress: {self.format(record)}\n")
        self._printed_step = record["step"]
        self._printed_at = time.monotonic()
        self.lines += 1

    def _draw(self, text: str) -> None:
        width = shutil.get_terminal_size((100, 24)).columns
        text = text[:max(10, width - 1)]
        self._write(CLEAR + text)
        self._shown = text

    def _write(self, text: str) -> None:
        if self._broken:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):
            self._broken = True  # a closed pipe (`| head`): the job goes on without progress


def _isatty(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False


class JobTelemetry:
    """Owned by the launcher that hosts the coordinator: ``on_record`` is the coordinator's
    ``on_telemetry`` (it runs on the launcher's event loop and only queues work)."""

    def __init__(self, run_dir: str | os.PathLike[str], *, job_id: str, world_size: int,
                 total_steps: int | None, config_summary: dict[str, Any], started: float,
                 progress: ProgressLine | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.recorder = TelemetryRecorder(self.run_dir / TELEMETRY_FILE)
        self.progress = progress
        self.coordinator: Any = None
        self.closed = False
        self.job_record = job_record(job_id=job_id, world_size=world_size,
                                     run_dir=str(self.run_dir), started=started,
                                     total_steps=total_steps, config_summary=config_summary)

    def on_record(self, record: Mapping[str, Any]) -> None:
        if self.closed:
            return  # job_ended was the last record
        self.recorder.append(record)
        if self.progress is None:
            return
        if record["kind"] == "step" and record["rank"] == 0:
            self.progress.update(record)
        elif record["kind"] == "event" and record["event"] in FAILURE_EVENTS:
            self.progress.finish()

    def advertise(self, coordinator: Any, secret: bytes) -> None:
        """Writes the live endpoint for local subscribers once the coordinator is bound."""
        self.coordinator = coordinator
        endpoint = coordinator.pub_endpoint.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")
        try:
            write_live_endpoint(self.run_dir, endpoint, secret)
        except OSError:
            pass  # the monitor cannot attach live; it can still replay the recording

    def child_exited(self, rank: int | None, label: str, code: int | None, how: str,
                     failure: bool) -> None:
        """A rank (or node launcher) process ended, as the supervisor saw it."""
        record = event_record("rank_failed" if failure else "rank_exited", f"{label} {how}",
                              rank=rank if rank is not None else -1,
                              data={"exit_code": code, "source": "exit", "failure": failure})
        if self.coordinator is not None:
            self.coordinator.publish_record(record)  # also reaches on_record
        else:
            self.on_record(record)

    def close(self, *, status: str, exit_code: int, message: str | None) -> None:
        """Publishes and records ``job_ended`` (live subscribers see the job end when the
        coordinator still serves: the launcher calls this before it stops the coordinator),
        writes the rest of the file, ends the progress line. Once; later calls do nothing."""
        if self.closed:
            return
        text = f"job {status} (exit code {exit_code})" + (f": {message}" if message else "")
        record = event_record("job_ended", text, data={
            "status": status, "exit_code": exit_code, "root_cause": message})
        if self.coordinator is not None:
            self.coordinator.publish_record(record)  # also reaches on_record, hence the file
        else:
            self.recorder.append(record)
        self.closed = True
        self.recorder.close()
        (self.run_dir / LIVE_FILE).unlink(missing_ok=True)
        if self.progress is not None:
            self.progress.finish()
