"""The runtime of one rank: an anyio (asyncio backend) event loop in its own thread, the actors
spawned on it, the services beside them, and the supervision that turns a failure into a stop."""

from __future__ import annotations

import asyncio
import threading
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.abc

from flowtrain.log import get_logger
from flowtrain.runtime.actor import Actor, ActorFailed, ActorRef, run_actor
from flowtrain.runtime.mailbox import Mailbox

T = TypeVar("T")
log = get_logger("flowtrain.runtime")


class RuntimeFailed(Exception):
    """The runtime stopped because one of its actors or services failed."""


@dataclass(frozen=True)
class Failure:
    """The first failure of a runtime: which actor or service, what it raised, and when."""

    actor: str
    exception: BaseException
    traceback: str
    timestamp: float = field(default_factory=time.time)

    def describe(self) -> str:
        return f"{self.actor}: {type(self.exception).__name__}: {self.exception}"


@dataclass
class _Slot:
    actor: Actor
    mailbox: Mailbox
    scope: anyio.CancelScope


class Runtime:
    """Runs actors for one rank. The loop lives in a dedicated thread so the user's training
    code keeps the main thread; actors are reached through their ``ActorRef``.

    Supervision is fail-fast: the first actor (or service) that raises cancels every actor of
    the runtime, is recorded in ``failure``, and ``on_failure`` is awaited on the loop (the
    rank uses it to tell the coordinator). Later calls into the runtime raise RuntimeFailed.
    """

    def __init__(self, name: str = "rank", *,
                 on_failure: Callable[[Failure], Awaitable[None]] | None = None,
                 stop_timeout: float = 10.0) -> None:
        self.name = name
        self.failure: Failure | None = None
        self._on_failure = on_failure
        self._stop_timeout = stop_timeout
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self._actors: dict[str, _Slot] = {}
        self._busy: dict[str, str] = {}
        self._started = threading.Event()
        self._stop_event: anyio.Event | None = None
        self._no_actors: anyio.Event | None = None
        self._thread_error: BaseException | None = None
        self._stopped = False
        self._counter = 0
        self.leaked_tasks: list[str] = []  # filled when the loop ends; empty on a clean stop

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self, timeout: float = 10.0) -> Runtime:
        """Starts the loop thread and returns once it accepts work."""
        if self._thread is not None:
            raise RuntimeError(f"runtime {self.name!r} was already started")
        self._thread = threading.Thread(target=self._thread_main, name=f"flowtrain-{self.name}",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"runtime {self.name!r} did not start within {timeout} s")
        if self._thread_error is not None:
            raise RuntimeError(f"runtime {self.name!r} failed to start") from self._thread_error
        return self

    def _thread_main(self) -> None:
        try:
            anyio.run(self._main, backend="asyncio")
        except BaseException as exc:  # noqa: BLE001 - reported through stop()/start()
            self._thread_error = exc
            self._started.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop_event = anyio.Event()
        self._no_actors = anyio.Event()
        self._no_actors.set()
        async with anyio.create_task_group() as tg:
            self._task_group = tg
            self._started.set()
            await self._stop_event.wait()
            for slot in list(self._actors.values()):
                slot.mailbox.close()
            with anyio.move_on_after(self._stop_timeout):
                await self._no_actors.wait()
            if self._actors:
                log.warning("actors did not stop in time; cancelling", runtime=self.name,
                            actors=sorted(self._actors), busy=dict(self._busy))
            tg.cancel_scope.cancel()
        self._task_group = None
        current = asyncio.current_task()
        self.leaked_tasks = [t.get_name() for t in asyncio.all_tasks() if t is not current]
        if self.leaked_tasks:
            log.warning("tasks outlived the runtime", runtime=self.name, tasks=self.leaked_tasks)

    def stop(self, timeout: float | None = None) -> None:
        """Stops the runtime: mailboxes close, actors finish what they hold and run on_stop,
        services are cancelled, the thread ends. Idempotent; call from outside the loop."""
        if self._thread is None or self._stopped:
            return
        if self.on_loop_thread():
            raise RuntimeError("Runtime.stop() blocks; call it from outside the event loop")
        self._stopped = True
        timeout = self._stop_timeout + 5.0 if timeout is None else timeout
        if self._loop is not None and not self._loop.is_closed() and self._stop_event is not None:
            try:
                self._loop.call_soon_threadsafe(self._stop_event.set)
            except RuntimeError:
                pass  # the loop already ended
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"runtime {self.name!r} did not stop within {timeout} s; "
                               f"busy actors: {self._busy or 'none'}")
        if self._thread_error is not None:
            raise RuntimeError(f"runtime {self.name!r} loop crashed") from self._thread_error

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped

    def on_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError(f"runtime {self.name!r} is not started")
        return self._loop

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RuntimeFailed(f"runtime {self.name!r} stopped after a failure: "
                                f"{self.failure.describe()}") from self.failure.exception

    # -- calling into the loop ---------------------------------------------------------------

    def call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any,
             timeout: float = 60.0) -> T:
        """Runs ``await fn(*args)`` on the loop from another thread and returns its result."""
        if self.on_loop_thread():
            raise RuntimeError("Runtime.call() blocks; on the loop, await the function instead")
        if not self.running:
            self.raise_if_failed()
            raise RuntimeError(f"runtime {self.name!r} is not running")
        future = asyncio.run_coroutine_threadsafe(fn(*args), self.loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"{getattr(fn, '__qualname__', fn)} did not finish on runtime "
                               f"{self.name!r} within {timeout} s") from None

    # -- actors ------------------------------------------------------------------------------

    def spawn(self, actor: Actor, name: str | None = None, *,
              mailbox_size: int | None = None) -> ActorRef[Any]:
        """Starts ``actor`` on this runtime and returns its reference. From any thread."""
        if self.on_loop_thread():
            return self._spawn_now(actor, name, mailbox_size)
        return self.call(self._spawn_async, actor, name, mailbox_size)

    async def _spawn_async(self, actor: Actor, name: str | None,
                           mailbox_size: int | None) -> ActorRef[Any]:
        return self._spawn_now(actor, name, mailbox_size)

    def _spawn_now(self, actor: Actor, name: str | None,
                   mailbox_size: int | None) -> ActorRef[Any]:
        self.raise_if_failed()
        if self._task_group is None or self._stop_event is None or self._stop_event.is_set():
            raise RuntimeError(f"runtime {self.name!r} is not running; cannot spawn")
        actor.handled_types()  # a bad handler signature fails here, at spawn
        if name is None:
            self._counter += 1
            name = f"{type(actor).__name__}-{self._counter}"
        if name in self._actors:
            raise ValueError(f"an actor named {name!r} already runs on runtime {self.name!r}")
        mailbox = Mailbox(mailbox_size or actor.mailbox_size, name)
        mailbox.bind(self.loop)
        ref: ActorRef[Any] = ActorRef(name, actor, mailbox, self)
        actor.name, actor.runtime, actor.ref = name, self, ref
        slot = _Slot(actor, mailbox, anyio.CancelScope())
        self._actors[name] = slot
        assert self._no_actors is not None
        if self._no_actors.is_set():
            self._no_actors = anyio.Event()
        self._task_group.start_soon(self._supervise, slot, name=f"actor:{name}")
        return ref

    async def _supervise(self, slot: _Slot) -> None:
        actor = slot.actor
        try:
            with slot.scope:
                await run_actor(actor, slot.mailbox, self._busy)
        except Exception as exc:  # noqa: BLE001 - this is the supervisor
            await self._fail(actor.name, exc.cause if isinstance(exc, ActorFailed) else exc, exc)
        finally:
            self._actors.pop(actor.name, None)
            if not self._actors and self._no_actors is not None:
                self._no_actors.set()

    def lookup(self, name: str) -> ActorRef[Any]:
        """The reference of a running actor, by name."""
        slot = self._actors.get(name)
        if slot is None:
            known = ", ".join(sorted(self._actors)) or "none"
            raise KeyError(f"no actor named {name!r} on runtime {self.name!r}; running: {known}")
        return slot.actor.ref

    def stop_actor(self, name: str, timeout: float = 10.0) -> None:
        """Stops one actor: its mailbox closes, it handles what is queued, runs on_stop, ends.
        From any thread other than the loop's; returns once it has ended."""
        slot = self._actors.get(name)
        if slot is None:
            return
        slot.mailbox.close()
        deadline = time.monotonic() + timeout
        while name in self._actors:
            if time.monotonic() > deadline:
                raise TimeoutError(f"actor {name!r} did not stop within {timeout} s; "
                                   f"busy with {self._busy.get(name, 'nothing')}")
            time.sleep(0.001)

    def actor_names(self) -> list[str]:
        return sorted(self._actors)

    def busy(self) -> dict[str, str]:
        """Actor name -> type of the message it is handling now (for heartbeats and reports)."""
        return dict(self._busy)

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Runs ``fn(*args)`` as a task of the runtime, from any thread; if it raises, the
        runtime fails as if an actor had."""
        if self._task_group is None:
            raise RuntimeError(f"runtime {self.name!r} is not running")
        if self.on_loop_thread():
            self._task_group.start_soon(self._run_task, fn, args)
        else:
            self.loop.call_soon_threadsafe(self._task_group.start_soon, self._run_task, fn, args)

    async def _run_task(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        except Exception as exc:  # noqa: BLE001 - this is the supervisor
            await self._fail(f"task {getattr(fn, '__qualname__', fn)}", exc, exc)

    # -- services ----------------------------------------------------------------------------

    def start_service(self, fn: Callable[..., Awaitable[Any]], name: str,
                      timeout: float = 60.0) -> None:
        """Runs a long-lived ``fn(task_status=...)`` (the control client, a coordinator) in the
        runtime's task group; returns once it called ``task_status.started()``. A service
        that raises fails the runtime like an actor."""
        self.call(self._start_service, fn, name, timeout=timeout)

    async def _start_service(self, fn: Callable[..., Awaitable[Any]], name: str) -> None:
        assert self._task_group is not None
        await self._task_group.start(self._run_service, fn, name, name=f"service:{name}")

    async def _run_service(self, fn: Callable[..., Awaitable[Any]], name: str, *,
                           task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            await fn(task_status=task_status)
        except Exception as exc:  # noqa: BLE001 - this is the supervisor
            await self._fail(f"service {name}", exc, exc)

    # -- supervision -------------------------------------------------------------------------

    async def _fail(self, who: str, cause: BaseException, raised: BaseException) -> None:
        if self.failure is not None:
            log.warning("further failure after the first", runtime=self.name, who=who,
                        error=f"{type(cause).__name__}: {cause}")
            return
        text = "".join(traceback.format_exception(cause))
        self.failure = Failure(who, cause, text)
        log.error("actor failed; stopping the rank's actors", runtime=self.name, actor=who,
                  error=f"{type(cause).__name__}: {cause}", traceback=text)
        for slot in list(self._actors.values()):
            slot.mailbox.close()
            slot.scope.cancel()
        if self._on_failure is not None:
            try:
                with anyio.fail_after(10.0):
                    await self._on_failure(self.failure)
            except Exception as exc:  # noqa: BLE001 - never let reporting mask the failure
                log.error("on_failure callback raised", runtime=self.name,
                          error=f"{type(exc).__name__}: {exc}")
