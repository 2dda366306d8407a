"""What one rank keeps for backward: a transformer layer's saved tensors as a training stack
stores them, the loss end's logits, and how many micro-batch chunks a pipeline schedule holds
at once (walked over the same per-stage instruction lists the engine and the planner use).

The layer accounting is Korthikanti et al. 2022 (arXiv:2205.05198, Sec. 4), written out per
tensor in ``sims.models.layer_activation_bytes``; this module adjusts it for what a stack's
kernels save instead (a fused SwiGLU, Transformer Engine's fp8 GEMM inputs, torchtitan's per-op
checkpointing policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flowtrain.plan.schedule import stage_ops
from sims.models import Architecture, layer_activation_bytes

# how a stack's loss end holds the logits, bytes per logit at its peak
LOSS_FP32_COPY = 6.0  # 16-bit logits and the fp32 copy the softmax is computed in (Megatron)
LOSS_FP32 = 4.0  # one fp32 logits tensor (DeepSpeed-style accounting)
LOSS_EAGER_FP32 = 8.0  # fp32 logits and fp32 log-softmax output (eager F.cross_entropy)
LOSS_FUSED = 4.0  # 16-bit logits and their 16-bit gradient (flash-attn's fused cross entropy)


@dataclass(frozen=True)
class Kernels:
    """What a stack's kernels save for backward, where stacks differ.

    ``fused_activation``: the MLP's activation is one op that keeps only its input (Megatron's
    bias-SwiGLU/GeLU fusions, Korthikanti's accounting), so a SwiGLU layer keeps its gate/up
    output (2f) and its product (f), not also the SiLU output. ``fp8_inputs``: with fp8 GEMMs
    each linear keeps its input cast to fp8 (Transformer Engine), 1 byte instead of 2.
    ``loss_bytes``: bytes per logit element held at the loss end (see the LOSS_* figures).
    """

    fused_activation: bool = False
    fp8_inputs: bool = False
    loss_bytes: float = LOSS_FP32


def layer_bytes(arch: Architecture, seq_len: int, *, tp: int, sequence_parallel: bool,
                maps: bool, kernels: Kernels, fp8: bool = False, recompute: str = "none"
                ) -> float:
    """Bytes one layer keeps for backward per sample (16-bit activations) between its forward
    and its backward, with ``recompute`` "none" or "selective" (the maps are then dropped:
    ``maps``) or "op" (torchtitan's per-op policy). Full recompute is not handled here: it
    keeps only the layer input."""
    s, h, f, t = seq_len, arch.hidden, arch.ffn, tp
    kv = max(arch.kv_heads / t, 1.0) * arch.head_dim  # K (or V) width on one tensor rank
    whole = t if sequence_parallel else 1  # what a tensor rank holds of per-token tensors
    if recompute == "op" and arch.gated_mlp:
        # torchtitan's per-op policy (parallelize_llama.py _save_list) keeps the outputs of
        # every other matmul in order (wq, wv, w1, w2 of wq wk wv wo w1 w3 w2), of the
        # attention kernel and of the tensor-parallel reduce-scatters, and the block input;
        # everything else is recomputed. w2's output is the unreduced partial sum on a tensor
        # rank (full width)
        per_token = 2 * h / whole + 2 * h / t + 2 * kv + 2 * f / t + 2 * h + 2 * h / t
        if t > 1 and sequence_parallel:
            per_token += 2 * (2 * h / t)
        return s * per_token
    total = layer_activation_bytes(arch, s, tp=t, maps=maps, sequence_parallel=sequence_parallel)
    if recompute == "op":
        # the per-op policy keeps about every other matmul output of a non-gated layer
        return total / 2
    if kernels.fused_activation and arch.gated_mlp:
        total -= s * 2 * f / t  # the SiLU output is recomputed inside the fused backward
    if fp8 and kernels.fp8_inputs:
        # the two norm outputs (QKV and FC1 inputs) and FC2's input are kept in fp8; the
        # output projection keeps an fp8 copy of its input beside the bf16 attention output
        # the attention kernel keeps
        total += s * (-2 * h / whole - f / t + h / t)
    return total


def loss_bytes(arch: Architecture, seq_len: int, *, tp: int, kernels: Kernels) -> float:
    """Bytes per sample live at the loss end of the last stage: the final norm's and the LM
    head's inputs (2·s·h each), the embedding dropout mask (GPT), and the logits as the stack's
    loss holds them (vocab-parallel over ``tp``)."""
    s, h = seq_len, arch.hidden
    return s * (h if arch.dropout else 0) + 4 * s * h + kernels.loss_bytes * s * arch.vocab / tp


def in_flight(schedule: str, stage: int, stages: int, micro_batches: int,
              chunk_bytes: Sequence[float]) -> tuple[float, int]:
    """(bytes, chunks) held at the worst moment of ``stage``'s step: its pipeline instructions
    walked in order, each forward of local chunk c adding ``chunk_bytes[c]`` until that
    micro-batch's backward of c frees it. Without a pipeline one micro-batch is in flight."""
    if stages == 1:
        return chunk_bytes[0], 1
    v = len(chunk_bytes)
    if v > 1:
        schedule = "interleaved"
    # After the warm-up (fewer than (v + 1)p forwards) each step runs one forward and one
    # backward, and the chunks they touch repeat with every group of p micro-batches: the held
    # bytes repeat too, so three groups (the warm-up and a full period beyond it) reach the
    # step's peak.
    walked = micro_batches
    if schedule == "interleaved":
        walked = min(micro_batches, 3 * stages)
    elif schedule == "1f1b":
        walked = min(micro_batches, stages + 1)
    ops = stage_ops(schedule, stage, stages, walked, v)
    live = peak = 0.0
    count = peak_count = 0
    for op in ops:
        chunk = op.chunk or 0
        if op.kind == "forward":
            live += chunk_bytes[chunk]
            count += 1
            if live > peak or (live == peak and count > peak_count):
                peak, peak_count = live, count
        elif op.kind == "backward":
            live -= chunk_bytes[chunk]
            count -= 1
    return peak, peak_count
