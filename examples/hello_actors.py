"""Ranks whose actors greet each other over the control plane and sum a tensor over the data
channel (gloo on CPUs, NCCL on GPUs).

    flowtrain launch --nproc-per-node 2 examples/hello_actors.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowtrain import comm
from flowtrain.actors import Actor, current_rank, handler, message


@message  # registered: it may cross ranks over the control plane
@dataclass(frozen=True)
class Greeting:
    from_rank: int
    text: str


@dataclass(frozen=True)
class SumOverRanks:
    value: float


class Greeter(Actor):
    """Answers greetings from other ranks and remembers them."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.received: list[Greeting] = []

    @handler
    async def greet(self, msg: Greeting) -> str:
        self.received.append(msg)
        return f"rank {self.rank} read {msg.text!r}"


class Reducer(Actor):
    """Sums a value over all ranks with an all-reduce awaited on the event loop."""

    @handler
    async def reduce(self, msg: SumOverRanks) -> float:
        tensor = torch.tensor([msg.value], dtype=torch.float64)
        await comm.all_reduce(tensor)
        return float(tensor.item())


def main() -> None:
    rank = current_rank()
    me, world = rank.env.rank, rank.env.world_size
    backend = comm.init_distributed()
    greeter = Greeter(me)
    rank.runtime.spawn(greeter, "greeter")
    reducer = rank.runtime.spawn(Reducer(), "reducer")
    rank.barrier("actors-ready")  # every rank's greeter exists before anyone greets

    peer = (me + 1) % world
    reply = rank.remote(peer, "greeter").ask_from_thread(Greeting(me, f"hello from rank {me}"))
    print(f"rank {me}: greeted rank {peer} over the control plane; it replied: {reply}")

    total = reducer.ask_from_thread(SumOverRanks(float(me + 1)))
    expected = world * (world + 1) / 2
    print(f"rank {me}: all-reduce over {backend} of (rank + 1) on {world} ranks = {total:g} "
          f"(expected {expected:g})")
    if total != expected:
        raise SystemExit(f"rank {me}: all-reduce gave {total}, expected {expected}")

    rank.barrier("greetings-done")
    senders = sorted(g.from_rank for g in greeter.received)
    print(f"rank {me}: received greetings from ranks {senders}")


if __name__ == "__main__":
    main()
