"""ZeRO-1/2 under ``flowtrain launch --peer-recovery``: each rank keeps a mirror of its
neighbour's optimizer shard, so the shard of a lost rank survives on its predecessor, and the
survivors re-partition the whole optimizer state among themselves without touching disk.

Rank r of W mirrors the shard of rank (r + 1) % W: an fp32 copy of that slice of the master
weights and a second instance of the user's optimizer over it, stepped every step on the same
reduced gradients with the same hyper-parameters, by the same code path as the owner, so the
mirror holds the owner's values bit for bit. The gradients must therefore be whole on every
rank after the reduce: under peer recovery stage 2 all-reduces (``reduce_scatter`` false) and
behaves as stage 1. The price is one more shard of optimizer state per rank and twice the
optimizer's arithmetic; a shard is lost only when a rank and its predecessor are lost together.

The exchange after a loss or a join (``assemble``) rebuilds each bucket's whole state from its
holders, one broadcast per (bucket, state tensor, old shard); every member then takes its new
shard and its new mirror from it (``load_shards``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from flowtrain.zero.partition import Shard, shard_of

if TYPE_CHECKING:
    from flowtrain.engine.buckets import GradBuckets
    from flowtrain.plan.buckets import BucketPlan

MASTER = "__master__"  # the key of the fp32 master weights among a shard's state tensors


def clone_optimizer(optimizer: torch.optim.Optimizer,
                    groups: Sequence[Sequence[torch.Tensor]]) -> torch.optim.Optimizer:
    """A fresh optimizer of ``optimizer``'s class and hyper-parameters over ``groups`` (one
    list of tensors per parameter group), made the way unpickling makes one, so any optimizer
    whose state pickles can be mirrored."""
    if optimizer.state:
        raise ValueError("the optimizer has stepped already; its mirror must start with it")
    cls = type(optimizer)
    clone = cls.__new__(cls)
    param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(params)}
                    for group, params in zip(optimizer.param_groups, groups, strict=True)]
    clone.__setstate__({"defaults": dict(optimizer.defaults), "state": defaultdict(dict),
                        "param_groups": param_groups})
    return clone


class MirroredShards(Protocol):
    """What a mirror reads of the ZeroOptimizer it sits beside (which imports this module: a
    Protocol, not the class): the group, the bucket plan, the whole flat parameters, the
    reduced gradient buckets and whether the shards' ``.grad`` are views of them."""

    rank: int
    world_size: int
    plan: tuple[BucketPlan, ...]
    flat_params: list[torch.Tensor | None]
    aliased: bool
    buckets: GradBuckets


class ShardMirror:
    """This rank's copy of rank (rank + 1) % world's optimizer shard (``ZeroOptimizer.mirror``)."""

    def __init__(self, zero: MirroredShards, optimizer: torch.optim.Optimizer) -> None:
        self.owner = (zero.rank + 1) % zero.world_size
        self.shards: list[Shard] = [shard_of(b.numel, zero.world_size, self.owner)
                                    for b in zero.plan]
        self.master: list[torch.nn.Parameter] = []
        for b, s in enumerate(self.shards):
            flat = zero.flat_params[b]
            if flat is None:
                raise ValueError("a ZeRO shard mirror needs the parameters whole on every rank "
                                 "(stages 1 and 2)")
            master = torch.nn.Parameter(flat.narrow(0, s.start, s.numel).detach()
                                        .to(torch.float32).clone())
            if zero.aliased:
                # the owner's .grad is a view of its slice of the all-reduced bucket: the same
                # here, so both step through the same code path and agree bit for bit
                master.grad = zero.buckets.buffer(b).narrow(0, s.start, s.numel)
            self.master.append(master)
        groups = [[m for m, bucket in zip(self.master, zero.plan) if bucket.group == g]
                  for g in range(len(optimizer.param_groups))]
        self.optimizer = clone_optimizer(optimizer, groups)

    def follow(self, optimizer: torch.optim.Optimizer) -> None:
        """Takes the owner's current hyper-parameters (an LR scheduler changes them on the
        user's optimizer only)."""
        for mine, theirs in zip(self.optimizer.param_groups, optimizer.param_groups):
            for key, value in theirs.items():
                if key != "params":
                    mine[key] = value

    def sources(self, zero: MirroredShards) -> list[torch.Tensor]:
        """Each bucket's reduced gradient slice of the mirrored shard (still loss-scaled)."""
        return [zero.buckets.buffer(b).narrow(0, s.start, s.numel)
                for b, s in enumerate(self.shards)]


