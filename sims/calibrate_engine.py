"""The engine's own costs on a CPU host, measured for ``flowtrain calibrate``: what a real step
spends its time on, piece by piece, rather than peak kernel rates.

On a CPU host the matmul-only profile predicted steps 20-80 % short. A forward or backward is a
chain of modules, each a small op plus Python, autograd and (backward) the engine's gradient
bucket hook; backward runs at a lower FLOP rate than forward; the data-parallel reduce goes over
the engine's shared-memory channel, whose summing is CPU work taken from compute; pipeline
sends are gloo point-to-point messages of a header and a tensor; the fused Adam kernel is
called once per tensor; and ranks that share a host's cores slow each other down. Each is
measured here by running that piece of the engine (``nn.Linear`` with ``GradBuckets``, the
``ShmChannel``, ``cuda_numba``'s Adam, the pipeline's header + tensor send) and fitted into the
profile's ``engine`` section (``sims.hardware.EngineCosts``).

The measured shapes are a calibration set of their own: none is a shape of the benchmark models
(``benchmarks/sim_accuracy.py``), so the benchmark tests the fit rather than repeating it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sims.calibrate_ops import fit_op_costs
from sims.costs import ADAM_BYTES_PER_PARAM
from sims.hardware import PASS_KINDS, EngineCosts, Link

# (rows, in, out) of the nn.Linear ops timed: log-spaced from a call that is all overhead to one
# that is all matmul, with varied aspect ratios.
PASS_SHAPES = ((8, 16, 16), (16, 48, 48), (32, 96, 192), (48, 192, 384), (96, 384, 512),
               (160, 640, 768), (320, 768, 1024))
QUICK_PASS_SHAPES = ((8, 16, 16), (32, 96, 192), (96, 384, 512), (160, 640, 768))
# Shapes of equal FLOPs (2^25) and weights of 0.25-4 MiB: how a layer's time grows with its
# weights when its FLOPs do not (fewer rows per weight)
WEIGHT_SHAPES = ((256, 256, 256), (64, 256, 1024), (32, 512, 1024), (16, 1024, 1024))
# The op every rank runs at once in the concurrency test (about 1.5 ms per pass on one core).
CONCURRENCY_SHAPE = (96, 384, 512)
# (tensors, elements each) the optimizer kernel steps per call: call-bound to DRAM-bound
OPTIMIZER_SETS = ((256, 1 << 12), (32, 1 << 16), (16, 1 << 18), (4, 1 << 20))
QUICK_OPTIMIZER_SETS = ((128, 1 << 12), (4, 1 << 20))
# elements of the three float32 tensors the memory-bound concurrency test streams (far past
# the caches)
STREAM_NUMEL = 1 << 23


ROUNDS = 3  # each measurement is taken in this many separate windows


def typical(fn: Callable[[], object], seconds: float, min_reps: int = 5) -> float:
    """Median time of ``fn`` over about ``seconds`` of repetitions after a warm-up. The
    median, not the fastest: the engine's steps are held against the simulator by their
    median, and even on a quiet host a 0.5 ms op's median is 10-20 % above its fastest."""
    fn()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < min_reps or time.perf_counter() < end:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def least_disturbed(rounds: Sequence[dict[str, float]], keys: Sequence[str]) -> dict[str, float]:
    """Per key, the smallest of the rounds' figures. Each round is a median over its own
    window, taken at a different time: a burst of other work on a shared host can fill one
    window (it did, for seconds at a time, on the project's 2-core host), rarely all."""
    return {k: min(r[k] for r in rounds) for k in keys}


COLD_BYTES = 4 << 20  # a layer's weights come from past the 1-2 MiB L2 caches, as in a model


