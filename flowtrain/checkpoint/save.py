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

import hashlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

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

from flowtrain.checkpoint.dcp_io import all_gather_objects, quiet, world_and_rank
from flowtrain.checkpoint.geometry import (
    Block,
    Holdings,
    Piece,
    aliases,
    flat_view,
    holdings,
    place,
    placed,
    split_entries,
    tp_place,
    whole_shape,
)
from flowtrain.checkpoint.storage import RawWriter

if TYPE_CHECKING:
    from flowtrain.checkpoint.protocol import CheckpointableEngine

# bumped when the keys or the description change meaning; 2: tensors in their whole shape
FORMAT = 2


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


_TENSOR = "__flowtrain_tensor__"


def _plain(rest: dict[str, Any]) -> dict[str, Any]:
    """Optimizer state besides the per-element tensors (Adam's ``step``, a 0-d tensor per
    parameter) with each small tensor as its values and dtype: pickling a tensor for the
    all-gather serializes its storage, which is most of the gather's time for a model of a
    few hundred parameters."""
    return {k: (_TENSOR, v.tolist(), str(v.dtype).removeprefix("torch."), v.device.type)
            if torch.is_tensor(v) and v.numel() <= 16 else v for k, v in rest.items()}


def _unplain(rest: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.tensor(v[1], dtype=getattr(torch, v[2]), device=v[3])
            if isinstance(v, tuple) and len(v) == 4 and v[0] == _TENSOR else v
            for k, v in rest.items()}


class Stager(Protocol):
    """Where an asynchronous save puts its host copies (``flowtrain.checkpoint.background.
    BackgroundWriter``): ``copy`` copies block ``index`` of DCP key ``key`` into a buffer kept
    from one save to the next; ``described`` keeps each key's ShardedTensor over those buffers
    with the layout it was built for, so an unchanged layout is not described again."""

    described: dict[str, tuple[Any, ShardedTensor]]

    def copy(self, key: str, index: int, tensor: torch.Tensor) -> torch.Tensor: ...


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
    for rank, (blocks, their) in enumerate(all_gather_objects((told, extra))):
        for key, offsets, sizes, device in blocks:
            layout.setdefault(key, []).append((rank, offsets, sizes, device))
        extras.append(their)
    return layout, extras


def as_dcp_tensor(whole: tuple[int, ...], local: list[Block],
                  everyone: list[tuple[int, tuple[int, ...], tuple[int, ...], str]],
                  stager: Stager | None = None, key: str = "") -> torch.Tensor:
    """One stored tensor as DCP should see it for a save: the plain tensor when this rank
    writes it whole, else a ShardedTensor of this rank's blocks within every rank's
    (``everyone``, which tile the whole exactly: DCP checks). With a ``stager`` (an
    asynchronous save) each block is its host copy, described as on the CPU, where every rank
    then holds its blocks. The caller holds ``quiet()``."""
    if len(local) == 1 and tuple(local[0][1].shape) == tuple(whole):
        return local[0][1] if stager is None else stager.copy(key, 0, local[0][1])
    rank = world_and_rank()[1]
    dtype = local[0][1].dtype
    # a block cut out of a fused qkv slice along a later dimension is the only strided one
    tensors = [t.contiguous() if stager is None else stager.copy(key, n, t)
               for n, (_, t) in enumerate(local)]
    if stager is not None:
        everyone = [(r, o, z, "cpu") for r, o, z, _ in everyone]
        layout = (tuple(whole), dtype, tuple(everyone),
                  tuple((tuple(o), id(t)) for (o, _), t in zip(local, tensors, strict=True)))
        known = stager.described.get(key)
        if known is not None and known[0] == layout:
            return known[1]  # the same buffers, refilled: DCP reads them at write time
    shards = [TensorShard(t, ShardMetadata(list(o), list(t.shape), f"rank:{rank}/{t.device}"))
              for (o, _), t in zip(local, tensors, strict=True)]
    described = [ShardMetadata(list(o), list(z), f"rank:{r}/{device}")
                 for r, o, z, device in everyone]
    meta = ShardedTensorMetadata(described, torch.Size(whole), TensorProperties(dtype=dtype))
    out = ShardedTensor._init_from_local_shards_and_global_metadata(shards, meta)
    if stager is not None:
        stager.described[key] = (layout, out)
    return out


# -- saving ------------------------------------------------------------------------------------


