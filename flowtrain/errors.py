"""Error files: a rank's failure written as JSON so the launcher can name the root cause."""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path


class FlowtrainError(Exception):
    """Base class of the errors flowtrain raises on purpose."""


class RankAborted(FlowtrainError):
    """Raised in a rank's main thread when the job is being torn down (another rank failed,
    the coordinator asked it to stop, or one of this rank's actors failed)."""


@dataclass
class RankFailure:
    """One rank's failure as it is written to, and read back from, its error file."""

    rank: int
    kind: str  # "exception" | "actor" | "signal" | "exit" | "stuck" | "lost"
    message: str  # one line: "ValueError: boom", "killed by SIGKILL", ...
    traceback: str = ""
    timestamp: float = 0.0  # time.time() when the failure was observed
    host: str = ""
    pid: int = 0
    actor: str | None = None  # the failing actor, when an actor failed

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_exception(cls, rank: int, exc: BaseException, *, kind: str = "exception",
                       actor: str | None = None) -> RankFailure:
        return cls(
            rank=rank,
            kind=kind,
            message=f"{type(exc).__name__}: {exc}".rstrip(": "),
            traceback="".join(traceback.format_exception(exc)),
            timestamp=time.time(),
            host=socket.gethostname(),
            pid=os.getpid(),
            actor=actor,
        )


def write_error_file(path: str | os.PathLike[str], failure: RankFailure) -> None:
    """Writes the failure atomically (temporary file, fsync, rename); the first one written wins,
    so a later, secondary failure of the same rank does not hide the root cause."""
    target = Path(path)
    if target.exists():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(failure.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)


def read_error_file(path: str | os.PathLike[str]) -> RankFailure | None:
    """Reads an error file; None when it is missing or unreadable (a rank killed mid-write)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return RankFailure(**data)
    except (OSError, ValueError, TypeError):
        return None
