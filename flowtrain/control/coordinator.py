"""The job's coordinator: a ZeroMQ ROUTER that every rank joins, plus a PUB socket for telemetry.

It runs barriers, a key/value store, routes frames between ranks, and declares silent ranks stuck.
What it learns about ranks (joined, beating, failed, stuck, finished) it also publishes as
telemetry records (flowtrain.telemetry), next to the records the ranks send.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, cast

import anyio
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus

from flowtrain.control.events import (
    AllFinished,
    CoordinatorEvent,
    JoinTimeout,
    RankFailed,
    RankFinished,
    RankJoined,
    RankState,
)
from flowtrain.control.events import (
    coordinator_log as _log,
)
from flowtrain.control.membership import Membership
from flowtrain.control.protocol import (
    Frame,
    FrameCodec,
    FrameRejected,
    Kind,
    RejectCounter,
    check_heartbeat,
    encrypt_server,
    limit_frames,
)
from flowtrain.errors import RankFailure
from flowtrain.telemetry.schema import (
    TOPIC_PREFIX,
    TelemetryError,
    event_record,
    heartbeat_record,
    topic_of,
    validate,
)

COORDINATOR_SENDER = "coordinator"
# Seconds that frames still queued when the coordinator stops may take to go out.
CLOSE_LINGER = 0.5


def identity_of(rank: int) -> bytes:
    """The ZeroMQ routing id of a rank's DEALER."""
    return f"rank{rank}".encode()


