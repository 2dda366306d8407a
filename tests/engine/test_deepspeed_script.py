"""A training script written as DeepSpeed's tutorials write one (tests/data/ds_style_train.py,
``import flowtrain as deepspeed``), launched on 2 ranks with a ds_config.json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import DATA, REPO, child_env, launch

SCRIPT = DATA / "ds_style_train.py"

pytestmark = pytest.mark.timeout(300)

DS_CONFIG = {
    "train_batch_size": 8,
    "steps_per_print": 16,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "Adam", "params": {"lr": 0.005, "betas": [0.9, 0.999], "eps": 1e-8,
                                             "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.005,
                                                 "warmup_num_steps": 10}},
    "fp16": {"enabled": False},
    "zero_optimization": {"stage": 0},
}
def _run(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    config = tmp_path / "ds_config.json"
    config.write_text(json.dumps(DS_CONFIG))
    save_dir, result = tmp_path / "ckpt", tmp_path / "result.json"
    launch(2, SCRIPT, "--deepspeed", "--deepspeed_config", str(config),
           "--save_dir", str(save_dir), "--result", str(result), run_dir=tmp_path / "run")
    return json.loads(result.read_text()), save_dir


def _check(result: dict[str, Any], save_dir: Path) -> None:
    steps = 4 * 128 // 8  # epochs * dataset / train_batch_size
    losses = result["epoch_losses"]
    assert len(losses) == 4
    assert losses[-1] < 0.7 * losses[0], losses
    assert result["global_steps"] == steps
    assert (save_dir / "latest").read_text().strip() == f"global_step{steps}"
    assert (save_dir / f"global_step{steps}" / "engine_state.pt").is_file()
    assert (save_dir / f"global_step{steps}" / "tensors" / ".metadata").is_file()
    assert Path(result["load_path"]).name == f"global_step{steps}"
    assert result["client_state"] == {"epoch": 4}
    assert result["restored"] is True
    assert result["lr"] == [pytest.approx(0.005)]


@pytest.mark.multiprocess
def test_ds_style_script_trains_and_checkpoints(tmp_path: Path) -> None:
    _check(*_run(tmp_path))


def test_initialize_attribute_survives_add_config_arguments() -> None:
    # Regression: flowtrain.initialize was once a submodule too, and importing it replaced the
    # package's initialize function ('module' object is not callable in DeepSpeed scripts).
    code = ("import argparse, flowtrain as deepspeed\n"
            "deepspeed.add_config_arguments(argparse.ArgumentParser())\n"
            "deepspeed.init_distributed\n"
            "import flowtrain.engine.engine\n"
            "print(type(deepspeed.initialize).__name__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "function"
