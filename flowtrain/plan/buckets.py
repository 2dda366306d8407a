"""Gradient buckets: which parameters share a flat buffer and one collective.

Bucket membership and order are decided here, once, from the parameters' sizes and the order in
which their gradients become ready; the engine's BucketReducer and the simulator both read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flowtrain.plan import names

ParamSpec = tuple[str, tuple[int, ...], str, int]  # (name, shape, dtype, element size)

# The first bucket is kept small so that the first all-reduce starts early in backward (the
# same reasoning as DDP's 1 MiB first bucket).
FIRST_BUCKET_BYTES = 1 << 20


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place in its bucket."""

    index: int  # position in model.parameters()
    name: str
    shape: tuple[int, ...]
    numel: int
    offset: int  # element offset inside the bucket's flat buffer


@dataclass(frozen=True)
class BucketPlan:
    """A flat buffer of gradients reduced by one collective."""

    index: int
    dtype: str  # the gradients' dtype, e.g. "float32"
    slots: tuple[ParamSlot, ...]
    numel: int
    group: int = 0  # the optimizer parameter group of every slot (ZeRO shards step per group)
    # ZeRO stage 3: the bucket is one module's parameters, partitioned between uses (False:
    # kept whole on every rank, like stages 1-2)
    partitioned: bool = False

    @property
    def task_name(self) -> str:
        return names.reduce(self.index)

    @property
    def param_indices(self) -> tuple[int, ...]:
        return tuple(s.index for s in self.slots)


def plan_buckets(
    params: Sequence[tuple[str, tuple[int, ...], str, int]],
    bucket_numel: int,
    order: Sequence[int] | None = None,
    first_bucket_bytes: int = FIRST_BUCKET_BYTES,
    groups: Sequence[int] | None = None,
) -> tuple[BucketPlan, ...]:
    """Groups parameters into buckets.

    Args:
        params: (name, shape, dtype name, element size in bytes) of each trainable parameter,
            in ``model.parameters()`` order.
        bucket_numel: the most elements a bucket holds (``reduce_bucket_size``); a parameter
            larger than that gets a bucket of its own.
        order: parameter indices in gradient-ready order (observed on a first step); by default
            the reverse of ``model.parameters()``, which is roughly when backward produces them.
        first_bucket_bytes: the first bucket's cap in bytes, so communication starts early.
        groups: each parameter's optimizer group; a bucket never mixes groups (ZeRO steps
            a bucket's shard with one group's hyper-parameters).
    """
    if bucket_numel < 1:
        raise ValueError(f"reduce_bucket_size must be at least 1 element, got {bucket_numel}")
    n = len(params)
    order = list(range(n - 1, -1, -1)) if order is None else list(order)
    if sorted(order) != list(range(n)):
        raise ValueError(f"gradient order must be a permutation of 0..{n - 1}, got {order}")
    buckets: list[BucketPlan] = []
    slots: list[ParamSlot] = []
    filled = 0
    dtype = None
    group = 0

    def close() -> None:
        nonlocal slots, filled
        if slots:
            buckets.append(BucketPlan(len(buckets), str(dtype), tuple(slots), filled, group))
        slots, filled = [], 0

    for index in order:
        name, shape, param_dtype, elem_size = params[index]
        numel = 1
        for d in shape:
            numel *= d
        cap = bucket_numel if buckets else \
            min(bucket_numel, max(1, first_bucket_bytes // elem_size))
        # Buckets hold one dtype: a single flat buffer and one collective per bucket.
        param_group = groups[index] if groups is not None else 0
        if slots and (param_dtype != dtype or param_group != group or filled + numel > cap):
            close()
        dtype, group = param_dtype, param_group
        slots.append(ParamSlot(index, name, tuple(shape), numel, filled))
        filled += numel
    close()
    return tuple(buckets)


def plan_units(
    params: Sequence[tuple[str, tuple[int, ...], str, int]],
    units: Sequence[Sequence[int]],
    *,
    bucket_numel: int,
    persistence_threshold: int,
    groups: Sequence[int] | None = None,
) -> tuple[BucketPlan, ...]:
    """ZeRO stage 3's buckets: each module's own parameters (``units``, in module order) form
    one partitioned bucket, gathered before the module runs and released after; a module's
    parameters of at most ``persistence_threshold`` elements each stay whole on every rank and
    are packed into ordinary buckets. Buckets follow backward order (last module first)."""
    def numel_of(index: int) -> int:
        n = 1
        for d in params[index][1]:
            n *= d
        return n

    buckets: list[BucketPlan] = []
    resident: list[int] = []
    for unit in reversed(units):
        # a unit splits by dtype and optimizer group, like any bucket
        keyed: dict[tuple[str, int], list[int]] = {}
        for index in unit:
            if numel_of(index) <= persistence_threshold:
                resident.append(index)
            else:
                key = (params[index][2], groups[index] if groups is not None else 0)
                keyed.setdefault(key, []).append(index)
        for (dtype, group), members in keyed.items():
            slots, filled = [], 0
            for index in members:
                name, shape = params[index][0], tuple(params[index][1])
                slots.append(ParamSlot(index, name, shape, numel_of(index), filled))
                filled += numel_of(index)
            buckets.append(BucketPlan(len(buckets), dtype, tuple(slots), filled, group, True))
    if resident:
        sub = [params[i] for i in resident]
        packed = plan_buckets(sub, bucket_numel, order=range(len(sub)), first_bucket_bytes=1 << 62,
                              groups=[groups[i] for i in resident] if groups is not None else None)
        for b in packed:
            renumbered = tuple(ParamSlot(resident[s.index], s.name, s.shape, s.numel, s.offset)
                               for s in b.slots)
            buckets.append(BucketPlan(len(buckets), b.dtype, renumbered, b.numel, b.group, False))
    return tuple(buckets)
