"""Reading a checkpoint's tensors (see ``save``) into an engine of any world size, ZeRO stage
and tensor-parallel size: DCP fetches, by overlap, exactly the blocks each rank holds now; and
the whole fp32 state dict, for ``custom_load_fn`` and ``flowtrain checkpoint consolidate``.

A rank asks for its blocks through a load planner (``_BlockReader``), not as a ShardedTensor:
the blocks ranks read may overlap (every tensor-parallel rank reads a replicated parameter
whole), which a ShardedTensor's description, a tiling of the tensor, cannot say. So a load
needs no collective of its own beyond DCP's."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from flowtrain.checkpoint.dcp_io import all_gather_objects, quiet, stored
from flowtrain.checkpoint.geometry import (
    Block,
    Holdings,
    Piece,
    aliases,
    flat_view,
    holdings,
    place,
    placed,
    shape_text,
    split_of,
    whole_shape,
)
from flowtrain.checkpoint.storage import RawReader
from flowtrain.log import get_logger

if TYPE_CHECKING:
    from flowtrain.checkpoint.protocol import CheckpointableEngine

log = get_logger("flowtrain.checkpoint")

_DTYPES = {str(t).removeprefix("torch."): t for t in
           (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
            torch.int32, torch.uint8, torch.int8, torch.bool)}


class _BlockReader(DefaultLoadPlanner):
    """DCP's default load planner for the plain tensors of the state dict, plus ``blocks``:
    key -> [(offsets in the stored tensor, a view to fill)], read by overlap with what the
    checkpoint's ranks wrote."""

    def __init__(self, blocks: dict[str, list[Block]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.blocks = blocks

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        assert self.metadata is not None  # set_up_planner gave it, before any plan
        for key, blocks in self.blocks.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.shape)
                      for o, t in blocks]
            stored_as = self.metadata.state_dict_metadata[key]
            assert isinstance(stored_as, TensorStorageMetadata)  # blocks are only asked of tensors
            items += create_read_items_for_chunk_list(key, stored_as, chunks)
        return LoadPlan(items, plan.storage_data, plan.planner_data)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        blocks = self.blocks.get(index.fqn)
        if blocks is not None:
            assert index.index is not None  # the read items made above carry their block's index
            return blocks[index.index][1]
        return super().lookup_tensor(index)


def load(engine: CheckpointableEngine, directory: Path, description: dict[str, Any], *,
         params: bool = True, module: bool = True, optimizer: bool = True,
         strict: bool = True) -> None:
    """Parameters into the fp32 masters (then the model's own parameters from them), buffers and
    frozen parameters into the module, optimizer state into its entries (created when the
    optimizer has not stepped yet). Every rank calls it."""
    on_disk = stored(directory)
    held = holdings(engine, split=False)
    _check_keys(engine, held, description, on_disk, strict=strict, params=params, module=module)
    saved = description.get("optimizer") if optimizer else None
    if saved is not None:
        _prepare_optimizer(engine.optimizer, held, saved)
    plain: dict[str, Any] = {}
    blocks: dict[str, list[Block]] = {}
    by_param: dict[int, list[Piece]] = {}
    for p in held.pieces:
        by_param.setdefault(p.param, []).append(p)
    for i, pieces in by_param.items():
        name = held.names[i]
        flats = {p.holder: flat_view(held.stepped[p.holder], f"parameter {name!r}") for p in pieces}
        # a parameter frozen when saved and trainable now is read from its module entry
        source = next((k for k in (f"param/{name}", f"module/{name}") if k in on_disk), None)
        if params and source is not None:
            blocks[source] = place(held, i, pieces, flats, on_disk[source][0])
        for key in (saved["keys"].get(name, {}) if saved is not None else ()):
            if f"optim/{name}/{key}" not in on_disk:
                continue
            values = {h: flat_view(engine.optimizer.state[held.stepped[h]][key],
                               f"optimizer state {key!r} of {name!r}") for h in flats}
            blocks[f"optim/{name}/{key}"] = place(held, i, pieces, values,
                                                  on_disk[f"optim/{name}/{key}"][0])
    if module:
        for key, tensor in _module_entries(engine, held).items():
            # a parameter trainable when saved and frozen now is read from its param entry
            source = next((k for k in (f"module/{key}", f"param/{key}") if k in on_disk), None)
            if source is None:
                continue
            split = split_of(tensor, key)
            if split is None and on_disk[source][0] == tuple(tensor.shape):
                plain[source] = tensor.detach()
            else:
                blocks[source] = placed(flat_view(tensor, f"module entry {key!r}"),
                                        tuple(tensor.shape), split, 0, tensor.numel(),
                                        on_disk[source][0])
    with quiet():
        dcp.load(plain, storage_reader=RawReader(directory), planner=_BlockReader(blocks),
                 no_dist=not dist.is_initialized())
    if params:
        sync_model(engine)


