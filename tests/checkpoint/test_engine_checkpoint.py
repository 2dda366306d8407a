"""Checkpoints end to end: a 2-rank run stopped at step 10 and resumed from its checkpoint
continues exactly as the uninterrupted run (losses, lr, weights, ==, and the gradient buckets'
layout), and a process killed in the middle of a save leaves the previous checkpoint as
``latest``, loadable."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers import DATA, launch, rank_results, run_single

WORKER = DATA / "engine_worker.py"
WORLD, STEPS = 2, 20

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """dropout -> (uninterrupted 20 steps, first 10 steps + save, resumed 11-20, ckpt dir)."""
    cache: dict[str, Any] = {}

    def run(dropout: str) -> Any:
        if dropout not in cache:
            root = tmp_path_factory.mktemp(f"resume{dropout}")
            results = {}
            for phase, ckpt in (("full", root / "unused"), ("first", root / "ckpt"),
                                ("second", root / "ckpt")):
                out = root / phase
                launch(WORLD, WORKER, "resume", str(out), str(ckpt), phase, dropout,
                       run_dir=root / f"run-{phase}")
                results[phase] = rank_results(out, WORLD)
            cache[dropout] = (results["full"], results["first"], results["second"],
                              root / "ckpt")
        return cache[dropout]

    return run


def _check_resume(run: Any, rng: bool) -> None:
    full, first, second, ckpt = run
    assert (ckpt / "latest").read_text().strip() == "global_step10"
    assert (ckpt / "global_step10" / "engine_state.pt").is_file()
    for r in range(WORLD):
        assert len(full[r]["losses"]) == STEPS
        assert first[r]["global_steps"] == 10 and second[r]["start"] == 10
        assert second[r]["global_steps"] == STEPS
        # the first half is the same run
        assert first[r]["losses"] == {k: v for k, v in full[r]["losses"].items() if int(k) <= 10}
        # the resumed half continues it exactly (bit for bit)
        tail = {k: v for k, v in full[r]["losses"].items() if int(k) > 10}
        assert sorted(second[r]["losses"], key=int) == sorted(tail, key=int)
        for k in sorted(tail, key=int):
            assert second[r]["losses"][k] == tail[k], f"rank {r} step {k}"
            assert second[r]["lrs"][k] == full[r]["lrs"][k], f"rank {r} step {k} lr"
        assert second[r]["params"] == full[r]["params"]
        # the gradient buckets as the first half settled them, from the first resumed step on
        # (this model's gradients arrive in another order than the engine starts with)
        assert first[r]["layout"] != second[r]["layout_before_load"]
        assert second[r]["layout_at_load"] == first[r]["layout"] == full[r]["layout"]
        if rng:  # the global torch generator continues where the uninterrupted run's is
            assert second[r]["torch_rng_next"] == full[r]["torch_rng_next"]


@pytest.mark.multiprocess
def test_resume_without_dropout_continues_exactly(resume_runs: Any) -> None:
    # model, optimizer, scheduler, loss scaler, counters and dataloader position resume exactly
    _check_resume(resume_runs("0.0"), rng=False)


@pytest.mark.multiprocess
def test_resume_with_dropout_is_bit_identical(resume_runs: Any) -> None:
    _check_resume(resume_runs("0.3"), rng=True)


@pytest.mark.multiprocess
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    crashed = run_single(WORKER, "crash", str(tmp_path / "crash"), str(ckpt), "crash",
                         check=False)
    data = json.loads(Path(f"{tmp_path / 'crash'}.rank0.json").read_text())
    assert "error" not in data, data.get("error")
    assert crashed.returncode == 17, crashed.stderr[-3000:]
    assert data["global_steps"] == 5
    # the step-10 save died after its first file: nothing of it is published
    assert (ckpt / "latest").read_text().strip() == "global_step5"
    assert not (ckpt / "global_step10").exists()
    assert (ckpt / "global_step5" / "engine_state.pt").is_file()

    run_single(WORKER, "crash", str(tmp_path / "load"), str(ckpt), "load")
    loaded = json.loads(Path(f"{tmp_path / 'load'}.rank0.json").read_text())
    assert Path(loaded["path"]).name == "global_step5"
    assert loaded["global_steps"] == 5
    assert loaded["params"] == data["step5_params"]
    # a later save over the crashed one's leftovers publishes cleanly
    assert loaded["latest_after_resave"] == "global_step10"
    assert [n for n in loaded["after_resave"] if not n.startswith(".")] == \
        ["global_step10", "global_step5", "latest"]
    assert not [n for n in loaded["after_resave"] if n.startswith(".")]
