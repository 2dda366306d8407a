"""Damaged checkpoints are refused, naming the file: every file's checksum is in the manifest
written inside the atomic save and checked at load and by ``checkpoint consolidate``; a missing
per-rank file, a truncated file, a binary ``latest`` and pickled code are one-line errors; a
checkpoint written before manifests existed still loads (unverified, and says so)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import engine_common as ec
import flowtrain
from flowtrain.checkpoint.manifest import MANIFEST, CheckpointError, write_manifest
from flowtrain.cli import main as cli_main
from helpers import world1

pytestmark = [pytest.mark.timeout(120)]

CONFIG = {"train_micro_batch_size_per_gpu": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}


def _engine(seed: int) -> Any:
    engine, *_ = flowtrain.initialize(model=ec.make_model(seed), config=CONFIG)
    return engine


def _params(engine: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    """(a save_dir holding one checkpoint of 2 trained steps, the saving engine's parameters)."""
    root = tmp_path_factory.mktemp("integrity") / "ckpt"
    with world1():
        engine = _engine(0)
        for step in range(2):
            x, y = ec.micro_batch(step, 0, 0, 4)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        engine.save_checkpoint(str(root), tag="t")
        yield root, _params(engine)


@pytest.fixture
def copy(saved: tuple[Path, dict[str, Any]], tmp_path: Path) -> Path:
    shutil.copytree(saved[0], tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _load(root: Path) -> dict[str, torch.Tensor]:
    engine = _engine(1)  # other initial weights: a load must replace them all
    path, _ = engine.load_checkpoint(str(root))
    assert path is not None
    return _params(engine)


def _flip(path: Path, offset: int, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for i in range(offset, min(offset + count, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_manifest_lists_every_file_and_an_intact_checkpoint_loads(
        saved: tuple[Path, dict[str, Any]], copy: Path) -> None:
    import json

    files = json.loads((copy / "t" / MANIFEST).read_text())["files"]
    assert sorted(files) == ["engine_state.pt", "rank00000_states.pt", "tensors/.metadata",
                             "tensors/__0_0.distcp"]
    got = _load(copy)
    for key, value in saved[1].items():
        assert torch.equal(got[key], value), key


def test_flipped_bytes_in_a_shard_are_an_error_naming_it(copy: Path) -> None:
    shard = copy / "t" / "tensors" / "__0_0.distcp"
    _flip(shard, shard.stat().st_size // 2)
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match its SHA-256"):
        _load(copy)


def test_missing_rank_file_is_an_error_naming_it(copy: Path) -> None:
    (copy / "t" / "rank00000_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rank00000_states\.pt is missing"):
        _load(copy)


def test_missing_rank_file_without_manifest_is_an_error_too(copy: Path) -> None:
    (copy / "t" / MANIFEST).unlink()
    (copy / "t" / "rank00000_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rank00000_states\.pt is missing: the "
                                              r"checkpoint was saved by 1 ranks"):
        _load(copy)


def test_checkpoint_without_manifest_still_loads(saved: tuple[Path, dict[str, Any]],
                                                 copy: Path) -> None:
    from structlog.testing import capture_logs

    (copy / "t" / MANIFEST).unlink()
    with capture_logs() as logs:
        got = _load(copy)
    for key, value in saved[1].items():
        assert torch.equal(got[key], value), key
    assert any("no manifest" in e["event"] for e in logs), logs


MARKER: list[Path] = []


def _ran(path: str) -> None:
    Path(path).write_text("code from the checkpoint ran")


class _Payload:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _ran, (str(self.path),)


def test_pickled_code_in_a_checkpoint_is_not_run(copy: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    state = torch.load(copy / "t" / "engine_state.pt", weights_only=True)
    state["client_state"] = {"x": _Payload(marker)}
    torch.save(state, copy / "t" / "engine_state.pt")
    (copy / "t" / MANIFEST).unlink()
    write_manifest(copy / "t")  # a consistent manifest: only the weights-only load stops it
    with pytest.raises(CheckpointError, match="weights-only load refuses"):
        _load(copy)
    assert not marker.exists()


def _consolidate_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert cli_main(["checkpoint", "consolidate", *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("flowtrain checkpoint consolidate: error: "), lines[0]
    return lines[0]


def test_consolidate_verifies_checksums(copy: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    shard = copy / "t" / "tensors" / "__0_0.distcp"
    _flip(shard, 100, 8)
    line = _consolidate_error([str(copy), str(tmp_path / "out.pt")], capsys)
    assert "__0_0.distcp does not match its SHA-256" in line
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("damage,named", [
    ("engine", "engine_state.pt"), ("metadata", ".metadata"), ("latest", "latest"),
    ("rank", "rank00000_states.pt")])
def test_damage_without_manifest_is_one_line_naming_the_file(
        copy: Path, tmp_path: Path, damage: str, named: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Checkpoints from before manifests: the damage is still named, by the file that fails
    to read, at load and in consolidate."""
    ckpt = copy / "t"
    (ckpt / MANIFEST).unlink()
    if damage == "engine":
        (ckpt / "engine_state.pt").write_bytes((ckpt / "engine_state.pt").read_bytes()[:500])
    elif damage == "metadata":
        meta = ckpt / "tensors" / ".metadata"
        meta.write_bytes(meta.read_bytes()[:300])
    elif damage == "latest":
        (copy / "latest").write_bytes(b"\xff\xfe\x00garbage\x80")
    else:
        (ckpt / "rank00000_states.pt").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(CheckpointError, match=named.replace(".", r"\.")) as caught:
        _load(copy)
    assert "\n" not in str(caught.value)
    if damage != "rank":  # consolidate does not read the ranks' generator states
        line = _consolidate_error([str(copy), str(tmp_path / "out.pt")], capsys)
        assert named in line, line


def test_consolidate_into_a_directory_is_one_line(copy: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    line = _consolidate_error([str(copy), str(tmp_path)], capsys)
    assert "is a directory" in line and str(tmp_path) in line
