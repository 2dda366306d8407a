"""The tensor part of a checkpoint, through torch.distributed.checkpoint (DCP): every rank writes
the pieces of the fp32 parameters and per-parameter optimizer state it holds, so DCP reads them
back by overlap into any world size, ZeRO stage and tensor-parallel size.

Keys: ``param/<name>`` (the fp32 master value), ``optim/<name>/<state key>`` (each per-element
optimizer state tensor), ``module/<key>`` (buffers and frozen parameters, whole, from rank 0's
module). Every tensor is stored in the shape of the whole, unsplit parameter under its plain
name, and each rank writes its part as rectangular blocks of it (a ShardedTensor whose shards
carry N-D offsets):
- a data-parallel or ZeRO piece is a range of the flattened (local) parameter: that range as at
  most 2 x ndim - 1 blocks, each one contiguous in memory, so no copy is made;
- a tensor-parallel slice (``param.tp_split_dim``, ``tp_ranges``; see ``flowtrain.tp.layers``)
  shifts those blocks along the split dimension to where the slice lies in the whole (a fused
  qkv slice, one block of each of q, k and v, cuts a block in three).
A reader of any layout asks DCP for the blocks it holds now, and DCP reads them by overlap.
Format 1 checkpoints held every tensor flattened to 1-D; they are still read (see
``placed``). What is not a per-element tensor (Adam's ``step``, the parameter groups'
settings, shapes) is described by ``snapshot``'s second result, which rank 0 keeps in the
checkpoint's ``engine_state.pt``."""

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

# bumped when the keys or the description change meaning; 2: tensors in their whole shape
FORMAT = 2


@dataclass(frozen=True)
class Split:
    """Where a tensor-parallel slice lies in the whole tensor: along dimension ``dim`` (of size
    ``full`` in the whole) the slice's indices are, in order, the whole's ``ranges``
    ((start, length), ...)."""

    dim: int
    full: int
    ranges: tuple[tuple[int, int], ...]


def split_of(tensor: Any, name: str) -> Split | None:
    """The tensor-parallel split of a parameter (None when it is whole on every rank)."""
    if not getattr(tensor, "tensor_parallel", False):
        return None
    dim, full = getattr(tensor, "tp_split_dim", None), getattr(tensor, "tp_full_size", None)
    ranges = getattr(tensor, "tp_ranges", None)
    if dim is None or full is None or ranges is None:
        raise ValueError(f"parameter {name!r} is marked tensor_parallel but does not say where "
                         f"its slice lies in the whole parameter (tp_split_dim, tp_full_size, "
                         f"tp_ranges: see flowtrain.tp.layers); checkpoints need them")
    return Split(int(dim), int(full), tuple((int(a), int(n)) for a, n in ranges))


def whole_shape(shape: tuple[int, ...], split: Split | None) -> tuple[int, ...]:
    """The unsplit shape of a (slice of a) parameter of ``shape``."""
    if split is None:
        return tuple(shape)
    return tuple(split.full if d == split.dim else n for d, n in enumerate(shape))


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
    shapes: list[tuple[int, ...]]  # as this rank holds them (a tensor-parallel slice's shape)
    stepped: list[torch.Tensor]
    members: list[list[int]]  # the parameters each stepped tensor holds (a part of)
    pieces: list[Piece]
    splits: list[Split | None]  # tensor-parallel parameters: where the slice lies

    def whole(self, i: int) -> tuple[int, ...]:
        """Parameter ``i``'s unsplit shape (the shape the checkpoint describes)."""
        return whole_shape(self.shapes[i], self.splits[i])


def tp_place(engine: Any) -> tuple[int, int]:
    """(this rank's index in its tensor-parallel group, the group's size)."""
    grid = getattr(engine, "grid", None)
    if grid is None or grid.shape.tp == 1:
        return 0, 1
    return grid.tp_rank, grid.shape.tp


