"""The control plane's CurveZMQ encryption (issue 18): with it, what a rank sends the
coordinator crosses the wire unreadable (a TCP relay in between sees the bytes; without
encryption the same bytes show the value in the clear, so the check can fail), a client that
does not encrypt cannot join, and `flowtrain launch --encrypt-control` runs a job. The
telemetry PUB socket always encrypts: a local subscriber without the job secret reads nothing
(reliability finding 7), one with it reads every record."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import anyio
import pytest
import zmq
import zmq.asyncio
from anyio.abc import SocketStream

from flowtrain.control import ControlClient, Coordinator
from flowtrain.control.protocol import curve_server_keys, encrypt_client
from helpers import DATA, LAUNCH, launcher_env

SECRET = b"curve-test-secret-0123456789abcdef"
MARKER = "PLAINTEXT-MARKER-4711"

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def _relay(listener: Any, target_port: int, seen: bytearray) -> None:
    """Forwards each connection to the coordinator, keeping every byte the rank sent."""
    async def pipe(src: SocketStream, dst: SocketStream, keep: bool) -> None:
        try:
            async for chunk in src:
                if keep:
                    seen.extend(chunk)
                await dst.send(chunk)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError,
                anyio.EndOfStream):
            pass

    async def handle(client: SocketStream) -> None:
        async with client, await anyio.connect_tcp("127.0.0.1", target_port) as server:
            async with anyio.create_task_group() as tg:
                tg.start_soon(pipe, client, server, True)
                tg.start_soon(pipe, server, client, False)

    await listener.serve(handle)


async def _wire_bytes(encrypt: bool) -> bytes:
    seen = bytearray()
    coordinator = Coordinator(world_size=1, secret=SECRET, encrypt=encrypt)
    async with anyio.create_task_group() as tg:
        await tg.start(coordinator.serve)
        port = int(coordinator.endpoint.rsplit(":", 1)[1])
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        relay_port = listener.extra(anyio.abc.SocketAttribute.local_port)
        tg.start_soon(_relay, listener, port, seen)
        client = ControlClient(endpoint=f"tcp://127.0.0.1:{relay_port}", secret=SECRET, rank=0,
                               world_size=1, connect_timeout=5.0, encrypt=encrypt)
        await tg.start(client.serve)
        await client.kv_set("note", MARKER)
        assert await client.kv_get("note", timeout=5) == MARKER
        tg.cancel_scope.cancel()
    return bytes(seen)


async def test_encrypted_frames_do_not_show_what_they_carry() -> None:
    assert MARKER.encode() in await _wire_bytes(encrypt=False)
    wire = await _wire_bytes(encrypt=True)
    assert len(wire) > 100 and MARKER.encode() not in wire


async def test_a_client_that_does_not_encrypt_cannot_join() -> None:
    coordinator = Coordinator(world_size=1, secret=SECRET, encrypt=True)
    async with anyio.create_task_group() as tg:
        await tg.start(coordinator.serve)
        client = ControlClient(endpoint=coordinator.endpoint, secret=SECRET, rank=0,
                               world_size=1, connect_timeout=1.0)
        with pytest.raises(ConnectionError, match="both encrypt the control plane or neither does"):
            await client.serve()
        assert not coordinator.ranks()[0].joined
        tg.cancel_scope.cancel()


async def _first_record(sub: zmq.asyncio.Socket, client: ControlClient) -> list[bytes] | None:
    """What ``sub`` receives within 2 s while ``client`` keeps publishing (None: nothing)."""
    with anyio.move_on_after(2.0):
        while True:
            await client.publish("metrics", {"loss": 0.5})
            with anyio.move_on_after(0.1):
                return list(await sub.recv_multipart())
    return None


@pytest.mark.parametrize("has_secret", [False, True])
async def test_telemetry_reaches_only_holders_of_the_secret(has_secret: bool) -> None:
    coordinator = Coordinator(world_size=1, secret=SECRET)
    async with anyio.create_task_group() as tg:
        await tg.start(coordinator.serve)
        client = ControlClient(endpoint=coordinator.endpoint, secret=SECRET, rank=0,
                               world_size=1, connect_timeout=5.0)
        await tg.start(client.serve)
        context = zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        try:
            if has_secret:
                encrypt_client(sub, SECRET)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(coordinator.pub_endpoint)
            got = await _first_record(sub, client)
            assert (got is not None) == has_secret
        finally:
            sub.close(linger=0)
            context.term()
        tg.cancel_scope.cancel()


def test_server_keys_follow_the_secret() -> None:
    public, private = curve_server_keys(SECRET)
    assert curve_server_keys(SECRET) == (public, private) and len(public) == 40
    assert curve_server_keys(SECRET + b"x")[0] != public


@pytest.mark.multiprocess
def test_launch_with_an_encrypted_control_plane(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([*LAUNCH, "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2",
                           "--encrypt-control", str(DATA / "rank_job.py"), "ok", str(out)],
                          cwd=tmp_path, env=launcher_env(), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert json.loads((out / f"rank{rank}.json").read_text())["sum"] == 3.0
