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
_M_MMAP_THRESHOLD = -3
# glibc's own ceiling for its adaptive mmap threshold on 64-bit hosts: tensors up to this size
# come from the heap and are reused; larger ones keep their own mapping as before
MMAP_THRESHOLD = 32 * 2**20
# free memory the heap keeps at its top before returning it: a step's activations and
# gradients are freed and allocated again within milliseconds, so returning them costs a page
# fault per 4 KiB on the next step
TRIM_THRESHOLD = 4 * MMAP_THRESHOLD

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
    """Raises glibc's trim and mmap thresholds for this process (once); returns whether they
    are in force. Without it, a ZeRO step's pattern of frees (gradients dropped as they are
    bucketed, gathered parameters released) lets the heap shrink and regrow every step: some
    thousands of minor page faults per step."""
    global _applied
    if _applied:
        return True
    if not sys.platform.startswith("linux"):
        return False
    why = user_has_chosen()
    if why is not None:
        log.debug("malloc thresholds left as they are", reason=why)
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
