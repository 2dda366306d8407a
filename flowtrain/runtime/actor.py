"""Actors: objects with a bounded mailbox and one async handler per message type, and the
references other code uses to send to them, from the loop or from any other thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import typing
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import anyio

from flowtrain.runtime.mailbox import Mailbox, MailboxClosed

DEFAULT_MAILBOX_SIZE = 1024
DEFAULT_SEND_TIMEOUT = 60.0
DEFAULT_ASK_TIMEOUT = 60.0
ON_STOP_TIMEOUT = 10.0

R = TypeVar("R")
T = TypeVar("T")
Handler = Callable[[Any], Awaitable[Any]]  # a bound handler method, called with the message


class ActorFailed(Exception):
    """An actor's handler raised; carries the actor's name and the message it was handling."""

    def __init__(self, actor: str, message: object, cause: BaseException) -> None:
        self.actor = actor
        self.message_type = type(message).__name__
        self.cause = cause
        super().__init__(f"actor {actor!r} failed handling {self.message_type}: "
                         f"{type(cause).__name__}: {cause}")


class ActorStopped(Exception):
    """The actor stopped before it could handle the message or answer it."""


def handler(fn: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
    """Marks an ``async def`` method as the handler of the message type its first parameter is
    annotated with::

        class Counter(Actor):
            @handler
            async def add(self, msg: Add) -> int: ...
    """
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"@handler needs an 'async def' method, got {fn.__qualname__}")
    fn.__flowtrain_handler__ = True  # type: ignore[attr-defined]
    return fn


@dataclass(slots=True)
class Envelope:
    """A message in a mailbox and where its reply goes (None for fire-and-forget)."""

    message: Any
    reply: asyncio.Future[Any] | concurrent.futures.Future[Any] | None = None


def _resolve(reply: asyncio.Future[Any] | concurrent.futures.Future[Any] | None,
             value: Any = None, error: BaseException | None = None) -> None:
    if reply is None or reply.done():
        return
    if isinstance(reply, asyncio.Future):
        # Only the loop that owns an asyncio future may complete it.
        loop = reply.get_loop()
        if asyncio._get_running_loop() is loop:
            _set_async(reply, value, error)
        elif error is not None:
            loop.call_soon_threadsafe(_set_async, reply, None, error)
        else:
            loop.call_soon_threadsafe(_set_async, reply, value, None)
    elif error is not None:
        reply.set_exception(error)
    else:
        reply.set_result(value)


def _set_async(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class RuntimeHandle(Protocol):
    """What actors and their references use of the rank's runtime
    (``flowtrain.runtime.system.Runtime``, which builds on this module)."""

    def on_loop_thread(self) -> bool: ...

    def raise_if_failed(self) -> None: ...

    # a coroutine function, not any awaitable: the call is handed to the loop's thread
    def call(self, fn: Callable[..., Coroutine[Any, Any, T]], *args: Any,
             timeout: float = 60.0) -> T: ...

    def spawn(self, actor: Actor, name: str | None = None, *,
              mailbox_size: int | None = None) -> ActorRef[Any]: ...

    def lookup(self, name: str) -> ActorRef[Any]: ...

    def stop_actor(self, name: str, timeout: float = 10.0) -> None: ...

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None: ...


class Actor:
    """Base class of every actor. Subclasses define ``@handler`` methods; the runtime runs
    each actor as one task that handles its messages one at a time, in mailbox order.

    Override ``on_start``/``on_stop`` for setup and teardown on the loop. Inside a handler,
    ``self.ref`` is the actor's own reference and ``self.runtime`` the rank's runtime.
    """

    mailbox_size: ClassVar[int] = DEFAULT_MAILBOX_SIZE
    _handler_table: ClassVar[dict[type, str] | None] = None

    name: str
    runtime: RuntimeHandle
    ref: ActorRef[Any]

    async def on_start(self) -> None:
        """Runs on the loop before the first message."""

    async def on_stop(self) -> None:
        """Runs on the loop after the last message, on a clean stop or a failure."""

    @classmethod
    def handled_types(cls) -> dict[type, str]:
        """Message type -> handler method name, built once per class from the annotations."""
        table = cls.__dict__.get("_handler_table")
        if table is not None:
            return table
        table = {}
        for klass in reversed(cls.__mro__):
            for attr, fn in vars(klass).items():
                if not getattr(fn, "__flowtrain_handler__", False):
                    continue
                params = list(inspect.signature(fn).parameters)
                if len(params) != 2:
                    raise TypeError(f"handler {klass.__name__}.{attr} must take (self, message)")
                hints = typing.get_type_hints(fn)
                message_type = hints.get(params[1])
                if not isinstance(message_type, type):
                    raise TypeError(f"handler {klass.__name__}.{attr}: annotate its message "
                                    f"parameter with a class, got {message_type!r}")
                table[message_type] = attr
        cls._handler_table = table
        return table

    def _handler_for(self, message: Any) -> Handler:
        table = self.handled_types()
        for klass in type(message).__mro__:
            name = table.get(klass)
            if name is not None:
                return getattr(self, name)
        known = ", ".join(sorted(t.__name__ for t in table)) or "nothing"
        raise TypeError(f"actor {getattr(self, 'name', type(self).__name__)!r} has no handler for "
                        f"{type(message).__name__}; it handles {known}")


class ActorRef(Generic[R]):
    """How code reaches an actor. ``send`` is fire-and-forget, ``ask`` awaits the handler's
    return value. The ``*_from_thread`` forms are for the training loop, autograd hooks and
    any other thread that is not the rank's event loop; they block instead of awaiting."""

    __slots__ = ("name", "_actor", "_mailbox", "_runtime")

    def __init__(self, name: str, actor: Actor, mailbox: Mailbox,
                 runtime: RuntimeHandle) -> None:
        self.name = name
        self._actor = actor
        self._mailbox = mailbox
        self._runtime = runtime

    def __repr__(self) -> str:
        return f"ActorRef({self.name!r}, {type(self._actor).__name__})"

    def _check(self, message: Any) -> None:
        # Fail at the sender, where the mistake is, not inside the actor.
        self._actor._handler_for(message)
        self._runtime.raise_if_failed()

    def _check_thread(self, on_loop: bool) -> None:
        if self._runtime.on_loop_thread() != on_loop:
            where = "the rank's event loop" if on_loop else "a thread other than the event loop"
            use = "await ref.send/ask" if not on_loop else "ref.send_from_thread/ask_from_thread"
            raise RuntimeError(f"this call to actor {self.name!r} must come from {where}; "
                               f"use {use}")

    async def send(self, message: Any, *, timeout: float | None = DEFAULT_SEND_TIMEOUT) -> None:
        """Queues the message, awaiting room while the mailbox is full (back-pressure)."""
        self._check(message)
        await self._mailbox.put(Envelope(message), timeout)

    def send_nowait(self, message: Any) -> None:
        """Queues the message or raises MailboxFull at once. On the loop only."""
        self._check(message)
        self._check_thread(on_loop=True)
        self._mailbox.put_nowait(Envelope(message))

    async def ask(self, message: Any, *, timeout: float | None = DEFAULT_ASK_TIMEOUT) -> Any:
        """Sends the message and returns what its handler returns (or raises what it raised,
        as ActorFailed)."""
        self._check(message)
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        await self._mailbox.put(Envelope(message, reply), timeout)
        try:
            return await asyncio.wait_for(reply, timeout)
        except TimeoutError:
            raise TimeoutError(f"actor {self.name!r} did not answer {type(message).__name__} "
                               f"within {timeout} s") from None

    def send_from_thread(self, message: Any, *,
                         timeout: float | None = DEFAULT_SEND_TIMEOUT) -> None:
        """Queues the message from another thread, blocking while the mailbox is full."""
        self._check(message)
        self._check_thread(on_loop=False)
        self._mailbox.put_threadsafe(Envelope(message), timeout)

    def ask_from_thread(self, message: Any, *,
                        timeout: float | None = DEFAULT_ASK_TIMEOUT) -> Any:
        """``ask`` for code that runs on another thread: blocks until the reply."""
        self._check(message)
        self._check_thread(on_loop=False)
        reply: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._mailbox.put_threadsafe(Envelope(message, reply), timeout)
        try:
            return reply.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"actor {self.name!r} did not answer {type(message).__name__} "
                               f"within {timeout} s") from None


