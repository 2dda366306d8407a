"""Actor message latency, send -> handled: inside the rank's loop, and from the main thread into
the loop, next to a bare asyncio.Queue doing the same hand-off (the floor), alternating rounds.

    python benchmarks/actor_latency.py [--messages 5000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from dataclasses import dataclass

from flowtrain.actors import Actor, Runtime, handler


@dataclass(frozen=True)
class Ping:
    sent_ns: int


class Sink(Actor):
    def __init__(self) -> None:
        self.latencies: list[int] = []
        self.loop_event: asyncio.Event | None = None
        self.thread_event = threading.Event()

    @handler
    async def ping(self, msg: Ping) -> None:
        self.latencies.append(time.perf_counter_ns() - msg.sent_ns)
        if self.loop_event is not None:
            self.loop_event.set()
        self.thread_event.set()


async def actor_in_loop(sink: Sink, n: int) -> list[int]:
    sink.latencies.clear()
    sink.loop_event = asyncio.Event()
    for _ in range(n):
        sink.loop_event.clear()
        await sink.ref.send(Ping(time.perf_counter_ns()))
        await sink.loop_event.wait()
    sink.loop_event = None
    return list(sink.latencies)


def actor_cross_thread(sink: Sink, n: int) -> list[int]:
    sink.latencies.clear()
    for _ in range(n):
        sink.thread_event.clear()
        sink.ref.send_from_thread(Ping(time.perf_counter_ns()))
        sink.thread_event.wait(5)
    return list(sink.latencies)


async def queue_in_loop(n: int) -> list[int]:
    queue: asyncio.Queue[int] = asyncio.Queue(1024)
    latencies: list[int] = []
    handled = asyncio.Event()

    async def consumer() -> None:
        while True:
            sent = await queue.get()
            latencies.append(time.perf_counter_ns() - sent)
            handled.set()

    task = asyncio.ensure_future(consumer())
    for _ in range(n):
        handled.clear()
        await queue.put(time.perf_counter_ns())
        await handled.wait()
    task.cancel()
    return latencies


def queue_cross_thread(runtime: Runtime, n: int) -> list[int]:
    latencies: list[int] = []
    handled = threading.Event()
    queue: asyncio.Queue[int] = runtime.call(_make_queue)

    async def consumer() -> None:
        for _ in range(n):
            sent = await queue.get()
            latencies.append(time.perf_counter_ns() - sent)
            handled.set()

    runtime.start_soon(consumer)
    for _ in range(n):
        handled.clear()
        runtime.loop.call_soon_threadsafe(queue.put_nowait, time.perf_counter_ns())
        handled.wait(5)
    return latencies


async def _make_queue() -> asyncio.Queue[int]:
    return asyncio.Queue(1024)


def summary(samples_ns: list[int]) -> tuple[float, float]:
    us = sorted(s / 1000 for s in samples_ns)
    return statistics.median(us), us[min(len(us) - 1, int(0.99 * len(us)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=5000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per case")
    args = parser.parse_args()

    runtime = Runtime("bench").start()
    sink = Sink()
    runtime.spawn(sink, "sink")
    results: dict[str, list[int]] = {k: [] for k in
                                     ("actor in-loop", "asyncio.Queue in-loop",
                                      "actor cross-thread", "asyncio.Queue cross-thread")}
    runtime.call(actor_in_loop, sink, 500)  # warm-up
    actor_cross_thread(sink, 500)
    for _ in range(args.rounds):
        results["actor in-loop"] += runtime.call(actor_in_loop, sink, args.messages)
        results["asyncio.Queue in-loop"] += runtime.call(queue_in_loop, args.messages)
        results["actor cross-thread"] += actor_cross_thread(sink, args.messages)
        results["asyncio.Queue cross-thread"] += queue_cross_thread(runtime, args.messages)
    runtime.stop()

    aims = {"actor in-loop": 15.0, "actor cross-thread": 50.0}
    print(f"{'case':30s} {'median µs':>10s} {'p99 µs':>10s}  aim")
    medians = {}
    for name, samples in results.items():
        median, p99 = summary(samples)
        medians[name] = median
        aim = f"≤ {aims[name]:g} µs median" if name in aims else "(bare floor)"
        print(f"{name:30s} {median:10.1f} {p99:10.1f}  {aim}")
    print(f"ratio actor / bare queue: in-loop "
          f"{medians['actor in-loop'] / medians['asyncio.Queue in-loop']:.2f}x, cross-thread "
          f"{medians['actor cross-thread'] / medians['asyncio.Queue cross-thread']:.2f}x")


if __name__ == "__main__":
    main()
