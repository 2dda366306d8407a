"""The public actor API: write a custom stage as an ``Actor`` with ``@handler`` methods, spawn
it on the rank's runtime, and talk to it (or to actors on other ranks) through references.

    from dataclasses import dataclass
    from flowtrain.actors import Actor, handler, current_rank

    @dataclass(frozen=True)
    class Add:
        n: int

    class Counter(Actor):
        def __init__(self) -> None:
            self.total = 0

        @handler
        async def add(self, msg: Add) -> int:
            self.total += msg.n
            return self.total

    rank = current_rank()
    counter = rank.runtime.spawn(Counter(), "counter")
    counter.ask_from_thread(Add(2))  # -> 2
"""

from flowtrain.errors import RankAborted
from flowtrain.runtime.actor import Actor, ActorFailed, ActorRef, ActorStopped, handler
from flowtrain.runtime.mailbox import MailboxClosed, MailboxFull
from flowtrain.runtime.rank import (
    Rank,
    RemoteActorRef,
    RemoteError,
    current_rank,
    shutdown_rank,
    start_rank,
)
from flowtrain.runtime.system import Failure, Runtime, RuntimeFailed
from flowtrain.runtime.wire import message

__all__ = [
    "Actor",
    "ActorFailed",
    "ActorRef",
    "ActorStopped",
    "Failure",
    "MailboxClosed",
    "MailboxFull",
    "Rank",
    "RankAborted",
    "RemoteActorRef",
    "RemoteError",
    "Runtime",
    "RuntimeFailed",
    "current_rank",
    "handler",
    "message",
    "shutdown_rank",
    "start_rank",
]
