"""``"checkpoint": {"async_save": true}``: save_checkpoint returns once the state is in host
memory and a background thread writes it; what it writes loads to the same state as a
synchronous save of the same moment, though training changed the model meanwhile; a crash
during the background write leaves the last published checkpoint; at most one write is in
flight, and waiting for one is bounded; under ZeRO 1 and 3 on 2 ranks (sharded tensors staged
shard by shard) the async save holds the same tensors as a sync save."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import engine_common as ec
import flowtrain
import flowtrain.checkpoint.save as dcp_save
from flowtrain.checkpoint import consolidate, save_engine
from flowtrain.checkpoint.background import BackgroundWriter
from flowtrain.checkpoint.manifest import MANIFEST, CheckpointError, listed_files, sha256_of
from helpers import DATA, launch, run_single

pytestmark = [pytest.mark.timeout(120)]


def _config(save_dir: Path, async_save: bool) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "checkpoint": {"save_dir": str(save_dir), "async_save": async_save}}


def _train(engine: Any, first: int, steps: int) -> None:
    for step in range(first, first + steps):
        x, y = ec.micro_batch(step, 0, 0, 4)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()


def _state(engine: Any) -> dict[str, torch.Tensor]:
    """The model's parameters and every optimizer state tensor, by name."""
    out = {f"model/{k}": v.detach().clone() for k, v in engine.module.state_dict().items()}
    for name, p in zip(engine.param_names, engine.trainable):
        for key, value in engine.optimizer.state.get(p, {}).items():
            out[f"optim/{name}/{key}"] = torch.as_tensor(value).clone()
    return out


def test_async_save_loads_as_the_sync_save_of_the_same_moment(
        tmp_path: Path, world1: None, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, *_ = flowtrain.initialize(model=ec.make_model(0),
                                      config=_config(tmp_path / "async", True))
    _train(engine, 0, 3)
    save_engine(engine, str(tmp_path / "sync"))  # the reference: written before it returns
    at_save = _state(engine)
    # the background write waits until training has changed the model: the write must come
    # from the host copy made before save_checkpoint returned
    trained_on = threading.Event()
    real_write = dcp_save.write

    def write_later(*args: Any) -> None:
        assert trained_on.wait(30), "save_checkpoint did not return before its write"
        real_write(*args)

    monkeypatch.setattr(dcp_save, "write", write_later)
    engine.save_checkpoint()
    assert engine.checkpoint_writer is not None and engine.checkpoint_writer.busy
    assert not (tmp_path / "async" / "latest").exists()  # published only after the write
    _train(engine, 3, 2)
    now = _state(engine)
    assert any(not torch.equal(now[k], v) for k, v in at_save.items() if k.startswith("model/"))
    trained_on.set()
    engine.destroy()  # waits for the write
    assert (tmp_path / "async" / "latest").read_text() == "global_step3"
    monkeypatch.setattr(dcp_save, "write", real_write)

    loaded = {}
    for name in ("sync", "async"):
        fresh, *_ = flowtrain.initialize(model=ec.make_model(1),
                                         config=_config(tmp_path / "unused", False))
        path, _ = fresh.load_checkpoint(str(tmp_path / name))
        assert path == str(tmp_path / name / "global_step3")
        loaded[name] = _state(fresh)
        fresh.destroy()
    assert loaded["sync"].keys() == loaded["async"].keys() == at_save.keys()
    for key, value in at_save.items():
        assert torch.equal(loaded["sync"][key], value), key
        assert torch.equal(loaded["async"][key], value), key


@pytest.mark.multiprocess
def test_a_crash_during_the_background_write_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    proc = run_single(DATA / "async_crash_worker.py", str(tmp_path / "params.json"),
                      str(tmp_path / "ckpt"), "crash", check=False, timeout=100)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])
    root = tmp_path / "ckpt"
    assert (root / "latest").read_text() == "global_step10"
    assert not (root / "global_step20").exists()
    assert (root / ".global_step20.partial" / "tensors" / ".metadata").is_file()  # written
    saved = json.loads((tmp_path / "params.json").read_text())
    state = consolidate(str(root))  # the step-10 checkpoint, verified against its manifest
    assert state.keys() == saved.keys()
    for key, value in saved.items():
        assert torch.equal(state[key], torch.tensor(value)), key


@pytest.mark.multiprocess
def test_a_script_that_ends_right_after_a_save_still_publishes_it(tmp_path: Path) -> None:
    run_single(DATA / "async_crash_worker.py", str(tmp_path / "params.json"),
               str(tmp_path / "ckpt"), "exit", timeout=100)
    root = tmp_path / "ckpt"
    assert (root / "latest").read_text() == "global_step20"
    saved = json.loads((tmp_path / "params.json").read_text())
    state = consolidate(str(root))  # verified against its manifest
    for key, value in saved.items():
        assert torch.equal(state[key], torch.tensor(value)), key


