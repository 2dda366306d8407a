"""`flowtrain simulate` given a model as a file (an architecture file, a Hugging Face config) and
the nodes' network by --nic-gbps / --nics-per-node: the same prediction as the preset and the
profile they stand for, and one-line errors for bad values."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from flowtrain.cli import main
from sims.architecture import PRESETS
from sims.hardware import BUILTIN_PROFILES, Link
from sims.model_files import architecture_dict


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4,
        "bf16": {"enabled": True}, "zero_optimization": {"stage": 3}}))
    return path


def _predict(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code = main(["simulate", *args, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return dict(json.loads(out))


_SAME = ("step_time_s", "step_time_range_s", "peak_memory_bytes", "mfu", "exposed_comm_s")


def test_a_model_file_predicts_what_its_preset_does(capsys: pytest.CaptureFixture[str],
                                                   config: Path, tmp_path: Path) -> None:
    arch = tmp_path / "llama.json"
    arch.write_text(json.dumps(architecture_dict(PRESETS["llama3-8b"])))
    flags = ["--config", str(config), "--cluster", "a100-80g-x8", "--nodes", "2",
             "--seq-len", "4096"]
    preset = _predict(capsys, "--model", "llama3-8b", *flags)
    from_file = _predict(capsys, "--model", str(arch), *flags)
    assert {k: from_file[k] for k in _SAME} == {k: preset[k] for k in _SAME}


def test_nic_flags_are_the_profile_with_that_network(capsys: pytest.CaptureFixture[str],
                                                     config: Path, tmp_path: Path) -> None:
    base = BUILTIN_PROFILES["h100-x8"]
    # 4 NICs of 200 Gb/s: a quarter of the builtin node's 8 x 400 Gb/s
    slower = dataclasses.replace(base, inter_node=Link(base.inter_node.latency_s, 4 * 25e9))
    path = tmp_path / "slow.json"
    slower.save(path)
    flags = ["--model", "llama3-8b", "--config", str(config), "--nodes", "4",
             "--seq-len", "2048"]
    by_flags = _predict(capsys, *flags, "--cluster", "h100-x8", "--nic-gbps", "200",
                        "--nics-per-node", "4")
    by_file = _predict(capsys, *flags, "--cluster", str(path))
    builtin = _predict(capsys, *flags, "--cluster", "h100-x8")
    assert by_flags["step_time_s"] == pytest.approx(by_file["step_time_s"], rel=1e-12)
    assert by_flags["exposed_comm_s"] > builtin["exposed_comm_s"]
    # the builtin's own rate per NIC when only the count changes
    same = _predict(capsys, *flags, "--cluster", "h100-x8", "--nics-per-node", "8")
    assert same["step_time_s"] == builtin["step_time_s"]


@pytest.mark.parametrize("args,message", [
    (["--nic-gbps", "0"], "--nic-gbps must be at least 1, got 0"),
    (["--nics-per-node", "-2"], "--nics-per-node must be at least 1, got -2"),
    (["--cluster", "CPU", "--nic-gbps", "100"], "describe GPU nodes' network; the profile "
                                                "'cpu-host' is a CPU host"),
])
def test_bad_network_flags(capsys: pytest.CaptureFixture[str], config: Path, args: list[str],
                           message: str, tmp_path: Path) -> None:
    cpu = tmp_path / "cpu.json"
    dataclasses.replace(BUILTIN_PROFILES["a100-80g-x8"], name="cpu-host", kind="cpu",
                        kernels=None).save(cpu)
    args = [str(cpu) if a == "CPU" else a for a in args]
    code = main(["simulate", "--model", "gpt2", "--config", str(config), *args])
    _, err = capsys.readouterr()
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowtrain simulate: error: ")
    assert message in lines[0]


def test_a_bad_model_file_is_one_line(capsys: pytest.CaptureFixture[str], config: Path,
                                      tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": 2, "hidden": 64, "heads": 4, "vocab": 10,
                               "context": 8, "ffn": 8, "heds": 4}))
    code = main(["simulate", "--model", str(bad), "--config", str(config)])
    _, err = capsys.readouterr()
    assert code == 2
    assert "heds: unknown key; did you mean heads?" in err
    assert len(err.strip().splitlines()) == 1
