"""Splitting a GPT/Llama-style model's standard blocks across a tensor-parallel group.

``parallelize(model, group)`` replaces, by module name:
- attention input projections (``q_proj``, ``k_proj``, ``v_proj``, ``query``, ``key``,
  ``value``, fused ``qkv`` / ``c_attn`` / ``query_key_value``) and MLP input projections
  (``up``, ``up_proj``, ``gate_proj``, ``fc1``, ``c_fc``, ``w1``, ``w3``) with
  ColumnParallelLinear (a fused qkv keeps whole heads of q, k and v on each rank);
- attention output projections (``proj``, ``o_proj``, ``out_proj``, ``c_proj``, ``dense``)
  and MLP output projections (``down``, ``down_proj``, ``fc2``, ``w2``) with RowParallelLinear;
- token embeddings (``token_embedding``, ``wte``, ``embed_tokens``, ``word_embeddings``) with
  VocabParallelEmbedding, and the output head (``head``, ``lm_head``) with a column-parallel
  linear that gathers the logits (sharing the embedding's slice when the weights are tied);
and divides head-count attributes (``n_head``, ``num_heads``, ``num_attention_heads``,
``n_heads``, ``num_key_value_heads``, ``n_kv_heads``) of the attention modules by the group
size. The attention code must take its head size from those attributes, not from the input's
width (``x.view(b, t, self.n_head, -1)``, not ``view(b, t, channels)``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flowtrain.tp.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    group_rank,
    group_size,
)

COLUMN = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "up", "up_proj", "gate_proj",
          "fc1", "c_fc", "w1", "w3"}
FUSED_QKV = {"qkv", "c_attn", "query_key_value", "Wqkv"}
ROW = {"proj", "o_proj", "out_proj", "c_proj", "dense", "down", "down_proj", "fc2", "w2"}
EMBEDDING = {"token_embedding", "wte", "embed_tokens", "word_embeddings", "tok_embeddings"}
HEAD = {"head", "lm_head", "output"}
HEAD_COUNTS = ("n_head", "num_heads", "num_attention_heads", "n_heads", "num_key_value_heads",
               "n_kv_heads")


def parallelize(model: nn.Module, group: Any) -> dict[str, list[str]]:
    """Splits ``model`` in place for this rank of ``group``; every rank must hold the same
    whole weights first. Returns what was replaced, by kind (names)."""
    tp = group_size(group)
    done: dict[str, list[str]] = {"column": [], "row": [], "embedding": [], "head": [],
                                  "heads": []}
    if tp == 1:
        return done
    # id of a replaced embedding -> its parallel module
    replaced: dict[int, VocabParallelEmbedding] = {}
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            new: nn.Module | None = None
            if isinstance(child, nn.Linear) and name in FUSED_QKV:
                new = ColumnParallelLinear.from_linear(child, group,
                                                       rows=_qkv_rows(child, tp, group_rank(group)))
                done["column"].append(full)
            elif isinstance(child, nn.Linear) and name in COLUMN:
                new = ColumnParallelLinear.from_linear(child, group)
                done["column"].append(full)
            elif isinstance(child, nn.Linear) and name in ROW:
                new = RowParallelLinear.from_linear(child, group)
                done["row"].append(full)
            elif isinstance(child, nn.Embedding) and name in EMBEDDING and \
                    child.num_embeddings % tp == 0:
                new = VocabParallelEmbedding.from_embedding(child, group)
                replaced[id(child.weight)] = new
                done["embedding"].append(full)
            elif isinstance(child, nn.Linear) and name in HEAD and \
                    child.out_features % tp == 0:
                tied = replaced.get(id(child.weight))
                new = ColumnParallelLinear.from_linear(child, group, gather_output=True)
                if tied is not None:
                    new.weight = tied.weight  # stays tied: both hold this rank's vocab rows
                done["head"].append(full)
            if new is not None:
                setattr(parent, name, new)
        if any(isinstance(c, ColumnParallelLinear) for c in parent.children()):
            for attr in HEAD_COUNTS:
                value = getattr(parent, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    if value % tp:
                        raise ValueError(f"{parent_name or 'model'}.{attr} = {value} is not "
                                         f"divisible by tensor_parallel.tp_size {tp}")
                    setattr(parent, attr, value // tp)
                    done["heads"].append(f"{parent_name}.{attr}")
    return done


def _qkv_rows(linear: nn.Linear, tp: int, rank: int) -> torch.Tensor:
    """Rows of a fused [q; k; v] projection that hold this rank's heads of each."""
    if linear.out_features % (3 * tp):
        raise ValueError(f"fused qkv projection with {linear.out_features} outputs cannot give "
                         f"each of {tp} tensor-parallel ranks a third of q, k and v")
    third = linear.out_features // 3
    size = third // tp
    return torch.cat([torch.arange(part * third + rank * size, part * third + (rank + 1) * size)
                      for part in range(3)])
