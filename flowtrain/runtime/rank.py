"""One rank's place in the job: its runtime, its control-plane client (and, when no flowtrain
launcher runs the job, rank 0's coordinator), remote actor references, and abort handling."""

from __future__ import annotations

import asyncio
import atexit
import itertools
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import anyio

from flowtrain import comm
from flowtrain.env import LOG_LEVEL, RankEnv, read_rank_env
from flowtrain.errors import RankAborted, RankFailure, write_error_file
from flowtrain.log import configure_logging, get_logger, log_level
from flowtrain.netaddr import is_loopback
from flowtrain.runtime.actor import DEFAULT_ASK_TIMEOUT, ActorFailed
from flowtrain.runtime.system import Failure, Runtime
from flowtrain.runtime.watch import MainThreadWatch
from flowtrain.runtime.wire import decode, encode

log = get_logger("flowtrain.rank")

ABORT_GRACE = 5.0  # seconds the main thread gets to unwind after an abort before a hard exit
STANDALONE_FINISH_WAIT = 60.0  # rank 0 hosting the coordinator waits this long for the others


class Rank:
    """The process-wide rank object; made by ``start_rank()``."""

    def __init__(self, env: RankEnv) -> None:
        self.env = env
        self.runtime = Runtime(f"rank{env.rank}", on_failure=self._on_failure)
        self.control: Any = None  # flowtrain.control.client.ControlClient
        self.coordinator: Any = None  # only in standalone mode, on rank 0
        self.aborted: str | None = None
        self._asks: dict[int, asyncio.Future[Any]] = {}
        self._ask_ids = itertools.count(1)
        self._all_finished = threading.Event()
        self._closed = False
        self._main = MainThreadWatch()

    # -- start ------------------------------------------------------------------------------

    def _start(self) -> None:
        from flowtrain.control.client import ControlClient

        self.runtime.start()
        endpoint, secret = self._control_endpoint()
        self.control = ControlClient(
            endpoint=endpoint, secret=secret, rank=self.env.rank, world_size=self.env.world_size,
            local_rank=self.env.local_rank, heartbeat_interval=self.env.heartbeat_interval,
            heartbeat_misses=self.env.heartbeat_misses, status=self.status,
            on_abort=self._on_abort, on_route=self._on_route, encrypt=self.env.control_curve)
        self.runtime.start_service(self.control.serve, "control")

    def _control_endpoint(self) -> tuple[str, bytes]:
        if self.env.control_endpoint is not None:
            if self.env.job_secret is None:
                raise RuntimeError("FLOWTRAIN_CONTROL_ENDPOINT is set but FLOWTRAIN_JOB_SECRET is "
                                   "not; both come from `flowtrain launch`")
            return self.env.control_endpoint, self.env.job_secret
        return self._host_standalone_coordinator()

    def _host_standalone_coordinator(self) -> tuple[str, bytes]:
        """Started by torchrun, SLURM or plain python: rank 0 hosts the coordinator and hands its
        endpoint and a fresh secret to the others over the torch.distributed rendezvous."""
        import torch.distributed as dist

        from flowtrain.control.coordinator import Coordinator

        endpoint, secret_hex = "", ""
        if self.env.rank == 0:
            loopback = self.env.world_size == 1 or is_loopback(self.env.master_addr, resolve=True)
            secret = os.urandom(32)
            self.coordinator = Coordinator(
                world_size=self.env.world_size, secret=secret,
                host="127.0.0.1" if loopback else "0.0.0.0",
                heartbeat_interval=self.env.heartbeat_interval,
                heartbeat_misses=self.env.heartbeat_misses, on_event=self._on_coordinator_event,
                encrypt=self.env.control_curve)
            self.runtime.start_service(self.coordinator.serve, "coordinator")
            port = self.coordinator.endpoint.rsplit(":", 1)[1]
            host = "127.0.0.1" if loopback else self.env.master_addr
            endpoint, secret_hex = f"tcp://{host}:{port}", secret.hex()
        if self.env.world_size > 1:
            comm.init_distributed()
            group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
            shared = [endpoint, secret_hex]
            dist.broadcast_object_list(shared, src=0, group=group)
            endpoint, secret_hex = shared
        return endpoint, bytes.fromhex(secret_hex)

    # -- what the heartbeat tells the coordinator ----------------------------------------------

    def status(self) -> dict[str, Any]:
        busy = self.runtime.busy()
        return {
            "busy": ", ".join(f"actor {a} handling {m}" for a, m in busy.items()) or "idle",
            "pending": comm.pending(),
            "waiting_s": round(comm.waiting_s(), 1),
            **self._main.sample(),
            "actors": self.runtime.actor_names(),
        }

    # -- remote actors ---------------------------------------------------------------------------

    def remote(self, rank: int, actor: str) -> RemoteActorRef:
        """A reference to the actor named ``actor`` on rank ``rank``."""
        if not 0 <= rank < self.env.world_size:
            raise ValueError(f"rank must be in 0..{self.env.world_size - 1}, got {rank}")
        return RemoteActorRef(self, rank, actor)

    async def _on_route(self, from_rank: int, body: dict[str, Any]) -> None:
        op = body.get("op")
        if op == "reply":
            future = self._asks.pop(int(body.get("req", -1)), None)
            if future is not None and not future.done():
                if body.get("ok"):
                    future.set_result(decode(body.get("value")))
                else:
                    future.set_exception(RemoteError(str(body.get("error"))))
            return
        name = str(body.get("actor"))
        try:
            ref = self.runtime.lookup(name)
            message = decode(body.get("msg"))
        except (KeyError, TypeError) as exc:
            log.error("undeliverable message from another rank", from_rank=from_rank,
                      error=str(exc))
            if op == "ask":
                await self._reply(from_rank, body, ok=False, error=str(exc))
            return
        if op == "send":
            await ref.send(message)
        elif op == "ask":
            # Answer in a task of its own so a slow handler does not hold the route loop.
            self.runtime.start_soon(self._answer, from_rank, body, ref, message)
        else:
            log.error("unknown route operation", from_rank=from_rank, op=op)

    async def _answer(self, from_rank: int, body: dict[str, Any], ref: Any, message: Any) -> None:
        try:
            value = await ref.ask(message, timeout=float(body.get("timeout", DEFAULT_ASK_TIMEOUT)))
        except (ActorFailed, TimeoutError, Exception) as exc:  # noqa: BLE001 - goes back to asker
            await self._reply(from_rank, body, ok=False, error=f"{type(exc).__name__}: {exc}")
        else:
            await self._reply(from_rank, body, ok=True, value=encode(value))

    async def _reply(self, to_rank: int, body: dict[str, Any], *, ok: bool, value: Any = None,
                     error: str | None = None) -> None:
        await self.control.route(to_rank, {"op": "reply", "req": body.get("req"), "ok": ok,
                                           "value": value, "error": error})

    # -- control-plane wrappers for synchronous code -----------------------------------------------

    def barrier(self, name: str, timeout: float = 300.0) -> None:
        """Waits until every rank reached the barrier ``name`` (control plane, not data)."""
        self.runtime.call(self.control.barrier, name, timeout, timeout=timeout + 5)

    def kv_set(self, key: str, value: Any) -> None:
        self.runtime.call(self.control.kv_set, key, value)

    def kv_get(self, key: str, timeout: float = 300.0) -> Any:
        return self.runtime.call(self.control.kv_get, key, timeout, timeout=timeout + 5)

    def publish(self, topic: str, body: dict[str, Any]) -> None:
        self.runtime.call(self.control.publish, topic, body)

    # -- failure and abort -----------------------------------------------------------------------

    async def _on_failure(self, failure: Failure) -> None:
        """An actor of this rank failed: record it, tell the coordinator, abort the rank."""
        record = RankFailure.from_exception(self.env.rank, failure.exception, kind="actor",
                                            actor=failure.actor)
        if self.env.error_file:
            write_error_file(self.env.error_file, record)
        if self.control is not None:
            with anyio.move_on_after(2.0):
                await self.control.report_failure(record)
        self._on_abort(f"actor {failure.actor} failed: {failure.describe()}")

    def _on_coordinator_event(self, event: Any) -> None:
        """Standalone mode: rank 0's coordinator saw a failure; stop every rank."""
        from flowtrain.control import coordinator as c

        if isinstance(event, c.AllFinished):
            self._all_finished.set()
        elif isinstance(event, (c.RankFailed, c.JoinTimeout)):
            reason = (f"rank {event.rank}: {event.failure.message}"
                      if isinstance(event, c.RankFailed) else f"ranks {event.missing} never joined")
            log.error("job failed", reason=reason)
            self.runtime.start_soon(self.coordinator.abort, reason)
            self._on_abort(reason)

    def _on_abort(self, reason: str) -> None:
        """The job is ending: interrupt the main thread (SIGTERM, which flowtrain turns into
        RankAborted) and make sure the process ends even if the main thread is stuck in C."""
        if self.aborted is not None:
            return
        self.aborted = reason
        log.error("rank aborting", reason=reason)
        # Aimed at the main thread: a process-wide signal may land on another thread, and then
        # a main thread blocked in sleep() or a wait would not run the handler until it wakes.
        main = threading.main_thread().ident  # set: the main thread has always started
        if main is not None:
            signal.pthread_kill(main, signal.SIGTERM)
        threading.Thread(target=_hard_exit_after, args=(ABORT_GRACE,), daemon=True,
                         name="flowtrain-abort-watchdog").start()

    # -- shutdown --------------------------------------------------------------------------------

    def shutdown(self, failure: RankFailure | None = None, timeout: float = 2.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.runtime.running and self.control is not None:
                if failure is not None:
                    self.runtime.call(self.control.report_failure, failure, timeout=timeout)
                elif self.aborted is None:
                    self.runtime.call(self.control.close, timeout=timeout)
                    if self.coordinator is not None and self.env.world_size > 1:
                        # The others still talk to this coordinator: let them finish first.
                        if not self._all_finished.wait(STANDALONE_FINISH_WAIT):
                            log.warning("not every rank finished before rank 0 left")
        except Exception as exc:  # noqa: BLE001 - shutdown must go on
            log.warning("control plane shutdown incomplete", error=f"{type(exc).__name__}: {exc}")
        self.runtime.stop()


class RemoteError(Exception):
    """An actor on another rank could not answer: what it raised, as text."""


class RemoteActorRef:
    """A reference to an actor on another rank; messages travel over the control plane and
    must be ``@message`` dataclasses or plain values."""

    def __init__(self, rank_obj: Rank, rank: int, name: str) -> None:
        self._rank = rank_obj
        self.rank = rank
        self.name = name

    def __repr__(self) -> str:
        return f"RemoteActorRef(rank={self.rank}, {self.name!r})"

    async def send(self, message: Any) -> None:
        await self._rank.control.route(self.rank, {"op": "send", "actor": self.name,
                                                   "msg": encode(message)})

    async def ask(self, message: Any, *, timeout: float = DEFAULT_ASK_TIMEOUT) -> Any:
        req = next(self._rank._ask_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._rank._asks[req] = future
        try:
            await self._rank.control.route(self.rank, {"op": "ask", "actor": self.name, "req": req,
                                                       "msg": encode(message), "timeout": timeout})
            return await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise TimeoutError(f"actor {self.name!r} on rank {self.rank} did not answer "
                               f"{type(message).__name__} within {timeout} s") from None
        finally:
            self._rank._asks.pop(req, None)

    def send_from_thread(self, message: Any, *, timeout: float = 60.0) -> None:
        self._rank.runtime.call(self.send, message, timeout=timeout)

    def ask_from_thread(self, message: Any, *, timeout: float = DEFAULT_ASK_TIMEOUT) -> Any:
        return self._rank.runtime.call(self._ask_kw, message, timeout, timeout=timeout + 5)

    async def _ask_kw(self, message: Any, timeout: float) -> Any:
        return await self.ask(message, timeout=timeout)


# -- the process-wide rank ------------------------------------------------------------------------

_current: Rank | None = None
_lock = threading.Lock()
_abort_signalled = False


def start_rank(env: RankEnv | None = None) -> Rank:
    """Starts this process's rank (idempotent): logging, the runtime thread, the control
    client. Under torchrun or SLURM it is collective: every rank must call it."""
    global _current
    with _lock:
        if _current is not None:
            return _current
        env = env or read_rank_env()
        json_path = Path(env.run_dir) / f"rank{env.rank}.jsonl" if env.run_dir else None
        configure_logging(json_path=json_path, console=env.console, rank=env.rank,
                          level=log_level(os.environ.get(LOG_LEVEL)),
                          local_rank=env.local_rank, world_size=env.world_size,
                          node_rank=env.node_rank, host=socket.gethostname())
        install_abort_handler()
        rank = Rank(env)
        try:
            rank._start()
        except BaseException:
            rank.runtime.stop()
            raise
        _current = rank
        atexit.register(shutdown_rank)
        return rank


def current_rank() -> Rank:
    """The rank of this process, started on first use."""
    return _current if _current is not None else start_rank()


def shutdown_rank(failure: RankFailure | None = None, timeout: float = 2.0) -> None:
    """Reports ``failure`` (or says goodbye) to the coordinator and stops the runtime.
    A no-op when no rank was started."""
    global _current
    with _lock:
        rank, _current = _current, None
    if rank is not None:
        rank.shutdown(failure, timeout)


def install_abort_handler() -> None:
    """Turns the first SIGTERM into RankAborted in the main thread; later ones are ignored so
    the unwinding code is not interrupted again. Only from the main thread, and only when
    the user has not installed a handler of their own."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    global _abort_signalled
    if _abort_signalled:
        return
    _abort_signalled = True
    reason = _current.aborted if _current is not None and _current.aborted else "received SIGTERM"
    raise RankAborted(f"rank aborted: {reason}")


def _hard_exit_after(seconds: float) -> None:
    time.sleep(seconds)
    log.error("main thread did not unwind after the abort; exiting", grace_s=seconds)
    os._exit(143)