async def run_actor(actor: Actor, mailbox: Mailbox, busy: dict[str, str]) -> None:
    """The actor's task: start, handle messages until the mailbox closes, stop. A handler's
    exception ends the task as ActorFailed (the asker gets it too); the runtime supervises."""
    await actor.on_start()
    current: Envelope | None = None
    try:
        while True:
            try:
                current = await mailbox.get()
            except MailboxClosed:
                return
            message = current.message
            busy[actor.name] = type(message).__name__
            try:
                result = await actor._handler_for(message)(message)
            except Exception as exc:
                failure = ActorFailed(actor.name, message, exc)
                failure.__cause__ = exc
                _resolve(current.reply, error=failure)
                raise failure from exc
            else:
                _resolve(current.reply, value=result)
            finally:
                busy.pop(actor.name, None)
            current = None
    finally:
        mailbox.close()
        # Nobody will answer what is still queued: release the askers now rather than at
        # their timeouts.
        stopped = ActorStopped(f"actor {actor.name!r} stopped before handling the message")
        for envelope in mailbox.drain():
            _resolve(envelope.reply, error=stopped)
        # on_stop runs even when the task is being cancelled, but may not hold shutdown forever.
        with anyio.CancelScope(shield=True), anyio.move_on_after(ON_STOP_TIMEOUT):
            await actor.on_stop()

