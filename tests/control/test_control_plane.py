"""Tests of the coordinator and its clients over loopback ZeroMQ: joins, barriers, kv, routing,
telemetry, failures, bad frames, heartbeats, and a real rank process that stops answering."""

from __future__ import annotations

import hashlib
import hmac
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgpack
import pytest
import zmq
import zmq.asyncio
from anyio.abc import TaskGroup

from flowtrain.control import (
    AllFinished,
    ControlClient,
    Coordinator,
    CoordinatorEvent,
    FrameCodec,
    JoinTimeout,
    Kind,
    RankFailed,
    RankFinished,
    RankJoined,
)
from flowtrain.control.protocol import encrypt_client
from flowtrain.errors import RankAborted, RankFailure
from helpers import REPO, free_port

SECRET = b"plane-test-secret-0123456789"

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(20)]


async def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> float:
    """Polls until predicate() holds; returns the seconds it took, fails the test after timeout."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what}: not true after {timeout} s")
        await anyio.sleep(0.005)
    return time.monotonic() - start


@asynccontextmanager
async def coordinator_running(
    world_size: int, **options: Any
) -> AsyncIterator[tuple[Coordinator, list[CoordinatorEvent], TaskGroup]]:
    events: list[CoordinatorEvent] = []
    coordinator = Coordinator(
        world_size=world_size, secret=SECRET, on_event=events.append, **options
    )
    async with anyio.create_task_group() as tg:
        await tg.start(coordinator.serve)
        yield coordinator, events, tg
        tg.cancel_scope.cancel()


async def start_client(
    tg: TaskGroup, coordinator: Coordinator, rank: int, world_size: int, **options: Any
) -> tuple[ControlClient, anyio.CancelScope]:
    """Starts a client in its own cancel scope, so a test can make it vanish without BYE."""
    client = ControlClient(
        endpoint=coordinator.endpoint,
        secret=SECRET,
        rank=rank,
        world_size=world_size,
        connect_timeout=5.0,
        **options,
    )
    scope = anyio.CancelScope()

    async def run(*, task_status: Any) -> None:
        with scope:
            await client.serve(task_status=task_status)

    await tg.start(run)
    return client, scope


def of_type(events: list[CoordinatorEvent], kind: type) -> list[Any]:
    return [event for event in events if isinstance(event, kind)]


async def test_ranks_join_and_finish() -> None:
    async with coordinator_running(3) as (coordinator, events, tg):
        clients = [(await start_client(tg, coordinator, rank, 3))[0] for rank in range(3)]
        assert sorted(of_type(events, RankJoined), key=lambda e: e.rank) == [
            RankJoined(rank=r, host=socket.gethostname(), pid=os.getpid()) for r in range(3)
        ]
        assert all(state.joined and not state.finished for state in coordinator.ranks().values())
        for client in clients:
            await client.close()
        await wait_until(lambda: len(of_type(events, AllFinished)) == 1, 5, "AllFinished")
        assert sorted(e.rank for e in of_type(events, RankFinished)) == [0, 1, 2]
        assert isinstance(events[-1], AllFinished)
        assert all(state.finished for state in coordinator.ranks().values())


async def test_barrier_releases_only_when_every_rank_arrived_and_is_reusable() -> None:
    async with coordinator_running(3) as (coordinator, events, tg):
        clients = [(await start_client(tg, coordinator, rank, 3))[0] for rank in range(3)]

        async def arrive(rank: int, passed: list[int]) -> None:
            await clients[rank].barrier("step", timeout=5)
            passed.append(rank)

        for generation in range(2):
            passed: list[int] = []
            async with anyio.create_task_group() as barrier_tasks:
                barrier_tasks.start_soon(arrive, 0, passed)
                barrier_tasks.start_soon(arrive, 1, passed)
                await anyio.sleep(0.3)
                assert passed == [], f"generation {generation}: released before rank 2 arrived"
                barrier_tasks.start_soon(arrive, 2, passed)
            assert sorted(passed) == [0, 1, 2]
        with pytest.raises(TimeoutError, match="barrier 'lonely'.*0.2 s"):
            await clients[0].barrier("lonely", timeout=0.2)


async def test_kv_get_waits_for_a_later_set() -> None:
    async with coordinator_running(2) as (coordinator, events, tg):
        clients = [(await start_client(tg, coordinator, rank, 2))[0] for rank in range(2)]
        value = {"host": "10.0.0.7", "port": 29500, "blob": b"\x00\x01\xff"}
        got: list[Any] = []

        async def get() -> None:
            got.append(await clients[1].kv_get("store/addr", timeout=5))

        async with anyio.create_task_group() as getters:
            getters.start_soon(get)
            await anyio.sleep(0.3)
            assert got == []
            await clients[0].kv_set("store/addr", value)
        assert got == [value]
        assert await clients[0].kv_get("store/addr", timeout=1) == value
        with pytest.raises(TimeoutError, match="'missing'"):
            await clients[0].kv_get("missing", timeout=0.2)


async def test_route_delivers_with_the_senders_rank() -> None:
    received: list[tuple[int, dict]] = []

    async def on_route(sender: int, body: dict) -> None:
        received.append((sender, body))

    async with coordinator_running(3) as (coordinator, events, tg):
        clients = [
            (
                await start_client(
                    tg, coordinator, rank, 3, on_route=on_route if rank == 2 else None
                )
            )[0]
            for rank in range(3)
        ]
        await clients[0].route(2, {"msg": "grad ready", "bucket": 3})
        await clients[1].route(2, {"msg": "hello", "data": b"\x01"})
        await wait_until(lambda: len(received) == 2, 5, "two routed frames")
        assert sorted(received, key=lambda r: r[0]) == [
            (0, {"msg": "grad ready", "bucket": 3}),
            (1, {"msg": "hello", "data": b"\x01"}),
        ]


async def test_a_slow_route_handler_does_not_stall_heartbeats() -> None:
    beats = {"heartbeat_interval": 0.05, "heartbeat_misses": 3}
    aborts: list[str] = []
    handled: list[int] = []

    async def slow(sender: int, body: dict) -> None:
        await anyio.sleep(0.3)  # six beat intervals, twice the silence that counts as stuck
        handled.append(body["n"])

    async with coordinator_running(2, **beats) as (coordinator, events, tg):
        sender, _ = await start_client(tg, coordinator, 0, 2, **beats)
        await start_client(tg, coordinator, 1, 2, on_route=slow, on_abort=aborts.append, **beats)
        for n in range(3):
            await sender.route(1, {"n": n})
        await wait_until(lambda: len(handled) == 3, 5, "three slow routes handled")
        assert handled == [0, 1, 2]  # in arrival order
        assert of_type(events, RankFailed) == [] and aborts == []


async def test_route_to_a_rank_that_has_not_joined_is_dropped() -> None:
    async with coordinator_running(2) as (coordinator, events, tg):
        client, _ = await start_client(tg, coordinator, 0, 2)
        await client.route(1, {"x": 1})
        await wait_until(lambda: coordinator.undeliverable == 1, 5, "undeliverable count")
        await client.kv_set("still", "working")
        assert await client.kv_get("still", timeout=2) == "working"


async def test_telemetry_reaches_a_subscriber_and_verifies() -> None:
    async with coordinator_running(2) as (coordinator, events, tg):
        client, _ = await start_client(tg, coordinator, 1, 2)
        context = zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        try:
            encrypt_client(sub, SECRET)  # the PUB socket is a CurveZMQ server
            sub.setsockopt(zmq.SUBSCRIBE, b"metrics")
            sub.connect(coordinator.pub_endpoint)
            parts = None
            # PUB drops what is sent before the subscription arrives (slow joiner), so retry.
            with anyio.fail_after(5):
                while parts is None:
                    await client.publish("metrics", {"loss": 0.5, "step": 7})
                    with anyio.move_on_after(0.1):
                        parts = await sub.recv_multipart()
            frame = FrameCodec(SECRET, "monitor").decode_published(parts)
            assert frame.kind == Kind.TELEMETRY and frame.sender == "coordinator"
            assert frame.body == {"topic": "metrics", "rank": 1, "body": {"loss": 0.5, "step": 7}}
            forged = [
                parts[0],
                parts[1],
                hmac.new(b"wrong-secret-0123456789", parts[1], hashlib.sha256).digest(),
            ]
            with pytest.raises(Exception, match="bad_signature"):
                FrameCodec(SECRET, "monitor").decode_published(forged)
        finally:
            sub.close(linger=0)
            context.term()


async def test_failure_report_becomes_rank_failed_with_the_traceback() -> None:
    async with coordinator_running(2) as (coordinator, events, tg):
        client, _ = await start_client(tg, coordinator, 1, 2)
        try:
            raise ValueError("boom in the optimizer")
        except ValueError as exc:
            failure = RankFailure.from_exception(1, exc, actor="Optimizer")
        await client.report_failure(failure)
        await wait_until(lambda: len(of_type(events, RankFailed)) == 1, 5, "RankFailed")
        event = of_type(events, RankFailed)[0]
        assert event.rank == 1 and event.failure == failure
        assert event.failure.message == "ValueError: boom in the optimizer"
        assert 'raise ValueError("boom in the optimizer")' in event.failure.traceback


def signed(message: object, secret: bytes = SECRET) -> list[bytes]:
    payload = msgpack.packb(message, use_bin_type=True)
    return [payload, hmac.new(secret, payload, hashlib.sha256).digest()]


def bad_frames() -> dict[str, list[list[bytes]]]:
    """Frames of each rejection reason, as an attacker or a buggy peer would send them."""
    good_payload = msgpack.packb(
        {"v": 1, "k": "BARRIER", "s": "x", "n": 1, "b": {"name": "a" * 40}}
    )
    truncated = good_payload[:-7]
    return {
        "unsigned": [[b"\xde\xad\xbe\xef"], [b"junk", b""]],
        "bad_signature": [
            [b"garbage bytes", b"\x00" * 32],
            [good_payload, b"short"],
            signed({"v": 1, "k": "BYE", "s": "x", "n": 1, "b": {}}, b"not-the-job-secret!!"),
        ],
        "unknown_version": [signed({"v": 99, "k": "BYE", "s": "x", "n": 1, "b": {}})],
        "malformed": [
            [truncated, hmac.new(SECRET, truncated, hashlib.sha256).digest()],
            signed(["not", "a", "map"]),
        ],
        "replayed": [],  # a replay sends a frame seen before: tests/control/test_control_replay.py
    }


async def test_bad_frames_to_the_coordinator_are_counted_and_dropped() -> None:
    async with coordinator_running(2) as (coordinator, events, tg):
        clients = [(await start_client(tg, coordinator, rank, 2))[0] for rank in range(2)]
        context = zmq.asyncio.Context()
        intruder = context.socket(zmq.DEALER)
        intruder.setsockopt(zmq.ROUTING_ID, b"intruder")
        try:
            intruder.connect(coordinator.endpoint)
            frames = bad_frames()
            codec = FrameCodec(SECRET, "intruder")
            wrong_rank = FrameCodec(SECRET, "rank1")
            # Correctly signed but refused: a HELLO for a rank outside the job, one with the wrong
            # world size, one whose signed sender is not its socket, and a frame before any HELLO.
            frames["malformed"] += [
                codec.encode(Kind.HELLO, {"rank": 5, "world_size": 2, "host": "h", "pid": 1}),
                codec.encode(Kind.HELLO, {"rank": 1, "world_size": 3, "host": "h", "pid": 1}),
                wrong_rank.encode(Kind.HELLO, {"rank": 1, "world_size": 2, "host": "h", "pid": 1}),
                codec.encode(Kind.BARRIER, {"name": "sync"}),
            ]
            for parts_list in frames.values():
                for parts in parts_list:
                    await intruder.send_multipart(parts)
            expected = {reason: len(parts_list) for reason, parts_list in frames.items()}
            await wait_until(
                lambda: coordinator.rejected.total == sum(expected.values()), 5, "rejections"
            )
            assert coordinator.rejected.counts == expected
            assert sorted(e.rank for e in of_type(events, RankJoined)) == [0, 1]
            async with anyio.create_task_group() as barrier_tasks:
                for client in clients:
                    barrier_tasks.start_soon(client.barrier, "after-garbage", 5)
        finally:
            intruder.close(linger=0)
            context.term()


async def test_bad_frames_to_a_client_are_counted_and_dropped() -> None:
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        coordinator_codec = FrameCodec(SECRET, "coordinator")
        client = ControlClient(
            endpoint=f"tcp://127.0.0.1:{port}",
            secret=SECRET,
            rank=0,
            world_size=1,
            heartbeat_interval=5.0,
            connect_timeout=5.0,
        )
        async with anyio.create_task_group() as tg:

            async def fake_coordinator() -> None:
                with anyio.fail_after(5):
                    identity, *parts = await router.recv_multipart()
                assert identity == b"rank0" and coordinator_codec.decode(parts).kind == Kind.HELLO
                await router.send_multipart(
                    [identity, *coordinator_codec.encode(Kind.WELCOME, {"world_size": 1})]
                )

            tg.start_soon(fake_coordinator)
            await tg.start(client.serve)
            frames = bad_frames()
            frames["malformed"] += [
                FrameCodec(SECRET, "rank3").encode(
                    Kind.BARRIER_RELEASE, {"name": "b"}
                ),  # not the coordinator
                coordinator_codec.encode(
                    Kind.HELLO, {"rank": 0}
                ),  # a kind the coordinator never sends
                coordinator_codec.encode(Kind.ROUTE, {"from": "x", "body": 1}),
            ]
            for parts_list in frames.values():
                for parts in parts_list:
                    await router.send_multipart([b"rank0", *parts])
            expected = {reason: len(parts_list) for reason, parts_list in frames.items()}
            await wait_until(
                lambda: client.rejected.total == sum(expected.values()), 5, "rejections"
            )
            assert client.rejected.counts == expected

            async def release() -> None:
                with anyio.fail_after(5):
                    identity, *parts = await router.recv_multipart()
                assert coordinator_codec.decode(parts).body == {"name": "b"}
                await router.send_multipart(
                    [
                        identity,
                        *coordinator_codec.encode(
                            Kind.BARRIER_RELEASE, {"name": "b", "generation": 0}
                        ),
                    ]
                )

            tg.start_soon(release)
            await client.barrier("b", timeout=5)
            await client.close(finished=False)
    finally:
        router.close(linger=0)
        context.term()


async def test_silent_rank_is_declared_stuck_with_its_last_status() -> None:
    status = {"busy": "actor Foo handling Bar", "pending": ["all_reduce #3 on 4 KiB"]}
    beats = {"heartbeat_interval": 0.05, "heartbeat_misses": 3}
    async with coordinator_running(2, **beats) as (coordinator, events, tg):
        await start_client(tg, coordinator, 0, 2, **beats)
        _, scope = await start_client(tg, coordinator, 1, 2, status=lambda: status, **beats)
        await wait_until(lambda: coordinator.ranks()[1].status == status, 5, "status received")
        scope.cancel()  # the rank vanishes without BYE
        took = await wait_until(lambda: len(of_type(events, RankFailed)) >= 1, 5, "RankFailed")
        assert took < 1.5
        failed = of_type(events, RankFailed)
        assert [e.rank for e in failed] == [1]
        failure = failed[0].failure
        assert failure.kind == "stuck" and failure.rank == 1 and failure.pid == os.getpid()
        assert failure.message.startswith("no heartbeat for ")
        assert (
            "missed beats); last status: "
            "busy actor Foo handling Bar, pending all_reduce #3 on 4 KiB" in failure.message
        )
        await anyio.sleep(0.3)
        assert len(of_type(events, RankFailed)) == 1, "declared stuck more than once"
        assert coordinator.ranks()[1].stuck and not coordinator.ranks()[0].failed


async def test_client_aborts_when_the_coordinator_vanishes() -> None:
    beats = {"heartbeat_interval": 0.05, "heartbeat_misses": 3}
    aborts: list[str] = []
    outcome: list[BaseException] = []
    coordinator = Coordinator(world_size=2, secret=SECRET, **beats)
    async with anyio.create_task_group() as tg:
        coordinator_scope = anyio.CancelScope()

        async def run_coordinator(*, task_status: Any) -> None:
            with coordinator_scope:
                await coordinator.serve(task_status=task_status)

        await tg.start(run_coordinator)
        client, _ = await start_client(tg, coordinator, 0, 2, on_abort=aborts.append, **beats)

        async def wait_barrier() -> None:
            try:
                await client.barrier("never", timeout=10)
            except RankAborted as exc:
                outcome.append(exc)

        tg.start_soon(wait_barrier)
        await anyio.sleep(0.1)
        coordinator_scope.cancel()
        took = await wait_until(lambda: len(aborts) == 1, 5, "on_abort")
        assert took < 1.5
        assert aborts[0].startswith(
            f"lost the coordinator at {coordinator.endpoint}: no frame for "
        )
        await wait_until(lambda: len(outcome) == 1, 2, "barrier aborted")
        assert str(outcome[0]) == aborts[0]
        await client.close(finished=False)


async def test_abort_reaches_every_joined_rank_even_when_the_coordinator_stops_at_once() -> None:
    aborts: list[tuple[int, str]] = []
    coordinator = Coordinator(world_size=2, secret=SECRET)
    coordinator_scope = anyio.CancelScope()

    async def run_coordinator(*, task_status: Any) -> None:
        with coordinator_scope:
            await coordinator.serve(task_status=task_status)

    async with anyio.create_task_group() as tg:
        await tg.start(run_coordinator)
        clients = []
        for rank in range(2):
            client, _ = await start_client(
                tg, coordinator, rank, 2, on_abort=lambda reason, r=rank: aborts.append((r, reason))
            )
            clients.append(client)
        await coordinator.abort("rank 1 failed: ValueError: boom")
        coordinator_scope.cancel()  # the launcher tears the coordinator down right away
        await wait_until(lambda: len(aborts) == 2, 5, "both aborted")
        for client in clients:
            await client.close(finished=False, timeout=0.1)
        assert sorted(aborts) == [
            (0, "rank 1 failed: ValueError: boom"),
            (1, "rank 1 failed: ValueError: boom"),
        ]


async def test_missing_ranks_are_reported_once_after_the_join_timeout() -> None:
    async with coordinator_running(3, heartbeat_interval=0.05, join_timeout=0.3) as (
        coordinator,
        events,
        tg,
    ):
        await start_client(tg, coordinator, 1, 3, heartbeat_interval=0.05)
        await wait_until(lambda: len(of_type(events, JoinTimeout)) == 1, 5, "JoinTimeout")
        await anyio.sleep(0.2)
        assert of_type(events, JoinTimeout) == [JoinTimeout(missing=[0, 2])]


async def test_hello_with_the_wrong_world_size_is_not_welcomed() -> None:
    async with coordinator_running(2) as (coordinator, events, tg):
        client = ControlClient(
            endpoint=coordinator.endpoint, secret=SECRET, rank=0, world_size=3, connect_timeout=0.5
        )
        with pytest.raises(
            ConnectionError, match=f"WELCOME from the coordinator at {coordinator.endpoint}"
        ):
            await client.serve()
        assert coordinator.rejected.counts["malformed"] == 1 and events == []


async def test_connect_timeout_names_the_endpoint() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    client = ControlClient(
        endpoint=endpoint, secret=SECRET, rank=0, world_size=1, connect_timeout=0.3
    )
    with pytest.raises(
        ConnectionError, match=f"no WELCOME from the coordinator at {endpoint} within 0.3 s"
    ):
        await client.serve()


async def test_a_crashing_event_handler_does_not_stop_the_coordinator() -> None:
    def explode(event: CoordinatorEvent) -> None:
        raise RuntimeError("handler bug")

    coordinator = Coordinator(world_size=2, secret=SECRET, on_event=explode)
    async with anyio.create_task_group() as tg:
        await tg.start(coordinator.serve)
        clients = [(await start_client(tg, coordinator, rank, 2))[0] for rank in range(2)]
        async with anyio.create_task_group() as barrier_tasks:
            for client in clients:
                barrier_tasks.start_soon(client.barrier, "ok", 5)
        assert all(state.joined for state in coordinator.ranks().values())
        tg.cancel_scope.cancel()


RANK_PROCESS = """
import sys, anyio
from flowtrain.control import ControlClient

