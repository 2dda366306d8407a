"""Where each rank's share of a parameter lies in the stored tensor: tensor-parallel splits, the
pieces a rank holds under data parallelism or ZeRO, and those pieces as rectangular blocks of the
whole, unsplit tensor (views, so a load writes through them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flowtrain.checkpoint.protocol import CheckpointableEngine

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


def tp_place(engine: CheckpointableEngine) -> tuple[int, int]:
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


def holdings(engine: CheckpointableEngine, *, split: bool) -> Holdings:
    """Stage 0: every parameter whole; ZeRO: the overlap of each bucket's shard with each of
    the bucket's parameters. ``split`` (for writing in parallel, each element by one rank):
    the part of those that this rank writes of what several ranks hold alike: stage 0 splits
    each parameter over its data-parallel copies; a parameter replicated over the
    tensor-parallel group is split over that group too."""
    names = list(engine.param_names)
    splits = [split_of(p, n) for n, p in zip(names, engine.trainable)]
    tp_rank, tp = tp_place(engine)
    pieces: list[Piece] = []
    if engine.zero is None:
        shapes = [tuple(p.shape) for p in engine.trainable]
        stepped: list[torch.Tensor] = list(engine.master.master) if engine.master is not None \
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
        raise ValueError(f"stored shape {shape_text(stored)} is neither the whole shape "
                         f"{shape_text(whole)} nor its flattening")
    out: list[Block] = []
    for offsets, sizes, first in _blocks(shape, lo, hi):
        view = src.narrow(0, first - lo, math.prod(sizes)).view(sizes)
        for o, t in _in_whole(offsets, view, split):
            out += _flattened(o, t, whole) if flat else [(o, t)]
    return out


def shape_text(shape: Any) -> str:
    """A shape as Python writes the tuple: ``(3, 4)``, ``(5,)``."""
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def flat_view(tensor: torch.Tensor, what: str) -> torch.Tensor:
    """A 1-D view sharing ``tensor``'s memory (DCP loads write through it)."""
    tensor = tensor.detach()
    if not tensor.is_contiguous():
        raise ValueError(f"{what} is not contiguous (strides {tensor.stride()}, shape "
                         f"{tuple(tensor.shape)}); checkpoints need contiguous tensors")
    return tensor.view(-1)


def aliases(engine: CheckpointableEngine, names: list[str]) -> dict[str, str]:
    """Other names of the trainable parameters (tied weights) -> the name they are saved under."""
    trainable = {id(p): names[i] for i, p in enumerate(engine.trainable)}
    return {n: trainable[id(p)]
            for n, p in engine.module.named_parameters(remove_duplicate=False)
            if id(p) in trainable and n != trainable[id(p)]}


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


def split_entries(engine: CheckpointableEngine) -> dict[str, tuple[torch.Tensor, Split]]:
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
