"""Replay protection of the control plane (reliability finding 7): the signed frames a rank sent,
captured and sent again by another local process once the rank's identity is free, are dropped
and counted as replays by a real coordinator; the rank does not join again."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio

from flowtrain.control import ControlClient, Coordinator, CoordinatorEvent, RankJoined

SECRET = b"replay-test-secret-0123456789"

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def _until(predicate: Any, what: str, timeout: float = 5.0) -> None:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what}: not true after {timeout} s")
        await anyio.sleep(0.005)


async def test_a_captured_hello_and_telemetry_replayed_are_dropped_and_counted() -> None:
    events: list[CoordinatorEvent] = []
    coordinator = Coordinator(world_size=2, secret=SECRET, on_event=events.append)
    async with anyio.create_task_group() as tg:
        await tg.start(coordinator.serve)
        clients = [ControlClient(endpoint=coordinator.endpoint, secret=SECRET, rank=rank,
                                 world_size=2, connect_timeout=5.0) for rank in range(2)]
        captured: list[list[bytes]] = []  # what an eavesdropper on rank 1's traffic keeps
        encode = clients[1].codec.encode

        def capture(kind: str, body: dict) -> list[bytes]:
            parts = encode(kind, body)
            captured.append(list(parts))
            return parts

        clients[1].codec.encode = capture  # type: ignore[method-assign]
        for client in clients:
            await tg.start(client.serve)
        await clients[1].publish("step", {"step": 1, "loss": 0.5})
        await _until(lambda: len(captured) >= 2, "rank 1's HELLO and TELEMETRY")
        await clients[1].close()  # BYE: the identity rank1 is free again
        context = zmq.asyncio.Context()
        intruder = context.socket(zmq.DEALER)
        intruder.setsockopt(zmq.ROUTING_ID, b"rank1")
        try:
            intruder.connect(coordinator.endpoint)
            replays = [parts for parts in captured if b"HELLO" in parts[0] or
                       b"TELEMETRY" in parts[0]]
            assert len(replays) == 2
            for parts in replays:
                await intruder.send_multipart(parts)
            await _until(lambda: coordinator.rejected.counts["replayed"] == 2, "two replays")
        finally:
            intruder.close(linger=0)
            context.term()
        joined = [e.rank for e in events if isinstance(e, RankJoined)]
        assert sorted(joined) == [0, 1]  # rank 1 joined once, not again from the replay
        assert {k: n for k, n in coordinator.rejected.counts.items() if n} == {"replayed": 2}
        await clients[0].close()
        tg.cancel_scope.cancel()
