"""Tensor parallelism, Megatron-style: column- and row-parallel linears, a vocab-parallel
embedding and cross-entropy (``flowtrain.tp.layers``), and ``parallelize`` to split a
GPT/Llama-style model's standard blocks (``flowtrain.tp.auto``)."""

from flowtrain.tp.auto import parallelize
from flowtrain.tp.layers import (
                                 ColumnParallelLinear,
                                 RowParallelLinear,
                                 VocabParallelEmbedding,
                                 copy_to_tp,
                                 gather_from_tp,
                                 reduce_from_tp,
                                 scatter_to_tp,
                                 vocab_parallel_cross_entropy,
)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "copy_to_tp",
           "gather_from_tp", "parallelize", "reduce_from_tp", "scatter_to_tp",
           "vocab_parallel_cross_entropy"]
