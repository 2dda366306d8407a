"""``deepspeed.zero.Init``: a model partitioned as it is built, so that under ZeRO stage 3 no
rank ever holds the whole model.

Inside the block every ``torch.nn.Module`` subclass's ``__init__`` is wrapped: when a module's
own ``__init__`` returns, each parameter it owns directly is made the same on every rank (rank
0's values are broadcast, so ranks that drew different random initial weights agree), and each
rank keeps only its slice of the flattened parameter, padded to a multiple of the world size
(``param.ds_tensor``, DeepSpeed's name; ``ds_shape``, ``ds_numel`` and ``ds_status`` beside
it). The parameter's ``.data`` becomes a one-element NaN tensor expanded to the parameter's
shape: its shape, dtype and element count are the parameter's, so code that sizes a model
still works, while reading it gives NaN and writing into it fails, instead of training on
garbage. Values are changed after construction inside ``GatheredParameters(params,
modifier_rank=r)``, as with DeepSpeed.

``flowtrain.initialize`` takes such a model as it is under stage 3 on several data-parallel
ranks: each of its ZeRO buckets is assembled from the slices one parameter at a time
(``full_flat``), so the peak is one parameter whole. Any other configuration (stages 0-2, one
rank, tensor or pipeline parallel) first gathers the parameters back whole (``restore``).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from flowtrain import comm

_lock = threading.Lock()
_depth = 0  # nested Init blocks: the wrappers come off when the outermost one exits
_wrapped: dict[type, Callable[..., None]] = {}
_dtype: torch.dtype | None = None  # Init's dtype= for the partitions


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` was partitioned by ``Init`` and not yet taken over by an engine."""
    return getattr(param, "ds_tensor", None) is not None and \
        getattr(param, "flowtrain_init", False)


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    fill = float("nan") if dtype.is_floating_point else 0
    one = torch.full((1,), fill, dtype=dtype, device=device)
    return one.expand(shape) if len(shape) else one.view(())


def _world() -> tuple[int, int]:
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(), dist.get_rank()


def partition(param: torch.nn.Parameter, dtype: torch.dtype | None = None) -> None:
    """Keeps this rank's slice of ``param`` (rank 0's values) and drops the rest."""
    world, rank = _world()
    with torch.no_grad():
        data = param.data if dtype is None or not param.is_floating_point() else \
            param.data.to(dtype)
        if world > 1:
            data = data.contiguous()
            comm.broadcast(data, src=0)
        flat = data.reshape(-1)
        numel = flat.numel()
        chunk = math.ceil(numel / world)
        shard = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
        lo, hi = min(numel, rank * chunk), min(numel, (rank + 1) * chunk)
        shard[:hi - lo].copy_(flat[lo:hi])
        shape = param.shape
        param.data = _placeholder(shape, flat.dtype, flat.device)
    param.ds_tensor = shard  # type: ignore[attr-defined]
    param.ds_shape = shape  # type: ignore[attr-defined]
    param.ds_numel = numel  # type: ignore[attr-defined]
    param.ds_status = "NOT_AVAILABLE"  # type: ignore[attr-defined]
    param.flowtrain_init = True  # type: ignore[attr-defined]


def full_flat(param: torch.Tensor) -> torch.Tensor:
    """The whole flattened values of a partitioned ``param``, gathered from every rank's slice
    (a collective: every rank calls it for the same parameters in the same order)."""
    shard: torch.Tensor = param.ds_tensor  # type: ignore[attr-defined]
    world, _ = _world()
    if world == 1:
        return shard[:param.ds_numel]  # type: ignore[attr-defined]
    full = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    comm.all_gather_into_tensor(full, shard)
    return full[:param.ds_numel]  # type: ignore[attr-defined]


def scatter_back(param: torch.Tensor, flat: torch.Tensor) -> None:
    """Takes this rank's slice of ``flat`` (whole values, the same on every rank) into
    ``param``'s partition."""
    shard: torch.Tensor = param.ds_tensor  # type: ignore[attr-defined]
    _, rank = _world()
    lo = min(flat.numel(), rank * shard.numel())
    hi = min(flat.numel(), lo + shard.numel())
    with torch.no_grad():
        shard.zero_()
        shard[:hi - lo].copy_(flat[lo:hi])


def gather(param: torch.Tensor) -> None:
    """Makes a partitioned ``param`` whole in place, keeping its partition (``drop`` undoes
    it); a collective, as ``full_flat``."""
    flat = full_flat(param)
    with torch.no_grad():
        param.data = flat.clone().view(param.ds_shape)  # type: ignore[attr-defined]


def publish(param: torch.Tensor, src: int) -> None:
    """Rank ``src``'s whole values of a gathered ``param`` become every rank's partition."""
    with torch.no_grad():
        data = param.data.contiguous()
        if _world()[0] > 1:
            comm.broadcast(data, src=src)
        scatter_back(param, data.reshape(-1))


def drop(param: torch.Tensor) -> None:
    """Replaces a gathered partitioned ``param``'s whole values by the placeholder."""
    param.data = _placeholder(param.shape, param.dtype, param.device)


def forget(param: torch.Tensor) -> None:
    """Drops the Init partition's attributes once an engine owns ``param``'s values."""
    for name in ("ds_tensor", "ds_status", "flowtrain_init"):
        if hasattr(param, name):
            delattr(param, name)


def restore(params: Iterable[torch.Tensor]) -> None:
    """Makes each partitioned parameter among ``params`` whole again on every rank."""
    for p in params:
        if is_partitioned(p):
            gather(p)
            forget(p)


def cast(params: Iterable[torch.Tensor], dtype: torch.dtype) -> None:
    """Casts the partitions of ``params`` (the engine's model dtype) without making them
    whole."""
    for p in params:
        if is_partitioned(p) and p.is_floating_point() and p.dtype != dtype:
            p.ds_tensor = p.ds_tensor.to(dtype)  # type: ignore[attr-defined]
            p.data = _placeholder(p.shape, dtype, p.device)


def _owner(cls: type) -> type | None:
    """The class whose ``__init__`` an instance of ``cls`` runs first."""
    return next((c for c in cls.__mro__ if "__init__" in c.__dict__), None)


def _after_init(module: torch.nn.Module) -> None:
    for p in module._parameters.values():
        if p is not None and not is_partitioned(p) and getattr(p, "ds_tensor", None) is None:
            partition(p, _dtype)


def _wrap(cls: type) -> None:
    original = cls.__dict__["__init__"]

    @functools.wraps(original)
    def __init__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        # only once the most-derived __init__ is done: a base's would cut its subclass short
        if _depth and _owner(type(self)) is cls:
            _after_init(self)

    try:
        cls.__init__ = __init__  # type: ignore[misc]
    except (TypeError, AttributeError):
        return  # a class whose attributes cannot be set (an extension type) stays as it is
    _wrapped[cls] = original


def _subclasses(root: type) -> list[type]:
    seen: list[type] = []
    todo: list[type] = [root]
    while todo:
        cls = todo.pop()
        sub: type
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


def enter(dtype: torch.dtype | None) -> None:
    global _depth, _dtype
    with _lock:
        _depth += 1
        if _depth > 1:
            return
        _dtype = dtype
        for cls in [torch.nn.Module, *_subclasses(torch.nn.Module)]:
            if "__init__" in cls.__dict__ and cls not in _wrapped:
                _wrap(cls)


def leave() -> None:
    global _depth, _dtype
    with _lock:
        _depth -= 1
        if _depth:
            return
        for cls, original in _wrapped.items():
            cls.__init__ = original  # type: ignore[misc]
        _wrapped.clear()
        _dtype = None
