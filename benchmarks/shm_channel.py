"""The shared-memory data channel's collectives against each other and against gloo, 2 ranks
on this machine, alternating within each repetition; prints medians and ratios.

    python benchmarks/shm_channel.py [--mib 9.2,30.5] [--reps 21] [--nproc 2]

all-reduce (sum, then x0.5 as the engine scales): gloo, the channel's slot path (copy into
the slot, every rank sums the whole tensor) and its arena path (gradients allocated in the
arena: no copy, each rank sums its 1/world share and copies the others').
all-gather (ZeRO's after-step parameter gather): gloo all_gather_into_tensor and the channel.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flowtrain.shm import ShmChannel  # noqa: E402


def _worker(rank: int, world: int, store: str, path: str, numels: list[int], reps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    largest = max(numels) * 4 + 64
    if rank == 0:
        channel = ShmChannel(path, rank=0, world_size=world, slot_bytes=largest, create=True,
                             timeout=120, arena_bytes=largest)
    dist.barrier()
    if rank != 0:
        channel = ShmChannel(path, rank=rank, world_size=world, slot_bytes=largest,
                             create=False, timeout=120, arena_bytes=largest)
    dist.barrier()
    if rank == 0:
        os.unlink(path)
    for n in numels:
        arena = channel.arena_allocator()(n, torch.float32)
        assert arena is not None
        plain = torch.zeros(n)
        flat = torch.zeros(n - n % world)
        shard = flat.narrow(0, rank * (flat.numel() // world), flat.numel() // world)
        times: dict[str, list[float]] = {k: [] for k in
                                         ("reduce gloo", "reduce slot", "reduce arena",
                                          "gather gloo", "gather shm")}
        for _ in range(reps):
            for name in times:
                dist.barrier()
                start = time.perf_counter()
                if name == "reduce gloo":
                    dist.all_reduce(plain)
                    plain.mul_(0.5)
                elif name == "reduce slot":
                    channel.all_reduce_async(plain, scale=0.5).result()
                elif name == "reduce arena":
                    channel.all_reduce_async(arena, scale=0.5).result()
                    channel.quiesce()
                elif name == "gather gloo":
                    dist.all_gather_into_tensor(flat, shard)
                else:
                    channel.all_gather_async(flat, shard).result()
                times[name].append(time.perf_counter() - start)
        if rank == 0:
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            rng = {k: f"{min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}" for k, v in times.items()}
            print(f"\n{n * 4 / 2**20:.1f} MiB fp32, {world} ranks, {reps} alternating reps: "
                  "median ms (range)")
            for k in times:
                print(f"  {k:13s} {med[k]:8.2f}  ({rng[k]})")
            print(f"  all-reduce: slot / arena = {med['reduce slot'] / med['reduce arena']:.2f}x,"
                  f" gloo / arena = {med['reduce gloo'] / med['reduce arena']:.2f}x")
            print(f"  all-gather: gloo / shm = {med['gather gloo'] / med['gather shm']:.2f}x")
    channel.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", default="9.2,30.5", help="tensor sizes in MiB (fp32)")
    parser.add_argument("--reps", type=int, default=21, help="alternating repetitions")
    parser.add_argument("--nproc", type=int, default=2, help="ranks")
    args = parser.parse_args()
    numels = [int(float(m) * 2**20 / 4) for m in args.mib.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        path = f"/dev/shm/flowtrain-bench-{os.getpid()}"
        mp.spawn(_worker, args=(args.nproc, str(Path(tmp) / "store"), path, numels, args.reps),
                 nprocs=args.nproc)


if __name__ == "__main__":
    main()
