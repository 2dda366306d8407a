"""Reliability finding 5: a rank whose script finished must not die of SIGABRT at interpreter
exit ("terminate called without an active exception") because a thread of it was still inside
a torch wait that returned during finalization; the run is reported succeeded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import DATA, launch


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_thread_left_in_a_torch_wait_does_not_abort_the_finished_rank(tmp_path: Path) -> None:
    proc = launch(2, DATA / "exit_abort_worker.py", run_dir=tmp_path / "run", timeout=100)
    output = proc.stdout + proc.stderr
    assert "terminate called" not in output
    assert output.count("script done") == 2
    job = json.loads((tmp_path / "run" / "job.json").read_text())
    assert job["status"] == "succeeded"
