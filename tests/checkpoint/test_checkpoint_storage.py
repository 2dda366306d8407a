"""flowtrain's storage layer under torch.distributed.checkpoint: raw tensor bytes written and
read back exactly, files hashed as written, DCP's own format still read, and DCP's own reader
refusing the raw entries rather than misreading them."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex

from flowtrain.checkpoint.dcp_io import quiet
from flowtrain.checkpoint.storage import RAW_SUPPORTED, RawReader, RawWriter

pytestmark = pytest.mark.skipif(not RAW_SUPPORTED, reason="this torch's DCP has no per-entry "
                                "transform descriptors; flowtrain writes DCP's own format")


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(6, 8, generator=g)
    return {
        "f32": torch.randn(5, 7, generator=g),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "f16": torch.randn(2, 3, 4, generator=g).half(),
        "i64": torch.arange(-5, 9),
        "flag": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "column": wide[:, 3],  # a strided view: only its own elements are stored
        "empty": torch.empty(0, 4),
        "count": 17,  # a plain value: DCP's bytes entry
    }


def _save(state: dict[str, object], directory: Path) -> RawWriter:
    writer = RawWriter(directory)
    with quiet():
        dcp.save(state, storage_writer=writer, no_dist=True)
    return writer


def _targets(state: dict[str, object]) -> dict[str, object]:
    return {k: torch.full_like(v, 7) if isinstance(v, torch.Tensor) else 0
            for k, v in state.items()}


def test_raw_entries_read_back_exactly(tmp_path: Path) -> None:
    state = _state()
    _save(state, tmp_path)
    targets = _targets(state)
    with quiet():
        dcp.load(targets, storage_reader=RawReader(tmp_path), no_dist=True)
    for key, want in state.items():
        got = targets[key]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor)
            assert got.dtype == want.dtype and torch.equal(got, want), key
        else:
            assert got == want, key
    # each entry is its elements' bytes: a strided view its own six, not its whole storage
    stored = dcp.FileSystemReader(str(tmp_path)).read_metadata().storage_data
    for key, want in state.items():
        if isinstance(want, torch.Tensor):
            index = MetadataIndex(key, torch.Size([0] * want.dim()))
            assert stored[index].length == want.numel() * want.element_size(), key


def test_a_block_of_a_stored_tensor_reads_its_part(tmp_path: Path) -> None:
    # a load that wants part of a stored tensor (resharding) narrows the raw block
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    whole = torch.arange(40.0).reshape(8, 5)
    _save({"w": whole}, tmp_path)
    target = {"w": torch.zeros(8, 5)}
    with quiet():
        dcp.load(target, storage_reader=RawReader(tmp_path), planner=DefaultLoadPlanner(),
                 no_dist=True)
    assert torch.equal(target["w"], whole)


def test_the_writer_hashes_the_file_it_writes(tmp_path: Path) -> None:
    writer = _save(_state(), tmp_path)
    (data,) = tmp_path.glob("*.distcp")
    digest = writer.digests[data.name]
    assert digest.size == data.stat().st_size
    assert digest.sha256 == hashlib.sha256(data.read_bytes()).hexdigest()


def test_dcp_format_checkpoints_still_load(tmp_path: Path) -> None:
    # checkpoints written by DCP's own writer (earlier flowtrain versions, other tools)
    state = _state()
    with quiet():
        dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    targets = _targets(state)
    with quiet():
        dcp.load(targets, storage_reader=RawReader(tmp_path), no_dist=True)
    for key, want in state.items():
        if isinstance(want, torch.Tensor):
            assert torch.equal(targets[key], want), key  # type: ignore[arg-type]


def test_dcp_own_reader_refuses_raw_entries_by_name(tmp_path: Path) -> None:
    state = _state()
    _save(state, tmp_path)
    with quiet(), pytest.raises(CheckpointException, match="flowtrain-raw"):
        dcp.load(_targets(state), checkpoint_id=str(tmp_path), no_dist=True)


def test_a_truncated_file_is_an_error_that_names_the_entry(tmp_path: Path) -> None:
    state = {"a": torch.arange(10.0), "b": torch.arange(100.0)}
    _save(state, tmp_path)
    (data,) = tmp_path.glob("*.distcp")
    data.write_bytes(data.read_bytes()[:60])
    with quiet(), pytest.raises(CheckpointException, match="ends inside entry 'b'"):
        dcp.load({"a": torch.zeros(10), "b": torch.zeros(100)},
                 storage_reader=RawReader(tmp_path), no_dist=True)


@pytest.mark.parametrize("keys", [
    ["param/h.0.w", "param/h.1.w", "optim/h.0.w/exp_avg", "module/shift", "plain"],
    ["a", "a.b", "c.d"],  # a key that is also a group: saved flat
])
def test_grouped_saves_store_the_flat_keys(tmp_path: Path, keys: list[str]) -> None:
    # save.write groups keys by their first dotted part for DCP, which joins them back
    from flowtrain.checkpoint.dcp_io import stored
    from flowtrain.checkpoint.save import write

    state = {k: torch.full((i + 1,), float(i)) for i, k in enumerate(keys)}
    write(state, tmp_path)
    assert set(stored(tmp_path)) == set(keys)
    targets = {k: torch.zeros_like(v) for k, v in state.items()}
    with quiet():
        dcp.load(targets, storage_reader=RawReader(tmp_path), no_dist=True)
    for k, v in state.items():
        assert torch.equal(targets[k], v), k
