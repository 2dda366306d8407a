"""Where a rank's main thread is, for its heartbeats: the line it runs, whose code that is, and
how long its stack has not moved. The coordinator reads these to tell a rank stuck in its own
code (a deadlock, an endless loop) from one that is waiting for its peers, while the rank's
heartbeats, sent from another thread, keep arriving."""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time
from types import FrameType

# this file is flowtrain/runtime/watch.py
_FLOWTRAIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_LIBRARY_MARKERS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def code_kind(filename: str) -> str:
    """"flowtrain", "library" (an installed package), "stdlib", or "user" (the job's own)."""
    path = os.path.abspath(filename)
    if path.startswith(_FLOWTRAIN):
        return "flowtrain"
    if any(m in path for m in _LIBRARY_MARKERS):
        return "library"
    if path.startswith(_STDLIB) or filename.startswith("<"):
        return "stdlib"
    return "user"


def _deciding_frame(frame: FrameType | None) -> FrameType | None:
    """The innermost frame outside the standard library: a lock's or a queue's wait is charged
    to the code that called it."""
    while frame is not None and code_kind(frame.f_code.co_filename) == "stdlib":
        frame = frame.f_back
    return frame


class MainThreadWatch:
    """Samples the main thread's stack at each heartbeat (``sample``)."""

    def __init__(self, thread: threading.Thread | None = None) -> None:
        self.ident = (thread or threading.main_thread()).ident
        self._signature: tuple[tuple[int, int], ...] = ()
        self._since = time.monotonic()

    def sample(self) -> dict[str, object]:
        frame = sys._current_frames().get(self.ident) if self.ident is not None else None
        signature = []
        walk = frame
        while walk is not None:
            signature.append((id(walk.f_code), walk.f_lineno or 0))
            walk = walk.f_back
        now = time.monotonic()
        if tuple(signature) != self._signature:
            self._signature = tuple(signature)
            self._since = now
        deciding = _deciding_frame(frame)
        if deciding is None:
            return {"main_where": "not running", "main_code": "none", "main_still_s": 0.0}
        code = deciding.f_code
        return {"main_where": f"{os.path.basename(code.co_filename)}:{deciding.f_lineno} in "
                              f"{code.co_name}",
                "main_code": code_kind(code.co_filename),
                "main_still_s": round(now - self._since, 1)}
