"""ZeRO (arXiv:1910.02054) in the data-parallel engine: stage 1 shards the optimizer state and
the fp32 master weights, stage 2 also reduce-scatters gradients into per-rank shards.

Every gradient bucket's flat buffer is padded to a multiple of the data-parallel world size N and
rank r owns the contiguous slice r of every bucket (see ``partition``); ``sharded`` holds the
optimizer side (master shards, the global overflow/norm, the post-step all-gather)."""

from flowtrain.zero.gathered import GatheredParameters, Init, is_zero3_param
from flowtrain.zero.partition import Shard, flatten_params, padded_numel, shard_of
from flowtrain.zero.sharded import ZeroOptimizer

__all__ = ["GatheredParameters", "Init", "Shard", "ZeroOptimizer", "flatten_params",
           "is_zero3_param", "padded_numel", "shard_of"]
