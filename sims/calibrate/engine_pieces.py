"""The engine's own pieces, timed for ``flowtrain calibrate``: what a real step spends its time
on, piece by piece, rather than peak kernel rates.

A forward or backward is a chain of modules, each a small op plus Python, autograd and
(backward) the engine's gradient bucket hook; backward runs at a lower FLOP rate than forward;
the data-parallel reduce goes over the engine's shared-memory channel, whose summing is CPU
work taken from compute; pipeline sends are gloo point-to-point messages of a header and a
tensor; the fused Adam kernel is called once per tensor; and ranks that share a host's cores
slow each other down. Each is measured here by running that piece of the engine (``nn.Linear``
with ``GradBuckets``, the ``ShmChannel``, ``cuda_numba``'s Adam, the pipeline's header + tensor
send); ``sims.calibrate.fits.fit_engine`` fits them into the profile's ``engine`` section
(``sims.hardware.EngineCosts``), since a matmul-only profile misses all of them.

The measured shapes (``sims.calibrate.settings``) are a calibration set of their own: none is a
shape of the benchmark models (``benchmarks/sim_accuracy.py``), so the benchmark tests the fit
rather than repeating it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sims.calibrate.settings import CONCURRENCY_SHAPE
from sims.calibrate.timing import agreed_repeats, least_disturbed, pick, repeat, sample

# elements of the three float32 tensors the memory-bound concurrency test streams (far past
# the caches)
STREAM_NUMEL = 1 << 23
ROUNDS = 3  # each measurement is taken in this many separate windows


COLD_BYTES = 4 << 20  # a layer's weights come from past the 1-2 MiB L2 caches, as in a model


class LinearPass:
    """One layer as the engine trains it: an ``nn.Linear`` alone (the activation or residual add
    that follows a matmul in a model is priced by its own class, ``sims.calibrate.ops``, from
    the model's op census). Its input needs a gradient (an inner layer), and its gradients land in
    flat bucket views through the engine's post-accumulate hooks
    (``flowtrain.engine.buckets.GradBuckets``), counting arrivals as on a reducing step.

    Each call runs the next of enough copies of the layer to hold COLD_BYTES of weights: in a
    model a layer's weights were last touched a whole pass ago, not by the previous call, and
    timing one layer over and over would keep them in the core's cache and time the op faster
    than it runs inside a model."""

    def __init__(self, rows: int, n_in: int, n_out: int) -> None:
        from flowtrain.engine.buckets import GradBuckets
        from flowtrain.plan import plan_buckets

        self.flops = 2.0 * rows * n_in * n_out
        copies = max(1, min(16, -(-COLD_BYTES // (4 * n_in * n_out))))
        self.layers = [torch.nn.Linear(n_in, n_out) for _ in range(copies)]
        self.layer = self.layers[0]
        self.x = torch.randn(rows, n_in, requires_grad=True)
        self.grad_out = torch.randn(rows, n_out)
        self._next = 0
        params = [p for layer in self.layers for p in layer.parameters()]
        specs = [(f"{i}.{name}", tuple(p.shape), "float32", 4)
                 for i, layer in enumerate(self.layers) for name, p in layer.named_parameters()]
        self.buckets = GradBuckets(params, plan_buckets(specs, bucket_numel=1 << 30))
        self.buckets.install_hooks()
        self.buckets.on_bucket_ready = lambda _index: None

    def forward(self) -> torch.Tensor:
        self.layer = self.layers[self._next]
        self._next = (self._next + 1) % len(self.layers)
        return self.layer(self.x)

    def backward(self, y: torch.Tensor) -> None:
        self.buckets.reset_arrivals()
        y.backward(self.grad_out)
        self.x.grad = None

    def both(self) -> None:
        self.backward(self.forward())

    def close(self) -> None:
        self.buckets.remove_hooks()


def time_pass(shape: tuple[int, int, int], seconds: float) -> dict[str, float]:
    """Median forward and median backward of one shape, each pass timed on its own."""
    op = LinearPass(*shape)

    def once() -> tuple[float, float]:
        start = time.perf_counter()
        y = op.forward()
        middle = time.perf_counter()
        op.backward(y)
        return middle - start, time.perf_counter() - middle

    try:
        op.both()
        runs = sample(once, seconds, min_reps=5)
    finally:
        op.close()
    return {"flops": op.flops, "forward_s": pick([f for f, _ in runs], "median"),
            "backward_s": pick([b for _, b in runs], "median")}


def measure_passes(thread_counts: Sequence[int], shapes: Sequence[tuple[int, int, int]],
                   seconds_per_point: float, rounds: int = ROUNDS) -> list[dict[str, Any]]:
    """Forward and backward of each shape at each thread count (``flowtrain launch`` gives a
    rank cores // ranks threads, so these are the counts the launched ranks run with), each
    the least disturbed of ``rounds`` rounds over all of them."""
    previous = torch.get_num_threads()
    timed: dict[tuple[int, tuple[int, int, int]], list[dict[str, float]]] = {}
    try:
        for _ in range(rounds):
            for threads in sorted(set(thread_counts)):
                torch.set_num_threads(threads)
                for shape in shapes:
                    timed.setdefault((threads, shape), []).append(
                        time_pass(shape, seconds_per_point / rounds))
    finally:
        torch.set_num_threads(previous)
    return [{"threads": threads, "rows": rows, "in": n_in, "out": n_out,
             "flops": runs[0]["flops"], **least_disturbed(runs, ("forward_s", "backward_s")),
             "rounds": runs}
            for (threads, (rows, n_in, n_out)), runs in timed.items()]


def measure_optimizer(sets: Sequence[tuple[int, int]],
                      seconds_per_point: float) -> list[dict[str, Any]]:
    """The engine's fused Adam kernel (``cuda_numba.ops.adam_step``, what a config's Adam/AdamW
    runs) stepping ``count`` tensors of ``numel`` elements one after the other, one thread, as
    the engine steps a model's parameters (or ZeRO's bucket shards) one call each. The sets
    hold more state than the caches, so the bandwidth is DRAM's; many small tensors show the
    cost of a call."""
    from cuda_numba import ops

    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # numba follows torch's thread count at its first call
    records = []
    try:
        for count, numel in sets:
            state = [(torch.randn(numel), torch.randn(numel), torch.zeros(numel),
                      torch.zeros(numel)) for _ in range(count)]
            steps = iter(range(1, 1 << 30))

            def call(state: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
                     = state, steps: Any = steps) -> None:
                t = next(steps)
                for p, g, m, v in state:
                    ops.adam_step(p, g, m, v, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.0, step=t, adamw=True, bias_correction=True)

            # the median call of each round (what a step's optimizer takes), the least
            # disturbed round
            rounds = [repeat(call, seconds_per_point / ROUNDS, policy="median", min_reps=5)
                      for _ in range(ROUNDS)]
            records.append({"tensors": count, "numel": count * numel,
                            "seconds": pick(rounds, "min"), "rounds": rounds})
    finally:
        torch.set_num_threads(previous)
    return records


# ----------------------------------------------------------------------------- on the ranks

def open_channel(path: str, rank: int, ranks: int, slot_bytes: int, timeout_s: float,
                 group: Any) -> Any:
    """The engine's shared-memory channel among ``ranks`` calibration ranks: rank 0 creates the
    file, the others map it after a barrier, and it is unlinked once all have it."""
    from pathlib import Path

    from flowtrain.shm import ShmChannel

    channel = None
    if rank == 0:
        channel = ShmChannel(path, rank=0, world_size=ranks, slot_bytes=slot_bytes, create=True,
                             timeout=timeout_s)
    dist.barrier(group=group)
    if rank != 0:
        channel = ShmChannel(path, rank=rank, world_size=ranks, slot_bytes=slot_bytes,
                             create=False, timeout=timeout_s)
    dist.barrier(group=group)
    if rank == 0:
        Path(path).unlink(missing_ok=True)
    assert channel is not None
    return channel


def channel_call(channel: Any, op: str, ranks: int, nbytes: int,
                 timeout_s: float) -> Callable[[], None]:
    """One blocking channel collective on a float32 buffer of ``nbytes`` (the full buffer)."""
    full = torch.ones(nbytes // 4)
    if op == "all_reduce":
        return lambda: channel.all_reduce_async(full).result(timeout=timeout_s)
    shard = torch.empty(nbytes // 4 // ranks)
    return lambda: channel.reduce_scatter_async(full, shard).result(timeout=timeout_s)


def time_p2p(rank: int, group: Any, sizes: Sequence[int], trials: int, trial_seconds: float,
             timeout_s: float) -> list[dict[str, Any]]:
    """Ranks 0 and 1 (``group``) send each other a pipeline message (its header and one
    float32 tensor) back and forth through the pipeline engine's own streams
    (``flowtrain.pipe.p2p``'s sender thread, and a receiver thread with every receive
    queued ahead, as a stage's schedule queues them); one way is half the round trip."""
    import itertools

    from flowtrain.pipe import p2p as pipe

    peer = 1 - rank
    out_tags, in_tags = ((pipe.TAG_ACT, pipe.TAG_ACT_DATA),
                         (pipe.TAG_GRAD, pipe.TAG_GRAD_DATA))[::1 if rank == 0 else -1]
    cpu = torch.device("cpu")
    sender = pipe.Sender(None, cpu, timeout_s, "calibrate-p2p-send")
    receiver = pipe.Receiver(None, peer, in_tags, cpu, timeout_s, "calibrate-p2p-recv")
    numbers = itertools.count()  # message numbers, the same sequence on both ranks
    what = "calibration pipeline message"

    def round_trips(count: int, tensor: torch.Tensor) -> None:
        ks = [next(numbers) for _ in range(count)]
        arrivals = [receiver.expect(1, k, what) for k in ks]
        for k, arrived in zip(ks, arrivals):
            if rank == 0:
                sender.send((tensor,), peer, out_tags, k, what)
                arrived.result(timeout=timeout_s)
            else:
                arrived.result(timeout=timeout_s)
                sender.send((tensor,), peer, out_tags, k, what)
        sender.drain().result(timeout=timeout_s)

    records = []
    try:
        for nbytes in sizes:
            tensor = torch.ones(nbytes // 4)
            start = time.perf_counter()
            round_trips(1, tensor)
            # both ranks must run the same number of round trips: the larger proposal wins
            count = agreed_repeats(time.perf_counter() - start, trial_seconds, group, cap=64)
            times = []
            for _ in range(trials):
                dist.barrier(group=group)
                start = time.perf_counter()
                round_trips(count, tensor)
                times.append((time.perf_counter() - start) / count / 2)
            # each trial averages many round trips: the least disturbed one
            records.append({"bytes": nbytes, "seconds": pick(times, "min"), "trials": times})
    finally:
        receiver.close()
        sender.close()
    return records


def time_concurrency(rank: int, ranks: int, group: Any, window_s: float) -> dict[str, float]:
    """How much slower each rank works when ``ranks`` ranks work at once: rank 0 alone (the
    others wait at a barrier), then every rank together, for a compute-bound layer pass and
    for a memory-bound stream (an add over tensors far larger than the caches, like the
    optimizer, gradient zeroing or the channel's sums). The slowdown is the rate alone over
    the ranks' mean rate together; memory bandwidth is shared by every core, so the second can
    be far larger than the first."""
    op = LinearPass(*CONCURRENCY_SHAPE)
    a, b, c = torch.ones(STREAM_NUMEL), torch.ones(STREAM_NUMEL), torch.empty(STREAM_NUMEL)
    work: dict[str, Callable[[], object]] = {
        "compute": op.both, "memory": lambda: torch.add(a, b, out=c)}

    def rate(fn: Callable[[], object]) -> float:
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < window_s:
            fn()
            count += 1
        return count / (time.perf_counter() - start)

    out: dict[str, float] = {"ranks": ranks, "threads": torch.get_num_threads()}
    try:
        for name, fn in work.items():
            fn()
            slowdowns = []
            for _ in range(ROUNDS):  # a burst of other work in one window skews it either way
                dist.barrier(group=group)
                alone = rate(fn) if rank == 0 else 0.0
                dist.barrier(group=group)
                rates = torch.tensor([rate(fn), alone], dtype=torch.float64)
                dist.all_reduce(rates, group=group)
                slowdowns.append(float(rates[1]) / (float(rates[0]) / ranks))
            out[f"{name}_slowdown"] = pick(slowdowns, "median")
            out[f"{name}_rounds"] = slowdowns  # type: ignore[assignment]
    finally:
        op.close()
    return out


def background_interference(call: Callable[[], None], window_s: float, group: Any,
                            repeats: int) -> dict[str, float]:
    """Matmul rate alone, while a thread runs ``call`` back to back ``repeats`` times, then
    alone again: the compute lost per second of collective."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def matmul_rate(keep_going: Callable[[float], bool]) -> float:
        count, start = 0, time.perf_counter()
        while keep_going(time.perf_counter() - start):
            torch.mm(a, b)
            count += 1
        return count / (time.perf_counter() - start)

    dist.barrier(group=group)
    alone_before = matmul_rate(lambda t: t < window_s)
    dist.barrier(group=group)
    comm_times: list[float] = []

    def run_collectives() -> None:
        begin = time.perf_counter()
        for _ in range(repeats):
            call()
        comm_times.append((time.perf_counter() - begin) / repeats)

    thread = threading.Thread(target=run_collectives, name="calibrate-collectives", daemon=True)
    thread.start()
    during = matmul_rate(lambda _t: thread.is_alive())
    thread.join(timeout=60)
    if thread.is_alive() or not comm_times:
        raise RuntimeError("the background collectives of the interference test did not "
                           "finish within 60 s")
    dist.barrier(group=group)
    alone_after = matmul_rate(lambda t: t < window_s)
    alone = (alone_before + alone_after) / 2
    return {"matmul_per_s_alone": alone, "matmul_per_s_during": during,
            "collective_seconds_during": comm_times[0],
            "fraction": min(1.0, max(0.0, 1.0 - during / alone))}