def _part(numel: int, k: int, n: int) -> tuple[int, int]:
    """The ``k``-th of ``n`` near-equal consecutive parts of range(numel)."""
    chunk = -(-numel // n)
    lo = min(numel, k * chunk)
    return lo, min(numel, lo + chunk)


def holdings(engine: Any, *, split: bool) -> Holdings:
    """Stage 0: every parameter whole; ZeRO: the overlap of each bucket's shard with each of
    the bucket's parameters. ``split`` (for writing in parallel, each element by one rank):
    the part of those that this rank writes of what several ranks hold alike: stage 0 splits
    each parameter over its data-parallel copies; a parameter replicated over the
    tensor-parallel group is split over that group too."""
    names = list(engine._names)
    splits = [split_of(p, n) for n, p in zip(names, engine.trainable)]
    tp_rank, tp = tp_place(engine)
    pieces: list[Piece] = []
    if engine.zero is None:
        shapes = [tuple(p.shape) for p in engine.trainable]
        stepped = list(engine.master.master) if engine.master is not None \
            else list(engine.trainable)
        for i, shape in enumerate(shapes):
            numel = math.prod(shape)
            lo, hi = 0, numel
            if split:
                # pipeline/tensor parallel: the copies are this rank's data-parallel group
                k, n = getattr(engine, "dp_rank", engine.global_rank), engine.world_size
                if splits[i] is None:
                    k, n = k * tp + tp_rank, n * tp
                lo, hi = _part(numel, k, n)
            if hi > lo:
                pieces.append(Piece(i, lo, hi - lo, i, lo))
        return Holdings(names, shapes, stepped, [[i] for i in range(len(stepped))], pieces,
                        splits)
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
            if split and tp > 1 and splits[slot.index] is None and hi > lo:
                a, z = _part(hi - lo, tp_rank, tp)
                lo, hi = lo + a, lo + z
            if hi > lo:
                pieces.append(Piece(slot.index, lo - slot.offset, hi - lo, b, lo - shard.start))
    return Holdings(names, shapes, stepped, members, pieces, splits)


# -- where a piece lies in the stored (whole) tensor -------------------------------------------

Block = tuple[tuple[int, ...], torch.Tensor]  # (offsets in the stored tensor, the elements)


def _blocks(shape: tuple[int, ...], lo: int, hi: int,
            ) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [lo, hi) of a row-major tensor of ``shape`` as rectangular blocks, each one
    contiguous in memory: (offsets, sizes, index of its first element)."""
    if hi <= lo:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,), lo)] if shape else [((), (), 0)]
    rest = tuple(shape[1:])
    inner = math.prod(rest)
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    first, skip = divmod(lo, inner)
    if skip:  # a partial first row
        stop = min(hi, (first + 1) * inner)
        out += [((first, *o), (1, *z), first * inner + f)
                for o, z, f in _blocks(rest, skip, stop - first * inner)]
        if stop == hi:
            return out
        first += 1
    last, tail = divmod(hi, inner)
    if last > first:  # whole rows
        out.append(((first,) + (0,) * len(rest), (last - first, *rest), first * inner))
    if tail:  # a partial last row
        out += [((last, *o), (1, *z), last * inner + f) for o, z, f in _blocks(rest, 0, tail)]
    return out


def _in_whole(offsets: tuple[int, ...], tensor: torch.Tensor, split: Split | None,
              ) -> list[Block]:
    """A block of a tensor-parallel slice as blocks of the whole tensor."""
    if split is None:
        return [(offsets, tensor)]
    d = split.dim
    lo, hi = offsets[d], offsets[d] + tensor.shape[d]
    out: list[Block] = []
    at = 0  # where the range starts in the slice
    for start, length in split.ranges:
        a, b = max(lo, at), min(hi, at + length)
        if b > a:
            moved = tuple(start + a - at if i == d else o for i, o in enumerate(offsets))
            out.append((moved, tensor.narrow(d, a - lo, b - a)))
        at += length
    return out


def _flattened(offsets: tuple[int, ...], tensor: torch.Tensor,
               whole: tuple[int, ...]) -> list[Block]:
    """A block of the whole tensor as runs of its flattening (format 1 stored every tensor
    flattened to 1-D): a block is one run when every dimension after its first one longer
    than 1 is whole; otherwise it is cut along that dimension."""
    spans = [i for i, n in enumerate(tensor.shape) if n > 1]
    if not spans or all(tensor.shape[j] == whole[j] for j in range(spans[0] + 1, len(whole))):
        if not tensor.is_contiguous():
            raise ValueError("a tensor-parallel slice split along a later dimension into "
                             "several ranges cannot be read from a format 1 checkpoint")
        stride = [math.prod(whole[j + 1:]) for j in range(len(whole))]
        start = sum(o * st for o, st in zip(offsets, stride))
        return [((start,), tensor.reshape(-1))]
    d = spans[0]
    out: list[Block] = []
    for k in range(tensor.shape[d]):
        moved = tuple(o + k if i == d else o for i, o in enumerate(offsets))
        out += _flattened(moved, tensor.narrow(d, k, 1), whole)
    return out


def placed(src: torch.Tensor, shape: tuple[int, ...], split: Split | None, lo: int, hi: int,
           stored: tuple[int, ...]) -> list[Block]:
    """Elements [lo, hi) of the flattened (local slice of a) tensor of ``shape``, held by the
    1-D ``src``, as blocks of the stored tensor (views of ``src``: a load writes through
    them). ``stored`` is the whole shape, or for format 1 files the whole's element count."""
    whole = whole_shape(shape, split)
    flat = tuple(stored) != whole
    if flat and tuple(stored) != (math.prod(whole),):
        raise ValueError(f"stored shape {_shape(stored)} is neither the whole shape "
                         f"{_shape(whole)} nor its flattening")
    out: list[Block] = []
    for offsets, sizes, first in _blocks(shape, lo, hi):
        view = src.narrow(0, first - lo, math.prod(sizes)).view(sizes)
        for o, t in _in_whole(offsets, view, split):
            out += _flattened(o, t, whole) if flat else [(o, t)]
    return out


def _shape(shape: Any) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


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


# DCP key -> [(rank, offsets, sizes, device)]: every rank's blocks of the stored tensor (by
# name, since pipeline stages number their parameters from 0 each)
Layout = dict[str, list[tuple[int, tuple[int, ...], tuple[int, ...], str]]]


def gather_layout(mine: dict[str, list[Block]], extra: Any = None) -> tuple[Layout, list[Any]]:
    """Every rank's blocks, by key (what a sharded tensor's global description needs), and
    every rank's ``extra``: one all-gather of small objects."""
    told = [(key, tuple(o), tuple(t.shape), str(t.device))
            for key, blocks in mine.items() for o, t in blocks]
    layout: Layout = {}
    extras = []
    for rank, (blocks, their) in enumerate(_all_gather((told, extra))):
        for key, offsets, sizes, device in blocks:
            layout.setdefault(key, []).append((rank, offsets, sizes, device))
        extras.append(their)
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


def as_dcp_tensor(whole: tuple[int, ...], local: list[Block],
                  everyone: list[tuple[int, tuple[int, ...], tuple[int, ...], str]],
                  ) -> torch.Tensor:
    """One stored tensor as DCP should see it for a save: the plain tensor when this rank
    writes it whole, else a ShardedTensor of this rank's blocks within every rank's
    (``everyone``, which tile the whole exactly: DCP checks)."""
    if len(local) == 1 and tuple(local[0][1].shape) == tuple(whole):
        return local[0][1]
    rank = _world()[1]
    dtype = local[0][1].dtype
    # a block cut out of a fused qkv slice along a later dimension is the only strided one
    shards = [TensorShard(t.contiguous(), ShardMetadata(list(o), list(t.shape),
                                                        f"rank:{rank}/{t.device}"))
              for o, t in local]
    described = [ShardMetadata(list(o), list(z), f"rank:{r}/{device}")
                 for r, o, z, device in everyone]
    meta = ShardedTensorMetadata(described, torch.Size(whole), TensorProperties(dtype=dtype))
    with quiet():
        return ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)


