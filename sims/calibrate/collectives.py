"""`flowtrain calibrate`'s measurements that need several processes: gloo's collectives over
loopback for each rank count, how much a collective slows compute, and, on the same forked
ranks, the engine's pieces that need peers (its shared-memory channel, ranks computing at once,
a pipeline send; ``sims.calibrate.engine_pieces``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_for_pipes
from typing import Any, cast

import torch
import torch.distributed as dist

from flowtrain import comm
from sims.calibrate import engine_pieces
from sims.calibrate.settings import CHANNEL_OPS, MEASURED_OPS, CalibrationError, Settings
from sims.calibrate.timing import agreed_repeats, pick


def free_port() -> int:
    """A TCP port on loopback that is free now, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure_collectives(settings: Settings, ranks: Sequence[int], timeout_s: float,
                        start_method: str | None = None
                        ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """Gloo collectives over loopback for each rank count, then the interference test on the
    smallest; every wait is bounded by ``timeout_s``. The same ranks also measure the
    engine's pieces that need several processes (``sims.calibrate.engine_pieces``): its
    shared-memory channel, how much ranks computing at once slow each other, and a pipeline
    send; they come back as the third value, the measurements' ``engine`` record in the
    making.

    Where each rank runs one thread, the ranks are forked from this process: torch is imported
    already, so they start in milliseconds rather than the seconds importing torch takes on a
    busy host. Where ranks need more threads they come from a fork server that imported
    torch once, since a child forked after the parent used OpenMP hangs in its first
    multi-threaded op (GNU libgomp)."""
    world = max(ranks)
    for nbytes in (*settings.collective_bytes, settings.interference_bytes):
        if nbytes <= 0 or nbytes % (4 * world):
            raise ValueError(f"collective sizes must be positive multiples of 4 B x {world} ranks "
                             f"(float32 shards of equal size), got {nbytes}")
    if start_method is None:
        one_thread = (os.cpu_count() or 1) // min(ranks) <= 1
        start_method = "fork" if one_thread else "forkserver"
    # typeshed types a context picked by a str as the BaseContext, which has no Process; each
    # start method's context has one
    ctx = cast("mp.context.ForkContext | mp.context.ForkServerContext | mp.context.SpawnContext",
               mp.get_context(start_method))
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["sims.calibrate.collectives"])
    port = free_port()
    from flowtrain import shm

    # the engine's shared-memory channel, where it would use one (CPU ranks of one host)
    shm_path = f"/dev/shm/flowtrain-calibrate-{os.getpid()}-{os.urandom(4).hex()}" \
        if shm.available() else None
    pipes: list[Connection] = []
    procs = []
    for rank in range(world):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, name=f"calibrate-rank{rank}",
                           args=(rank, world, port, tuple(ranks), settings, timeout_s,
                                 child_end, shm_path))
        proc.start()
        child_end.close()
        pipes.append(parent_end)
        procs.append(proc)
    deadline = time.monotonic() + timeout_s
    results: dict[int, dict[str, Any]] = {}
    waiting = {pipe: rank for rank, pipe in enumerate(pipes)}
    try:
        # All pipes at once, so the first rank to fail is the one reported (its peers only
        # notice at their process-group timeout) and a dead rank is seen at once (EOF).
        while waiting:
            remaining = deadline - time.monotonic()
            # wait() hands back the very objects it was given, here the pipes; typeshed types
            # them as any waitable (a socket or a file descriptor too)
            ready = cast("list[Connection]",
                         wait_for_pipes(list(waiting), timeout=max(0.0, remaining)))
            if not ready:
                raise CalibrationError(
                    f"calibration ranks {sorted(waiting.values())} of {world} sent nothing within "
                    f"{timeout_s:g} s; rerun with a larger --timeout or on a less busy host")
            for pipe in ready:
                rank = waiting.pop(pipe)
                try:
                    results[rank] = pipe.recv()
                except EOFError:
                    procs[rank].join(1)
                    raise CalibrationError(f"calibration rank {rank} died without a result "
                                           f"(exit code {procs[rank].exitcode})") from None
                if "error" in results[rank]:
                    raise CalibrationError(f"calibration rank {rank} failed:\n"
                                           f"{results[rank]['error']}")
        for proc in procs:
            proc.join(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    shares = [r["interference"] for r in results.values() if "interference" in r]
    interference = {key: statistics.fmean(s[key] for s in shares) for key in shares[0]}
    interference["ranks"] = min(ranks)
    engine: dict[str, Any] = {"channel": results[0]["channel"],
                              "concurrency": results[0]["concurrency"],
                              "p2p": results[0].get("p2p", [])}
    channel_shares = [r["channel_interference"] for r in results.values()
                      if "channel_interference" in r]
    if channel_shares:
        engine["channel_interference"] = {
            key: statistics.fmean(s[key] for s in channel_shares) for key in channel_shares[0]}
    return results[0]["collectives"], interference, engine


def _rank_main(rank: int, world: int, port: int, ranks: tuple[int, ...], settings: Settings,
               timeout_s: float, conn: Connection, shm_path: str | None = None) -> None:
    """One forked rank: measures what its groups ask and sends the outcome (or its error)."""
    try:
        warnings.simplefilter("ignore", FutureWarning)  # torch's rename of the *_tensor ops
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))
        result: dict[str, Any] = {"collectives": [], "channel": [], "concurrency": []}
        groups = {n: (dist.group.WORLD if n == world else dist.new_group(list(range(n))))
                  for n in sorted(ranks)}
        # every rank takes part in creating a group, even one it is not in
        pair = groups[2] if 2 in groups else dist.new_group([0, 1])
        channels: dict[int, Any] = {}
        for n, group in groups.items():
            if rank < n:
                _set_threads(n)
                result["collectives"] += time_collectives(group, n, settings)
                if shm_path is not None:
                    channels[n] = engine_pieces.open_channel(
                        f"{shm_path}-{n}", rank, n, max(settings.collective_bytes) + 64,
                        timeout_s, group)
                    result["channel"] += time_collectives(group, n, settings, channels[n],
                                                          timeout_s)
                result["concurrency"].append(engine_pieces.time_concurrency(
                    rank, n, group, settings.concurrency_window_s))
            dist.barrier()
        smallest = min(ranks)
        if rank < smallest:
            _set_threads(smallest)
            result["interference"] = _interference(groups[smallest], smallest, settings)
            if smallest in channels:
                call = engine_pieces.channel_call(channels[smallest], "all_reduce", smallest,
                                                  settings.interference_bytes, timeout_s)
                start = time.perf_counter()
                call()
                repeats = agreed_repeats(time.perf_counter() - start,
                                         settings.interference_window_s, groups[smallest],
                                         cap=10_000)
                result["channel_interference"] = {
                    **engine_pieces.background_interference(
                        call, settings.interference_window_s, groups[smallest], repeats),
                    "bytes": settings.interference_bytes, "ranks": smallest}
        if rank < 2:
            _set_threads(2)
            result["p2p"] = engine_pieces.time_p2p(
                rank, pair, settings.p2p_bytes, settings.collective_trials,
                settings.trial_seconds, timeout_s)
        dist.barrier()
        for channel in channels.values():
            channel.close()
        conn.send(result)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - handed to the parent, which reports it
        conn.send({"error": traceback.format_exc()})
    finally:
        conn.close()


