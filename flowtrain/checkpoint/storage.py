"""The storage layer under torch.distributed.checkpoint: DCP still plans every save and load
(which rank writes which block, resharding on load, the ``.metadata`` file); these classes only
decide how a tensor's bytes sit in a rank's ``.distcp`` file.

DCP's own FileSystemWriter stores each tensor as a separate ``torch.save`` zip archive. For the
many small tensors of an optimizer state (a bias, a norm's weight, Adam's moments of each) that
archive costs far more than the bytes: a pickled header, per-record CRC-32, dozens of small
writes through a Python stream. ``RawWriter`` writes each tensor's bytes as they are in memory,
contiguous, and marks the entry with the ``RAW`` transform descriptor; the dtype and the block's
shape it needs to read them back are already in DCP's metadata. It also hashes the file while it
writes it, so the manifest does not read every file back (see ``manifest.write_manifest``).

``RawReader`` reads those entries and hands any other to DCP's reader, so checkpoints written
by DCP's own writer (earlier flowtrain versions, other tools) load as before. DCP's reader meets
``RAW`` as an unknown transform and refuses the entry (ValueError naming it) rather than
misreading it; ``flowtrain checkpoint consolidate`` turns a checkpoint into one plain
``torch.save`` file for tools that read no flowtrain."""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

try:  # DCP's per-entry record; private, so a torch without it keeps DCP's own format
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    # raw bytes are the machine's byte order; every platform torch trains on is little-endian
    RAW_SUPPORTED = "transform_descriptors" in getattr(_StorageInfo, "__dataclass_fields__",
                                                       {}) and sys.byteorder == "little"
except ImportError:  # pragma: no cover - depends on the torch installed
    RAW_SUPPORTED = False

RAW = "flowtrain-raw/1"
SUFFIX = ".distcp"
# the write result that carries a file's digest from its rank to the coordinator's finish();
# removed there, so the metadata file never holds it
_DIGEST_FQN = "__flowtrain_file_digest__"


@dataclass(frozen=True)
class FileDigest:
    """A ``.distcp`` file as its rank wrote it: its name, size and SHA-256."""

    name: str
    size: int
    sha256: str


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    """``tensor``'s elements as they lie in memory (row-major), without a copy where it is
    already a contiguous CPU tensor of its own."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())  # type: ignore[arg-type]


class RawWriter(dcp.FileSystemWriter):
    """DCP's file-system writer with each tensor stored as its raw bytes (one file per rank).
    ``digests`` holds, on the coordinator after the save, every rank's file digest."""

    def __init__(self, path: str | os.PathLike[str], **kwargs: Any) -> None:
        super().__init__(path, single_file_per_rank=True, **kwargs)
        self.digests: dict[str, FileDigest] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if not RAW_SUPPORTED:  # pragma: no cover - depends on the torch installed
            return super().write_data(plan, planner)
        name = f"{plan.storage_data.prefix}0{SUFFIX}"
        digest = hashlib.sha256()
        results: list[WriteResult] = []
        with open(os.path.join(self.path, name), "wb") as stream:
            for item in plan.items:
                data = planner.resolve_data(item)
                if isinstance(data, torch.Tensor):
                    payload: Any = _raw_bytes(data)
                    descriptors: list[str] | None = [RAW]
                else:  # WriteItemType.BYTE_IO: bytes DCP's reader reads as they are
                    payload = data.getbuffer()
                    descriptors = None
                offset = stream.tell()
                stream.write(payload)
                digest.update(payload)
                length = stream.tell() - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length,
                                                                     descriptors)))
            size = stream.tell()
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        results.append(WriteResult(index=MetadataIndex(_DIGEST_FQN), size_in_bytes=0,
                                   storage_data=FileDigest(name, size, digest.hexdigest())))
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        kept: list[list[WriteResult]] = []
        for rank_results in results:
            mine = []
            for r in rank_results:
                if isinstance(r.storage_data, FileDigest):
                    self.digests[r.storage_data.name] = r.storage_data
                else:
                    mine.append(r)
            kept.append(mine)
        super().finish(metadata, kept)


class RawReader(dcp.FileSystemReader):
    """DCP's file-system reader that also reads ``RawWriter``'s raw entries."""

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._tensors = metadata.state_dict_metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        raw: list[Any] = []
        other: list[Any] = []
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            is_raw = item.type != LoadItemType.BYTE_IO and \
                RAW in (getattr(info, "transform_descriptors", None) or ())
            (raw if is_raw else other).append(item)
        if other:
            super().read_data(LoadPlan(other, plan.storage_data, plan.planner_data),
                              planner).wait()
        by_file: dict[str, list[Any]] = {}
        for item in raw:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in by_file.items():
            with open(os.path.join(self.path, name), "rb") as f:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    stored = self._stored_block(item.storage_index, f)
                    block = stored
                    for dim, (start, length) in enumerate(zip(item.storage_offsets,
                                                              item.lengths, strict=True)):
                        block = block.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.size() != block.size():
                        raise ValueError(f"checkpoint entry {item.storage_index.fqn!r}: the "
                                         f"block read is {tuple(block.size())}, the load "
                                         f"asks for {tuple(target.size())}")
                    target.copy_(block)
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _stored_block(self, index: MetadataIndex, f: Any) -> torch.Tensor:
        """The whole stored block at ``index``, read from the open file ``f``."""
        info = self.storage_data[index]
        meta = self._tensors[index.fqn]
        if not isinstance(meta, TensorStorageMetadata):
            raise ValueError(f"checkpoint entry {index.fqn!r} is stored raw but its metadata "
                             f"is not a tensor's")
        chunks = meta.chunks
        hint = index.index
        chunk = chunks[hint] if hint is not None and hint < len(chunks) and \
            torch.Size(chunks[hint].offsets) == index.offset else \
            next((c for c in chunks if torch.Size(c.offsets) == index.offset), None)
        if chunk is None:
            raise ValueError(f"checkpoint entry {index.fqn!r} has no stored block at offset "
                             f"{tuple(index.offset or ())}")
        dtype = meta.properties.dtype
        want = chunk.sizes.numel() * dtype.itemsize
        if info.length != want:
            raise ValueError(f"checkpoint entry {index.fqn!r}: {info.length} bytes stored, "
                             f"its shape {tuple(chunk.sizes)} of {dtype} needs {want}")
        f.seek(info.offset)
        data = bytearray(info.length)
        if f.readinto(data) != info.length:
            raise ValueError(f"checkpoint file {f.name} ends inside entry {index.fqn!r}")
        if not data:
            return torch.empty(tuple(chunk.sizes), dtype=dtype)
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(tuple(chunk.sizes))
