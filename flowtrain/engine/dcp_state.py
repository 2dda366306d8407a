"""The tensor part of a checkpoint, through torch.distributed.checkpoint (DCP): every rank writes
the pieces of the fp32 parameters and per-parameter optimizer state it holds, one 1-D tensor per
parameter, so DCP reads them back by overlap into any world size and ZeRO stage.

Keys: ``param/<name>`` (the flattened fp32 master value), ``optim/<name>/<state key>`` (each
per-element optimizer state tensor, flattened the same way), ``module/<key>`` (buffers and frozen
parameters, whole, from rank 0's module). What is not a per-element tensor (Adam's ``step``, the
parameter groups' settings, shapes) is described by ``snapshot``'s second result, which rank 0
keeps in the checkpoint's ``engine_state.pt``."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard as TensorShard
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

FORMAT = 1  # bumped when the keys or the description change meaning


@dataclass(frozen=True)
class Piece:
    """Elements [offset, offset + length) of the flattened trainable parameter ``param``, held
    by the stepped tensor ``holder`` from its element ``start`` on."""

    param: int
    offset: int
    length: int
    holder: int
    start: int


@dataclass
class Holdings:
    """What this rank holds of the trainable parameters: the tensors the optimizer steps (the
    fp32 masters when there are any) and where each parameter's elements lie in them."""

    names: list[str]
    shapes: list[tuple[int, ...]]
    stepped: list[torch.Tensor]
    members: list[list[int]]  # the parameters each stepped tensor holds (a part of)
    pieces: list[Piece]


