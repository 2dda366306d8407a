"""sims.op_program: a traced module's ops recognized as a GPU runs them. Hand-written attention
and scaled_dot_product_attention are one attention each; what a layer keeps equals Korthikanti
et al.'s formula for the same architecture; memory-bound ops are fused kernels (or eager ones,
with the bytes an eager RMSNorm streams); tensor parallelism splits column- and row-parallel
linears; what is not recognized is named."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from sims.architecture import Architecture, layer_activation_bytes
from sims.layer_ops import Attention, Gemm, RankShape, Stream, eager_bytes
from sims.models import trace_module
from sims.op_program import PAttention, PGemm, PLoss, items_of

SEQ, BATCH = 16, 2
FIGURES = dict(tp=1, sequence_parallel=False, fused_activation=False, eager=False,
               loss_bytes=4.0)


def _program(factory: str, seq: int = SEQ, batch: int = BATCH) -> Any:
    return trace_module(factory, seq_len=seq, batch=batch).program


@pytest.mark.parametrize("factory,kind", [("sim_models:gpt2_tiny_dropout", "hand-written"),
                                          ("sim_models:gpt2_tiny_sdpa", "sdpa")])
def test_attention_is_one_op_whichever_way_it_is_written(factory: str, kind: str) -> None:
    program = _program(factory)
    assert program.attention_kinds == {kind: 2}
    attention = [i for i in program.layers[0].items if isinstance(i, PAttention)]
    assert len(attention) == 1
    a = attention[0]
    assert (a.batch, a.heads, a.seq, a.keys, a.head_dim, a.causal) == (BATCH, 4, SEQ, SEQ, 16,
                                                                       True)
    # the layer's matmuls are its four linears, none of them the attention's products
    assert [(g.m, g.n, g.k) for g in program.layers[0].items if isinstance(g, PGemm)] == \
        [(BATCH * SEQ, 192, 64), (BATCH * SEQ, 64, 64), (BATCH * SEQ, 256, 64),
         (BATCH * SEQ, 64, 256)]
    flash = program.forward(0, RankShape(micro_batch=BATCH))
    unfused = program.forward(0, RankShape(micro_batch=BATCH, flash=False))
    assert [op.label for op in flash if isinstance(op, Attention)] == ["attention"]
    assert {"softmax"} <= {op.label for op in unfused if isinstance(op, Stream)}


@pytest.mark.parametrize("factory,arch", [
    ("sim_models:gpt2_tiny_dropout", Architecture("gpt2", 2, 64, 4, 4, 256, 97, 32)),
    ("sim_models:llama_tiny_mha", Architecture("llama", 2, 64, 4, 4, 96, 101, 32))])
def test_a_layer_keeps_what_the_formula_counts(factory: str, arch: Architecture) -> None:
    program = _program(factory)
    for maps in (False, True):
        kept = program.saved_bytes(0, maps=maps, **FIGURES) / BATCH
        assert kept == layer_activation_bytes(arch, SEQ, maps=maps)


def test_fused_kernels_and_eager_ones() -> None:
    program = _program("sim_models:llama_tiny")
    tokens, hidden = BATCH * SEQ, 64
    fused = program.forward(0, RankShape(micro_batch=BATCH))
    eager = program.forward(0, RankShape(micro_batch=BATCH, eager=True))
    norm_fused = next(op for op in fused if op.label == "norm")
    norm_eager = next(op for op in eager if op.label == "norm")
    assert isinstance(norm_fused, Stream) and isinstance(norm_eager, Stream)
    # a fused RMSNorm reads its input and writes its output (and reads its weight)
    assert norm_fused.bytes == 2 * tokens * hidden * 2 + hidden * 2
    # eagerly each primitive kernel streams its tensors: eager_bytes' count for torchtitan's
    # RMSNorm, plus a second x.float() (read 2, write 4) this one makes, the row statistics
    # and the weight
    per_element = eager_bytes("rmsnorm", 2) + 6
    assert tokens * hidden * per_element < norm_eager.bytes < \
        tokens * hidden * (per_element + 1)


def test_tensor_parallel_splits_columns_then_rows() -> None:
    program = _program("sim_models:llama_tiny_mha")
    assert program.row_parallel(0) == 2
    whole = [op for op in program.forward(0, RankShape(micro_batch=BATCH)) if
             isinstance(op, Gemm)]
    split = [op for op in program.forward(0, RankShape(micro_batch=BATCH, tp=2)) if
             isinstance(op, Gemm)]
    # q, k, v, gate and up column-parallel (n halved); the output projection and down
    # row-parallel (k halved)
    assert [(a.n // b.n, a.k // b.k) for a, b in zip(whole, split)] == \
        [(2, 1), (2, 1), (2, 1), (1, 2), (2, 1), (2, 1), (1, 2)]
    heads = [op.batch_heads for op in program.forward(0, RankShape(micro_batch=BATCH, tp=2))
             if isinstance(op, Attention)]
    assert heads == [BATCH * 2]
    # the LM head is vocab-parallel, and so is the loss over its logits
    head = [op for op in program.forward(-2, RankShape(micro_batch=BATCH, tp=2))
            if isinstance(op, Gemm)]
    assert head[0].n == math.ceil(101 / 2)


def test_the_training_script_s_loss_is_added_to_logits() -> None:
    program = _program("sim_models:gpt2_tiny")
    loss = [i for i in items_of(program) if isinstance(i, PLoss)]
    assert len(loss) == 1 and loss[0].added and loss[0].elements == BATCH * SEQ * 97
    with_targets = trace_module("sim_models:gpt2_tiny", seq_len=SEQ, batch=BATCH,
                                example="sim_models:tokens_and_targets").program
    loss = [i for i in items_of(with_targets) if isinstance(i, PLoss)]
    assert len(loss) == 1 and not loss[0].added


class _Odd(torch.nn.Module):
    """A block calling an op the recognizer does not know (top-k over the features)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(2)])
        self.embed = torch.nn.Embedding(50, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            values, _ = torch.topk(block(x), 8, dim=-1)
            x = x + values.sum(-1, keepdim=True)
        return x


def odd() -> _Odd:
    return _Odd()


def test_what_is_not_recognized_is_named() -> None:
    program = trace_module(f"{__name__}:odd", seq_len=SEQ, batch=BATCH).program
    assert program.unrecognized == {"topk": 2}
    assert any("not recognized" in line and "topk x2" in line for line in program.summary())
