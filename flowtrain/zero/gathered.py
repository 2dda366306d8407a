"""DeepSpeed's ``deepspeed.zero.Init`` and ``deepspeed.zero.GatheredParameters`` over
flowtrain's ZeRO stage 3, which scripts and libraries written for DeepSpeed (transformers,
accelerate) call by those names.

Each parameter an engine runs under stage 3 carries its place (``register``): the engine's
ZeroOptimizer, its bucket, and DeepSpeed's ``ds_id`` / ``ds_shape`` / ``ds_numel`` attributes,
which those libraries read to count a partitioned parameter's elements."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from flowtrain import comm
from flowtrain.plan.zero_stage import partitions_parameters
from flowtrain.zero import construct

if TYPE_CHECKING:
    from flowtrain.config.load import ConfigSource
    from flowtrain.zero.sharded import ZeroOptimizer
    from flowtrain.zero.stage3 import Stage3Params

_PLACE = "flowtrain_zero3"  # the attribute a registered parameter carries


@dataclass(frozen=True)
class _Place:
    zero: ZeroOptimizer
    stage3: Stage3Params | None  # None on one rank: nothing is partitioned
    bucket: int


def register(zero: ZeroOptimizer, stage3: Stage3Params | None) -> None:
    """Marks every parameter of a stage-3 ZeroOptimizer with its place."""
    for b, bucket in enumerate(zero.plan):
        for slot in bucket.slots:
            param = zero.params[slot.index]
            setattr(param, _PLACE, _Place(zero, stage3, b))
            setattr(param, "ds_id", slot.index)  # noqa: B010 - DeepSpeed's names, not torch's
            setattr(param, "ds_shape", torch.Size(slot.shape))  # noqa: B010
            setattr(param, "ds_numel", slot.numel)  # noqa: B010


class GatheredParameters:
    """``with GatheredParameters(params, modifier_rank=r):`` — inside the block the stage-3
    parameters among ``params`` (one parameter or an iterable) are whole on every rank; on
    exit, when ``modifier_rank`` is set, the values rank ``r`` (a rank of the data-parallel
    group) holds then are broadcast to every rank and become the model's: each rank's shard
    and its fp32 master copy take them, so the next forward and the optimizer see them. Then
    the parameters are partitioned again. Every rank must enter the block. Parameters that
    ``zero.Init`` partitioned before any engine took them are gathered and published the same
    way. Parameters not under stage 3 are left alone, as DeepSpeed leaves them;
    ``fwd_module`` is accepted."""

    def __init__(self, params: torch.Tensor | Iterable[torch.Tensor] | None,
                 modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        if params is None or not enabled:
            params = []
        elif isinstance(params, torch.Tensor):
            params = [params]
        self.modifier_rank = modifier_rank
        params = list(params)
        # parameters partitioned by zero.Init that no engine has taken over yet
        self._loose = [p for p in params if construct.is_partitioned(p)]
        # the buckets to gather, per owning ZeroOptimizer, in bucket order
        self._groups: dict[int, tuple[_Place, list[int]]] = {}
        for p in params:
            place = getattr(p, _PLACE, None)
            if place is None:
                continue
            _, buckets = self._groups.setdefault(id(place.zero), (place, []))
            if place.bucket not in buckets:
                buckets.append(place.bucket)
        for _, buckets in self._groups.values():
            buckets.sort()
        self._gathered: dict[int, list[int]] = {}

    def __enter__(self) -> None:
        for p in self._loose:
            construct.gather(p)
        for key, (place, buckets) in self._groups.items():
            if place.stage3 is not None:
                self._gathered[key] = place.stage3.gather_buckets(buckets)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            # a block that raised may have raised on this rank alone: no collective then
            if self.modifier_rank is not None and exc_type is None:
                if self._loose:
                    src = self._source_rank(comm.get_world_size() if comm.is_initialized()
                                            else 1, None)
                    for p in self._loose:
                        construct.publish(p, src)
                for place, buckets in self._groups.values():
                    self._publish(place, buckets)
        finally:
            for p in self._loose:
                construct.drop(p)
            for key, (place, _) in self._groups.items():
                if place.stage3 is not None:
                    place.stage3.release_buckets(self._gathered.pop(key, []))

    def _source_rank(self, world_size: int, group: Any) -> int:
        """The global rank of ``modifier_rank`` in a data-parallel group of ``world_size``."""
        rank = self.modifier_rank
        assert rank is not None
        if not 0 <= rank < world_size:
            raise ValueError(f"GatheredParameters: modifier_rank {rank} is not a rank of the "
                             f"data-parallel group (0..{world_size - 1})")
        return dist.get_global_rank(group, rank) if group is not None else rank

    def _publish(self, place: _Place, buckets: list[int]) -> None:
        zero = place.zero
        src = self._source_rank(zero.world_size, zero.group)
        fulls = []
        for b in buckets:
            full = zero.flat_params[b]
            if full is None:
                assert place.stage3 is not None
                full = place.stage3.live[b]
            if zero.world_size > 1:
                comm.broadcast(full, src=src, group=zero.group)
            fulls.append(full)
        zero.before_write()  # host-shared parameters: peers done reading them
        for b, full in zip(buckets, fulls):
            zero.store_full(b, full)


class Init:
    """``with zero.Init(...):`` around a model's construction, DeepSpeed's way of building a
    ZeRO-3 model: on several ranks each module's parameters are partitioned as soon as the
    module is built (``flowtrain.zero.construct``), so the whole model never exists on one
    rank. A config given (``config_dict_or_path``/``config``) whose ``zero_optimization.stage``
    is not 3 leaves the parameters whole, as does one process. ``dtype`` casts the partitions;
    ``module=`` (an already built model) partitions that model's parameters. DeepSpeed's other
    arguments (process group, remote device, pinning, mpu) are accepted; the engine takes
    those from the config given to initialize. Module classes defined inside the block are not
    partitioned at construction (initialize shards them as any model)."""

    recorded: list[torch.nn.Module] = []

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: Any = None,
                 pin_memory: bool = False, config_dict_or_path: ConfigSource | None = None,
                 config: ConfigSource | None = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None,
                 **_: Any) -> None:
        self.config = config_dict_or_path if config_dict_or_path is not None else config
        self.dtype = dtype
        self.enabled = enabled and _stage_three(self.config) and comm.is_initialized() and \
            comm.get_world_size() > 1
        self._entered = False
        if module is not None and enabled:
            Init.recorded.append(module)
            if self.enabled:
                for p in module.parameters():
                    if getattr(p, "ds_tensor", None) is None and not is_zero3_param(p):
                        construct.partition(p, dtype)

    def __enter__(self) -> Init:
        if self.enabled:
            construct.enter(self.dtype)
            self._entered = True
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._entered:
            self._entered = False
            construct.leave()
        return None


def _stage_three(config: ConfigSource | None) -> bool:
    """Whether ``config`` (a dict, a path to a JSON file, or None) leaves stage 3 on."""
    if config is None:
        return True
    if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
        import json
        from pathlib import Path

        config = json.loads(Path(config).read_text())
    if not isinstance(config, dict):
        return True
    zero = config.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    return partitions_parameters(stage)


def is_zero3_param(param: torch.Tensor) -> bool:
    """Whether an engine runs ``param`` under ZeRO stage 3 (it has DeepSpeed's ds_id)."""
    return hasattr(param, _PLACE)
