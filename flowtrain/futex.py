"""Blocking waits on a 32-bit word of shared memory (the Linux futex system call): a rank of the
shared-memory channel sleeps in the kernel until a peer raises the flag it waits for, instead
of waking every few hundred microseconds to look."""

from __future__ import annotations

import ctypes
import platform
import sys

# the futex system call's number per architecture (asm/unistd.h)
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98,
              "ppc64le": 221, "ppc64": 221, "s390x": 238}
# operations without FUTEX_PRIVATE_FLAG: the word is shared between processes
_FUTEX_WAIT = 0
_FUTEX_WAKE = 1
_WAKE_ALL = 2**31 - 1
# the low half of a little-endian int64 flag (the half that changes as the flag counts up)
_LOW_HALF = 0 if sys.byteorder == "little" else 4


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """Wait and wake on int64 counters in a shared mapping (their low 32 bits)."""

    def __init__(self) -> None:
        number = _SYS_FUTEX.get(platform.machine().lower())
        if not sys.platform.startswith("linux") or number is None:
            raise OSError(f"no futex on {sys.platform}/{platform.machine()}")
        self._number = number
        syscall = ctypes.CDLL(None, use_errno=True).syscall
        syscall.restype = ctypes.c_long
        self._syscall = syscall

    def wait(self, address: int, seen: int, timeout: float) -> None:
        """Sleeps while the int64 at ``address`` still holds ``seen``, at most ``timeout``
        seconds. Returns early on a wake, a changed value or a signal: the caller looks
        again."""
        seconds = int(timeout)
        span = _Timespec(seconds, int((timeout - seconds) * 1e9))
        self._syscall(ctypes.c_long(self._number), ctypes.c_void_p(address + _LOW_HALF),
                      ctypes.c_int(_FUTEX_WAIT), ctypes.c_uint32(seen & 0xFFFFFFFF),
                      ctypes.byref(span), None, ctypes.c_int(0))

    def wake(self, address: int) -> None:
        """Wakes every process sleeping on the int64 at ``address``."""
        self._syscall(ctypes.c_long(self._number), ctypes.c_void_p(address + _LOW_HALF),
                      ctypes.c_int(_FUTEX_WAKE), ctypes.c_int(_WAKE_ALL), None, None,
                      ctypes.c_int(0))


def futex() -> Futex | None:
    """A Futex, or None where the system call is not there (then callers poll)."""
    try:
        return Futex()
    except (OSError, AttributeError):
        return None
