"""A live reader of a job's telemetry: a ZeroMQ SUB socket on the coordinator's PUB endpoint that
verifies each frame's HMAC and schema, usable from plain threads or from an asyncio loop."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

import zmq
import zmq.asyncio

from flowtrain.control.protocol import (
    FrameCodec,
    FrameRejected,
    RejectCounter,
    encrypt_client,
    limit_frames,
)
from flowtrain.telemetry.schema import TOPIC_PREFIX, TOPICS, Record, TelemetryError, validate

COORDINATOR_SENDER = "coordinator"  # who signs published frames (flowtrain.control.coordinator)
RECEIVE_QUEUE = 100_000  # frames ZeroMQ keeps for a subscriber that reads slowly


class Subscriber:
    """Receives records published under ``topics`` (prefixes; ``telemetry.`` for all).

    ZeroMQ connects in the background and reconnects by itself, so a subscriber may start before
    the job publishes or join a running job (it misses what was published before it joined:
    read ``telemetry.msgpack`` for history). Frames that fail the signature or the schema are
    counted in ``rejected`` and skipped, never raised.
    """

    def __init__(self, endpoint: str, secret: bytes,
                 topics: Iterable[str] = (TOPIC_PREFIX,)) -> None:
        """The coordinator's PUB socket is a CurveZMQ server whose key follows from the job
        secret (``Coordinator``): the subscriber connects as its client."""
        topics = list(topics)
        for topic in topics:
            if not isinstance(topic, str) or not topic.startswith(TOPIC_PREFIX[:-1]):
                raise ValueError(f"telemetry topic {topic!r} is not one of {', '.join(TOPICS)} "
                                 f"(or a prefix of them such as {TOPIC_PREFIX!r})")
        self.endpoint = endpoint
        self.topics = topics
        self.codec = FrameCodec(secret, "subscriber")
        self.rejected = RejectCounter("telemetry subscriber")
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        limit_frames(self._socket)
        encrypt_client(self._socket, secret)
        self._socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
        if endpoint.startswith("tcp://[") or endpoint.count(":") > 2:
            self._socket.setsockopt(zmq.IPV6, 1)
        for topic in topics:
            self._socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._socket.connect(endpoint)
        self._async: zmq.asyncio.Socket | None = None

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def recv(self, timeout: float) -> Record | None:
        """The next valid record, or None when none came within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._socket.poll(max(1, int(left * 1000)), zmq.POLLIN):
                return None
            record = self._verify(self._socket.recv_multipart(zmq.NOBLOCK))
            if record is not None:
                return record

    def drain(self, timeout: float, until: Any = None) -> list[Record]:
        """Every record that arrives within ``timeout`` seconds; stops early once ``until``
        (a predicate on the records so far) is true."""
        out: list[Record] = []
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            record = self.recv(left)
            if record is None:
                break
            out.append(record)
            if until is not None and until(out):
                break
        return out

    async def arecv(self, timeout: float | None = None) -> Record | None:
        """``recv`` for an asyncio loop (a Textual worker); None after ``timeout`` seconds."""
        sock = self._async_socket()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if wait is not None and wait <= 0:
                return None
            # flags default to POLLIN (pyzmq's annotations give the socket's poll no flags)
            ready = await sock.poll(None if wait is None else max(1, int(wait * 1000)))
            if not ready:
                return None
            record = self._verify(await sock.recv_multipart())
            if record is not None:
                return record

    async def __aiter__(self) -> AsyncIterator[Record]:
        while True:
            record = await self.arecv()
            if record is not None:
                yield record

    def close(self) -> None:
        if self._async is not None:
            self._async.close(linger=0)
        self._socket.close(linger=0)
        self._context.term()

    def _async_socket(self) -> zmq.asyncio.Socket:
        if self._async is None:
            # A shadow of the same socket: the asyncio wrapper adds awaitable I/O to it.
            self._async = zmq.asyncio.Socket.shadow(self._socket.underlying)
        return self._async

    def _verify(self, parts: list[bytes]) -> Record | None:
        try:
            frame = self.codec.decode_published(parts)
            if frame.sender != COORDINATOR_SENDER:
                raise FrameRejected("malformed", f"published by {frame.sender!r}, not the "
                                                 "coordinator")
            record = validate(frame.body.get("body"))
        except FrameRejected as rejection:
            self.rejected.record_rejection(rejection, self.endpoint)
            return None
        except TelemetryError as exc:
            self.rejected.record("malformed", str(exc), self.endpoint)
            return None
        return record