def snapshot(engine: CheckpointableEngine, exclude_frozen_parameters: bool = False,
             stager: Stager | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the DCP state dict this rank writes: views, nothing copied, or with a ``stager`` the
    host copies an asynchronous save writes; the description rank 0 keeps next to it, None on other
    ranks). Every rank calls it (one small all-gather)."""
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
    layout, told = gather_layout(blocks, (keys, {i: _plain(o) for i, o in other.items()}))
    for rank_keys, rank_other in told:  # ZeRO: the ranks hold state of different parameters
        for i, k in rank_keys.items():
            keys.setdefault(i, k)
        for i, o in rank_other.items():
            if i not in other:
                other[i] = _unplain(o)

    state_dict: dict[str, Any] = {}
    with quiet():
        for key, local in blocks.items():
            if local:
                state_dict[key] = as_dcp_tensor(wholes[key], local, layout[key], stager, key)
        for i, pieces in by_param.items():  # the optimizer state: the parameter's blocks
            name = held.names[i]
            for key in keys.get(name, {}):
                values = {h: flat_view(optimizer.state[held.stepped[h]][key],
                                       f"{key} of {name!r}") for h in flats[i]}
                local = place(held, i, pieces, values, held.whole(i))
                if local:
                    stored = f"optim/{name}/{key}"
                    state_dict[stored] = as_dcp_tensor(held.whole(i), local,
                                                       layout[f"param/{name}"], stager, stored)
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
        parts = [d for d in all_gather_objects(part) if d is not None]
        part = _merge_descriptions(parts) if engine.global_rank == 0 else None
    return state_dict, part if engine.global_rank == 0 else None


def _describe(engine: CheckpointableEngine, held: Holdings, keys: dict[str, dict[str, str]],
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
        "frozen": sorted(frozen),  # so that a reader can drop them and keep the buffers
        "state_dict_keys": [k for k in module_state
                            if not (exclude_frozen_parameters and k in frozen)],
        "optimizer": {"class": type(optimizer).__name__, "groups": groups,
                      "keys": dict(keys), "other": dict(other)},
    }
    return state_dict, description


def _merge_descriptions(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Pipeline stages' descriptions as one (stage order: parameters, keys and groups)."""
    out = {**parts[0], "params": {}, "aliases": {}, "module_keys": [], "excluded_frozen": [],
           "frozen": [], "state_dict_keys": [],
           "optimizer": {**parts[0]["optimizer"], "groups": [], "keys": {}, "other": {}}}
    if "tensor_parallel" in parts[0]:
        out["tensor_parallel"] = {**parts[0]["tensor_parallel"], "split_dims": {}}
    for part in parts:
        out["params"].update(part["params"])
        if "tensor_parallel" in part:
            out["tensor_parallel"]["split_dims"].update(part["tensor_parallel"]["split_dims"])
        out["aliases"].update(part["aliases"])
        for k in ("module_keys", "excluded_frozen", "frozen", "state_dict_keys"):
            out[k] += [x for x in part.get(k, ()) if x not in out[k]]
        opt = part["optimizer"]
        out["optimizer"]["keys"].update(opt["keys"])
        out["optimizer"]["other"].update(opt["other"])
        for g, group in enumerate(opt["groups"]):
            if g == len(out["optimizer"]["groups"]):
                out["optimizer"]["groups"].append({"settings": group["settings"], "params": []})
            out["optimizer"]["groups"][g]["params"] += group["params"]
    return out


def _dtypes(state_dict: dict[str, Any]) -> str:
    """A short digest of every entry's dtype, in key order."""
    digest = hashlib.blake2b(digest_size=8)
    for key, value in state_dict.items():
        dtype: Any = value.metadata().tensor_properties.dtype \
            if isinstance(value, ShardedTensor) else getattr(value, "dtype", None)
        digest.update(f"{key}\0{dtype}\0".encode())
    return digest.hexdigest()


def _planner(process_group: Any, state_dict: dict[str, Any]) -> dcp.DefaultSavePlanner:
    """DCP's default planner with its plan cache on: a save whose tensors have the same keys,
    shapes and blocks as the last one's (every save of a run, unless the model changes)
    reuses the global plan instead of building and checking it again. DCP keeps that cache
    for the whole process under the planner's key, so the key names the world this save runs
    in (its size, this rank and the group's name): a re-formed world (peer recovery) or
    another engine's group never meets a plan made for another; within one world DCP compares
    every rank's plan with the cached one before using it. That comparison looks at keys,
    shapes and blocks but not dtypes, and the cached metadata records each entry's dtype, so
    the key also carries a digest of every rank's dtypes (an fp16 engine after an fp32 one of
    the same shapes gets its own plan). Every rank must take the same key, or one rank would
    send only "as cached" to a coordinator holding no cache: hence the digests' all-gather."""
    planner = dcp.DefaultSavePlanner(enable_plan_caching=True)
    if dist.is_initialized():
        world, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None  # torch.distributed is initialized
        name = dist._get_process_group_name(group)
    else:
        world, rank, name = 1, 0, "none"
    digests = [_dtypes(state_dict)]
    if world > 1:
        digests = [None] * world  # type: ignore[list-item]
        dist.all_gather_object(digests, _dtypes(state_dict), group=process_group)
    everyone = hashlib.blake2b("".join(digests).encode(), digest_size=8).hexdigest()
    planner._cached_plans_key = f"flowtrain:{world}:{rank}:{name}:{everyone}"
    return planner


def _nested(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` grouped by the part of each key before its first dot, which DCP's
    flattening joins back with a dot: the stored keys are the same. DCP wraps the state_dict()
    of every top-level entry in its logger (a record with a fresh uuid each), which for a flat
    dict of a few hundred tensors costs more than planning the save; grouped, it is a few. A
    key that is also another key's group stays flat."""
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        head, dot, rest = key.partition(".")
        if not dot:
            if head in out:
                return state_dict
            out[key] = value
            continue
        group = out.setdefault(head, {})
        if not isinstance(group, dict) or head in state_dict or rest in group:
            return state_dict
        group[rest] = value
    return out


def write(state_dict: dict[str, Any], directory: Path, process_group: Any = None
          ) -> dict[str, tuple[int, str]]:
    """DCP's save of ``snapshot``'s state dict into ``directory`` (its collectives on
    ``process_group``, the default group when None); every rank calls it. Returns, on the
    coordinator (the group's first rank), the size and SHA-256 of every rank's tensor file as
    its rank wrote it, by name relative to ``directory``; on the other ranks, nothing."""
    writer = RawWriter(directory)
    with quiet():
        dcp.save(_nested(state_dict), storage_writer=writer, process_group=process_group,
                 no_dist=not dist.is_initialized(), planner=_planner(process_group, state_dict))
    return {d.name: (d.size, d.sha256) for d in writer.digests.values()}
