"""Plumbing the test modules share: the repository's paths, a free port, the environment of a
child process, `flowtrain launch` runs and their per-rank results, and flowtrain.initialize at
world size 1 inside the test process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
EXAMPLES = REPO / "examples"
# What makes a process a rank of a torch.distributed job.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCH = [sys.executable, "-m", "flowtrain.cli", "launch"]


def free_port() -> int:
    """A loopback port that was free a moment ago (nothing listens on it afterwards)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """This process's environment plus what makes a child rank ``rank`` of ``world`` (a plain
    process started without the launcher)."""
    return dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra)


def child_env() -> dict[str, str]:
    """A child that is not yet a rank: this process's environment without the rank variables,
    one OpenMP thread, and tests/data and examples importable (the workers' shared modules and
    the example GPT)."""
    env = dict(os.environ)
    for k in RANK_VARIABLES:
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(DATA), str(EXAMPLES), env.get("PYTHONPATH", "")])
    return env


def launcher_env(**extra: str) -> dict[str, str]:
    """For tests of the launcher itself: no FLOWTRAIN_* settings and no OMP_NUM_THREADS from
    this process, so the launcher's own defaults show."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWTRAIN_")
           and k != "OMP_NUM_THREADS"}
    env.update(extra)
    return env


def launch(nproc: int, script: Path, *args: str, run_dir: Path | None = None,
           timeout: float = 120, extra: list[str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    """``flowtrain launch`` on this machine (``extra``: more launcher flags); fails the test
    with the output when it fails."""
    cmd = [*LAUNCH, "--nproc-per-node", str(nproc), *(extra or [])]
    if run_dir is not None:
        cmd += ["--run-dir", str(run_dir)]
    cmd += [str(script), *args]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"launch failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n"
                             f"{proc.stderr[-6000:]}")
    return proc


def run_single(script: Path, *args: str, timeout: float = 120,
               check: bool = True) -> subprocess.CompletedProcess[str]:
    """One plain process (no launcher, world size 1)."""
    proc = subprocess.run([sys.executable, str(script), *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{script.name} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
    return proc


def rank_results(out: Path | str, world: int) -> list[dict[str, Any]]:
    """What each rank wrote to ``<out>.rank<R>.json``, by rank."""
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]


def check_cases(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fails the test with the traceback of any case a rank reported as an error (a worker
    writes one result per case name); returns ``ranks``."""
    for r, data in enumerate(ranks):
        for name, result in data.items():
            assert "error" not in result, f"rank {r} {name}:\n{result['error']}"
    return ranks


def one_error_line(proc: subprocess.CompletedProcess[str],
                   prefix: str = "flowtrain launch: error: ") -> str:
    """The command failed as bad input does: exit 2 and one line on stderr starting with
    ``prefix``; returns that line."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(prefix), lines[0]
    return lines[0]


@contextlib.contextmanager
def world1() -> Iterator[None]:
    """``flowtrain.initialize`` in this process as world size 1; afterwards the process group
    and the rank runtime are torn down and the environment and SIGTERM handler restored."""
    import torch.distributed as dist

    saved_env = {k: os.environ.get(k) for k in RANK_VARIABLES}
    saved_term = signal.getsignal(signal.SIGTERM)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    try:
        yield
    finally:
        from flowtrain.runtime.rank import shutdown_rank

        shutdown_rank()
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        signal.signal(signal.SIGTERM, saved_term)
