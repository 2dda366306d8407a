"""DeepSpeed's `--launcher slurm|openmpi` (issue 18): the ranks started as the tasks of one
srun / mpirun (stand-ins here that start the tasks locally with the variables the real ones
set; the mpirun one passes only the variables named with -x, as Open MPI does to other hosts):
the tasks form one world, join the launcher's control plane, and a failing task is the root
cause; the job secret never appears on a command line."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import DATA, LAUNCH, launcher_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]
JOB = DATA / "rank_job.py"


def _bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for kind in ("srun", "mpirun"):
        path = bin_dir / kind
        path.write_text(f"#!/bin/sh\nexec {sys.executable} {DATA / 'fake_tasks.py'} {kind} "
                        f"\"$@\"\n")
        path.chmod(0o755)
    return bin_dir


def _launch(tmp_path: Path, args: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    env = launcher_env(**extra)
    env["PATH"] = f"{_bin(tmp_path)}{os.pathsep}{env['PATH']}"
    env["FAKE_TASKS_ARGS"] = str(tmp_path / "task_args")
    return subprocess.run([*LAUNCH, "--run-dir", str(tmp_path / "run"), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=100)


@pytest.mark.parametrize("launcher", ["slurm", "openmpi"])
def test_tasks_form_one_world(tmp_path: Path, launcher: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = _launch(tmp_path, ["--launcher", launcher, "--nproc-per-node", "2",
                              "--launcher_args=--extra-flag", str(JOB), "ok", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["sum"] == seen["expected"] == 3.0
        env = seen["env"]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(rank) and env["LOCAL_WORLD_SIZE"] == "2"
        assert env["FLOWTRAIN_CONTROL_ENDPOINT"].startswith("tcp://127.0.0.1:")
        assert env["FLOWTRAIN_ERROR_FILE"].endswith(f"rank{rank}.error.json")
    job = json.loads((tmp_path / "run" / "job.json").read_text())
    assert job["mode"] == "tasks" and job["status"] == "succeeded"
    args = (tmp_path / "task_args").read_text()
    assert "--extra-flag" in args and "flowtrain.launch.bootstrap" in args
    # the secret (64 hex digits) reaches the tasks in their environment, never as an argument
    for line in args.splitlines():
        assert len(line) < 64 or not all(c in "0123456789abcdef" for c in line)


def test_a_failing_task_is_the_root_cause(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    message = f"boom-{secrets.token_hex(4)}"
    proc = _launch(tmp_path, ["--launcher", "slurm", "--nproc-per-node", "2", str(JOB),
                              "raise", str(out)], BOOM_MESSAGE=message)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    root = json.loads((tmp_path / "run" / "job.json").read_text())["root_cause"]
    assert root["rank"] == 1 and message in root["message"], root


def test_a_missing_task_launcher_is_named(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    env = launcher_env()
    env["PATH"] = str(tmp_path)  # neither srun nor mpiexec here
    proc = subprocess.run([sys.executable, "-m", "flowtrain.cli", "launch", "--launcher",
                           "mpich", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "runs 'mpiexec', which is not on PATH" in proc.stderr, \
        proc.stderr
