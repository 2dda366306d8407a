"""`flowtrain simulate`'s range widened by what the command does not state (sims.unstated): the
attention kernel, recompute and the micro-batch left out or marked --assumed. Each
alternative's own prediction lies inside the widened range; stated inputs widen nothing; an
alternative that does not fit the devices' memory is not tried."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flowtrain.cli import main

BASE = {"gradient_accumulation_steps": 4, "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1}}


def _predict(capsys: pytest.CaptureFixture[str], tmp_path: Path, config: dict[str, Any],
             *flags: str) -> dict[str, Any]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    code = main(["simulate", "--model", "llama3-8b", "--config", str(path), "--cluster",
                 "h100-x8", "--nodes", "2", "--seq-len", "4096", "--json", *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return dict(json.loads(out))


def test_stated_inputs_widen_nothing(capsys: pytest.CaptureFixture[str],
                                     tmp_path: Path) -> None:
    p = _predict(capsys, tmp_path, {**BASE, "train_micro_batch_size_per_gpu": 1},
                 "--attention", "flash3", "--recompute", "full")
    assert p["widened_by"] is None
    low, high = p["step_time_range_s"]
    assert low < p["step_time_s"] < high


@pytest.mark.parametrize("left_out,flags,changes", [
    ("attention", ["--recompute", "full"],
     [(["--attention", k], {}) for k in ("flash2", "flash3", "flash-triton")]),
    ("recompute", ["--attention", "flash3"],
     [(["--recompute", r], {}) for r in ("none", "selective", "full")]),
    ("micro-batch", ["--attention", "flash3", "--recompute", "full", "--assumed",
                     "micro-batch"],
     [([], {"train_micro_batch_size_per_gpu": m, "gradient_accumulation_steps": 4 // m})
      for m in (1, 2, 4)]),
])
def test_each_alternative_lies_in_the_range(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            left_out: str, flags: list[str],
                                            changes: list[tuple[list[str], dict[str, Any]]]
                                            ) -> None:
    config = {**BASE, "train_micro_batch_size_per_gpu": 1}
    p = _predict(capsys, tmp_path, config, *flags)
    assert set(p["widened_by"]) == {left_out}
    low, high = p["step_time_range_s"]
    fast, slow, tried = p["widened_by"][left_out]
    assert fast <= 1.0 <= slow and tried
    for extra, changed in changes:
        stated = [f for f in flags if f not in ("--assumed", "micro-batch")]
        other = _predict(capsys, tmp_path, {**config, **changed}, *stated, *extra,
                         *([] if "--attention" in stated + extra else ["--attention", "flash3"]),
                         *([] if "--recompute" in stated + extra else ["--recompute", "full"]))
        if other["oom"]:
            continue
        assert low <= other["step_time_s"] <= high, (extra, changed)
        # the alternative's own hardware range, around the same point, is inside too
        assert other["step_time_s"] / p["step_time_s"] == pytest.approx(
            min(max(other["step_time_s"] / p["step_time_s"], fast), slow), rel=1e-9)


def test_alternatives_that_do_not_fit_are_not_tried(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    # Llama 3 8B at 4 x 4096 tokens a rank with ZeRO-1 on two nodes: without recompute its
    # activations do not fit 80 GB
    config = {**BASE, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    p = _predict(capsys, tmp_path, config, "--attention", "flash3", "--assumed", "recompute",
                 "--recompute", "full")
    for other in ("none", "selective"):  # with flash attention selective keeps as much
        assert _predict(capsys, tmp_path, config, "--attention", "flash3", "--recompute",
                        other)["oom"]
    # neither fits, so the range is the stated run's own
    assert p["widened_by"] is None
    stated = _predict(capsys, tmp_path, config, "--attention", "flash3", "--recompute", "full")
    assert p["step_time_range_s"] == stated["step_time_range_s"]


def test_a_bad_assumed_input_is_one_line(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, "train_micro_batch_size_per_gpu": 1}))
    code = main(["simulate", "--model", "gpt2", "--config", str(path), "--assumed", "optimizer"])
    _, err = capsys.readouterr()
    assert code == 2
    assert "--assumed: 'optimizer' is not an input the range can widen by; choose from " \
        "micro-batch, recompute, attention" in err
    assert len(err.strip().splitlines()) == 1


def test_a_run_that_does_not_fit_names_what_would(capsys: pytest.CaptureFixture[str],
                                                   tmp_path: Path) -> None:
    # the same 4 x 4096 tokens a rank without recompute do not fit; with the micro-batch and
    # recompute only assumed, the report names the values that fit, each one as its own
    # stated prediction finds it
    config = {**BASE, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    flags = ["--attention", "flash3", "--recompute", "none"]
    p = _predict(capsys, tmp_path, config, *flags, "--assumed", "micro-batch,recompute")
    assert p["oom"]
    expected = []
    for m in (1, 2):
        smaller = {**config, "train_micro_batch_size_per_gpu": m,
                   "gradient_accumulation_steps": 4 // m}
        other = _predict(capsys, tmp_path, smaller, *flags)
        if not other["oom"]:
            expected.append(f"micro-batch {m} (x{other['step_time_s'] / p['step_time_s']:.2f} "
                            "step time)")
    for r in ("selective", "full"):
        other = _predict(capsys, tmp_path, config, "--attention", "flash3", "--recompute", r)
        if not other["oom"]:
            expected.append(f"recompute {r} (x{other['step_time_s'] / p['step_time_s']:.2f} "
                            "step time)")
    assert expected and p["fits_with"] == expected
    # stated, the same inputs name nothing
    assert _predict(capsys, tmp_path, config, *flags)["fits_with"] is None


def test_a_run_that_fits_names_nothing(capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    p = _predict(capsys, tmp_path, {**BASE, "train_micro_batch_size_per_gpu": 1},
                 "--attention", "flash3", "--recompute", "full", "--assumed", "micro-batch")
    assert not p["oom"] and p["fits_with"] is None
