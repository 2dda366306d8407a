"""A bounded FIFO mailbox fed from the rank's event loop (awaiting when full) and from other
threads (blocking when full), read by one actor task on the loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any


class MailboxFull(Exception):
    """The mailbox stayed full for as long as the sender was willing to wait."""


class MailboxClosed(Exception):
    """The mailbox's actor has stopped (or is stopping) and takes no more messages."""


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Mailbox:
    """Bounded FIFO of envelopes.

    Ordering: items leave in the order they were accepted, so messages of one sender (which
    waits for each send to be accepted before the next) arrive in the order sent.
    Back-pressure: a full mailbox makes loop senders await and thread senders block, each with a
    timeout, instead of growing without bound.
    """

    def __init__(self, capacity: int, owner: str) -> None:
        if capacity < 1:
            raise ValueError(f"mailbox capacity of {owner!r} must be at least 1, got {capacity}")
        self.capacity = capacity
        self.owner = owner
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)  # threads waiting for room
        self._loop: asyncio.AbstractEventLoop | None = None
        self._getter: asyncio.Future[None] | None = None
        self._loop_putters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Attaches the mailbox to the loop its actor runs on."""
        self._loop = loop

    def __len__(self) -> int:
        return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- senders on the loop ------------------------------------------------------------------

    def put_nowait(self, item: Any) -> None:
        """Accepts the item or raises MailboxFull at once. Call on the loop's thread."""
        with self._lock:
            self._accept(item)
            getter, self._getter = self._getter, None
        if getter is not None:
            _wake(getter)

    async def put(self, item: Any, timeout: float | None) -> None:
        """Accepts the item, awaiting room for up to ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                self.put_nowait(item)
                return
            except MailboxFull:
                pass
            assert self._loop is not None
            waiter = self._loop.create_future()
            self._loop_putters.append(waiter)
            remaining = None if deadline is None else deadline - time.monotonic()
            try:
                if remaining is not None and remaining <= 0:
                    raise TimeoutError
                await asyncio.wait_for(waiter, remaining)
            except TimeoutError:
                raise MailboxFull(
                    f"mailbox of actor {self.owner!r} stayed full ({self.capacity} messages) for "
                    f"{timeout:.3g} s; the actor is not keeping up with its senders"
                ) from None
            finally:
                if waiter in self._loop_putters:
                    self._loop_putters.remove(waiter)

    # -- senders on other threads -------------------------------------------------------------

    def put_threadsafe(self, item: Any, timeout: float | None) -> None:
        """Accepts the item from a thread other than the loop's, blocking while full."""
        with self._space:
            deadline = None if timeout is None else time.monotonic() + timeout
            while len(self._items) >= self.capacity and not self._closed:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise MailboxFull(
                        f"mailbox of actor {self.owner!r} stayed full ({self.capacity} messages) "
                        f"for {timeout:.3g} s; the actor is not keeping up with its senders"
                    )
                self._space.wait(remaining)
            self._accept(item)
            getter, self._getter = self._getter, None
        if getter is not None:
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(_wake, getter)
            except RuntimeError:  # the loop closed under us
                raise MailboxClosed(f"actor {self.owner!r} has stopped") from None

    def _accept(self, item: Any) -> None:
        # Caller holds the lock.
        if self._closed:
            raise MailboxClosed(f"actor {self.owner!r} has stopped and takes no more messages")
        if len(self._items) >= self.capacity:
            raise MailboxFull(f"mailbox of actor {self.owner!r} is full ({self.capacity} messages)")
        self._items.append(item)

    # -- the reader ----------------------------------------------------------------------------

    async def get(self) -> Any:
        """The next item; raises MailboxClosed once closed and drained. One reader only."""
        while True:
            with self._lock:
                if self._items:
                    item = self._items.popleft()
                    self._space.notify()
                    putter = self._loop_putters.popleft() if self._loop_putters else None
                    if putter is not None:
                        _wake(putter)
                    return item
                if self._closed:
                    raise MailboxClosed(f"actor {self.owner!r} has stopped")
                assert self._loop is not None
                waiter = self._getter = self._loop.create_future()
            try:
                await waiter
            finally:
                with self._lock:
                    if self._getter is waiter:
                        self._getter = None

    def close(self) -> None:
        """Refuses further items and wakes every waiter; the reader still drains what was
        accepted. Safe from any thread."""
        with self._lock:
            self._closed = True
            self._space.notify_all()
            getter, self._getter = self._getter, None
            putters = list(self._loop_putters)
        for future in ([getter] if getter else []) + putters:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(_wake, future)

    def drain(self) -> list[Any]:
        """Removes and returns everything still queued (used when an actor dies)."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._space.notify_all()
        return items