def place(held: Holdings, i: int, pieces: list[Piece], flats: dict[int, torch.Tensor],
          stored: tuple[int, ...]) -> list[Block]:
    """Parameter ``i``'s ``pieces`` (in the 1-D ``flats`` of their holders) as blocks of the
    stored tensor of shape ``stored``."""
    out: list[Block] = []
    for p in pieces:
        src = flats[p.holder].narrow(0, p.start, p.length)
        out += placed(src, held.shapes[i], held.splits[i], p.offset, p.offset + p.length,
                      stored)
    return out


def split_entries(engine: Any) -> dict[str, tuple[torch.Tensor, Split]]:
    """The module's state-dict entries that are not trainable but split over the
    tensor-parallel group (frozen tensor-parallel parameters): key -> (tensor, split)."""
    trainable = {id(p) for p in engine.trainable}
    out = {}
    for key, tensor in engine.module.state_dict(keep_vars=True).items():
        if id(tensor) not in trainable:
            split = split_of(tensor, key)
            if split is not None:
                out[key] = (tensor, split)
    return out


# -- saving ------------------------------------------------------------------------------------


def snapshot(engine: Any, exclude_frozen_parameters: bool = False,
             ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the DCP state dict this rank writes: views, nothing copied; the description rank 0 keeps
    next to it, None on other ranks). Every rank calls it (one small all-gather)."""
    held = holdings(engine, split=True)
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

    by_param: dict[int, list[Piece]] = {}
    for p in held.pieces:
        by_param.setdefault(p.param, []).append(p)
    blocks: dict[str, list[Block]] = {}
    wholes: dict[str, tuple[int, ...]] = {}
    flats: dict[int, dict[int, torch.Tensor]] = {}
    for i, pieces in by_param.items():
        name = held.names[i]
        flats[i] = {p.holder: flat_view(held.stepped[p.holder], f"parameter {name!r}")
                    for p in pieces}
        wholes[f"param/{name}"] = held.whole(i)
        blocks[f"param/{name}"] = place(held, i, pieces, flats[i], held.whole(i))
    # Frozen tensor-parallel parameters: each slice from the first data-parallel rank holding
    # it. (Buffers and other frozen parameters are whole on every rank: one rank writes them.)
    split_frozen = {} if exclude_frozen_parameters else split_entries(engine)
    for key, (tensor, split) in split_frozen.items():
        wholes[f"module/{key}"] = whole_shape(tuple(tensor.shape), split)
        if getattr(engine, "dp_rank", 0) == 0:
            blocks[f"module/{key}"] = placed(flat_view(tensor, f"module entry {key!r}"),
                                             tuple(tensor.shape), split, 0, tensor.numel(),
                                             wholes[f"module/{key}"])
    layout, told = gather_layout(blocks, (keys, other))
    for rank_keys, rank_other in told:  # ZeRO: the ranks hold state of different parameters
        for i, k in rank_keys.items():
            keys.setdefault(i, k)
        for i, o in rank_other.items():
            other.setdefault(i, o)

    state_dict: dict[str, Any] = {}
    for key, local in blocks.items():
        if local:
            state_dict[key] = as_dcp_tensor(wholes[key], local, layout[key])
    for i, pieces in by_param.items():  # the optimizer state: the parameter's blocks
        name = held.names[i]
        for key in keys.get(name, {}):
            values = {h: flat_view(optimizer.state[held.stepped[h]][key], f"{key} of {name!r}")
                      for h in flats[i]}
            local = place(held, i, pieces, values, held.whole(i))
            if local:
                state_dict[f"optim/{name}/{key}"] = as_dcp_tensor(held.whole(i), local,
                                                                  layout[f"param/{name}"])
    # With pipeline or tensor parallelism the first data-parallel (and tensor-parallel) rank of
    # every stage describes its own part (parameters, buffers, groups); rank 0 merges them.
    # Otherwise rank 0 describes it all.
    split_model = bool(getattr(engine, "model_parallel", False))
    describes = getattr(engine, "dp_rank", 0) == 0 and tp_place(engine)[0] == 0 \
        if split_model else engine.global_rank == 0
    part = None
    if describes:
        module_entries, part = _describe(engine, held, keys, other, exclude_frozen_parameters,
                                         set(split_frozen))
        state_dict.update(module_entries)
    if split_model:
        parts = [d for d in _all_gather(part) if d is not None]
        part = _merge_descriptions(parts) if engine.global_rank == 0 else None
    return state_dict, part if engine.global_rank == 0 else None


def _describe(engine: Any, held: Holdings, keys: dict[str, dict[str, str]],
              other: dict[str, dict[str, Any]], exclude_frozen_parameters: bool,
              sharded: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(this rank's module entries to save, the description of what it holds). ``sharded``:
    module entries every tensor-parallel rank writes its slice of (not written here)."""
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
        if k not in sharded:
            state_dict[f"module/{k}"] = module_state[k]
    groups = []
    for group in optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        names = [held.names[i] for h, t in enumerate(held.stepped) if id(t) in ids
                 for i in held.members[h]]
        groups.append({"settings": {k: v for k, v in group.items() if k != "params"},
                       "params": list(dict.fromkeys(names))})
    description = {
        "format": FORMAT,
        "params": {n: list(held.whole(i)) for i, n in enumerate(held.names)},
        # the dimension each tensor-parallel parameter was split along when saved (for the
        # record: the stored tensors are whole, and a load of any layout needs none of it)
        "tensor_parallel": {"tp_size": tp_place(engine)[1],
                            "split_dims": {n: sp.dim for n, sp in zip(held.names, held.splits)
                                           if sp is not None}},
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
    if "tensor_parallel" in parts[0]:
        out["tensor_parallel"] = {**parts[0]["tensor_parallel"], "split_dims": {}}
    for part in parts:
        out["params"].update(part["params"])
        if "tensor_parallel" in part:
            out["tensor_parallel"]["split_dims"].update(part["tensor_parallel"]["split_dims"])
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