def _set_threads(ranks: int) -> None:
    """The thread count ``flowtrain launch`` gives each of ``ranks`` ranks on this host."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))


def _collective_call(op: str, group: Any, ranks: int, nbytes: int) -> Callable[[], None]:
    full = torch.ones(nbytes // 4)
    shard = torch.ones(nbytes // 4 // ranks)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter_single(shard, full, group=group)
    return lambda: comm.all_gather_single(full, shard, group=group)


def time_collectives(group: Any, ranks: int, settings: Settings, channel: Any = None,
                      timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Gloo's collectives over ``group``, or with ``channel`` the engine's shared-memory
    channel's (all_reduce and reduce_scatter, what its reducer sends there)."""
    records = []
    ops = MEASURED_OPS if channel is None else CHANNEL_OPS
    for op in ops:
        for nbytes in settings.collective_bytes:
            call = _collective_call(op, group, ranks, nbytes) if channel is None else \
                engine_pieces.channel_call(channel, op, ranks, nbytes, timeout_s)
            start = time.perf_counter()
            call()
            k = agreed_repeats(time.perf_counter() - start, settings.trial_seconds, group)
            trials = []
            for _ in range(settings.collective_trials):
                dist.barrier(group=group)
                start = time.perf_counter()
                for _ in range(k):
                    call()
                trials.append((time.perf_counter() - start) / k)
            # The median trial: the engine's steps are held against the simulator by their
            # median, and a gloo call's time varies widely from call to call even on a quiet
            # host, so its fastest is far from what a step sees. Each trial averages
            # back-to-back calls; all trials are kept.
            records.append({"op": op, "ranks": ranks, "bytes": nbytes,
                            "seconds": pick(trials, "median"), "trials": trials})
    return records


def _interference(group: Any, ranks: int, settings: Settings) -> dict[str, float]:
    """Matmul throughput alone, then while a background thread runs back-to-back gloo
    all-reduces, then alone again. The compute lost per second of collective is the fraction of
    the collective's time that also occupies the compute resource."""
    call = _collective_call("all_reduce", group, ranks, settings.interference_bytes)
    start = time.perf_counter()
    call()
    repeats = agreed_repeats(time.perf_counter() - start, settings.interference_window_s,
                             group, cap=10_000)
    share = engine_pieces.background_interference(call, settings.interference_window_s,
                                                  group, repeats)
    share["all_reduce_seconds_during"] = share.pop("collective_seconds_during")
    share["bytes"] = settings.interference_bytes
    return share