def shard_state(masters: Sequence[torch.Tensor], optimizer: torch.optim.Optimizer,
                ) -> list[dict[str, Any]]:
    """Per bucket, the shard's master weights and its optimizer state by key."""
    out = []
    for master in masters:
        state = {MASTER: master.detach()}
        state.update(optimizer.state.get(master, {}))
        out.append(state)
    return out


def describe(state: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a member without the state needs to take part in ``assemble``: per bucket, each
    state tensor's dtype (tensors of the shard's length) or its value (the rest, such as the
    step count, alike on every rank)."""
    out = []
    for entries in state:
        described: dict[str, Any] = {}
        for key, value in entries.items():
            if torch.is_tensor(value) and value.dim() == 1:
                described[key] = ("tensor", str(value.dtype).removeprefix("torch."))
            else:
                described[key] = ("value", value.detach().clone() if torch.is_tensor(value)
                                  else value)
        out.append(described)
    return out


def holders(layout: Sequence[int], members: Sequence[int]) -> list[tuple[int, bool]]:
    """For each shard of the layout (``layout``: the launch ranks the shards were cut for, in
    group order), the group rank among ``members`` that holds it and whether as its mirror.
    ValueError when a shard's owner and its predecessor (its mirror) are both gone."""
    where = {rank: i for i, rank in enumerate(members)}
    out = []
    world = len(layout)
    for k, owner in enumerate(layout):
        if owner in where:
            out.append((where[owner], False))
            continue
        before = layout[(k - 1) % world]
        if world > 1 and before in where:
            out.append((where[before], True))
            continue
        lost = sorted(set(layout) - set(members))
        raise ValueError(f"ZeRO shard {k} of {world} is lost: rank {owner}, which owned it, and "
                         f"rank {before}, which mirrored it, are both gone (lost: {lost}); the "
                         f"survivors cannot rebuild the optimizer state, restart the job from "
                         f"a checkpoint (--max-restarts)")
    return out


def assemble(numels: Sequence[int], description: Sequence[dict[str, Any]],
             layout_world: int, holding: Sequence[tuple[int, bool]], me: int,
             mine: Callable[[int, bool], list[dict[str, Any]] | None],
             broadcast: Callable[[torch.Tensor, int, str], None],
             device: torch.device) -> list[dict[str, Any]]:
    """Each bucket's whole state (padded to the old layout), one broadcast per state tensor and
    old shard from the rank holding it (``holding``, from ``holders``); ``mine(k, mirrored)``
    gives this rank's state of old shard k. Values (not tensors) come from ``description``."""
    out: list[dict[str, Any]] = []
    for b, numel in enumerate(numels):
        whole: dict[str, Any] = {}
        for key, (kind, what) in description[b].items():
            if kind == "value":
                whole[key] = what
                continue
            s0 = shard_of(numel, layout_world, 0)
            full = torch.zeros(s0.padded, dtype=getattr(torch, what), device=device)
            for k, (src, mirrored) in enumerate(holding):
                s = shard_of(numel, layout_world, k)
                piece = full.narrow(0, s.start, s.numel)
                if src == me:
                    held = mine(k, mirrored)
                    assert held is not None
                    piece.copy_(held[b][key])
                broadcast(piece, src, f"ZeRO state {key!r} of bucket {b}, shard {k}")
            whole[key] = full
        out.append(whole)
    return out


def take(whole: dict[str, Any], shard: Shard, numel: int) -> dict[str, Any]:
    """``shard``'s slice of a bucket's whole state (zeros past the bucket's ``numel``: the new
    layout may pad further than the old one)."""
    out: dict[str, Any] = {}
    for key, value in whole.items():
        if not (torch.is_tensor(value) and value.dim() == 1):
            out[key] = value.clone() if torch.is_tensor(value) else value
            continue
        piece = torch.zeros(shard.numel, dtype=value.dtype, device=value.device)
        hi = min(shard.start + shard.numel, numel)
        if hi > shard.start:
            piece[:hi - shard.start].copy_(value[shard.start:hi])
        out[key] = piece
    return out


def load_state(masters: Sequence[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
               states: Sequence[dict[str, Any]], *, copy_masters: bool) -> None:
    """Puts each bucket's shard ``states`` (from ``take``) into ``optimizer`` (whose parameters
    are ``masters``) and, with ``copy_masters``, into the master weights."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups
                                             for p in g["params"])}
    loaded = optimizer.state_dict()
    loaded["state"] = {}
    for master, state in zip(masters, states, strict=True):
        if copy_masters:
            with torch.no_grad():
                master.copy_(state[MASTER])
        entries = {k: v for k, v in state.items() if k != MASTER}
        if entries:
            loaded["state"][index[id(master)]] = entries
    optimizer.load_state_dict(loaded)
