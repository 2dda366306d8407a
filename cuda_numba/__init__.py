"""Numba kernels of the engine (fused optimizers, unscale/overflow check, grad norm, casts),
each for CUDA (``cuda.py``) and CPU (``cpu.py``) behind the torch-facing functions of ``ops``.
"""

from __future__ import annotations

import os
import time

import numpy as np

from .ops import (
    adam_step,
    cast_,
    flatten,
    l2_norm,
    lion_step,
    sgd_step,
    unflatten,
    unflatten_into,
    unscale_and_check,
)

__all__ = ["adam_step", "lion_step", "sgd_step", "unscale_and_check", "l2_norm", "cast_",
           "flatten", "unflatten", "unflatten_into", "warm_up", "kernel_status"]


def _cpu_samples() -> dict[str, list[tuple]]:
    """One argument tuple per type signature each CPU kernel is called with by ``ops``.

    Scalars have the exact Python types ops passes (float, int, bool): a different type
    would be a different numba signature and compile again mid-training.
    """
    f = np.zeros(1, np.float32)
    h = np.zeros(1, np.uint16)
    no = np.empty(0, np.uint16)
    out: dict[str, list[tuple]] = {k: [] for k in
                                   ("adam", "lion", "sgd", "unscale_check", "sum_squares", "cast")}
    for g, gk in ((f, 0), (h, 1)):
        for mo, ok in ((no, 0), (h.copy(), 2)):
            out["adam"].append((f.copy(), g, gk, f.copy(), f.copy(), mo, ok, 1e-3, 0.9, 0.999,
                                1e-8, 0.01, 0.1, 0.001, 1.0, True))
            out["lion"].append((f.copy(), g, gk, f.copy(), mo, ok, 1e-4, 0.9, 0.99, 0.0, 1.0))
            out["sgd"].append((f.copy(), g, gk, f.copy(), mo, ok, 0.1, 0.9, 0.0, 0.0, False,
                               True, 1.0))
        out["unscale_check"].append((g, gk, f.copy(), 1.0))
        out["sum_squares"].append((g, gk))
        for d, dk in ((f, 0), (h, 1)):
            out["cast"].append((g, gk, d.copy(), dk))
    return out


def warm_up(names: tuple[str, ...] | None = None) -> float:
    """Compile (or load from the disk cache) the CPU kernels ``names`` (all by default) for
    every signature ops uses, so no training step pays for compilation; returns the seconds."""
    from . import cpu
    from .ops import keep_torch_threads, sync_threads

    sync_threads()
    t0 = time.perf_counter()
    samples = _cpu_samples()
    for name, builds in cpu.KERNELS.items():
        if names is not None and name not in names:
            continue
        for k in builds:
            for args in samples[name]:
                with keep_torch_threads():
                    k(*args)
    return time.perf_counter() - t0


def _cuda_state() -> tuple[str, object | None]:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        mode = "simulator"
    else:
        try:
            from numba import cuda as ncuda

            mode = "available" if ncuda.is_available() else "no device"
        except Exception as e:  # numba without its CUDA target
            return f"unavailable ({type(e).__name__}: {e})", None
    try:
        from . import cuda as kcuda
    except Exception as e:
        return f"missing (cuda_numba.cuda: {type(e).__name__}: {e})", None
    return mode, kcuda


def kernel_status() -> list[dict]:
    """Per kernel: whether the CPU build compiles here, and the CUDA build's state."""
    from . import cpu

    samples = _cpu_samples()
    mode, kcuda = _cuda_state()
    rows = []
    for name, builds in cpu.KERNELS.items():
        try:
            t0 = time.perf_counter()
            for k in builds:
                for args in samples[name]:
                    k(*args)
            hits = sum(sum(k.stats.cache_hits.values()) for k in builds)
            cpu_state = f"ok ({time.perf_counter() - t0:.2f}s, {hits} cache hits)"
        except Exception as e:
            cpu_state = f"error: {type(e).__name__}: {e}"
        if kcuda is None:
            cuda_state = mode
        elif not hasattr(kcuda, name):
            cuda_state = f"{mode}, but cuda_numba.cuda has no {name}"
        else:
            cuda_state = mode
        rows.append({"kernel": name, "cpu": cpu_state, "cuda": cuda_state})
    return rows
