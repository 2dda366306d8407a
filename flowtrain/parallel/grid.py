"""The process grid: data × pipeline × tensor parallel ranks, built once from the world size.

Rank layout (tensor-parallel ranks adjacent, so a tensor-parallel group sits on one host when
it can; then data parallel; pipeline stages outermost):

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class GridShape:
    world_size: int
    pp: int
    tp: int

    @property
    def dp(self) -> int:
        return self.world_size // (self.pp * self.tp)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of a global rank."""
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return pp_rank, dp_rank, tp_rank

    def rank_of(self, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def dp_ranks(self, pp_rank: int, tp_rank: int) -> list[int]:
        return [self.rank_of(pp_rank, d, tp_rank) for d in range(self.dp)]

    def pp_ranks(self, dp_rank: int, tp_rank: int) -> list[int]:
        return [self.rank_of(p, dp_rank, tp_rank) for p in range(self.pp)]

    def tp_ranks(self, pp_rank: int, dp_rank: int) -> list[int]:
        return [self.rank_of(pp_rank, dp_rank, t) for t in range(self.tp)]


def check_shape(world_size: int, pp: int, tp: int) -> GridShape:
    """The grid for these sizes, or a ValueError naming them."""
    for name, value in (("world size", world_size), ("pipeline stages", pp),
                        ("tensor_parallel.tp_size", tp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % (pp * tp):
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"cannot lay out {world_size} ranks as {pp} pipeline stages x {tp} tensor-parallel "
            f"ranks x data parallel: {pp} x {tp} = {pp * tp} does not divide {world_size}; "
            f"pipeline stages times tp_size must be one of {divisors}")
    return GridShape(world_size, pp, tp)


@dataclass
class ProcessGrid:
    """This rank's place in the grid and its process groups (None where the group is the
    whole world, so the default group serves)."""

    shape: GridShape
    rank: int
    dp_group: Any = None
    pp_group: Any = None
    tp_group: Any = None
    pp_ranks: list[int] = field(default_factory=list)  # global ranks of my pipeline, by stage
    dp_ranks: list[int] = field(default_factory=list)
    tp_ranks: list[int] = field(default_factory=list)

    @property
    def pp_rank(self) -> int:
        return self.shape.coords(self.rank)[0]

    @property
    def dp_rank(self) -> int:
        return self.shape.coords(self.rank)[1]

    @property
    def tp_rank(self) -> int:
        return self.shape.coords(self.rank)[2]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.shape.pp - 1

    def stage_rank(self, stage: int) -> int:
        """The global rank of pipeline stage ``stage`` in my pipeline."""
        return self.pp_ranks[stage]


def build_grid(pp: int = 1, tp: int = 1) -> ProcessGrid:
    """Creates every data-, pipeline- and tensor-parallel group (every rank must call this,
    in the same order: torch.distributed.new_group is collective) and returns this rank's."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    if world == 1 and pp * tp > 1 and not dist.is_initialized():
        import os

        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if launched > 1:
            # launched on several ranks but built before the process group: say that, not
            # "1 rank", which points at the launcher instead of the script
            raise ValueError(f"torch.distributed is not initialised, so this process sees 1 "
                             f"rank of the {launched} launched: call "
                             f"flowtrain.init_distributed() before building a model of {pp} "
                             f"pipeline stages x {tp} tensor-parallel ranks")
    shape = check_shape(world, pp, tp)
    pp_rank, dp_rank, tp_rank = shape.coords(rank)
    grid = ProcessGrid(shape, rank, pp_ranks=shape.pp_ranks(dp_rank, tp_rank),
                       dp_ranks=shape.dp_ranks(pp_rank, tp_rank),
                       tp_ranks=shape.tp_ranks(pp_rank, dp_rank))
    if world == 1:
        return grid

    def groups(lists: list[list[int]]) -> Any:
        mine = None
        for ranks in lists:
            group = dist.new_group(ranks=ranks) if len(ranks) < world else None
            if rank in ranks:
                mine = group
        return mine

    grid.dp_group = groups([shape.dp_ranks(p, t) for p in range(pp) for t in range(tp)])
    grid.pp_group = groups([shape.pp_ranks(d, t) for d in range(shape.dp) for t in range(tp)])
    grid.tp_group = groups([shape.tp_ranks(p, d) for p in range(pp) for d in range(shape.dp)])
    return grid
