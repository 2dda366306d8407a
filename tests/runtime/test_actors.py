"""The actor runtime: ordering, ask, back-pressure, supervision, shutdown, thread rules."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest

from flowtrain.actors import (
    Actor,
    ActorFailed,
    ActorStopped,
    Failure,
    MailboxFull,
    Runtime,
    RuntimeFailed,
    handler,
)

pytestmark = pytest.mark.timeout(30)


@dataclass(frozen=True)
class Item:
    sender: str
    seq: int


@dataclass(frozen=True)
class Read:
    pass


@dataclass(frozen=True)
class Boom:
    text: str


@dataclass(frozen=True)
class Hold:
    pass


class Recorder(Actor):
    def __init__(self) -> None:
        self.seen: list[Item] = []
        self.stopped = False

    @handler
    async def item(self, msg: Item) -> int:
        self.seen.append(msg)
        return len(self.seen)

    @handler
    async def read(self, msg: Read) -> list[Item]:
        return list(self.seen)

    @handler
    async def boom(self, msg: Boom) -> None:
        raise ValueError(msg.text)

    async def on_stop(self) -> None:
        self.stopped = True


class Gate(Actor):
    """Blocks on each Hold until the test opens the gate."""

    mailbox_size = 2

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.handled = 0

    @handler
    async def hold(self, msg: Hold) -> int:
        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        self.handled += 1
        return self.handled


@pytest.fixture
def runtime():
    rt = Runtime("test").start()
    yield rt
    rt.stop()


def test_ask_returns_handler_value_from_thread_and_loop(runtime: Runtime) -> None:
    ref = runtime.spawn(Recorder(), "rec")
    assert ref.ask_from_thread(Item("main", 0)) == 1

    async def from_loop() -> int:
        return await ref.ask(Item("loop", 0))

    assert runtime.call(from_loop) == 2
    assert [m.sender for m in ref.ask_from_thread(Read())] == ["main", "loop"]


def test_per_sender_order_with_threads_and_loop_tasks(runtime: Runtime) -> None:
    recorder = Recorder()
    ref = runtime.spawn(recorder, "rec", mailbox_size=8)  # small: senders hit back-pressure
    n = 400

    def thread_sender(name: str) -> None:
        for i in range(n):
            ref.send_from_thread(Item(name, i))

    async def loop_senders() -> None:
        async def one(name: str) -> None:
            for i in range(n):
                await ref.send(Item(name, i))

        await asyncio.gather(one("task-a"), one("task-b"))

    threads = [threading.Thread(target=thread_sender, args=(f"thread-{k}",)) for k in range(3)]
    for t in threads:
        t.start()
    runtime.call(loop_senders)
    for t in threads:
        t.join(10)
    seen = ref.ask_from_thread(Read())
    assert len(seen) == 5 * n
    by_sender: dict[str, list[int]] = {}
    for m in seen:
        by_sender.setdefault(m.sender, []).append(m.seq)
    assert set(by_sender) == {"thread-0", "thread-1", "thread-2", "task-a", "task-b"}
    for sender, seqs in by_sender.items():
        assert seqs == list(range(n)), f"{sender} arrived out of order"


def test_full_mailbox_pushes_back_on_thread_and_loop_senders(runtime: Runtime) -> None:
    gate = Gate()
    ref = runtime.spawn(gate, "gate")
    ref.send_from_thread(Hold())  # taken by the handler, which now blocks
    deadline = time.monotonic() + 5
    while not runtime.busy() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert runtime.busy() == {"gate": "Hold"}
    ref.send_from_thread(Hold())
    ref.send_from_thread(Hold())  # mailbox (2) now full

    started = time.monotonic()
    with pytest.raises(MailboxFull, match="gate"):
        ref.send_from_thread(Hold(), timeout=0.3)
    assert time.monotonic() - started >= 0.29

    async def try_nowait() -> None:
        ref.send_nowait(Hold())

    with pytest.raises(MailboxFull):
        runtime.call(try_nowait)

    # A loop sender waits for room and gets in once the actor drains its mailbox.
    async def blocked_send() -> float:
        t0 = time.monotonic()
        await ref.send(Hold(), timeout=5)
        return time.monotonic() - t0

    def open_gate_later() -> None:
        time.sleep(0.3)
        gate.gate.set()

    threading.Thread(target=open_gate_later).start()
    waited = runtime.call(blocked_send)
    assert waited >= 0.25
    assert ref.ask_from_thread(Hold()) == 5  # 1 + 2 queued + 1 blocked + this one


def test_handler_exception_reaches_supervisor_and_stops_the_rank() -> None:
    failures: list[Failure] = []

    async def on_failure(failure: Failure) -> None:
        failures.append(failure)

    runtime = Runtime("sup", on_failure=on_failure).start()
    try:
        bystander = Recorder()
        runtime.spawn(bystander, "bystander")
        ref = runtime.spawn(Recorder(), "faulty")
        with pytest.raises(ActorFailed, match="faulty.*ValueError: kaput") as info:
            ref.ask_from_thread(Boom("kaput"))
        assert isinstance(info.value.cause, ValueError)
        deadline = time.monotonic() + 5
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(failures) == 1
        failure = failures[0]
        assert failure.actor == "faulty"
        assert isinstance(failure.exception, ValueError)
        assert 'raise ValueError(msg.text)' in failure.traceback
        # The whole rank stops: the bystander was cancelled and ran on_stop.
        while runtime.actor_names() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runtime.actor_names() == []
        assert bystander.stopped
        with pytest.raises(RuntimeFailed, match="faulty"):
            ref.send_from_thread(Item("late", 0))
    finally:
        runtime.stop()


def test_fire_and_forget_failure_also_reaches_supervisor() -> None:
    failures: list[Failure] = []

    async def on_failure(failure: Failure) -> None:
        failures.append(failure)

    runtime = Runtime("sup2", on_failure=on_failure).start()
    try:
        runtime.spawn(Recorder(), "faulty").send_from_thread(Boom("silent"))
        deadline = time.monotonic() + 5
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [str(f.exception) for f in failures] == ["silent"]
    finally:
        runtime.stop()


def test_stop_drains_mailboxes_and_leaks_no_threads_or_tasks() -> None:
    before = set(threading.enumerate())
    runtime = Runtime("clean").start()
    recorder = Recorder()
    ref = runtime.spawn(recorder, "rec")
    for i in range(100):
        ref.send_from_thread(Item("main", i))
    runtime.stop()
    assert [m.seq for m in recorder.seen] == list(range(100))  # queued work was handled
    assert recorder.stopped
    assert runtime.leaked_tasks == []
    assert set(threading.enumerate()) == before
    with pytest.raises(RuntimeError, match="not running"):
        runtime.spawn(Recorder())


def test_pending_ask_is_released_when_actor_is_cancelled() -> None:
    runtime = Runtime("cancel", stop_timeout=0.3).start()
    gate = Gate()
    ref = runtime.spawn(gate, "gate")
    ref.send_from_thread(Hold())  # blocks forever: the gate never opens
    result: list[BaseException] = []

    def asker() -> None:
        try:
            ref.ask_from_thread(Hold(), timeout=10)
        except BaseException as exc:  # noqa: BLE001
            result.append(exc)

    t = threading.Thread(target=asker)
    t.start()
    time.sleep(0.1)
    started = time.monotonic()
    runtime.stop()
    t.join(5)
    assert time.monotonic() - started < 3
    assert len(result) == 1 and isinstance(result[0], ActorStopped)


def test_wrong_message_type_fails_at_the_sender(runtime: Runtime) -> None:
    ref = runtime.spawn(Recorder(), "rec")
    with pytest.raises(TypeError, match="no handler for Hold; it handles Boom, Item, Read"):
        ref.send_from_thread(Hold())


def test_thread_rules_are_enforced(runtime: Runtime) -> None:
    ref = runtime.spawn(Recorder(), "rec")
    with pytest.raises(RuntimeError, match="must come from the rank's event loop"):
        ref.send_nowait(Item("main", 0))

    async def wrong() -> None:
        ref.send_from_thread(Item("loop", 0))

    with pytest.raises(RuntimeError, match="a thread other than the event loop"):
        runtime.call(wrong)


def test_bad_handlers_are_rejected_at_spawn(runtime: Runtime) -> None:
    class NoAnnotation(Actor):
        @handler
        async def on(self, msg) -> None:  # type: ignore[no-untyped-def]
            pass

    with pytest.raises(TypeError, match="annotate its message parameter"):
        runtime.spawn(NoAnnotation())
    with pytest.raises(TypeError, match="async def"):
        handler(lambda self, m: None)  # type: ignore[arg-type]


def test_duplicate_names_are_rejected(runtime: Runtime) -> None:
    runtime.spawn(Recorder(), "same")
    with pytest.raises(ValueError, match="already runs"):
        runtime.spawn(Recorder(), "same")
    assert runtime.lookup("same").name == "same"
    with pytest.raises(KeyError, match="running: same"):
        runtime.lookup("other")
