"""Checkpoint files on disk: the staging/rename protocol (the DCP tensor files written inside
it), the latest pointer, bad tags, the copy set aside while a tag is re-saved, and the old
layout named as such."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from flowtrain.checkpoint import atomic as ckpt
from flowtrain.checkpoint.manifest import MANIFEST, CheckpointError


def _save(root: Path, tag: str, value: int) -> Path:
    return ckpt.save(root, tag, rank=0, shared={"v": value}, per_rank={"r": value},
                     barrier=lambda name: None)


def test_save_publishes_and_moves_latest_last(tmp_path: Path) -> None:
    _save(tmp_path, "a", 1)
    _save(tmp_path, "b", 2)
    assert (tmp_path / "latest").read_text() == "b"
    shared, mine = ckpt.load(ckpt.resolve(tmp_path, None), 0)
    assert shared == {"v": 2} and mine == {"r": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "latest"]  # no leftovers


def test_leftover_staging_is_replaced_and_resave_of_a_tag_works(tmp_path: Path) -> None:
    (tmp_path / ".a.partial").mkdir()
    (tmp_path / ".a.partial" / "junk").write_text("from a crash")
    _save(tmp_path, "a", 1)
    _save(tmp_path, "a", 3)
    assert ckpt.load(ckpt.resolve(tmp_path, "a"), 0)[0] == {"v": 3}
    assert not (tmp_path / ".a.partial").exists() and not (tmp_path / ".a.replaced").exists()


def test_crash_between_renames_of_a_resave_loads_the_old_copy(tmp_path: Path) -> None:
    _save(tmp_path, "a", 1)
    (tmp_path / "a").rename(tmp_path / ".a.replaced")  # the state a crash there leaves
    assert ckpt.load(ckpt.resolve(tmp_path, None), 0)[0] == {"v": 1}


def test_missing_and_bad_checkpoints(tmp_path: Path) -> None:
    assert ckpt.resolve(tmp_path, None) is None
    (tmp_path / "broken").mkdir()
    with pytest.raises(FileNotFoundError, match="incomplete or missing"):
        ckpt.resolve(tmp_path, "broken")
    for bad in ("", "../x", ".hidden", "latest"):
        with pytest.raises(ValueError, match="plain directory name"):
            ckpt.validate_tag(bad)
    torch.save({}, tmp_path / "x.pt")  # loadable files alone do not make a checkpoint
    with pytest.raises(FileNotFoundError):
        ckpt.resolve(tmp_path, "x.pt")


def test_failed_tensor_write_publishes_nothing(tmp_path: Path) -> None:
    """The DCP files are written into the staging directory: a failure there (or a crash)
    leaves the previous checkpoint and ``latest`` as they were; the next save cleans up."""
    _save(tmp_path, "a", 1)
    seen: list[Path] = []

    def fail(directory: Path) -> None:
        seen.append(directory)
        directory.mkdir()
        (directory / "__0_0.distcp").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(CheckpointError, match="OSError: disk full"):
        ckpt.save(tmp_path, "b", rank=0, shared={"v": 2}, per_rank={"r": 2},
                  barrier=lambda name: None, write_tensors=fail)
    assert seen == [tmp_path / ".b.partial" / ckpt.TENSOR_DIR]
    assert (tmp_path / "latest").read_text() == "a" and not (tmp_path / "b").exists()
    assert ckpt.load(ckpt.resolve(tmp_path, None), 0)[0] == {"v": 1}
    ckpt.save(tmp_path, "b", rank=0, shared={"v": 2}, per_rank={"r": 2},
              barrier=lambda name: None, write_tensors=lambda d: d.mkdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "latest"]
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == \
        [ckpt.ENGINE_FILE, MANIFEST, ckpt.rank_file(0), ckpt.TENSOR_DIR]


@pytest.mark.parametrize("how", ["enospc", "dcp_wrapped"])
def test_disk_full_is_named_and_leaves_the_last_good_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """ENOSPC raised as such, or hidden by DCP's writer ("unexpected pos") on a disk with no
    space left: one line naming the directory and the full disk; no partial directory stays."""
    import errno
    import shutil

    _save(tmp_path, "a", 1)

    def fail(directory: Path) -> None:
        directory.mkdir()
        (directory / "__0_0.distcp").write_bytes(b"half")
        if how == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(
            10 << 30, 10 << 30, 0))  # type: ignore[attr-defined]
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 "
                           "vs 598")

    with pytest.raises(CheckpointError) as caught:
        ckpt.save(tmp_path, "b", rank=0, shared={"v": 2}, per_rank={"r": 2},
                  barrier=lambda name: None, write_tensors=fail)
    message = str(caught.value)
    assert "no space left on device" in message and str(tmp_path) in message, message
    assert "'a' is still the latest checkpoint" in message and "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "latest"]
    assert ckpt.load(ckpt.resolve(tmp_path, None), 0)[0] == {"v": 1}


def test_binary_latest_is_named(tmp_path: Path) -> None:
    _save(tmp_path, "a", 1)
    (tmp_path / "latest").write_bytes(b"\xff\x00\x80")
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'latest'} is damaged"):
        ckpt.resolve(tmp_path, None)


def test_checkpoint_of_the_old_layout_is_named(tmp_path: Path) -> None:
    (tmp_path / "old").mkdir()
    torch.save({}, tmp_path / "old" / ckpt.LEGACY_MODEL_FILE)
    with pytest.raises(ValueError, match="older flowtrain") as info:
        ckpt.resolve(tmp_path, "old")
    assert str(tmp_path / "old") in str(info.value)


def test_checkpoint_barrier_spans_the_whole_job_not_the_data_parallel_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline of 2 stages has a data-parallel group of 1; its stages still write into one
    staging directory, so rank 0 must wait for the other stage before publishing it (CI once
    saw stage 1's file land after stage 0 had renamed the directory)."""
    import torch.distributed as dist

    from flowtrain.engine.surface import EngineSurface
    from flowtrain.runtime import rank as rank_mod

    waited: list[str] = []

    class FakeRank:
        def barrier(self, name: str) -> None:
            waited.append(name)

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(rank_mod, "current_rank", lambda: FakeRank())

    class OneStage(EngineSurface):
        world_size = 1  # the data-parallel group

    OneStage().job_barrier("ckpt-x-written")
    assert waited == ["ckpt-x-written"]
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    OneStage().job_barrier("ckpt-y-written")
    assert waited == ["ckpt-x-written"]


def test_a_dead_saves_partial_directory_is_removed_by_the_next_save(tmp_path: Path) -> None:
    """A save killed mid-way left ``.x.partial`` (another tag than the next save's): the next
    save removes it when its owner process is gone, and keeps one whose owner still runs."""
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    host = socket.gethostname()
    for name, pid in ((".x.partial", dead.stdout.strip()), (".y.partial", str(os.getpid()))):
        (tmp_path / name / ckpt.TENSOR_DIR).mkdir(parents=True)
        (tmp_path / name / ckpt.OWNER_FILE).write_text(f"{host} {pid}")
    (tmp_path / ".z.partial").mkdir()  # no owner: not known to be ours, kept
    _save(tmp_path, "a", 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".y.partial", ".z.partial", "a",
                                                          "latest"]
    assert not (tmp_path / "a" / ckpt.OWNER_FILE).exists()
