"""``"checkpoint": {"auto_resume": true}``: a job restarted by `flowtrain launch
--max-restarts` resumes from the latest complete checkpoint though its script never calls
load_checkpoint, with exactly the losses of an uninterrupted run; with no checkpoint yet it
starts fresh; without a save_dir the config is refused naming the key."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import engine_common as ec
import flowtrain
from flowtrain.config import ConfigError, load_config
from helpers import DATA, launch

WORKER = DATA / "auto_resume_worker.py"
# checkpoints every 10 steps; the kill comes before step 40's; the learning rate warms up over
# 50 steps, so the resumed steps need the scheduler's state too
STEPS, KILL_AT = 50, 40


def _record(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    data["losses"] = {int(k): v for k, v in data["losses"].items()}
    return data


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Each rank's record of an uninterrupted run (synchronous saves), for both cases."""
    tmp = tmp_path_factory.mktemp("reference")
    launch(2, WORKER, str(tmp / "ref"), str(tmp / "ref-ckpt"), str(STEPS), "0", "0",
           run_dir=tmp / "ref-run", timeout=120)
    records = [_record(tmp / f"ref.attempt0.rank{rank}") for rank in range(2)]
    for record in records:
        assert sorted(record["losses"]) == list(range(1, STEPS + 1))
        assert record["resumed"] is None  # nothing to resume: a fresh start
    return records


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("async_save", ["0", "1"], ids=["sync_save", "async_save"])
def test_a_killed_rank_resumes_without_load_checkpoint(tmp_path: Path, async_save: str,
                                                       reference: list[dict[str, Any]]) -> None:
    proc = launch(2, WORKER, str(tmp_path / "out"), str(tmp_path / "ckpt"), str(STEPS),
                  str(KILL_AT), async_save, run_dir=tmp_path / "run",
                  extra=["--max-restarts", "2"], timeout=240)
    assert "restarting the job" in proc.stdout + proc.stderr
    assert not (tmp_path / "out.attempt0.rank1").exists()  # the first attempt died
    for rank in range(2):
        resumed = _record(tmp_path / f"out.attempt1.rank{rank}")
        # A synchronous save of step 30 is published before step 31; an asynchronous one
        # may still be in flight 10 steps later, when the kill comes: then step 20's is the
        # latest complete checkpoint.
        start = int(Path(resumed["resumed"]).name.removeprefix("global_step"))
        assert start in ((30,) if async_save == "0" else (20, 30))
        assert resumed["resumed"] == str(tmp_path / "ckpt" / f"global_step{start}")
        # the second attempt ran the steps after that checkpoint's, bit for bit
        assert sorted(resumed["losses"]) == list(range(start + 1, STEPS + 1))
        assert resumed["losses"] == {s: reference[rank]["losses"][s] for s in resumed["losses"]}
    attempts = json.loads((tmp_path / "run" / "restarts.json").read_text())
    assert [a["exit_code"] == 0 for a in attempts] == [False, True]
    assert (tmp_path / "ckpt" / "latest").read_text() == f"global_step{STEPS}"


def test_auto_resume_needs_a_save_dir() -> None:
    with pytest.raises(ConfigError) as caught:
        load_config({"train_batch_size": 8, "checkpoint": {"auto_resume": True}})
    assert "checkpoint.auto_resume true needs checkpoint.save_dir" in str(caught.value)
    cfg = load_config({"train_batch_size": 8,
                       "checkpoint": {"auto_resume": True, "save_dir": "ckpt"}})
    assert cfg.checkpoint.auto_resume and cfg.checkpoint.save_dir == "ckpt"


def _train(engine: Any, steps: int) -> None:
    for step in range(steps):
        x, y = ec.micro_batch(step, 0, 0, 4)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def _params(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


@pytest.mark.timeout(120)
def test_auto_resume_starts_fresh_then_resumes(tmp_path: Path, world1: None) -> None:
    config = {"train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "checkpoint": {"save_dir": str(tmp_path / "ckpt"), "auto_resume": True}}
    fresh_model = ec.make_model(0)
    initial = {k: v.detach().clone() for k, v in fresh_model.state_dict().items()}
    engine, *_ = flowtrain.initialize(model=fresh_model, config=config)
    # nothing saved yet: the model as built, at step 0
    assert engine.resumed_checkpoint is None and engine.global_steps == 0
    assert all(torch.equal(v, initial[k]) for k, v in _params(engine).items())
    _train(engine, 3)
    engine.save_checkpoint(client_state={"epoch": 7})  # into checkpoint.save_dir
    saved = _params(engine)
    engine.destroy()
    # another model (another seed): auto_resume replaces its weights with the saved ones
    again, *_ = flowtrain.initialize(model=ec.make_model(1), config=config)
    assert again.resumed_checkpoint == str(tmp_path / "ckpt" / "global_step3")
    assert again.resumed_client_state == {"epoch": 7}
    assert again.global_steps == 3
    assert all(torch.equal(v, saved[k]) for k, v in _params(again).items())
    again.destroy()
