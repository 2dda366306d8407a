"""The rank side of the control plane: a DEALER that joins the coordinator and keeps beating.

Barriers, the key/value store, routed frames to other ranks, failures and telemetry go through it.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import anyio
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from flowtrain.control.coordinator import COORDINATOR_SENDER, identity_of, send_now
from flowtrain.control.protocol import (
    Frame,
    FrameCodec,
    FrameRejected,
    Kind,
    RejectCounter,
    check_heartbeat,
    encrypt_client,
    limit_frames,
)
from flowtrain.errors import RankAborted, RankFailure
from flowtrain.log import get_logger


def _log() -> Any:
    # Looked up per call: a logger bound at import keeps the logging configuration of that
    # moment and would ignore configure_logging() called later by the rank or the launcher.
    return get_logger("flowtrain.control.client")


# Routed frames wait here for on_route; bounded so a slow handler pushes back instead of
# letting memory grow, and separate from the receive loop so heartbeats keep flowing.
ROUTE_QUEUE_SIZE = 256


class _Waiter:
    """One pending reply (a barrier release or a key's value)."""

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def resolve(self, value: Any) -> None:
        self.value = value
        self.event.set()

    def fail(self, error: BaseException) -> None:
        if not self.event.is_set():
            self.error = error
            self.event.set()


class ControlClient:
    """One rank's connection to the coordinator; use it only from the loop that runs ``serve()``."""

    def __init__(
        self,
        *,
        endpoint: str,
        secret: bytes,
        rank: int,
        world_size: int,
        local_rank: int = 0,
        heartbeat_interval: float = 1.0,
        heartbeat_misses: int = 5,
        connect_timeout: float = 60.0,
        status: Callable[[], dict] | None = None,
        on_abort: Callable[[str], None] | None = None,
        on_route: Callable[[int, dict], Awaitable[None]] | None = None,
        encrypt: bool = False,
    ) -> None:
        """``encrypt``: the coordinator is a CurveZMQ server (``Coordinator(encrypt=True)``)."""
        if not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be in 0..{world_size - 1} for world size {world_size}, got {rank}"
            )
        check_heartbeat(heartbeat_interval, heartbeat_misses)
        self.endpoint = endpoint
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_misses = heartbeat_misses
        self.connect_timeout = connect_timeout
        self.status = status
        self.on_abort = on_abort
        self.on_route = on_route
        self.identity = identity_of(rank)
        self.codec = FrameCodec(secret, self.identity.decode())
        self.encrypt = encrypt
        self._secret = secret
        self.rejected = RejectCounter(f"rank{rank}")
        # A send that ZeroMQ cannot take within this long means the coordinator stopped reading.
        self.send_timeout = heartbeat_interval * heartbeat_misses
        self._dealer: zmq.asyncio.Socket | None = None
        self._scope: anyio.CancelScope | None = None
        self._stopped = anyio.Event()
        self._linger = 0.0
        self._last_heard = 0.0
        self._route_blocked = False
        self._aborted = False
        # Run by close() before BYE, each within its timeout: the telemetry actor publishes
        # the records its rate limit held back, so the last step of a run is not lost.
        self.before_close: list[Callable[[], Awaitable[None]]] = []
        self.telemetry_dropped = 0  # frames publish_nowait could not queue
        self._barrier_waiters: dict[str, _Waiter] = {}
        self._kv_waiters: dict[int, _Waiter] = {}
        self._requests = itertools.count(1)
        # --peer-recovery: the pending commit vote, and who hears of a new generation
        self._commit_waiter: _Waiter | None = None
        self.on_reconfigure: Callable[[dict], None] | None = None
        self.last_reconfigure: dict | None = None

    # ----------------------------------------------------------------- public API

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Joins the coordinator, reports started, then beats and receives until cancelled."""
        self._stopped = anyio.Event()
        self._aborted = False
        context = zmq.asyncio.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.ROUTING_ID, self.identity)
        dealer.setsockopt(zmq.LINGER, 0)
        limit_frames(dealer)
        if self.encrypt:
            encrypt_client(dealer, self._secret)
        dealer.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(self.heartbeat_interval * 1000)))
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(self.send_timeout * 1000)))
        routes_in, routes_out = anyio.create_memory_object_stream[tuple[int, dict]](
            ROUTE_QUEUE_SIZE
        )
        try:
            dealer.connect(self.endpoint)
            self._dealer = dealer
            await self._join(dealer)
            with anyio.CancelScope() as scope:
                self._scope = scope
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._receive_loop, dealer, routes_in)
                    tg.start_soon(self._heartbeat_loop)
                    tg.start_soon(self._route_worker, routes_out)
                    task_status.started()
        finally:
            self._dealer = None
            routes_in.close()
            routes_out.close()
            self._fail_waiters(RankAborted(f"the control client of rank {self.rank} stopped"))
            dealer.close(linger=int(self._linger * 1000))
            with anyio.CancelScope(shield=True):
                # term() waits out the linger; a thread keeps the loop free meanwhile.
                await anyio.to_thread.run_sync(context.term)
            self._stopped.set()

    async def barrier(self, name: str, timeout: float) -> None:
        """Returns once all ranks reached the barrier ``name``; TimeoutError after ``timeout`` s."""
        if name in self._barrier_waiters:
            raise RuntimeError(f"barrier {name!r} is already being waited on by rank {self.rank}")
        waiter = self._barrier_waiters[name] = _Waiter()
        try:
            with anyio.move_on_after(timeout) as scope:
                await self._send(Kind.BARRIER, {"name": name})
                await waiter.event.wait()
            if scope.cancelled_caught:
                raise TimeoutError(
                    f"barrier {name!r}: rank {self.rank} waited {timeout} s and not all "
                    f"{self.world_size} ranks arrived"
                )
        finally:
            self._barrier_waiters.pop(name, None)
        if waiter.error is not None:
            raise waiter.error

    async def kv_set(self, key: str, value: Any) -> None:
        await self._send(Kind.KV_SET, {"key": key, "value": value})

    async def kv_get(self, key: str, timeout: float) -> Any:
        """The value under ``key``, waiting until a rank sets it; TimeoutError after ``timeout``."""
        request = next(self._requests)
        waiter = self._kv_waiters[request] = _Waiter()
        try:
            with anyio.move_on_after(timeout) as scope:
                await self._send(Kind.KV_GET, {"key": key, "req": request})
                await waiter.event.wait()
            if scope.cancelled_caught:
                raise TimeoutError(f"kv_get({key!r}): no rank set the key within {timeout} s")
        finally:
            self._kv_waiters.pop(request, None)
        if waiter.error is not None:
            raise waiter.error
        return waiter.value

    async def vote(self, generation: int, step: int, ok: bool, timeout: float) -> dict:
        """--peer-recovery: this rank's vote on committing ``step``; returns the coordinator's
        verdict ``{"commit": bool, "generation": int, "members": [...], ...}`` once every
        member voted, or at once when the generation moved on (a member was lost)."""
        if self._commit_waiter is not None:
            raise RuntimeError(f"rank {self.rank} is already waiting on a commit vote")
        waiter = self._commit_waiter = _Waiter()
        try:
            with anyio.move_on_after(timeout) as scope:
                await self._send(Kind.COMMIT, {"generation": generation, "step": step, "ok": ok})
                await waiter.event.wait()
            if scope.cancelled_caught:
                raise TimeoutError(f"commit vote on step {step}: no verdict within {timeout} s")
        finally:
            self._commit_waiter = None
        if waiter.error is not None:
            raise waiter.error
        return dict(waiter.value)

    async def request_join(self) -> None:
        """--peer-recovery: this replacement rank is ready to enter the group."""
        await self._send(Kind.JOIN, {})

    async def route(self, to_rank: int, body: dict) -> None:
        if not 0 <= to_rank < self.world_size:
            raise ValueError(f"to_rank must be in 0..{self.world_size - 1}, got {to_rank}")
        await self._send(Kind.ROUTE, {"to": to_rank, "body": body})

    async def report_failure(self, failure: RankFailure) -> None:
        await self._send(Kind.FAILURE, {"failure": asdict(failure)})

    async def publish(self, topic: str, body: dict) -> None:
        await self._send(Kind.TELEMETRY, {"topic": topic, "body": body})

    def publish_nowait(self, topic: str, body: dict) -> bool:
        """Queues a telemetry frame if ZeroMQ takes it at once; False (dropped) when its queue
        is full. Telemetry must never make training wait. On the client's loop only."""
        dealer = self._dealer
        if dealer is None:
            raise RuntimeError(
                f"rank {self.rank}'s control client is not serving; run ControlClient.serve() first"
            )
        error = send_now(dealer, self.codec.encode(Kind.TELEMETRY, {"topic": topic, "body": body}))
        if error is None:
            return True
        if not isinstance(error, zmq.Again):
            raise error
        self.telemetry_dropped += 1
        return False

    async def close(self, *, finished: bool = True, timeout: float = 1.0) -> None:
        """Says BYE (if ``finished``), stops ``serve()``, closes the socket within ``timeout`` s."""
        if self._dealer is None or self._scope is None:
            return
        if finished:
            for hook in list(self.before_close):
                with anyio.move_on_after(timeout):
                    try:
                        await hook()
                    except Exception as exc:  # a failing hook must not keep BYE from going out
                        _log().warning("close hook failed", rank=self.rank, error=repr(exc))
            try:
                with anyio.fail_after(timeout):
                    await self._send(Kind.BYE, {})
            except TimeoutError:
                _log().warning("BYE could not be sent in time", rank=self.rank, timeout=timeout)
        self._linger = timeout
        self._scope.cancel()
        with anyio.move_on_after(timeout + 1.0):
            await self._stopped.wait()

    # ------------------------------------------------------------------ plumbing

    async def _send(self, kind: str, body: dict) -> None:
        dealer = self._dealer
        if dealer is None:
            raise RuntimeError(
                f"rank {self.rank}'s control client is not serving; run ControlClient.serve() first"
            )
        parts = self.codec.encode(kind, body)
        # The usual case needs no timer: ZeroMQ takes the frame at once unless its queue is full.
        error = send_now(dealer, parts)
        if error is None:
            return
        if not isinstance(error, zmq.Again):
            raise error
        try:
            with anyio.fail_after(self.send_timeout):
                await dealer.send_multipart(parts)
        except TimeoutError:
            raise TimeoutError(
                f"rank {self.rank} could not queue a {kind} frame for {self.endpoint} within "
                f"{self.send_timeout} s; the coordinator is not reading"
            ) from None

    async def _join(self, dealer: zmq.asyncio.Socket) -> None:
        """Sends HELLO and waits for WELCOME; frames other than WELCOME before it are dropped."""
        hello = {
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "local_rank": self.local_rank,
        }
        with anyio.move_on_after(self.connect_timeout) as scope:
            await dealer.send_multipart(self.codec.encode(Kind.HELLO, hello))
            while True:
                frame = self._decode(await dealer.recv_multipart())
                if frame is not None and frame.kind == Kind.WELCOME:
                    break
        if scope.cancelled_caught:
            raise ConnectionError(
                f"rank {self.rank} got no WELCOME from the coordinator at {self.endpoint} within "
                f"{self.connect_timeout} s; check that it is running there, that its world size is "
                f"{self.world_size}, that both use the same job secret, and that both encrypt "
                f"the control plane or neither does (this rank "
                f"{'does' if self.encrypt else 'does not'}: --encrypt-control, "
                f"FLOWTRAIN_CONTROL_CURVE=1)"
            )
        self._last_heard = time.monotonic()
        _log().info("joined the coordinator", rank=self.rank, endpoint=self.endpoint)

    def _decode(self, parts: list[bytes]) -> Frame | None:
        try:
            frame = self.codec.decode(parts)
            if frame.sender != COORDINATOR_SENDER:
                raise FrameRejected(
                    "malformed", f"{frame.kind} signed by {frame.sender!r}, not the coordinator"
                )
        except FrameRejected as rejection:
            self.rejected.record_rejection(rejection, self.endpoint)
            return None
        self._last_heard = time.monotonic()
        return frame

    async def _receive_loop(
        self, dealer: zmq.asyncio.Socket, routes: MemoryObjectSendStream[tuple[int, dict]]
    ) -> None:
        while True:
            frame = self._decode(await dealer.recv_multipart())
            if frame is None:
                continue
            try:
                route = self._handle(frame)
            except FrameRejected as rejection:
                self.rejected.record_rejection(rejection, self.endpoint)
                continue
            if route is not None:
                try:
                    routes.send_nowait(route)
                except anyio.WouldBlock:
                    # Our own handler is behind; the coordinator is not silent meanwhile.
                    self._route_blocked = True
                    await routes.send(route)
                    self._route_blocked = False
                    self._last_heard = time.monotonic()

    def _handle(self, frame: Frame) -> tuple[int, dict] | None:
        body = frame.body
        if frame.kind in (Kind.HEARTBEAT, Kind.WELCOME):
            return None
        if frame.kind == Kind.BARRIER_RELEASE:
            waiter = self._barrier_waiters.get(str(body.get("name")))
            if waiter is not None:
                waiter.resolve(None)
        elif frame.kind == Kind.KV_VALUE:
            waiter = self._kv_waiters.get(body.get("req"))  # type: ignore[arg-type]
            if waiter is not None:
                waiter.resolve(body.get("value"))
        elif frame.kind == Kind.ROUTE:
            sender, payload = body.get("from"), body.get("body")
            if type(sender) is not int or not isinstance(payload, dict):
                raise FrameRejected(
                    "malformed", f"ROUTE with from={sender!r} and a {type(payload).__name__} body"
                )
            return sender, payload
        elif frame.kind == Kind.COMMIT_RESULT:
            if self._commit_waiter is not None:
                self._commit_waiter.resolve(body)
        elif frame.kind == Kind.RECONFIGURE:
            self.last_reconfigure = body
            if self.on_reconfigure is not None:
                try:
                    self.on_reconfigure(body)
                except Exception:
                    _log().exception("on_reconfigure raised", rank=self.rank)
        elif frame.kind == Kind.ABORT:
            self._abort(str(body.get("reason", "the coordinator aborted the job")))
        else:
            raise FrameRejected("malformed", f"the coordinator may not send {frame.kind} frames")
        return None

    async def _route_worker(self, routes: MemoryObjectReceiveStream[tuple[int, dict]]) -> None:
        # One worker keeps routed frames in arrival order, as an actor's mailbox would.
        async for sender, body in routes:
            if self.on_route is None:
                _log().warning(
                    "ROUTE frame with no on_route handler; dropped", rank=self.rank, sender=sender
                )
                continue
            await self.on_route(sender, body)

    async def _heartbeat_loop(self) -> None:
        dealer = self._dealer
        assert dealer is not None
        silence_limit = self.heartbeat_interval * self.heartbeat_misses
        previous = time.monotonic()
        while True:
            await anyio.sleep(self.heartbeat_interval)
            error = send_now(dealer, self._heartbeat_parts())
            if error is not None and not isinstance(error, zmq.Again):
                _log().warning("heartbeat not sent", rank=self.rank, error=repr(error))
            now = time.monotonic()
            # A stall of this loop (a long synchronous handler, the GIL) leaves the coordinator's
            # beats unread; give the receive loop one tick to catch up before judging.
            judge = now - previous <= 2 * self.heartbeat_interval
            previous = now
            silence = now - self._last_heard
            if judge and silence > silence_limit and not self._route_blocked and not self._aborted:
                self._abort(
                    f"lost the coordinator at {self.endpoint}: no frame for {silence:.1f} s"
                )

    def _heartbeat_parts(self) -> list[bytes]:
        if self.status is None:
            return self.codec.encode(Kind.HEARTBEAT, {})
        try:
            return self.codec.encode(Kind.HEARTBEAT, self.status())
        except Exception as exc:  # a broken status callback must not stop the beats
            _log().warning("status callback failed", rank=self.rank, error=repr(exc))
            return self.codec.encode(Kind.HEARTBEAT, {"status_error": repr(exc)[:200]})

    def _abort(self, reason: str) -> None:
        if self._aborted:
            return
        self._aborted = True
        _log().error("control plane abort", rank=self.rank, reason=reason)
        self._fail_waiters(RankAborted(reason))
        if self.on_abort is None:
            return
        try:
            self.on_abort(reason)
        except Exception:
            _log().exception("on_abort raised", rank=self.rank)

    def _fail_waiters(self, error: BaseException) -> None:
        extra = [self._commit_waiter] if self._commit_waiter is not None else []
        for waiter in [*self._barrier_waiters.values(), *self._kv_waiters.values(), *extra]:
            waiter.fail(error)
