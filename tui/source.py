"""Where the monitor's records come from: a recording replayed at a chosen speed, or the
coordinator's PUB socket live. Both fold records into the same ``RunState`` and never block the
app's event loop: file reads run in a thread, the live socket is awaited.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from flowtrain.telemetry import Record, Subscriber, TelemetryDamage, read_records
from tui.state import DamageNotice, RunState

# The replay speeds that +/- step through; inf replays as fast as the screen can take it.
SPEEDS: tuple[float, ...] = (1.0, 2.0, 10.0, math.inf)
SPEED_NAMES = ("1", "2", "10", "max")
# The replay clock wakes at least this often so that ages and the header tick smoothly.
TICK_S = 0.05
READ_BATCH = 512
# Records a paused live monitor keeps (about 5 minutes of 64 ranks at 10 Hz); past that the
# oldest go, as they would have on a PUB socket nobody read.
LIVE_BUFFER = 200_000


def parse_speed(text: str) -> float:
    """``"1" | "2" | "10" | "max"`` to a speed factor (inf for max)."""
    if text not in SPEED_NAMES:
        raise ValueError(f"replay speed {text!r} is not one of {', '.join(SPEED_NAMES)}")
    return SPEEDS[SPEED_NAMES.index(text)]


def speed_name(speed: float) -> str:
    return "max" if math.isinf(speed) else f"{speed:g}x"


class Source(Protocol):
    """What the app needs of a record source."""

    paused: bool

    async def run(self, state: RunState) -> None:
        """Feeds ``state`` until the source is exhausted (replay) or cancelled (live)."""

    def set_paused(self, paused: bool) -> None:
        """Stops (or restarts) the state from advancing; records are not lost meanwhile."""

    def describe(self) -> str:
        """A few words for the header: what is shown and how."""


class ReplaySource:
    """Replays ``telemetry.msgpack``, spacing records as their timestamps were spaced, divided
    by the speed; a damaged tail ends the replay with a notice saying where it stopped."""

    def __init__(self, path: str | Path, speed: float = 1.0) -> None:
        if not (speed > 0):
            raise ValueError(f"replay speed must be positive, got {speed!r}")
        self.path = Path(path)
        self.speed = speed
        self.paused = False
        self.done = False
        self._virtual: float | None = None
        self._resumed = asyncio.Event()
        self._resumed.set()

    # ------------------------------------------------------------ controls
    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        if paused:
            self._resumed.clear()
        else:
            self._resumed.set()

    def faster(self) -> None:
        self.speed = SPEEDS[min(len(SPEEDS) - 1, self._speed_index() + 1)]

    def slower(self) -> None:
        self.speed = SPEEDS[max(0, self._speed_index() - 1)]

    def _speed_index(self) -> int:
        # A speed set outside the list (a test's 1000x) steps from the listed one below it.
        return max((i for i, s in enumerate(SPEEDS) if s <= self.speed), default=0)

    def describe(self) -> str:
        if self.done:
            return f"replay of {self.path.name}: finished"
        state = "paused" if self.paused else speed_name(self.speed)
        return f"replay of {self.path.name} at {state}"

    # ------------------------------------------------------------ the replay
    async def run(self, state: RunState) -> None:
        records: Iterator[Record] = read_records(self.path)
        try:
            while True:
                batch, damage, exhausted = await asyncio.to_thread(_take, records, READ_BATCH)
                for record in batch:
                    await self._wait_for(record, state)
                    state.apply(record)
                if damage is not None:
                    state.damage = damage
                    state.version += 1
                if exhausted:
                    break
                await asyncio.sleep(0)
        finally:
            self.done = True
            state.version += 1

    async def _wait_for(self, record: dict[str, Any], state: RunState) -> None:
        """Sleeps until the replay clock reaches the record's time (or not at all at max)."""
        t = record.get("t")
        if not isinstance(t, (int, float)):
            return
        if self._virtual is None:
            self._virtual = float(t)
        loop = asyncio.get_running_loop()
        while t > self._virtual or self.paused:
            if self.paused:
                await self._resumed.wait()
                continue
            if math.isinf(self.speed):
                self._virtual = float(t)
                break
            before = loop.time()
            await asyncio.sleep(min(TICK_S, (t - self._virtual) / self.speed))
            if not self.paused:
                # A stalled loop (a busy machine, a slow redraw) must not jump the replay ahead:
                # the clock moves at most two ticks per wake-up.
                waited = min(loop.time() - before, 2 * TICK_S)
                self._virtual += waited * self.speed
                state.now = max(state.now, min(self._virtual, float(t)))
                state.version += 1
        if math.isinf(self.speed) and state.records % READ_BATCH == 0:
            # At max speed nothing else would let the app redraw or take a key press.
            await asyncio.sleep(0)