def tcp_endpoint(host: str, port: int | str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Coordinator(Membership):
    """Accepts ``world_size`` ranks on a ROUTER socket and supervises them with heartbeats."""

    def __init__(
        self,
        *,
        world_size: int,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        pub_port: int = 0,
        heartbeat_interval: float = 1.0,
        heartbeat_misses: int = 5,
        join_timeout: float = 300.0,
        on_event: Callable[[CoordinatorEvent], None] | None = None,
        on_telemetry: Callable[[Mapping[str, Any]], None] | None = None,
        job_record: Mapping[str, Any] | None = None,
        encrypt: bool = False,
        peer_recovery: bool = False,
    ) -> None:
        """``on_telemetry`` gets every schema record the coordinator publishes (the recorder and
        the launcher's progress line hang there); ``job_record`` is published when it starts.
        The PUB socket is always a CurveZMQ server with a key pair derived from the secret
        (``protocol.curve_server_keys``), so only holders of the secret can subscribe;
        ``encrypt`` makes the ROUTER one too, for jobs whose hosts talk over untrusted
        networks. ``peer_recovery`` (``flowtrain launch --peer-recovery``): the coordinator
        keeps the data-parallel group's membership in generations, answers each step's commit
        votes (COMMIT) and, when a rank is lost (``member_lost``) or a replacement joins, tells
        the members the next generation (RECONFIGURE)."""
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        check_heartbeat(heartbeat_interval, heartbeat_misses)
        self.world_size = world_size
        self.host = host
        self.port = port
        self.pub_port = pub_port
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_misses = heartbeat_misses
        self.join_timeout = join_timeout
        self.on_event = on_event
        self.on_telemetry = on_telemetry
        self.job_record = job_record
        self.codec = FrameCodec(secret, COORDINATOR_SENDER)
        self.encrypt = encrypt
        self._secret = secret
        self.rejected = RejectCounter("coordinator")
        self.undeliverable = 0  # frames for a rank that is not (or no longer) connected
        self.endpoint = ""
        self.pub_endpoint = ""
        self._states = {rank: RankState(rank) for rank in range(world_size)}
        self._router: zmq.asyncio.Socket | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._barriers: dict[str, tuple[int, set[int]]] = {}  # name -> (generation, ranks arrived)
        self._kv: dict[str, Any] = {}
        self._kv_waiters: dict[str, list[tuple[int, Any]]] = {}  # key -> [(rank, req)]
        self._join_reported = False
        self._all_finished_reported = False
        self.peer_recovery = peer_recovery
        self.generation = 0
        self.members: set[int] = set(range(world_size))
        self._joining: set[int] = set()
        self._votes: dict[int, dict[int, bool]] = {}  # step -> {rank: ok} of this generation

    # ----------------------------------------------------------------- public API

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Binds both sockets, reports started, serves until cancelled; closes the sockets."""
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)
        pub = context.socket(zmq.PUB)
        try:
            router.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.LINGER, 0)
            limit_frames(router)
            limit_frames(pub)
            # the telemetry (losses, learning rates, step times) is for the job's holders of
            # the secret only, so PUB always encrypts; the ROUTER does when asked
            encrypt_server(pub, self._secret)
            if self.encrypt:
                encrypt_server(router, self._secret)
            # Unroutable sends raise EHOSTUNREACH instead of vanishing silently.
            router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # Protocol heartbeats drop dead TCP connections; app-level beats decide who is stuck.
            router.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(self.heartbeat_interval * 1000)))
            router.setsockopt(
                zmq.HEARTBEAT_TIMEOUT,
                max(1, int(self.heartbeat_interval * self.heartbeat_misses * 1000)),
            )
            if ":" in self.host:
                router.setsockopt(zmq.IPV6, 1)
                pub.setsockopt(zmq.IPV6, 1)
            router.bind(tcp_endpoint(self.host, self.port or "*"))
            pub.bind(tcp_endpoint(self.host, self.pub_port or "*"))
            self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self.pub_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            self._router, self._pub = router, pub
            started = time.monotonic()
            if self.job_record is not None:
                self.publish_record(self.job_record)
            _log().info(
                "coordinator listening",
                endpoint=self.endpoint,
                pub_endpoint=self.pub_endpoint,
                world_size=self.world_size,
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._receive_loop, router)
                tg.start_soon(self._tick_loop, started)
                task_status.started()
        finally:
            self._router = self._pub = None
            # A bounded linger lets an ABORT sent just before shutdown still reach the ranks.
            router.close(linger=int(CLOSE_LINGER * 1000))
            # Also bounded for PUB: the last records (a failure, the final step) reach subscribers.
            pub.close(linger=int(CLOSE_LINGER * 1000))
            with anyio.CancelScope(shield=True):
                # term() waits out the linger; a thread keeps the loop free meanwhile.
                await anyio.to_thread.run_sync(context.term)

    async def abort(self, reason: str) -> None:
        """Sends ABORT to every joined rank that has not said BYE."""
        for state in self._states.values():
            if state.joined and not state.finished:
                self._send(state.rank, Kind.ABORT, {"reason": reason})
        _log().warning("coordinator aborted the job", reason=reason)

    def publish_record(self, record: Mapping[str, Any]) -> None:
        """Publishes one telemetry record (flowtrain.telemetry schema) from the coordinator's
        side and hands it to ``on_telemetry``; TelemetryError if it breaks the schema."""
        validate(record)
        self._rank_telemetry(record)

    def ranks(self) -> dict[int, RankState]:
        return {
            rank: replace(state, status=dict(state.status)) for rank, state in self._states.items()
        }

    # ------------------------------------------------------------------ plumbing

    def _emit(self, event: CoordinatorEvent) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(event)
        except Exception:
            _log().exception(
                "on_event raised; the coordinator carries on", coordinator_event=repr(event)
            )

    def _send(self, rank: int, kind: str, body: dict) -> bool:
        """Sends without waiting; a rank that vanished or stopped reading is logged, not fatal."""
        router = self._router
        if router is None:
            raise RuntimeError("the coordinator is not serving; start Coordinator.serve() first")
        parts = [identity_of(rank), *self.codec.encode(kind, body)]
        error = send_now(router, parts)
        if error is None:
            return True
        self.undeliverable += 1
        if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            # The heartbeat check reports a vanished rank; a line per beat would only add noise.
            log = _log().debug if kind == Kind.HEARTBEAT else _log().warning
            log("rank is not connected; frame dropped", rank=rank, kind=kind)
        elif isinstance(error, zmq.Again):
            _log().warning(
                "rank is not reading (send queue full); frame dropped", rank=rank, kind=kind
            )
        else:
            _log().error(
                "sending to rank failed; frame dropped", rank=rank, kind=kind, error=repr(error)
            )
        return False

    async def _receive_loop(self, router: zmq.asyncio.Socket) -> None:
        while True:
            parts = await router.recv_multipart()
            identity, frame_parts = parts[0], parts[1:]
            try:
                frame = self.codec.decode(
                    frame_parts, origin=identity.decode("utf-8", "backslashreplace"))
            except FrameRejected as rejection:
                self.rejected.record_rejection(rejection, identity)
                continue
            try:
                self._handle(identity, frame)
            except FrameRejected as rejection:
                self.rejected.record_rejection(rejection, identity)

    def _rank_of(self, identity: bytes, frame: Frame) -> int:
        """The joined rank that sent this frame; FrameRejected if it is not one."""
        name = identity.decode("utf-8", "backslashreplace")
        if frame.sender != name:
            raise FrameRejected(
                "malformed", f"{frame.kind} signed by {frame.sender!r} arrived from socket {name!r}"
            )
        rank = _parse_rank(name)
        if rank is None or rank not in self._states or not self._states[rank].joined:
            raise FrameRejected(
                "malformed", f"{frame.kind} from {name!r}, which has not joined with HELLO"
            )
        return rank

    def _handle(self, identity: bytes, frame: Frame) -> None:
        if frame.kind == Kind.HELLO:
            self._on_hello(identity, frame)
            return
        rank = self._rank_of(identity, frame)
        state = self._states[rank]
        state.last_seen = time.monotonic()
        body = frame.body
        kind = frame.kind
        if kind == Kind.HEARTBEAT:
            state.status = body
            self._rank_telemetry(heartbeat_record(rank, body))
        elif kind == Kind.BARRIER:
            self._on_barrier(rank, _field(body, "name", str, kind))
        elif kind == Kind.KV_SET:
            self._on_kv_set(_field(body, "key", str, kind), body.get("value"))
        elif kind == Kind.KV_GET:
            self._on_kv_get(rank, _field(body, "key", str, kind), body.get("req"))
        elif kind == Kind.ROUTE:
            self._on_route(rank, body)
        elif kind == Kind.FAILURE:
            self._on_failure(rank, _field(body, "failure", dict, kind))
        elif kind == Kind.TELEMETRY:
            self._on_telemetry(
                rank, _field(body, "topic", str, kind), _field(body, "body", dict, kind)
            )
        elif kind == Kind.BYE:
            self._on_bye(rank)
        elif kind == Kind.JOIN and self.peer_recovery and rank not in self.members:
            self._joining.add(rank)
            _log().warning("replacement rank ready; it enters the group after the next step",
                           rank=rank, generation=self.generation)
            self._release_joiners()
        elif kind == Kind.COMMIT and self.peer_recovery:
            self._on_commit(rank, _field(body, "generation", int, kind),
                            _field(body, "step", int, kind), bool(body.get("ok")))
        else:
            raise FrameRejected("malformed", f"a rank may not send {kind} frames")

    def _on_hello(self, identity: bytes, frame: Frame) -> None:
        body = frame.body
        name = identity.decode("utf-8", "backslashreplace")
        rank = _field(body, "rank", int, Kind.HELLO)
        world_size = _field(body, "world_size", int, Kind.HELLO)
        if not 0 <= rank < self.world_size:
            raise FrameRejected(
                "malformed",
                f"HELLO from rank {rank}; ranks of this job are 0..{self.world_size - 1}",
            )
        if world_size != self.world_size:
            raise FrameRejected(
                "malformed",
                f"HELLO from rank {rank} says world size {world_size}; "
                f"this job has {self.world_size}",
            )
        if frame.sender != name or identity != identity_of(rank):
            raise FrameRejected(
                "malformed",
                f"HELLO for rank {rank} signed by {frame.sender!r} from socket {name!r}; "
                f"both must be 'rank{rank}'",
            )
        state = self._states[rank]
        rejoin = state.joined
        if self.peer_recovery and state.lost:
            # a replacement for a lost rank: it enters the group at the first committed step
            # after it says it is ready (JOIN)
            state.lost = state.failed = state.stuck = state.finished = False
            state.status = {}
            rejoin = False
            _log().warning("replacement rank joined the control plane", rank=rank,
                           generation=self.generation)
        state.joined = True
        state.host = str(body.get("host", ""))
        state.pid = body.get("pid", 0) if isinstance(body.get("pid"), int) else 0
        state.local_rank = (
            body.get("local_rank", 0) if isinstance(body.get("local_rank"), int) else 0
        )
        state.last_seen = time.monotonic()
        self._send(rank, Kind.WELCOME, {"world_size": self.world_size})
        if rejoin:
            _log().warning("rank joined again", rank=rank, host=state.host, pid=state.pid)
            return
        _log().info("rank joined", rank=rank, host=state.host, pid=state.pid)
        self._rank_telemetry(event_record(
            "rank_joined", f"rank {rank} joined from {state.host or '?'} (pid {state.pid})",
            rank=rank, data={"host": state.host, "pid": state.pid,
                             "local_rank": state.local_rank}))
        self._emit(RankJoined(rank=rank, host=state.host, pid=state.pid))

    def _on_barrier(self, rank: int, name: str) -> None:
        generation, arrived = self._barriers.get(name, (0, set()))
        arrived.add(rank)
        if len(arrived) < self.world_size:
            self._barriers[name] = (generation, arrived)
            return
        # Everyone is here: release and open the next generation of the same name.
        self._barriers[name] = (generation + 1, set())
        for other in range(self.world_size):
            self._send(other, Kind.BARRIER_RELEASE, {"name": name, "generation": generation})

    def _on_kv_set(self, key: str, value: Any) -> None:
        self._kv[key] = value
        for rank, req in self._kv_waiters.pop(key, []):
            self._send(rank, Kind.KV_VALUE, {"key": key, "req": req, "value": value})

    def _on_kv_get(self, rank: int, key: str, req: Any) -> None:
        if key in self._kv:
            self._send(rank, Kind.KV_VALUE, {"key": key, "req": req, "value": self._kv[key]})
        else:
            self._kv_waiters.setdefault(key, []).append((rank, req))

    def _on_route(self, rank: int, body: dict) -> None:
        to = body.get("to")
        payload = _field(body, "body", dict, Kind.ROUTE)
        if type(to) is not int or not 0 <= to < self.world_size:
            raise FrameRejected(
                "malformed",
                f"ROUTE from rank {rank} to {to!r}; destinations are 0..{self.world_size - 1}",
            )
        target = self._states[to]
        if not target.joined or target.finished:
            self.undeliverable += 1
            _log().warning(
                "ROUTE to a rank that is not joined or has finished; dropped",
                sender=rank,
                to=to,
                joined=target.joined,
                finished=target.finished,
            )
            return
        self._send(to, Kind.ROUTE, {"from": rank, "body": payload})

    def _on_failure(self, rank: int, raw: dict) -> None:
        try:
            failure = RankFailure(**raw)
        except TypeError as exc:
            raise FrameRejected(
                "malformed", f"FAILURE from rank {rank} is not a RankFailure: {exc}"
            ) from None
        self._states[rank].failed = True
        _log().error(
            "rank reported a failure", rank=rank, kind=failure.kind, message=failure.message
        )
        self._rank_telemetry(event_record(
            "rank_failed", f"rank {rank}: {failure.message}", rank=rank,
            data={"kind": failure.kind, "actor": getattr(failure, "actor", None),
                  "host": failure.host, "pid": failure.pid, "source": "rank"}))
        self._emit(RankFailed(rank=rank, failure=failure))

    def _on_telemetry(self, rank: int, topic: str, body: dict) -> None:
        if topic.startswith(TOPIC_PREFIX):
            # A schema record: the rank field is the verified sender, whatever the body says.
            record = dict(body, rank=rank)
            try:
                validate(record)
            except TelemetryError as exc:
                raise FrameRejected("malformed", f"telemetry from rank {rank}: {exc}") from None
            if topic != topic_of(record):
                raise FrameRejected("malformed", f"a {record['kind']} record from rank {rank} "
                                                 f"under topic {topic!r}")
            self._publish(topic, rank, record)
            return
        self._publish(topic, rank, body, record=False)

    def _rank_telemetry(self, record: Mapping[str, Any]) -> None:
        self._publish(topic_of(record), record["rank"], record)

    def _publish(self, topic: str, rank: int, body: Mapping[str, Any], record: bool = True) -> None:
        pub = self._pub
        if pub is not None:
            parts = self.codec.encode_published(topic, {"topic": topic, "rank": rank, "body": body})
            # PUB never blocks: with no or slow subscribers ZeroMQ drops, which telemetry tolerates.
            send_now(pub, parts)
        if record and self.on_telemetry is not None:
            try:
                self.on_telemetry(body)
            except Exception:
                _log().exception("on_telemetry raised; the coordinator carries on")

    def _on_bye(self, rank: int) -> None:
        state = self._states[rank]
        if state.finished:
            return
        state.finished = True
        self._joining.discard(rank)
        for key, waiters in list(self._kv_waiters.items()):
            self._kv_waiters[key] = [(r, req) for r, req in waiters if r != rank]
        _log().info("rank finished", rank=rank)
        self._rank_telemetry(event_record("rank_finished", f"rank {rank} finished", rank=rank))
        self._emit(RankFinished(rank=rank))
        self._release_joiners()
        if not self._all_finished_reported and all(s.finished for s in self._states.values()):
            self._all_finished_reported = True
            self._emit(AllFinished())

    async def _tick_loop(self, started: float) -> None:
        silence_limit = self.heartbeat_interval * self.heartbeat_misses
        previous = time.monotonic()
        while True:
            await anyio.sleep(self.heartbeat_interval)
            now = time.monotonic()
            # After a stall of our own loop the ranks' beats sit unread in the socket; judge
            # them on the next tick, once the receive loop has caught up.
            judge = now - previous <= 2 * self.heartbeat_interval
            previous = now
            for state in self._states.values():
                if not state.joined or state.finished or state.lost:
                    continue
                self._send(state.rank, Kind.HEARTBEAT, {})
                silence = now - state.last_seen
                if judge and silence > silence_limit and not state.failed:
                    self._declare_stuck(state, silence)
            if judge:
                self._check_stalls(silence_limit)
            if not self._join_reported and now - started > self.join_timeout:
                missing = [s.rank for s in self._states.values() if not s.joined]
                if missing:
                    self._join_reported = True
                    _log().error(
                        "ranks did not join in time",
                        missing=missing,
                        join_timeout=self.join_timeout,
                    )
                    self._rank_telemetry(event_record(
                        "join_timeout", f"ranks {missing} did not join within "
                        f"{self.join_timeout:g} s", data={"missing": missing}))
                    self._emit(JoinTimeout(missing=missing))

def send_now(socket: zmq.asyncio.Socket, parts: list[bytes]) -> BaseException | None:
    """Sends without waiting and returns the error, if any (zmq.Again when the queue is full)."""
    # With NOBLOCK pyzmq resolves the future at once; reading it here keeps errors synchronous
    # and keeps asyncio from warning about an exception nobody retrieved.
    # pyzmq annotates the asyncio socket's send as an Awaitable; what it returns is a Future.
    future = cast("asyncio.Future[Any]", socket.send_multipart(parts, flags=zmq.NOBLOCK))
    if not future.done():
        return None
    return future.exception()


def _parse_rank(name: str) -> int | None:
    if not name.startswith("rank") or not name[4:].isdigit():
        return None
    return int(name[4:])


def _field(body: dict, key: str, expected: type, kind: str) -> Any:
    value = body.get(key)
    # bool is an int subclass, and never a valid rank or size.
    if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
        raise FrameRejected(
            "malformed", f"{kind} field {key!r} is {value!r:.80}, expected {expected.__name__}"
        )
    return value
