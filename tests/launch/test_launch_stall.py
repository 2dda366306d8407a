"""A rank deadlocked in its own code while its heartbeats go on (reliability finding 3): the
job ends within the frozen-rank bound, and the root cause names that rank, not the peer whose
collective timed out waiting for it."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from helpers import DATA, LAUNCH, launcher_env

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]


def test_rank_stuck_in_its_own_code_is_named(tmp_path: Path) -> None:
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    proc = subprocess.run([*LAUNCH, "--run-dir", str(run_dir), "--nproc-per-node", "2",
                           "--heartbeat-interval", "0.2", "--heartbeat-misses", "10",
                           str(DATA / "stall_worker.py"), str(out)],
                          cwd=tmp_path, env=launcher_env(), capture_output=True, text=True,
                          timeout=80)
    ended = time.time()
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fault = float((out / "fault_time").read_text())
    # the bound is 10 beats of 0.2 s; the collective's own timeout is minutes away
    assert ended - fault < 15.0, proc.stderr
    root = json.loads((run_dir / "job.json").read_text())["root_cause"]
    assert root["rank"] == 1 and root["kind"] == "stuck", root
    assert "has not reached the collective rank 0 has waited in" in root["message"], root
    assert "stall_worker.py:" in root["message"], root
    assert not (out / "done0").exists() and not (out / "done1").exists()