def _stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's DCP files, whole (read without a process group)."""
    import torch.distributed.checkpoint as dcp

    from flowtrain.checkpoint.dcp_io import quiet, stored
    from flowtrain.checkpoint.storage import RawReader

    targets = {k: torch.empty(shape, dtype=dtype)
               for k, (shape, dtype) in stored(directory).items()}
    with quiet():
        dcp.load(targets, storage_reader=RawReader(directory), no_dist=True)
    return targets


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("stage", [1, 3])
def test_sharded_async_save_holds_what_the_sync_save_holds(tmp_path: Path, stage: int) -> None:
    # under ZeRO each rank writes its pieces as sharded tensors, staged shard by shard
    launch(2, DATA / "async_zero_worker.py", str(tmp_path / "sync"), str(tmp_path / "async"),
           str(stage), run_dir=tmp_path / "run", timeout=150)
    assert (tmp_path / "async" / "latest").read_text() == "global_step5"
    # the second save (step 5) refilled the first one's host buffers and reused their
    # descriptions: it must hold step 5's values, not step 3's
    first = _stored_tensors(tmp_path / "sync" / "global_step3" / "tensors")
    for tag in ("global_step3", "global_step5"):
        sync = _stored_tensors(tmp_path / "sync" / tag / "tensors")
        written = _stored_tensors(tmp_path / "async" / tag / "tensors")
        assert any(k.startswith("optim/") for k in sync)
        assert sync.keys() == written.keys()
        for key, value in sync.items():
            assert torch.equal(written[key], value), (tag, key)
        if tag == "global_step5":
            assert all(not torch.equal(first[k], v) for k, v in sync.items()
                       if k.startswith("param/"))
        # both saves' manifests: every file of both ranks, its size and checksum as on disk
        for kind in ("sync", "async"):
            directory = tmp_path / kind / tag
            files = json.loads((directory / MANIFEST).read_text())["files"]
            assert sorted(files) == listed_files(directory)
            assert {"rank00001_states.pt", "tensors/__1_0.distcp"} <= set(files)
            assert files == {name: {"size": (directory / name).stat().st_size,
                                    "sha256": sha256_of(directory / name)} for name in files}


def test_one_write_in_flight_and_a_bounded_wait() -> None:
    writer = BackgroundWriter()
    release = threading.Event()
    writer.start("global_step5", lambda: release.wait(30) and None)
    with pytest.raises(RuntimeError, match="still being written"):
        writer.start("global_step5", lambda: None)
    with pytest.raises(CheckpointError, match=r"'global_step5' has not finished after 0.2 s"):
        writer.wait(timeout=0.2)
    release.set()
    writer.wait()
    assert not writer.busy

    def fail() -> None:
        raise OSError("disk gone")

    writer.start("global_step7", fail)
    with pytest.raises(OSError, match="disk gone"):
        writer.wait()
    writer.wait()  # the error is raised once


@pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-thread nice values here")
def test_background_write_runs_at_lowest_priority_and_training_does_not() -> None:
    seen: list[int] = []
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    writer = BackgroundWriter()
    writer.start("t", lambda: seen.append(os.getpriority(os.PRIO_PROCESS,
                                                          threading.get_native_id())))
    writer.wait(30)
    assert seen == [19]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_a_cached_save_plan_is_not_reused_for_another_model(tmp_path: Path, world1: None) -> None:
    # DCP's plan cache is per process: saves of two engines with different parameters in
    # one world, taking turns, must each write their own tensors
    from torch import nn

    def engine_of(width: int) -> Any:
        torch.manual_seed(width)
        model = nn.Sequential(nn.Linear(6, width), nn.Linear(width, 3))
        engine, *_ = flowtrain.initialize(model=model, config=_config(tmp_path / "unused", False))
        return engine

    engines = {w: engine_of(w) for w in (5, 11)}
    for round_ in range(2):
        for width, engine in engines.items():
            x = torch.randn(4, 6)
            engine.backward(engine(x).square().mean())
            engine.step()
            save_engine(engine, str(tmp_path / f"w{width}"), tag=f"r{round_}")
            stored = _stored_tensors(tmp_path / f"w{width}" / f"r{round_}" / "tensors")
            params = dict(zip(engine.param_names, engine.trainable, strict=True))
            assert {k.removeprefix("param/") for k in stored if k.startswith("param/")} \
                == set(params)
            for name, p in params.items():
                assert torch.equal(stored[f"param/{name}"], p.detach().float()), (width, name)
    for engine in engines.values():
        engine.destroy()


def test_a_cached_save_plan_is_not_reused_for_another_dtype(tmp_path: Path, world1: None) -> None:
    # DCP compares a cached plan by keys, shapes and blocks, not dtypes, and its cached
    # metadata records each entry's dtype: an fp32 and a bf16 engine of the same shapes, saving
    # in turn, must each have their buffers stored and read back in their own dtype
    from torch import nn

    from flowtrain.checkpoint.dcp_io import stored

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 3)
            self.register_buffer("shift", torch.arange(3.0) / 7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) + self.shift

    def engine_of(precision: str) -> Any:
        torch.manual_seed(0)
        config = _config(tmp_path / "unused", False)
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        engine, *_ = flowtrain.initialize(model=Net(), config=config)
        return engine

    engines = {p: engine_of(p) for p in ("fp32", "bf16")}
    for round_ in range(2):
        for precision, engine in engines.items():
            directory = tmp_path / precision / f"r{round_}" / "tensors"
            save_engine(engine, str(tmp_path / precision), tag=f"r{round_}")
            buffer = engine.module.shift
            assert stored(directory)["module/shift"][1] == buffer.dtype, (precision, round_)
            assert torch.equal(_stored_tensors(directory)["module/shift"], buffer)
    for engine in engines.values():
        engine.destroy()
