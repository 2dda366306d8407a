"""How fast ``flowtrain monitor`` answers a key while 1,024 ranks publish at 10 Hz.

A thread plays the coordinator: it signs each record as the coordinator does and publishes it on
a real PUB socket, which the monitor's LiveSource reads through ``flowtrain.telemetry.Subscriber``
(``--via state`` instead feeds the RunState inside the app's loop, leaving the socket out).
The app runs headless; a key's latency is the time from the key event to the first screen
update whose text shows the key's effect (the view switched, the next rank drawn, the next
outlier picked, a rank's detail page, the table sorted or filtered, "paused"). One rank of the
job is 1.5 times slower than the others: the outlier the keys find.

    .venv/bin/python benchmarks/monitor_responsiveness.py [--ranks 1024] [--hz 10] [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flowtrain.control.protocol import FrameCodec, encrypt_server  # noqa: E402
from flowtrain.telemetry import encode, topic_of  # noqa: E402
from tui.app import MonitorApp  # noqa: E402
from tui.rank_order import TableOptions, rank_rows  # noqa: E402
from tui.source import LiveSource  # noqa: E402
from tui.state import RunState  # noqa: E402

SECRET = b"monitor-benchmark-secret-32bytes"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
MEM = {"model_states": 3 << 30, "parameters": 1 << 30, "gradients": 1 << 30,
       "optimizer_state": 2 << 30, "process_rss": 6 << 30, "device_allocated": 20 << 30}
SLOW_RANK = 7  # its steps take 1.5 times the others'
RANKS_PER_NODE = 8
SPANS = [["forward/mb0", 0.0, 0.03], ["backward/mb0", 0.03, 0.08], ["reduce/bucket0", 0.06, 0.085],
         ["comm/wait", 0.08, 0.085], ["optimizer/step", 0.085, 0.095]]


def tick_records(ranks: int, step: int, now: float) -> list[dict[str, Any]]:
    """One 10 Hz tick of a job: every rank's step record, its spans every 10th step and its
    heartbeat once a second."""
    out: list[dict[str, Any]] = []
    if step == 1:
        out.append({"v": 1, "kind": "job", "rank": -1, "t": now, "job_id": "bench",
                    "world_size": ranks, "run_dir": "runs/bench", "started": now,
                    "total_steps": 100_000, "config_summary": {}})
    for rank in range(ranks):
        if step == 1:
            out.append({"v": 1, "kind": "event", "rank": rank, "t": now, "event": "rank_joined",
                        "message": f"rank {rank} joined",
                        "data": {"host": f"node{rank // RANKS_PER_NODE}"}})
        step_s = 0.15 if rank == SLOW_RANK else 0.1
        out.append({"v": 1, "kind": "step", "rank": rank, "t": now, "step": step,
                    "loss": 4.0 / (1 + step * 0.01), "lr": 1e-4, "loss_scale": 65536.0,
                    "skipped": 0, "grad_norm": 1.0, "step_s": step_s, "samples_per_s": 5120.0,
                    "tokens_per_s": None, "forward_s": 0.03, "backward_s": 0.05,
                    "comm_s": 0.005, "optimizer_s": 0.01, "overlap": 0.8, "comm_share": 0.05,
                    "mfu": 0.55, "mem": MEM})
        if step % 10 == 1:
            out.append({"v": 1, "kind": "spans", "rank": rank, "t": now, "step": step,
                        "spans": SPANS, "step_start": now - 0.1})
            out.append({"v": 1, "kind": "heartbeat", "rank": rank, "t": now, "status": "busy",
                        "busy_actor": "trainer", "pending_collective": None})
    return out


class Publisher(threading.Thread):
    """The coordinator's PUB side at ``hz`` ticks a second, in its own thread."""

    def __init__(self, ranks: int, hz: float) -> None:
        super().__init__(daemon=True, name="bench-publisher")
        self.ranks, self.hz = ranks, hz
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, 1_000_000)
        encrypt_server(self.socket, SECRET)  # as the coordinator's PUB is
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.codec = FrameCodec(SECRET, "coordinator")
        self.published = 0
        self.stop = threading.Event()

    def run(self) -> None:
        step, period = 0, 1.0 / self.hz
        next_tick = time.monotonic()
        while not self.stop.is_set():
            step += 1
            for record in tick_records(self.ranks, step, time.time()):
                topic = topic_of(record)
                encode(record)  # the coordinator validates what it publishes
                parts = self.codec.encode_published(
                    topic, {"topic": topic, "rank": record["rank"], "body": record})
                self.socket.send_multipart(parts, flags=zmq.NOBLOCK)
                self.published += 1
            next_tick += period
            self.stop.wait(max(0.0, next_tick - time.monotonic()))
        self.socket.close(linger=0)
        self.context.term()


class InLoopSource(LiveSource):
    """The same records applied straight to the RunState on the app's loop (no socket)."""

    def __init__(self, ranks: int, hz: float) -> None:
        super().__init__("in-process", SECRET, feed=self._generate)
        self.ranks, self.hz = ranks, hz

    async def _generate(self) -> AsyncIterator[dict[str, Any]]:
        step = 0
        while True:
            step += 1
            for record in tick_records(self.ranks, step, time.time()):
                yield record
            await asyncio.sleep(1.0 / self.hz)