def load_through(engine: CheckpointableEngine, custom_load_fn: Any, directory: Path,
                 description: dict[str, Any]) -> None:
    """``custom_load_fn(src=<the whole fp32 state dict>, dst=<the module>)`` writes the module
    (under ZeRO stage 3 while every parameter is gathered), then the fp32 masters are taken
    from the module's parameters, in their dtype, as DeepSpeed does. Every rank calls it."""
    src = _this_slice(engine, full_state_dict(directory, description))
    gathered = getattr(engine, "gathered_parameters", None)
    with gathered() if gathered is not None else contextlib.nullcontext():
        custom_load_fn(src=src, dst=engine.module)
        held = holdings(engine, split=False)
        with torch.no_grad():
            for p in held.pieces:
                param = engine.trainable[p.param]
                if held.stepped[p.holder] is param:
                    continue  # stage 0 without masters: the optimizer steps the parameter
                value = param.detach().reshape(-1).narrow(0, p.offset, p.length)
                flat_view(held.stepped[p.holder], "a master").narrow(0, p.start, p.length).copy_(
                    value)
    sync_model(engine)


def _this_slice(engine: CheckpointableEngine,
                src: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole state dict with each tensor-parallel entry cut to this rank's slice, so
    ``custom_load_fn`` sees what the module holds."""
    out = dict(src)
    for key, tensor in engine.module.state_dict(keep_vars=True).items():
        split = split_of(tensor, key)
        if split is None or key not in src:
            continue
        out[key] = torch.cat([src[key].narrow(split.dim, start, length)
                              for start, length in split.ranges], dim=split.dim)
    return out


def sync_model(engine: CheckpointableEngine) -> None:
    """The model's own parameters from the (just loaded) fp32 masters, on every rank."""
    zero = engine.zero
    if zero is not None:
        sync = getattr(zero, "sync_model_from_master", None)
        if sync is not None:
            sync()
            return
        with torch.no_grad():
            for master, shard in zip(zero.master, zero.model_shards):
                if master.data_ptr() != shard.data_ptr():
                    shard.copy_(master.detach())
        zero.all_gather()
    elif engine.master is not None:
        engine.master.copy_to_model()


def _module_entries(engine: CheckpointableEngine, held: Holdings) -> dict[str, torch.Tensor]:
    """The module's state-dict entries that are not trainable parameters: buffers and frozen
    parameters (the tensors themselves, so a load writes into them)."""
    skip = set(held.names) | set(aliases(engine, held.names))
    return {k: v for k, v in engine.module.state_dict(keep_vars=True).items() if k not in skip}


def _check_keys(engine: CheckpointableEngine, held: Holdings, description: dict[str, Any],
                on_disk: dict[str, tuple[tuple[int, ...], torch.dtype]], *, strict: bool,
                params: bool, module: bool) -> None:
    """torch's load_state_dict rules: a size mismatch always fails; missing and unexpected
    entries fail when ``strict``, and are named in a warning otherwise."""
    if not (params or module):  # custom_load_fn maps the entries itself
        return
    saved_shapes = {n: tuple(s) for n, s in description["params"].items()}
    for key in description["module_keys"]:
        saved_shapes[key] = on_disk[f"module/{key}"][0]
    entries = _module_entries(engine, held)
    # the unsplit shapes (a tensor-parallel rank holds a slice), and what this rank holds
    wanted = {n: held.whole(i) for i, n in enumerate(held.names)} if params else {}
    local = {n: held.shapes[i] for i, n in enumerate(held.names)
             if held.splits[i] is not None} if params else {}
    if module:
        for k, v in entries.items():
            wanted[k] = whole_shape(tuple(v.shape), split_of(v, k))
            if wanted[k] != tuple(v.shape):
                local[k] = tuple(v.shape)
    missing = [k for k in wanted if k not in saved_shapes and
               k not in description.get("excluded_frozen", ())]
    mismatched = [f"size mismatch for {k}: the checkpoint has shape {shape_text(saved_shapes[k])}, "
                  f"the model {shape_text(s)}"
                  + (f" (unsplit; this tensor-parallel rank holds {shape_text(local[k])} of it)"
                     if k in local else "")
                  for k, s in wanted.items()
                  if k in saved_shapes and tuple(saved_shapes[k]) != tuple(s)]
    mine = set(held.names) | set(entries) | set(aliases(engine, held.names))
    if getattr(engine, "model_parallel", False):  # other stages hold the rest of the model
        mine = set().union(*all_gather_objects(sorted(mine)))
    unexpected = [k for k in saved_shapes if k not in mine]
    if mismatched:
        raise RuntimeError("loading the checkpoint's tensors: " + "; ".join(mismatched))
    if not (missing or unexpected):
        return
    what = (f"missing from the checkpoint: {', '.join(missing) or 'nothing'}; in the checkpoint "
            f"but not in the model: {', '.join(unexpected) or 'nothing'}")
    if strict:
        raise RuntimeError(f"the checkpoint does not match the model ({what}); load with "
                           f"load_module_strict=False to load the entries that do match")
    log.warning("checkpoint and model differ; loading what matches", differences=what)


def _prepare_optimizer(optimizer: torch.optim.Optimizer, held: Holdings,
                       saved: dict[str, Any]) -> None:
    """Creates the state entries a load fills (a fresh optimizer has none), sets ``step`` and
    the other non-per-element values, and the parameter groups' settings."""
    if saved["class"] != type(optimizer).__name__:
        log.warning("the checkpoint's optimizer state is loaded into another optimizer class",
                    saved=saved["class"], engine=type(optimizer).__name__)
    keys, other = saved["keys"], saved["other"]
    saved_fresh = not keys and not other  # saved before the first step
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for h, tensor in enumerate(held.stepped):
        if saved_fresh:
            optimizer.state.pop(tensor, None)
            continue
        known = [held.names[i] for i in held.members[h]
                 if held.names[i] in keys or held.names[i] in other]
        if not known:
            continue
        state = optimizer.state[tensor]
        for key, dtype in keys.get(known[0], {}).items():
            current = state.get(key)
            if not (torch.is_tensor(current) and current.shape == tensor.shape):
                state[key] = torch.zeros(tensor.shape, dtype=_DTYPES.get(dtype, torch.float32),
                                         device=tensor.device)
        group = group_of.get(id(tensor), {})
        for key, value in other.get(known[0], {}).items():
            state[key] = _placed(key, value, tensor, group)
    owner = {n: g["settings"] for g in saved["groups"] for n in g["params"]}
    for group in optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        names = [held.names[i] for h, t in enumerate(held.stepped) if id(t) in ids
                 for i in held.members[h]]
        found = [owner[n] for n in names if n in owner]
        if found:
            group.update(copy.deepcopy(found[0]))


def _placed(key: str, value: Any, tensor: torch.Tensor, group: dict[str, Any]) -> Any:
    """Where torch.optim keeps a loaded non-per-element value: ``step`` on the CPU unless the
    group is capturable or fused, other tensors beside the parameter."""
    if not torch.is_tensor(value):
        return copy.deepcopy(value)
    if key == "step":
        on_device = bool(group.get("capturable") or group.get("fused"))
        return value.detach().clone().to(tensor.device if on_device else "cpu")
    return value.detach().clone().to(tensor.device)


# -- the whole state dict --------------------------------------------------------------------------


def full_state_dict(directory: Path, description: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The model's whole state dict from the checkpoint's tensors, in the saved model's key
    order: each trainable parameter as its fp32 master value in its shape (tied names share the
    tensor), buffers and frozen parameters as saved. Reads every file; no collective."""
    on_disk = stored(directory)
    targets: dict[str, torch.Tensor] = {}
    for name in description["params"]:
        shape, dtype = on_disk[f"param/{name}"]
        targets[f"param/{name}"] = torch.empty(shape, dtype=dtype)
    for key in description["module_keys"]:
        shape, dtype = on_disk[f"module/{key}"]
        targets[f"module/{key}"] = torch.empty(shape, dtype=dtype)
    with quiet():
        dcp.load(targets, storage_reader=RawReader(directory), no_dist=True)
    params = {n: targets[f"param/{n}"].view(tuple(s)) for n, s in description["params"].items()}
    out: dict[str, torch.Tensor] = {}
    for key in description["state_dict_keys"]:
        name = description["aliases"].get(key, key)
        if name in params:
            out[key] = params[name]
        elif f"module/{key}" in targets:
            out[key] = targets[f"module/{key}"]
    for name, value in params.items():
        out.setdefault(name, value)
    return out