def holdings(engine: Any, *, split: bool) -> Holdings:
    """Stage 0: every parameter whole, or (``split``, for writing in parallel) this rank's 1/N
    of each. ZeRO: the overlap of each bucket's shard with each of the bucket's parameters."""
    names = list(engine._names)
    pieces: list[Piece] = []
    if engine.zero is None:
        shapes = [tuple(p.shape) for p in engine.trainable]
        stepped = list(engine.master.master) if engine.master is not None \
            else list(engine.trainable)
        for i, shape in enumerate(shapes):
            numel = math.prod(shape)
            lo, hi = 0, numel
            if split:
                chunk = -(-numel // engine.world_size)
                # pipeline/tensor parallel: split within this rank's data-parallel group
                lo = min(numel, getattr(engine, "dp_rank", engine.global_rank) * chunk)
                hi = min(numel, lo + chunk)
            if hi > lo:
                pieces.append(Piece(i, lo, hi - lo, i, lo))
        return Holdings(names, shapes, stepped, [[i] for i in range(len(stepped))], pieces)
    zero = engine.zero
    plan = getattr(zero, "plan", None) or zero.buckets.plan
    stepped = list(zero.master)
    # the plan's shapes: under stage 3 a released parameter is an empty placeholder
    shapes = [tuple(p.shape) for p in engine.trainable]
    for bucket in plan:
        for slot in bucket.slots:
            shapes[slot.index] = tuple(slot.shape)
    members = []
    for b, bucket in enumerate(plan):
        shard = zero.shards[b]
        members.append([slot.index for slot in bucket.slots])
        for slot in bucket.slots:
            lo = max(shard.start, slot.offset)
            hi = min(shard.start + shard.numel, slot.offset + slot.numel)
            if hi > lo:
                pieces.append(Piece(slot.index, lo - slot.offset, hi - lo, b, lo - shard.start))
    return Holdings(names, shapes, stepped, members, pieces)


def flat_view(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """A 1-D view sharing ``tensor``'s memory (DCP loads write through it)."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        raise ValueError(f"{what} is not contiguous (strides {tensor.stride()}, shape "
                         f"{tuple(tensor.shape)}); checkpoints need contiguous tensors")
    return tensor.view(-1)


def _per_element(state: dict[str, Any], stepped: torch.Tensor) -> tuple[dict[str, torch.Tensor],
                                                                          dict[str, Any]]:
    """Splits optimizer state into per-element tensors (sliced like the parameter) and the rest
    (``step``, anything else), which is the same on every rank."""
    per, rest = {}, {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.shape == stepped.shape and key != "step":
            per[key] = value
        else:
            rest[key] = value
    return per, rest


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _all_gather(obj: Any) -> list[Any]:
    world, _ = _world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


# parameter name -> (rank, offset, length, device); by name, since pipeline stages number
# their parameters from 0 each
Layout = dict[str, list[tuple[int, int, int, str]]]


def gather_layout(held: Holdings, extra: Any = None) -> tuple[Layout, list[Any]]:
    """Every rank's pieces, by parameter (what a sharded tensor's global description needs),
    and every rank's ``extra``: one all-gather of small objects."""
    mine = [(held.names[p.param], p.offset, p.length, str(held.stepped[p.holder].device))
            for p in held.pieces]
    layout: Layout = {}
    extras = []
    for rank, (pieces, told) in enumerate(_all_gather((mine, extra))):
        for param, offset, length, device in pieces:
            layout.setdefault(param, []).append((rank, offset, length, device))
        extras.append(told)
    return layout, extras


def aliases(engine: Any, names: list[str]) -> dict[str, str]:
    """Other names of the trainable parameters (tied weights) -> the name they are saved under."""
    trainable = {id(p): names[i] for i, p in enumerate(engine.trainable)}
    return {n: trainable[id(p)]
            for n, p in engine.module.named_parameters(remove_duplicate=False)
            if id(p) in trainable and n != trainable[id(p)]}


@contextmanager
def quiet() -> Iterator[None]:
    """DCP calls without ShardedTensor's deprecation warning and no_dist's notice."""
    # ShardedTensor warns that it will give way to DTensor; DTensor cannot describe the uneven,
    # bucket-aligned pieces ZeRO holds, so the warning says nothing actionable here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*ShardedTensor.*")
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def as_dcp_tensor(numel: int, local: list[tuple[int, torch.Tensor]],
                  everyone: list[tuple[int, int, int, str]] | None) -> torch.Tensor:
    """One parameter's 1-D tensor as DCP should see it: the plain tensor when this rank holds it
    whole, else a ShardedTensor of this rank's pieces within every rank's (``everyone``)."""
    if len(local) == 1 and local[0][0] == 0 and local[0][1].numel() == numel:
        return local[0][1]
    assert everyone is not None, "a partly held parameter needs every rank's pieces"
    dtype = local[0][1].dtype
    shards = [TensorShard(t, ShardMetadata([offset], [t.numel()],
                                           f"rank:{_world()[1]}/{t.device}"))
              for offset, t in local]
    described = [ShardMetadata([offset], [length], f"rank:{rank}/{device}")
                 for rank, offset, length, device in everyone]
    meta = ShardedTensorMetadata(described, torch.Size([numel]), TensorProperties(dtype=dtype))
    with quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


# -- saving ------------------------------------------------------------------------------------


def snapshot(engine: Any, exclude_frozen_parameters: bool = False,
             ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the DCP state dict this rank writes: views, nothing copied; the description rank 0 keeps
    next to it, None on other ranks). Every rank calls it (one small all-gather)."""
    grid = getattr(engine, "grid", None)
    if grid is not None and grid.shape.tp > 1:
        raise NotImplementedError(
            f"checkpoints of tensor-parallel models (tensor_parallel.tp_size {grid.shape.tp}) "
            f"are not supported yet: each rank holds a different slice under the same name")
    held = holdings(engine, split=engine.zero is None and engine.world_size > 1)
    optimizer = engine.optimizer
    keys: dict[str, dict[str, str]] = {}  # by parameter name
    other: dict[str, dict[str, Any]] = {}
    for h, tensor in enumerate(held.stepped):
        state = optimizer.state.get(tensor)
        if not state:
            continue
        per, rest = _per_element(state, tensor)
        for i in held.members[h]:
            keys.setdefault(held.names[i], {k: str(v.dtype).removeprefix("torch.")
                                            for k, v in per.items()})
            other.setdefault(held.names[i], rest)
    layout, told = gather_layout(held, (keys, other))
    for rank_keys, rank_other in told:  # ZeRO: the ranks hold state of different parameters
        for i, k in rank_keys.items():
            keys.setdefault(i, k)
        for i, o in rank_other.items():
            other.setdefault(i, o)

    state_dict: dict[str, Any] = {}
    by_param: dict[int, list[Piece]] = {}
    for p in held.pieces:
        by_param.setdefault(p.param, []).append(p)
    for i, pieces in by_param.items():
        name, numel = held.names[i], math.prod(held.shapes[i])
        flats = {p.holder: flat_view(held.stepped[p.holder], f"parameter {name!r}") for p in pieces}
        state_dict[f"param/{name}"] = as_dcp_tensor(
            numel, [(p.offset, flats[p.holder].narrow(0, p.start, p.length)) for p in pieces],
            layout[name])
        for key in keys.get(name, {}):
            values = {h: flat_view(optimizer.state[held.stepped[h]][key], f"{key} of {name!r}")
                      for h in flats}
            state_dict[f"optim/{name}/{key}"] = as_dcp_tensor(
                numel, [(p.offset, values[p.holder].narrow(0, p.start, p.length))
                        for p in pieces], layout[name])
    # With pipeline stages every stage's first data-parallel rank describes its own part
    # (parameters, buffers, groups); rank 0 merges them. Otherwise rank 0 describes it all.
    split_model = bool(getattr(engine, "model_parallel", False))
    describes = getattr(engine, "dp_rank", 0) == 0 if split_model else engine.global_rank == 0
    part = None
    if describes:
        module_entries, part = _describe(engine, held, keys, other, exclude_frozen_parameters)
        state_dict.update(module_entries)
    if split_model:
        parts = [d for d in _all_gather(part) if d is not None]
        part = _merge_descriptions(parts) if engine.global_rank == 0 else None
    return state_dict, part if engine.global_rank == 0 else None


def _describe(engine: Any, held: Holdings, keys: dict[str, dict[str, str]],
              other: dict[str, dict[str, Any]], exclude_frozen_parameters: bool,
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this rank's module entries to save, the description of what it holds)."""
    optimizer = engine.optimizer
    state_dict: dict[str, Any] = {}

    module = engine.module
    tied = aliases(engine, held.names)
    trainable = {id(p) for p in engine.trainable}
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False)
              if id(p) not in trainable}
    skip = set(held.names) | set(tied) | (frozen if exclude_frozen_parameters else set())
    # Under ZeRO stage 3 the module's trainable entries are released placeholders: only the
    # buffers and frozen parameters are read from it.
    module_state = module.state_dict()
    module_keys = [k for k in module_state if k not in skip]
    for k in module_keys:
        state_dict[f"module/{k}"] = module_state[k]
    groups = []
    for group in optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        names = [held.names[i] for h, t in enumerate(held.stepped) if id(t) in ids
                 for i in held.members[h]]
        groups.append({"settings": {k: v for k, v in group.items() if k != "params"},
                       "params": list(dict.fromkeys(names))})
    description = {
        "format": FORMAT, "params": {n: list(s) for n, s in zip(held.names, held.shapes)},
        "aliases": tied, "module_keys": module_keys,
        "excluded_frozen": sorted(frozen) if exclude_frozen_parameters else [],
        "state_dict_keys": [k for k in module_state
                            if not (exclude_frozen_parameters and k in frozen)],
        "optimizer": {"class": type(optimizer).__name__, "groups": groups,
                      "keys": dict(keys), "other": dict(other)},
    }
    return state_dict, description


