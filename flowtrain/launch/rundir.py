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
        """Creates the run directory readable by its owner only: it holds the control plane's
        endpoints, the job secret (telemetry.live.json), logs and telemetry."""
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
            if self.path.stat().st_uid == os.getuid():
                os.chmod(self.path, 0o700)
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
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(record, indent=2, default=str) + "\n")
        os.replace(tmp, self.job_json)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, someone else's
        return True
    return True


def mark_stale_jobs(runs: Path, host: str) -> list[Path]:
    """Run directories beside this one (in ``runs``) whose launcher died without ending its
    job (SIGKILL, a crash of the machine): job.json says "running" but the launcher process,
    on this host, is gone. Each gets status "killed" and loses telemetry.live.json (the job
    secret). Only directories of this user, with a record naming this host and a launcher
    pid, are touched. Returns the directories marked."""
    from flowtrain.telemetry.files import LIVE_FILE

    marked: list[Path] = []
    try:
        candidates = sorted(p for p in runs.iterdir() if p.is_dir())
    except OSError:
        return marked
    for run in candidates:
        job = run / "job.json"
        try:
            if run.stat().st_uid != os.getuid():
                continue
            record = json.loads(job.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        pid = record.get("launcher_pid") if isinstance(record, dict) else None
        if record.get("status") != "running" or record.get("launcher_host") != host or \
                not isinstance(pid, int) or _alive(pid):
            continue
        record.update(status="killed", root_cause={
            "message": f"the launcher (pid {pid}) ended without finishing the job; found by a "
                       f"later launch"})
        RunDir(run).write_job(record)
        (run / LIVE_FILE).unlink(missing_ok=True)
        marked.append(run)
    return marked
