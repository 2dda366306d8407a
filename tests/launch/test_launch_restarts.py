"""`flowtrain launch --max-restarts`: a rank SIGKILLed mid-run, the job restarted from the last
complete checkpoint ends successfully with every step done, and the steps after the resume
have exactly the losses of an uninterrupted run; each attempt is on record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import DATA, launch

WORKER = DATA / "restart_worker.py"
STEPS, KILL_AT = 20, 12  # checkpoints every 5 steps: the restart resumes from step 10


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_killed_rank_restarts_from_the_last_checkpoint(tmp_path: Path) -> None:
    launch(2, WORKER, str(tmp_path / "ref"), str(tmp_path / "ref-ckpt"), str(STEPS), "0",
           run_dir=tmp_path / "ref-run", timeout=100)
    proc = launch(2, WORKER, str(tmp_path / "out"), str(tmp_path / "ckpt"), str(STEPS),
                  str(KILL_AT), run_dir=tmp_path / "run", extra=["--max-restarts", "2"],
                  timeout=200)
    assert "restarting the job" in proc.stdout + proc.stderr
    reference = json.loads((tmp_path / "ref.attempt0.rank0").read_text())
    for rank in range(2):
        resumed = json.loads((tmp_path / f"out.attempt1.rank{rank}").read_text())
        # the second attempt ran steps 11..20 from the step-10 checkpoint
        assert sorted(int(s) for s in resumed) == list(range(11, STEPS + 1))
        ref = json.loads((tmp_path / f"ref.attempt0.rank{rank}").read_text())
        assert resumed == {s: ref[s] for s in resumed}
    assert not (tmp_path / "out.attempt0.rank1").exists()  # the first attempt died
    attempts = json.loads((tmp_path / "run" / "restarts.json").read_text())
    assert [a["exit_code"] == 0 for a in attempts] == [False, True]
    cause = attempts[0]["root_cause"]
    assert cause["rank"] == 1 and "SIGKILL" in cause["message"]
    assert (tmp_path / "run" / "attempt0" / "rank1.out").exists()
    assert json.loads((tmp_path / "run" / "job.json").read_text())["exit_code"] == 0
    assert len(reference) == STEPS