def _merge_descriptions(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Pipeline stages' descriptions as one (stage order: parameters, keys and groups)."""
    out = {**parts[0], "params": {}, "aliases": {}, "module_keys": [], "excluded_frozen": [],
           "state_dict_keys": [],
           "optimizer": {**parts[0]["optimizer"], "groups": [], "keys": {}, "other": {}}}
    for part in parts:
        out["params"].update(part["params"])
        out["aliases"].update(part["aliases"])
        for k in ("module_keys", "excluded_frozen", "state_dict_keys"):
            out[k] += [x for x in part[k] if x not in out[k]]
        opt = part["optimizer"]
        out["optimizer"]["keys"].update(opt["keys"])
        out["optimizer"]["other"].update(opt["other"])
        for g, group in enumerate(opt["groups"]):
            if g == len(out["optimizer"]["groups"]):
                out["optimizer"]["groups"].append({"settings": group["settings"], "params": []})
            out["optimizer"]["groups"][g]["params"] += group["params"]
    return out


def write(state_dict: dict[str, Any], directory: Path) -> None:
    """DCP's save of ``snapshot``'s state dict into ``directory``; every rank calls it."""
    with quiet():
        dcp.save(state_dict, checkpoint_id=str(directory), no_dist=not dist.is_initialized())


def stored(directory: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every tensor key the DCP files hold, with its full shape and dtype."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    return {k: (tuple(v.size), v.properties.dtype)
            for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}