class LinearPass:
    """One layer as the engine trains it: an ``nn.Linear`` alone (the activation or residual add
    that follows a matmul in a model is priced by its own class, ``sims.calibrate_ops``, from
    the model's op census). Its input needs a gradient (an inner layer), and its gradients land in
    flat bucket views through the engine's post-accumulate hooks
    (``flowtrain.engine.buckets.GradBuckets``), counting arrivals as on a reducing step.

    Each call runs the next of enough copies of the layer to hold COLD_BYTES of weights: in a
    model a layer's weights were last touched a whole pass ago, not by the previous call, and
    timing one layer over and over kept them in the core's cache (which made ops 20-60 %
    faster than they run inside a model)."""

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
    forward: list[float] = []
    backward: list[float] = []
    try:
        op.both()
        end = time.perf_counter() + seconds
        while len(forward) < 5 or time.perf_counter() < end:
            start = time.perf_counter()
            y = op.forward()
            middle = time.perf_counter()
            op.backward(y)
            forward.append(middle - start)
            backward.append(time.perf_counter() - middle)
    finally:
        op.close()
    return {"flops": op.flops, "forward_s": statistics.median(forward),
            "backward_s": statistics.median(backward)}


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

            def call(state: list[tuple[torch.Tensor, ...]] = state, steps: Any = steps) -> None:
                t = next(steps)
                for p, g, m, v in state:
                    ops.adam_step(p, g, m, v, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.0, step=t, adamw=True, bias_correction=True)

            rounds = [typical(call, seconds_per_point / ROUNDS) for _ in range(ROUNDS)]
            records.append({"tensors": count, "numel": count * numel, "seconds": min(rounds),
                            "rounds": rounds})
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
    (``flowtrain.pipe.engine``'s sender thread, and a receiver thread with every receive
    queued ahead, as a stage's schedule queues them); one way is half the round trip."""
    import itertools

    from flowtrain.pipe import engine as pipe
    from sims.calibrate_comm import _agreed_repeats

    peer = 1 - rank
    out_tags, in_tags = ((pipe.TAG_ACT, pipe.TAG_ACT_DATA),
                         (pipe.TAG_GRAD, pipe.TAG_GRAD_DATA))[::1 if rank == 0 else -1]
    cpu = torch.device("cpu")
    sender = pipe._Sender(None, cpu, timeout_s, "calibrate-p2p-send")
    receiver = pipe._Receiver(None, peer, in_tags, cpu, timeout_s, "calibrate-p2p-recv")
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
            count = _agreed_repeats(time.perf_counter() - start, trial_seconds, group, cap=64)
            times = []
            for _ in range(trials):
                dist.barrier(group=group)
                start = time.perf_counter()
                round_trips(count, tensor)
                times.append((time.perf_counter() - start) / count / 2)
            # each trial averages many round trips: the least disturbed one, as for collectives
            records.append({"bytes": nbytes, "seconds": min(times), "trials": times})
    finally:
        receiver.close()
        sender.close()
    return records


def _delta(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


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
            out[f"{name}_slowdown"] = statistics.median(slowdowns)
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


def _relative_fit(rows: Sequence[tuple[float, float]], what: str) -> Link:
    from sims.calibrate import fit_link

    return fit_link(rows, what)


def fit_pass_rates(records: Sequence[dict[str, Any]]
                   ) -> dict[int, dict[str, tuple[tuple[float, float], ...]]]:
    """Per thread count and pass kind, the measured FLOP/s by op FLOPs (backward does twice
    the forward's FLOPs: grad input and grad weight), keeping the best rate per size."""
    out: dict[int, dict[str, dict[float, float]]] = {}
    for r in records:
        kinds = out.setdefault(int(r["threads"]), {k: {} for k in PASS_KINDS})
        for kind, flops in (("forward", r["flops"]), ("backward", 2 * r["flops"])):
            rate = flops / r[f"{kind}_s"]
            kinds[kind][flops] = max(kinds[kind].get(flops, 0.0), rate)
    return {t: {k: tuple(sorted(points.items())) for k, points in kinds.items()}
            for t, kinds in out.items()}


def fit_engine(m: dict[str, Any]) -> tuple[EngineCosts, list[str]]:
    """The ``engine`` section from the measurements' ``engine`` record; also returns what
    could not be fitted (left out, so the simulator falls back to its generic figures)."""
    from sims.calibrate import CalibrationError

    skipped: list[str] = []
    rates = fit_pass_rates(m["passes"])
    optimizer = fit_calls_and_bytes(m["optimizer"])
    channel: dict[str, dict[int, Link]] = {}
    grouped: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in m.get("channel", []):
        grouped.setdefault((r["op"], int(r["ranks"])), []).append((r["bytes"], r["seconds"]))
    for (op, ranks), points in sorted(grouped.items()):
        try:
            channel.setdefault(op, {})[ranks] = _relative_fit(
                points, f"shared-memory {op} over {ranks} ranks")
        except CalibrationError as exc:
            skipped.append(str(exc))
    p2p = None
    if m.get("p2p"):
        try:
            p2p = _relative_fit([(r["bytes"], r["seconds"]) for r in m["p2p"]],
                                "pipeline send")
        except CalibrationError as exc:
            skipped.append(str(exc))
    slowdown: dict[int, float] = {}
    memory_slowdown: dict[int, float] = {}
    for r in m.get("concurrency", []):
        slowdown[int(r["ranks"])] = max(1.0, float(r["compute_slowdown"]))
        memory_slowdown[int(r["ranks"])] = max(1.0, float(r["memory_slowdown"]))
    interference = m.get("channel_interference", {}).get("fraction", 1.0)
    from sims.calibrate import _slowdown_during

    channel_slowdown = _slowdown_during(m.get("channel_interference", {}),
                                        "collective_seconds_during",
                                        channel.get("all_reduce", {}))
    op_costs = fit_op_costs(m["ops"]) if m.get("ops") else {}
    weight_cost = fit_weight_cost(m.get("weight_passes", []))
    threads = min(int(r["threads"]) for r in m["passes"])
    pass_weights = tuple(sorted({(float(r["flops"]), 4.0 * r["in"] * r["out"])
                                 for r in m["passes"]
                                 if int(r["threads"]) == threads and "in" in r and "out" in r}))
    if not weight_cost or len(pass_weights) < 2:
        weight_cost, pass_weights = {}, ()
    return EngineCosts(pass_rates=rates, optimizer=optimizer, slowdown=slowdown,
                       memory_slowdown=memory_slowdown, channel=channel,
                       channel_interference=float(interference),
                       channel_slowdown=channel_slowdown, p2p=p2p,
                       op_costs=op_costs, weight_cost=weight_cost,
                       pass_weights=pass_weights), skipped


def fit_weight_cost(records: Sequence[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per thread count and pass kind, the seconds per byte of weights that equal-FLOP layers
    (WEIGHT_SHAPES) add: the least-squares slope of time over weight bytes, at least 0."""
    grouped: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        grouped.setdefault(int(r["threads"]), []).append(r)
    out: dict[int, dict[str, float]] = {}
    for threads, rows in sorted(grouped.items()):
        if len({r["in"] * r["out"] for r in rows}) < 2:
            continue
        x = [4.0 * r["in"] * r["out"] for r in rows]
        mean_x = statistics.fmean(x)
        var = sum((v - mean_x) ** 2 for v in x)
        out[threads] = {}
        for kind in PASS_KINDS:
            y = [r[f"{kind}_s"] for r in rows]
            mean_y = statistics.fmean(y)
            slope = sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y)) / var
            out[threads][kind] = max(0.0, slope)
    return out


def fit_calls_and_bytes(records: Sequence[dict[str, Any]]) -> Link:
    """The optimizer kernel as ``latency_s`` per call plus its 28-byte-per-parameter pass at
    ``bandwidth``: least squares of seconds = tensors x latency + bytes / bandwidth over the
    measured sets, relative error."""
    from sims.calibrate import CalibrationError, _seconds_per_byte_to_link, _solve_relative

    rows = [(float(r.get("tensors", 1)), ADAM_BYTES_PER_PARAM * r["numel"], r["seconds"])
            for r in records]
    try:
        latency, per_byte = _solve_relative(rows)
    except CalibrationError:
        # one set size only: no split between calls and bytes, all of it is bandwidth
        latency, per_byte = 0.0, sum(t for _, _, t in rows) / sum(b for _, b, _ in rows)
    return _seconds_per_byte_to_link(latency, per_byte, "the Adam kernel")


def summary_lines(engine: EngineCosts) -> list[str]:
    """The engine figures in the units people quote, for ``flowtrain calibrate``'s report."""
    lines = []
    for threads, kinds in sorted(engine.pass_rates.items()):
        for kind, curve in kinds.items():
            lines.append(f"  engine {kind:<8} {threads} thread{'s' if threads > 1 else ' '}: "
                         f"{curve[0][1] / 1e9:6.1f} GFLOP/s at {curve[0][0]:.3g} FLOPs .. "
                         f"{curve[-1][1] / 1e9:6.1f} at {curve[-1][0]:.3g}")
    kernel = engine.optimizer
    lines.append(f"  engine Adam kernel: {kernel.latency_s * 1e6:.1f} us per call, "
                 f"{kernel.bandwidth / 1e9:.1f} GB/s")
    for op, by_ranks in engine.channel.items():
        for ranks, link in sorted(by_ranks.items()):
            lines.append(f"  shm channel {op:<14} {ranks} ranks: latency "
                         f"{link.latency_s * 1e6:8.1f} us, bandwidth {link.bandwidth / 1e9:6.3f} "
                         "GB/s")
    lines.append(f"  shm channel interference {engine.channel_interference:.2f}, all-reduce "
                 f"x{engine.channel_slowdown:.2f} while computing")
    if engine.p2p is not None:
        lines.append(f"  pipeline send: {engine.p2p.latency_s * 1e6:.1f} us + "
                     f"{engine.p2p.bandwidth / 1e9:.3f} GB/s")
    if engine.pipeline_op_s or engine.pipeline_message_s:
        lines.append(f"  engine pipeline: {engine.pipeline_op_s * 1e6:.0f} us to start each "
                     f"instruction, {engine.pipeline_message_s * 1e6:.0f} us to deliver each "
                     "message beyond the send")
    for ranks, by_class in sorted(engine.factors.items()):
        lines.append(f"  engine job on {ranks} rank{'s' if ranks > 1 else ' '}: forward x"
                     f"{by_class.get('forward', 1.0):.2f} + "
                     f"{by_class.get('forward_s', 0.0) * 1e3:.2f} ms, backward x"
                     f"{by_class.get('backward', 1.0):.2f} + "
                     f"{by_class.get('backward_s', 0.0) * 1e3:.2f} ms per step, optimizer x"
                     f"{by_class.get('optimizer', 1.0):.2f} the isolated measurements; "
                     f"{by_class.get('micro_batch_s', 0.0) * 1e3:.2f} ms between forward and "
                     f"backward, {by_class.get('step_s', 0.0) * 1e3:.2f} ms more per step, "
                     f"gloo calls {by_class.get('gloo_s', 0.0) * 1e3:.2f} ms longer")
        if "zero3_fetch_s" in by_class or "zero3_backward_s" in by_class:
            lines.append(f"    ZeRO-3 hooks: {by_class.get('zero3_fetch_s', 0.0) * 1e3:.2f} ms "
                         f"per module fetch, {by_class.get('zero3_backward_s', 0.0) * 1e3:.2f}"
                         " ms per module in a backward")
        if "bucket_s" in by_class or "reduce_s" in by_class:
            lines.append(f"    buckets: {by_class.get('bucket_s', 0.0) * 1e3:.2f} ms to hand each "
                         f"to the reducer, {by_class.get('reduce_s', 0.0) * 1e3:.2f} ms more "
                         "per reduce")
    for ranks, factor in sorted(engine.slowdown.items()):
        memory = engine.memory_slowdown.get(ranks)
        lines.append(f"  {ranks} ranks working at once: each computes {factor:.2f}x slower"
                     + (f", streams memory {memory:.2f}x slower" if memory else ""))
    return lines
