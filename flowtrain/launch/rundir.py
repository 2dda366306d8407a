"""The run directory of one launch: file names inside it, the job id, and ``job.json``."""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any


def new_job_id(now: float | None = None) -> str:
    """A sortable, mostly unique job id such as ``20261202-093012-ab12``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return f"{stamp}-{secrets.token_hex(2)}"


class RunDir:
    """Paths of the files a launch writes; node launchers of a multi-host job use their own
    names."""

    def __init__(self, path: str | os.PathLike[str], node_suffix: str = "") -> None:
        self.path = Path(path).absolute()
        # "" for the launcher that owns the job, ".node<i>" for a node launcher beside it.
        self.node_suffix = node_suffix

    def create(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OSError(f"cannot create run directory {str(self.path)!r}: "
                          f"{exc.strerror or exc}") from exc

    @property
    def launcher_log(self) -> Path:
        return self.path / f"launcher{self.node_suffix}.jsonl"

    @property
    def job_json(self) -> Path:
        return self.path / f"job{self.node_suffix}.json"

    def rank_out(self, rank: int) -> Path:
        return self.path / f"rank{rank}.out"

    def rank_error(self, rank: int) -> Path:
        return self.path / f"rank{rank}.error.json"

    def rank_log(self, rank: int) -> Path:
        return self.path / f"rank{rank}.jsonl"

    def node_out(self, node: int) -> Path:
        return self.path / f"node{node}.out"

    def write_job(self, record: dict[str, Any]) -> None:
        """Writes job.json atomically so a reader (the monitor) never sees half a file."""
        tmp = self.job_json.with_name(f".{self.job_json.name}.tmp")
        tmp.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, self.job_json)