class ScreenWatch:
    """Times screen updates: wraps the app's display call, which a headless app still makes
    with each composed update, and looks for a text in what was drawn."""

    def __init__(self, app: MonitorApp) -> None:
        self.app = app
        self.marker: str | None = None
        self.seen_at: float | None = None
        self.cpu_at: float | None = None
        self.updated = asyncio.Event()
        original = app._display

        def display(screen: Any, renderable: Any) -> None:
            original(screen, renderable)
            if self.marker is None or renderable is None:
                return
            text = ANSI.sub("", renderable.render_segments(app.console))
            if self.marker in text:
                self.seen_at = time.perf_counter()
                self.cpu_at = time.thread_time()
                self.marker = None
                self.updated.set()

        app._display = display  # type: ignore[method-assign]

    async def press(self, pilot: Any, key: str, marker: str) -> tuple[float, float]:
        """(wall seconds, CPU seconds of the app's thread) from the key to the update. On a
        busy machine the wall time includes waiting for a core; the CPU time does not."""
        self.marker, self.seen_at, self.cpu_at = marker, None, None
        self.updated.clear()
        start, cpu_start = time.perf_counter(), time.thread_time()
        press = asyncio.create_task(pilot.press(key))
        await asyncio.wait_for(self.updated.wait(), timeout=5.0)
        await press
        assert self.seen_at is not None and self.cpu_at is not None
        return self.seen_at - start, self.cpu_at - cpu_start


async def measure(via: str, ranks: int, hz: float, rounds: int
                  ) -> dict[str, list[tuple[float, float]]]:
    publisher = None
    if via == "pub":
        publisher = Publisher(ranks, hz)
        source: LiveSource = LiveSource(publisher.endpoint, SECRET)
        publisher.start()
    else:
        source = InLoopSource(ranks, hz)
    app = MonitorApp(source)
    state: RunState = app.state
    latencies: dict[str, list[tuple[float, float]]] = {}
    started = time.monotonic()
    cpu_steady = 0.0
    try:
        async with app.run_test(size=(140, 50)) as pilot:
            watch = ScreenWatch(app)
            deadline = time.monotonic() + 20
            while len(state.ranks) < ranks:
                if time.monotonic() > deadline:
                    raise SystemExit(f"only {len(state.ranks)} of {ranks} ranks arrived in 20 s")
                await pilot.pause(0.05)
            await pilot.pause(1.0)  # let the table fill and the rates settle
            cpu_before, wall_before = time.process_time(), time.perf_counter()
            await pilot.pause(3.0)
            cpu_steady = (time.process_time() - cpu_before) / (time.perf_counter() - wall_before)
            for _ in range(rounds):
                order = rank_rows(app.rows())
                after = order[(order.index(app.selected_rank) + 1) % len(order)] \
                    if app.selected_rank in order else order[0]
                steps = [("t: overview -> timeline", "t", "all ranks, last step"),
                         ("r: next rank (timeline)", "r", f"rank {after}  step"),
                         ("o: next outlier (timeline)", "o", f"rank {SLOW_RANK}  step"),
                         ("t: timeline -> events", "t", "message"),
                         ("t: events -> plots", "t", "step time over"),
                         ("t: plots -> overview", "t", "heartbeat"),
                         ("enter: rank detail", "enter", f"rank {SLOW_RANK} on node"),
                         ("escape: back to the table", "escape", "status▼"),
                         ("s: sort by rank", "s", "rank▼"),
                         ("f: outliers only", "f", "showing outliers"),
                         ("p: pause", "p", "paused"),
                         ("p: resume", "p", f"{source.endpoint}]")]
                for name, key, marker in steps:
                    latencies.setdefault(name, []).append(await watch.press(pilot, key, marker))
                    await pilot.pause(0.1)
                app.options = TableOptions()  # the next round starts from the default table
                app.selected_rank = order[0]
            received = state.records
    finally:
        if publisher is not None:
            publisher.stop.set()
            publisher.join(5)
    rate = received / (time.monotonic() - started)
    print(f"{via}: {ranks} ranks at {hz:g} Hz, {received} records applied (~{rate:.0f}/s); "
          f"the monitor process uses {cpu_steady * 100:.0f}% of a core with no key pressed")
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024,
                        help="simulated ranks (default 1024)")
    parser.add_argument("--hz", type=float, default=10.0, help="records per rank per second")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the six key presses")
    parser.add_argument("--via", choices=("pub", "state", "both"), default="both",
                        help="through a real PUB socket, straight into the RunState, or both")
    args = parser.parse_args()
    if args.ranks < 1 or args.hz <= 0 or args.rounds < 1:
        parser.error("--ranks and --rounds must be at least 1 and --hz positive")
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} cores, load average {load:.1f} (other processes slow the "
          "wall times; the CPU times are what the monitor itself spent)")
    for via in (("pub", "state") if args.via == "both" else (args.via,)):
        latencies = asyncio.run(measure(via, args.ranks, args.hz, args.rounds))
        print(f"  {'key -> screen update':<30} {'wall median':>12} {'wall max':>9} "
              f"{'CPU median':>11}")
        for name, values in [*latencies.items(),
                             ("all keys", [v for vs in latencies.values() for v in vs])]:
            wall = [w for w, _ in values]
            cpu = [c for _, c in values]
            print(f"  {name:<30} {statistics.median(wall) * 1e3:9.1f} ms {max(wall) * 1e3:6.0f} ms "
                  f"{statistics.median(cpu) * 1e3:8.1f} ms")
        print("  (target: <= 100 ms)")


if __name__ == "__main__":
    main()
