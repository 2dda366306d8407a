"""This host's own figures for ``flowtrain calibrate``: single-thread matmul rates per dtype,
streaming memory copies, and what the host is (CPU model, cores, memory, load)."""

from __future__ import annotations

import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from sims.calibrate.settings import DTYPES, Settings
from sims.calibrate.timing import repeat


def measure_matmul(settings: Settings) -> list[dict[str, Any]]:
    """Single-thread matmul times, the fastest of each size. One thread stands for one device
    of a CPU profile: with as many ranks as cores, ``flowtrain launch`` gives each rank one
    thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    records: list[dict[str, Any]] = []
    try:
        for dtype in DTYPES:
            sizes = settings.matmul_sizes if dtype == "float32" else settings.low_precision_sizes
            last: tuple[int, float] | None = None
            for n in sizes:
                if last and last[1] * (n / last[0]) ** 3 > settings.max_op_seconds:
                    break  # this dtype is too slow here for larger sizes to be worth the time
                a = torch.randn(n, n).to(getattr(torch, dtype))
                b = torch.randn(n, n).to(getattr(torch, dtype))

                def mm(a: torch.Tensor = a, b: torch.Tensor = b) -> torch.Tensor:
                    return torch.mm(a, b)

                seconds = repeat(mm, settings.seconds_per_point, policy="min", min_reps=3)
                records.append({"dtype": dtype, "n": n, "flops": 2.0 * n**3,
                                "seconds": seconds})
                last = (n, seconds)
    finally:
        torch.set_num_threads(previous)
    return records


def measure_memory(settings: Settings) -> list[dict[str, Any]]:
    """Single-thread streaming copy and add (bytes read + written), and a 4 KiB copy whose
    time stands for the latency of one host copy; the fastest of each."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = settings.memory_elements
        src, other, dst = torch.ones(n), torch.ones(n), torch.zeros(n)
        small_src, small_dst = torch.ones(1024), torch.zeros(1024)
        return [
            {"kind": "copy", "bytes_moved": 2 * 4 * n,
             "seconds": repeat(lambda: dst.copy_(src), settings.seconds_per_point,
                               policy="min", min_reps=3)},
            {"kind": "add", "bytes_moved": 3 * 4 * n,
             "seconds": repeat(lambda: torch.add(src, other, out=dst),
                               settings.seconds_per_point, policy="min", min_reps=3)},
            {"kind": "small_copy", "bytes_moved": 2 * 4 * 1024,
             "seconds": repeat(lambda: small_dst.copy_(small_src), 0.01, policy="min",
                               min_reps=50)},
        ]
    finally:
        torch.set_num_threads(previous)


def host_facts() -> dict[str, Any]:
    """What the profile describes: the CPU model, core count and memory of this host."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"hostname": socket.gethostname(), "cpu": model, "cores": os.cpu_count() or 1,
            "memory_bytes": int(psutil.virtual_memory().total), "torch": torch.__version__,
            # Other work on the host skews every figure; the load says how much there was.
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "recorded": time.strftime("%Y-%m-%d %H:%M:%S %z")}
