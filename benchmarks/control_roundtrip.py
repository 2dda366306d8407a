"""Round-trip latency of the control plane over loopback, through the full signed msgpack path.

The coordinator runs in this process; ranks run in subprocesses. Prints median and p99 in µs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

import anyio
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus

from flowtrain.control import ControlClient, Coordinator
from flowtrain.log import configure_logging

AIM_US = 250.0
REPO = Path(__file__).resolve().parents[1]


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def report(samples: list[float]) -> None:
    print(
        json.dumps(
            {
                "median": statistics.median(samples),
                "p99": percentile(samples, 0.99),
                "mean": statistics.fmean(samples),
            }
        ),
        flush=True,
    )


async def run_raw_rank(endpoint: str, iterations: int, warmup: int) -> None:
    """The peer: a bare zmq.asyncio DEALER echo, unsigned and unpacked, same processes and loop."""
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        samples: list[float] = []
        message = [b"x" * 64, b"y" * 32]
        for i in range(warmup + iterations):
            start = time.perf_counter_ns()
            await dealer.send_multipart(message)
            with anyio.fail_after(5):
                await dealer.recv_multipart()
            if i >= warmup:
                samples.append((time.perf_counter_ns() - start) / 1000)
        report(samples)
    finally:
        dealer.close(linger=0)
        context.term()


async def serve_raw_echo(*, task_status: TaskStatus[str]) -> None:
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        task_status.started(f"tcp://127.0.0.1:{port}")
        while True:
            await router.send_multipart(await router.recv_multipart())
    finally:
        router.close(linger=0)
        context.term()


async def run_rank(
    endpoint: str, secret: bytes, mode: str, rank: int, iterations: int, warmup: int
) -> None:
    """One rank: 'kv' times KV_GET round trips; 'route' pings rank 1, which pongs back."""
    if mode == "raw":
        await run_raw_rank(endpoint, iterations, warmup)
        return
    world_size = 2 if mode == "route" else 1
    pong = anyio.Event()
    stop = anyio.Event()
    client: ControlClient

    async def on_route(sender: int, body: dict) -> None:
        nonlocal pong
        if rank == 0:
            pong.set()
        elif body.get("stop"):
            stop.set()
        else:
            await client.route(sender, body)

    client = ControlClient(
        endpoint=endpoint,
        secret=secret,
        rank=rank,
        world_size=world_size,
        connect_timeout=30,
        on_route=on_route,
    )
    samples: list[float] = []
    async with anyio.create_task_group() as tg:
        await tg.start(client.serve)
        await client.barrier("start", timeout=30)
        if mode == "kv":
            await client.kv_set("bench", b"x" * 64)
            for i in range(warmup + iterations):
                start = time.perf_counter_ns()
                await client.kv_get("bench", timeout=5)
                if i >= warmup:
                    samples.append((time.perf_counter_ns() - start) / 1000)
        elif rank == 0:
            for i in range(warmup + iterations):
                pong = anyio.Event()
                start = time.perf_counter_ns()
                await client.route(1, {"i": i})
                with anyio.fail_after(5):
                    await pong.wait()
                if i >= warmup:
                    samples.append((time.perf_counter_ns() - start) / 1000)
            await client.route(1, {"stop": True})
        else:
            with anyio.fail_after(300):
                await stop.wait()
        await client.close()
    if samples:
        report(samples)


async def measure(mode: str, iterations: int, warmup: int) -> dict[str, float]:
    """Serves a coordinator while the rank subprocesses run; returns the pinging rank's figures."""
    secret = secrets.token_bytes(32)
    world_size = 2 if mode == "route" else 1
    coordinator = Coordinator(world_size=world_size, secret=secret)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    results: list[dict[str, float]] = []

    async def rank_process(rank: int, endpoint: str) -> None:
        command = [
            sys.executable,
            __file__,
            "--rank",
            str(rank),
            "--mode",
            mode,
            "--endpoint",
            endpoint,
            "--secret",
            secret.hex(),
            "--iterations",
            str(iterations),
            "--warmup",
            str(warmup),
        ]
        done = await anyio.run_process(command, env=env, stderr=subprocess.PIPE, check=False)
        if done.returncode != 0:
            raise RuntimeError(
                f"rank {rank} ({mode}) exited with {done.returncode}:\n{done.stderr.decode()}"
            )
        if done.stdout.strip():
            results.append(json.loads(done.stdout))

    async with anyio.create_task_group() as tg:
        if mode == "raw":
            endpoint = await tg.start(serve_raw_echo)
        else:
            await tg.start(coordinator.serve)
            endpoint = coordinator.endpoint
        with anyio.fail_after(600):
            async with anyio.create_task_group() as ranks:
                for rank in range(world_size):
                    ranks.start_soon(rank_process, rank, endpoint)
        tg.cancel_scope.cancel()
    if coordinator.rejected.total:
        raise RuntimeError(
            f"the coordinator rejected frames during the benchmark: {coordinator.rejected.counts}"
        )
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--iterations", type=int, default=5000, help="timed round trips per measurement"
    )
    parser.add_argument("--warmup", type=int, default=500, help="untimed round trips first")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="kv", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--secret", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    configure_logging(console="plain", level=logging.WARNING)
    if args.rank is not None:
        anyio.run(
            run_rank,
            args.endpoint,
            bytes.fromhex(args.secret),
            args.mode,
            args.rank,
            args.iterations,
            args.warmup,
        )
        return
    print(
        f"control-plane round trips over loopback, HMAC-SHA256 signed msgpack frames, "
        f"{args.iterations} timed after {args.warmup} warm-up"
    )
    rows = [
        ("raw", "peer: bare zmq.asyncio DEALER->ROUTER echo (no signing, no msgpack)"),
        ("kv", "KV_GET rank -> coordinator -> rank"),
        ("route", "ROUTE ping-pong rank0 -> coord -> rank1 -> coord -> rank0"),
    ]
    figures: dict[str, dict[str, float]] = {}
    for mode, label in rows:
        figures[mode] = anyio.run(measure, mode, args.iterations, args.warmup)
        print(
            f"  {label:<62} median {figures[mode]['median']:7.1f} µs   "
            f"p99 {figures[mode]['p99']:8.1f} µs"
        )
    kv, raw, route = figures["kv"], figures["raw"], figures["route"]
    print(
        f"ratios: KV_GET / bare echo = {kv['median'] / raw['median']:.2f}x median; "
        f"ROUTE ping-pong / KV_GET = {route['median'] / kv['median']:.2f}x "
        "(it crosses the coordinator twice)"
    )
    verdict = "meets" if kv["median"] <= AIM_US else "misses"
    print(
        f"aim: a control round trip (KV_GET) of <= {AIM_US:.0f} µs median; "
        f"measured {kv['median']:.1f} µs "
        f"({kv['median'] / AIM_US:.2f}x the aim) -> {verdict} it"
    )


if __name__ == "__main__":
    main()
