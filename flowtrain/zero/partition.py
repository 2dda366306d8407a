"""How a bucket splits across the data-parallel ranks, and the flat parameter buffers that make
the post-step all-gather write the model's parameters in place."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flowtrain.plan import BucketPlan


def padded_numel(numel: int, world_size: int) -> int:
    """``numel`` rounded up to a multiple of ``world_size`` (the padding is never read)."""
    return -(-numel // world_size) * world_size


@dataclass(frozen=True)
class Shard:
    """Rank ``rank``'s contiguous slice [start, start + numel) of a padded bucket."""

    rank: int
    start: int
    numel: int
    padded: int  # the bucket's padded length: numel * world size


def shard_of(numel: int, world_size: int, rank: int) -> Shard:
    padded = padded_numel(numel, world_size)
    size = padded // world_size
    return Shard(rank, rank * size, size, padded)


def flatten_params(params: Sequence[torch.nn.Parameter], plan: Sequence[BucketPlan],
                   world_size: int) -> list[torch.Tensor]:
    """One padded flat buffer per bucket holding its parameters' values; every parameter's
    ``.data`` becomes a view into it (same layout as the bucket's gradient buffer)."""
    flats = []
    with torch.no_grad():
        for bucket in plan:
            first = params[bucket.slots[0].index]
            flat = torch.zeros(padded_numel(bucket.numel, world_size), dtype=first.dtype,
                               device=first.device)
            for slot in bucket.slots:
                param = params[slot.index]
                view = flat.narrow(0, slot.offset, slot.numel).view(slot.shape)
                view.copy_(param.data)
                param.data = view
            flats.append(flat)
    return flats
