"""glibc's malloc tuned for CPU training: memory a step frees is kept for the next step instead
of being handed back to the kernel and faulted in again page by page."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

from flowtrain.log import get_logger

log = get_logger("flowtrain.host_memory")

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# mallopt(3): a trim threshold of -1 turns trimming off. The heap keeps its high-water mark, as
# torch's CUDA caching allocator keeps device memory: a training step frees its activations,
# logits and gradients and allocates the same sizes again milliseconds later, and every page
# handed back costs a fault (and the kernel zeroing it) on the next step.
NEVER_TRIM = -1
# No allocation gets a mapping of its own. glibc maps every block above its mmap threshold
# (at most 32 MiB on 64-bit hosts, and no mallopt value can raise it further) and unmaps it on
# free: with mmap allowed, a step's large tensors (a 50k-vocabulary head's logits and their
# gradient are some hundred MiB) are faulted in again on every step, whatever the thresholds.
NO_MMAP = 0

_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                  "MALLOC_MMAP_MAX_")
_OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
_applied = False


def user_has_chosen() -> str | None:
    """Why the allocator is left as it is: the user tuned glibc's malloc or preloaded another
    allocator (None: neither)."""
    for name in _USER_SETTINGS:
        if name in os.environ:
            return f"{name} is set"
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets glibc.malloc"
    preload = os.environ.get("LD_PRELOAD", "")
    for allocator in _OTHER_ALLOCATORS:
        if allocator in preload:
            return f"LD_PRELOAD loads {allocator}"
    return None


def keep_freed_memory() -> bool:
    """Makes glibc serve every allocation of this process from its heaps and never shrink them
    (once); returns whether that is in force. Without it, a ZeRO step's pattern of frees
    (gradients dropped as they are bucketed, gathered parameters released) lets the heap shrink
    and regrow every step, and every tensor above 32 MiB is mapped and unmapped: thousands to
    hundreds of thousands of minor page faults per step. The price is that the process keeps
    its peak heap: memory freed after the peak stays available to this process only."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    why = user_has_chosen()
    if why is not None:
        log.debug("malloc settings left as they are", reason=why)
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(_M_TRIM_THRESHOLD, NEVER_TRIM)) and \
        bool(mallopt(_M_MMAP_MAX, NO_MMAP))
    return _applied