async def main() -> None:
    client = ControlClient(endpoint=sys.argv[1], secret=bytes.fromhex(sys.argv[2]), rank=0,
                           world_size=1, heartbeat_interval=0.1, heartbeat_misses=5,
                           connect_timeout=10,
                           status=lambda: {"busy": "actor Sleeper handling Nap"})
    await client.serve()

anyio.run(main)
"""


@pytest.mark.multiprocess
async def test_a_stopped_rank_process_is_declared_stuck() -> None:
    async with coordinator_running(1, heartbeat_interval=0.1, heartbeat_misses=5) as (
        coordinator,
        events,
        tg,
    ):
        env = {**os.environ, "PYTHONPATH": str(REPO), "FLOWTRAIN_CONSOLE": "off"}
        process = subprocess.Popen(
            [sys.executable, "-c", RANK_PROCESS, coordinator.endpoint, SECRET.hex()],
            env=env,
            cwd=REPO,
        )
        try:
            await wait_until(
                lambda: len(of_type(events, RankJoined)) == 1, 15, "the rank process joined"
            )
            assert of_type(events, RankJoined)[0].pid == process.pid
            await wait_until(lambda: coordinator.ranks()[0].status != {}, 5, "first heartbeat")
            os.kill(process.pid, signal.SIGSTOP)
            took = await wait_until(lambda: len(of_type(events, RankFailed)) == 1, 5, "RankFailed")
            assert took < 2.0
            failure = of_type(events, RankFailed)[0].failure
            assert failure.kind == "stuck" and failure.pid == process.pid
            assert "last status: busy actor Sleeper handling Nap" in failure.message
        finally:
            process.kill()
            process.wait(timeout=10)


async def test_an_oversized_frame_is_refused_by_the_transport_before_decoding() -> None:
    """A frame over the limit never reaches the decoder (old: buffered whole, then counted as a
    bad signature); the coordinator keeps serving and counts the next bad frame as usual."""
    from flowtrain.control.protocol import MAX_FRAME_BYTES

    async with coordinator_running(1) as (coordinator, events, tg):
        context = zmq.asyncio.Context()
        big, small = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
        try:
            big.connect(coordinator.endpoint)
            await big.send_multipart([b"\0" * (MAX_FRAME_BYTES + 1), b"\0" * 32])
            await anyio.sleep(1.0)  # the 16 MB part is read long before this over loopback
            small.connect(coordinator.endpoint)
            await small.send_multipart([b"\xde\xad"])
            await wait_until(lambda: coordinator.rejected.total >= 1, 5, "the small frame")
            await anyio.sleep(0.2)
            assert {k: n for k, n in coordinator.rejected.counts.items() if n} == {"unsigned": 1}
            client, _ = await start_client(tg, coordinator, 0, 1)
            await client.barrier("after-the-big-frame", 5)
        finally:
            big.close(linger=0)
            small.close(linger=0)
            context.term()
