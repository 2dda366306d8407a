"""How calibration times things on a shared host: one repeat loop with an explicit policy (the
fastest or the median sample), the least disturbed of several rounds, how many back-to-back
calls all ranks agree on, and how much other processes loaded the host meanwhile."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

# "min": the fastest sample, for a kernel rate (other work on a shared host only ever adds
# time, so the fastest is the figure that repeats from run to run). "median": the typical
# sample, for what the engine's steps are held against (their median; even on a quiet host
# a short op's median sits above its fastest).
Policy = Literal["min", "median"]


def pick(values: Sequence[float], policy: Policy) -> float:
    """The fastest or the median of ``values``."""
    if policy == "min":
        return min(values)
    if policy == "median":
        return statistics.median(values)
    raise ValueError(f"policy must be 'min' or 'median', got {policy!r}")


def sample(run: Callable[[], tuple[float, ...]], seconds: float,
           min_reps: int) -> list[tuple[float, ...]]:
    """``run`` (which times its own phases and returns their seconds) called back to back for
    about ``seconds``, at least ``min_reps`` times."""
    samples: list[tuple[float, ...]] = []
    end = time.perf_counter() + seconds
    while len(samples) < min_reps or time.perf_counter() < end:
        samples.append(run())
    return samples


def repeat(fn: Callable[[], object], seconds: float, *, policy: Policy, min_reps: int) -> float:
    """The time of one ``fn`` call, by ``policy`` over about ``seconds`` of calls after one
    warm-up call."""
    fn()

    def once() -> tuple[float]:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start,)

    return pick([t for t, in sample(once, seconds, min_reps)], policy)


def least_disturbed(rounds: Sequence[dict[str, float]], keys: Sequence[str]) -> dict[str, float]:
    """Per key, the smallest of the rounds' figures. Each round is a median over its own
    window, taken at a different time: a burst of other work on a shared host can fill one
    window for seconds at a time, rarely all of them."""
    return {k: pick([r[k] for r in rounds], "min") for k in keys}


def agreed_repeats(estimate_s: float, target_s: float, group: Any, cap: int = 16) -> int:
    """How many back-to-back calls fill ``target_s``; every rank must issue the same number,
    so the largest proposal wins."""
    k = torch.tensor([max(1, min(cap, math.ceil(target_s / max(estimate_s, 1e-6))))])
    dist.all_reduce(k, op=dist.ReduceOp.MAX, group=group)
    return int(k.item())


class ForeignLoad:
    """Cores kept busy by other processes while a block runs: the host's busy CPU time
    (/proc/stat) less this process's and its finished children's, over the wall time. A
    shared host's other users skew any timing; this says how much they were there."""

    def __enter__(self) -> ForeignLoad:
        self._busy, self._ours = host_busy_seconds(), own_cpu_seconds()
        self._start = time.monotonic()
        self.cores = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(time.monotonic() - self._start, 1e-9)
        others = (host_busy_seconds() - self._busy) - (own_cpu_seconds() - self._ours)
        self.cores = max(0.0, others) / wall


def host_busy_seconds() -> float:
    """CPU seconds the whole host has been busy (not idle or waiting for I/O); 0 where there
    is no /proc/stat."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process and of its children that have been waited for."""
    import resource  # POSIX only, as /proc/stat above

    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total
