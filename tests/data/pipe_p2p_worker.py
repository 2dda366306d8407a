"""Worker for tests/pipe/test_pipeline.py: the pipeline engine's point-to-point streams
(flowtrain.pipe.p2p's Sender and Receiver) between two plain processes, no launcher, so
that one of them may die and the other report it. Rank 0 plays stage 0, rank 1 stage 1.

argv: CASE RANK PORT OUT — rank 1 (and for "dead_receiver" rank 0) writes OUT as JSON.
  shapes         activations 0 -> 1 and gradients 1 -> 0 at once, the shapes, dtypes and
                 tensor counts changing between messages (and staying the same)
  timeout        rank 0 never sends; rank 1's receive has a 1 s timeout
  dead_sender    rank 0 sends micro-batch 0, then dies; rank 1 waits for micro-batch 1
  dead_receiver  rank 1 dies without receiving; rank 0 sends and drains its sends
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist

from flowtrain.pipe import p2p

ACT, GRAD = (p2p.TAG_ACT, p2p.TAG_ACT_DATA), (p2p.TAG_GRAD, p2p.TAG_GRAD_DATA)


def messages(seed: int) -> list[list[torch.Tensor]]:
    """The stream's messages: shapes repeat, shrink, grow, change dtype and tensor count."""
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(4, 8, generator=g)],
            [torch.randn(4, 8, generator=g)],
            [torch.randn(3, 8, generator=g)],
            [torch.randn(3, 8, generator=g)],
            [torch.randn(3, 8, generator=g), torch.arange(5)],
            [torch.randn(3, 8, generator=g), torch.arange(5) * 2],
            [],
            [torch.randn(2, 2, 2, generator=g).to(torch.bfloat16)],
            [torch.randn(6, 8, generator=g)],
            [torch.randn(6, 8, generator=g)]]


def what(kind: str, mb: int, peer: int) -> str:
    direction = "from" if kind.startswith("recv") else "to"
    data = "activations" if kind.endswith("act") else "gradients"
    return f"{data} of micro-batch {mb} {direction} stage {peer} (rank {peer})"


def shapes(rank: int) -> dict[str, Any]:
    peer = 1 - rank
    out_tags, in_tags = (ACT, GRAD) if rank == 0 else (GRAD, ACT)
    out_kind, in_kind = ("act", "grad") if rank == 0 else ("grad", "act")
    sender = p2p.Sender(None, torch.device("cpu"), 30.0, "test-send")
    receiver = p2p.Receiver(None, peer, in_tags, torch.device("cpu"), 30.0, "test-recv")
    sent, expected = messages(10 + rank), messages(10 + peer)
    futures = [receiver.expect(1, mb, what(f"recv_{in_kind}", mb, peer))
               for mb in range(len(expected))]
    for mb, tensors in enumerate(sent):
        sender.send(tuple(tensors), peer, out_tags, mb, what(f"send_{out_kind}", mb, peer))
    sender.drain().result(timeout=60)
    mismatches = []
    for mb, (future, want) in enumerate(zip(futures, expected)):
        got = future.result(timeout=60)
        if len(got) != len(want) or not all(
                a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                for a, b in zip(got, want)):
            mismatches.append(mb)
    receiver.close()
    sender.close()
    dist.barrier()  # neither leaves while the other may still be reading
    return {"received": len(futures), "mismatches": mismatches}


def failure(fn: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return {"error_type": type(exc).__name__, "error": str(exc),
                "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def main() -> None:
    case, rank, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    result: dict[str, Any] = {}
    try:
        if case == "shapes":
            result = shapes(rank)
        elif case == "timeout":
            if rank == 0:
                time.sleep(4)
                os._exit(0)
            receiver = p2p.Receiver(None, 0, ACT, torch.device("cpu"), 1.0, "test-recv")
            future = receiver.expect(1, 3, what("recv_act", 3, 0))
            result = failure(lambda: future.result(timeout=30))
        elif case == "dead_sender":
            if rank == 0:
                sender = p2p.Sender(None, torch.device("cpu"), 30.0, "test-send")
                sender.send((torch.ones(4),), 1, ACT, 0, what("send_act", 0, 1))
                sender.drain().result(timeout=30)
                time.sleep(0.5)
                os._exit(1)
            receiver = p2p.Receiver(None, 0, ACT, torch.device("cpu"), 60.0, "test-recv")
            first = receiver.expect(1, 0, what("recv_act", 0, 0))
            second = receiver.expect(1, 1, what("recv_act", 1, 0))
            result = {"first": first.result(timeout=30).__len__()}
            result.update(failure(lambda: second.result(timeout=60)))
        elif case == "dead_receiver":
            if rank == 1:
                time.sleep(0.5)
                os._exit(1)
            time.sleep(1.5)
            sender = p2p.Sender(None, torch.device("cpu"), 60.0, "test-send")

            def send() -> None:
                sender.send((torch.ones(4),), 1, ACT, 0, what("send_act", 0, 1))
                sender.drain().result(timeout=60)

            result = failure(send)
        else:
            raise ValueError(f"unknown case {case!r}")
    except Exception:
        result = {"crash": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(result, f)
    os._exit(0)  # no teardown handshake with a peer that may be gone


if __name__ == "__main__":
    main()