def _take(records: Iterator[Record], count: int
          ) -> tuple[list[dict[str, Any]], DamageNotice | None, bool]:
    """Up to ``count`` records (run in a thread: the file read blocks), the damage that ended
    the recording if any, and whether the recording is over."""
    batch: list[dict[str, Any]] = []
    try:
        for _ in range(count):
            batch.append(dict(next(records)))
    except StopIteration:
        return batch, None, True
    except TelemetryDamage as damage:
        return batch, DamageNotice(damage.offset, damage.records_read, damage.reason), True
    return batch, None, False


RecordFeed = Callable[[], AsyncIterator[dict[str, Any]]]
# The recording trails the socket by at most its flush interval (under a second); records of
# the recording's last OVERLAP_S seconds may also arrive live.
OVERLAP_S = 10.0


def _record_key(record: dict[str, Any]) -> tuple[Any, ...]:
    return (record.get("kind"), record.get("rank"), record.get("t"), record.get("step"),
            record.get("event"))


class LiveSource:
    """Subscribes to the coordinator's telemetry. Given the run's recording as ``history``, it
    first shows what was recorded before the monitor joined (the job header, the loss so far),
    then what arrives live, each record once. While paused, records are held (up to
    LIVE_BUFFER) and the clock stops, so a paused screen does not turn every rank stale."""

    def __init__(self, endpoint: str, secret: bytes, *, history: Path | None = None,
                 feed: RecordFeed | None = None) -> None:
        self.endpoint = endpoint
        self.history = history
        self.paused = False
        self._secret = secret
        self._feed = feed
        self._held: deque[dict[str, Any]] = deque(maxlen=LIVE_BUFFER)
        self._state: RunState | None = None

    def set_paused(self, paused: bool) -> None:
        self.paused = paused
        if not paused and self._state is not None:
            while self._held:
                self._state.apply(self._held.popleft())
            self._state.now = max(self._state.now, time.time())

    def describe(self) -> str:
        held = f", {len(self._held)} records held" if self._held else ""
        return f"live from {self.endpoint}" + (f" (paused{held})" if self.paused else "")

    async def run(self, state: RunState) -> None:
        self._state = state
        # The socket is read from the start, so nothing falls between the file and the live
        # records; what both carry is applied once.
        queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()
        pump = asyncio.create_task(self._pump(queue))
        ticker = asyncio.create_task(self._tick(state))
        try:
            recorded = await self._load_history(state)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if recorded and _record_key(item) in recorded:
                    continue
                if self.paused:
                    self._held.append(item)
                else:
                    state.apply(item)
        finally:
            ticker.cancel()
            pump.cancel()

    async def _pump(self, queue: asyncio.Queue[dict[str, Any] | BaseException]) -> None:
        try:
            async for record in (self._feed or self._subscribe)():
                queue.put_nowait(record)
        except Exception as exc:  # handed to run(), which reports it on screen
            queue.put_nowait(exc)

    async def _load_history(self, state: RunState) -> set[tuple[Any, ...]]:
        """Applies the recording in batches (the loop stays free) and returns the keys of its
        last seconds, which the socket may deliver again."""
        if self.history is None or not self.history.is_file():
            return set()
        records: Iterator[Record] = read_records(self.history)
        recent: deque[dict[str, Any]] = deque()
        while True:
            # Damage here is the record the recorder is writing right now: not worth a notice.
            batch, _, exhausted = await asyncio.to_thread(_take, records, READ_BATCH)
            for record in batch:
                state.apply(record)
                recent.append(record)
                while recent and recent[0]["t"] < record["t"] - OVERLAP_S:
                    recent.popleft()
            if exhausted:
                return {_record_key(r) for r in recent}
            await asyncio.sleep(0)

    async def _tick(self, state: RunState) -> None:
        # Ages grow between records; the wall clock is the live clock.
        while True:
            if not self.paused:
                state.now = max(state.now, time.time())
                state.version += 1
            await asyncio.sleep(TICK_S * 5)

    async def _subscribe(self) -> AsyncIterator[dict[str, Any]]:
        subscriber = Subscriber(self.endpoint, self._secret)
        try:
            while True:
                record = await subscriber.arecv()
                if record is not None:
                    yield dict(record)
        finally:
            subscriber.close()
