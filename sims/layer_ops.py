"""A transformer's work on one GPU rank, op by op: the matmuls with their shapes, the attention
core, and the memory-bound ops (norms, activations, residuals, dropout, rotary, softmax, loss) with
the bytes they stream. ``sims.gpu_costs`` prices each op on a GPU profile; the op lists follow the
Megatron-LM layer (Korthikanti et al. 2022, arXiv:2205.05198, Sec. 4 and 5, for what each op
reads and writes, what tensor and sequence parallelism split, and what selective recompute
repeats).

Shapes are per rank: ``tp`` tensor-parallel ranks split the attention heads and the MLP width;
with ``sequence_parallel`` the norms, dropouts and residuals run on 1/tp of the tokens;
otherwise every tensor rank repeats them on all tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from flowtrain.plan.partition import PARTITIONS, partition_costs
from sims.frameworks import LOSSES, get_framework
from sims.workload import TransformerShape, layer_of

if TYPE_CHECKING:
    from flowtrain.config.model import FlowtrainConfig

# "selective": Megatron's (Korthikanti et al.): the attention core again; "op": torchtitan's
# per-op selective checkpointing: every other matmul and every memory-bound op again; "full":
# the whole layer's forward again
RECOMPUTE = ("none", "selective", "op", "full")


@dataclass(frozen=True, slots=True)
class Gemm:
    """(m x k) @ (k x n), ``count`` of them in one batched launch: 2·m·n·k FLOPs each."""

    label: str
    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count


@dataclass(frozen=True, slots=True)
class Attention:
    """The attention core of ``batch_heads`` (micro-batch x heads on the rank) heads: scores
    Q·Kᵀ over ``seq`` queries and ``kv_seq`` keys (``seq`` when 0; with context parallelism a
    rank's queries see every rank's keys), softmax, and its product with V. ``flash``: one
    fused kernel that never stores the scores (causal: the masked half is skipped); otherwise
    two batched matmuls of the full score matrix and the softmax/mask/dropout between them as
    memory-bound ops."""

    label: str
    batch_heads: int
    seq: int
    head_dim: int
    causal: bool = True
    flash: bool = True
    backward: bool = False
    kv_seq: int = 0

    @property
    def keys(self) -> int:
        return self.kv_seq or self.seq

    @property
    def flops(self) -> float:
        """The matmul FLOPs done: 4·s²·d per head forward (2 products), 2.5x that backward
        for flash attention (it recomputes the scores), 2x for the unfused core; causal flash
        does half."""
        forward = 4.0 * self.batch_heads * self.seq * self.keys * self.head_dim
        if self.flash:
            done = forward * (0.5 if self.causal else 1.0)
            return done * (2.5 if self.backward else 1.0)
        return forward * (2.0 if self.backward else 1.0)


@dataclass(frozen=True, slots=True)
class Stream:
    """A memory-bound op (elementwise or a row reduction): ``bytes`` read plus written."""

    label: str
    bytes: float


Op = Gemm | Attention | Stream


@dataclass(frozen=True)
class RankShape:
    """How one rank runs the model: micro-batch, tensor-parallel width, the options that change
    a layer's ops, and the activation element size."""

    micro_batch: int
    tp: int = 1
    sequence_parallel: bool = False
    flash: bool = True
    recompute: str = "none"
    act_bytes: int = 2  # bf16/fp16 activations
    cp: int = 1  # context-parallel ranks: the shape's seq_len is one rank's share
    # eager PyTorch (no fused kernels, no torch.compile): RMSNorm, rotary, SwiGLU and the loss
    # run as their primitive ops, each a kernel streaming its tensors (``eager_bytes``)
    eager: bool = False
    # how the cross-entropy over the logits runs (``LOSSES``; "eager" when ``eager``)
    loss: str = "fused"
    # Q, K and V one matmul, and a gated MLP's gate and up one, whatever the model's code
    # says (Megatron's layers: ``sims.frameworks.Framework.fused_projections``)
    fused_projections: bool = True

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got "
                             f"{self.recompute!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")

    @property
    def loss_kernel(self) -> str:
        return "eager" if self.eager else self.loss


def _heads_per_rank(heads: int, tp: int) -> int:
    return max(1, math.ceil(heads / tp))


def eager_bytes(op: str, e: int) -> float:
    """Bytes per element an op streams in forward when eager PyTorch runs it as its primitive
    kernels (``e``: the activation's element size), as a Llama block written in plain PyTorch
    (torchtitan's, Meta's reference model) spells it:

    - "rmsnorm": ``x.float()`` (read e, write 4), ``pow(2)`` (4, 4), ``mean`` (4), the
      ``x * rsqrt(...)`` multiply (4, 4), ``type_as`` (4, e), ``* weight`` (e, e);
    - "rotary": ``x.float()`` viewed as complex (e, 4), the complex multiply by the
      frequencies (4, 4), ``type_as`` (4, e);
    - "swiglu" (per element of the gate): ``silu`` (e, e) and the multiply (2e, e);
    - "cross_entropy" (per logit): ``logits.float()`` (e, 4), ``log_softmax`` (two reads and
      a write of fp32); the gather of the targets is negligible; its backward
      ("cross_entropy.grad"): the zeroed gradient the targets scatter into (4), the
      log-softmax backward (4, 4, 4) and the cast back (4, e).

    A fused kernel reads its inputs and writes its output once (2e, 3e for SwiGLU, e + 8 for
    the loss over fp32 logits)."""
    per_element = {"rmsnorm": 4 * e + 28, "rotary": 2 * e + 16, "swiglu": 5 * e,
                   "cross_entropy": e + 16, "cross_entropy.grad": e + 24}
    return float(per_element[op])


def megatronloss_bytes_per_logit(e: int, backward: bool) -> float:
    """Bytes per logit of Megatron's vocab-parallel cross-entropy (Megatron-LM's
    ``mpu/cross_entropy.py``, Megatron-Core's ``tensor_parallel/cross_entropy.py`` without
    ``--cross-entropy-loss-fusion``), each step a kernel of its own over the rank's logits
    (``e``: their element size). Forward: the cast to fp32 (read e, write 4), the row max
    (4), subtracting it in place (4, 4), ``exp`` in place (4, 4), the row sum (4) and the
    division into the softmax it keeps for backward (4, 4). Backward: the softmax scaled by
    the output gradient in place (4, 4; the target's -1 touches one logit a row), and the
    cast back to the logits' dtype (4, e)."""
    return float(12 + e if backward else e + 36)


def layer_forward(t: TransformerShape, r: RankShape) -> list[Op]:
    """One layer's forward on one rank, in order."""
    tokens = r.micro_batch * t.seq_len
    h, e = t.hidden, r.act_bytes
    heads = _heads_per_rank(t.heads, r.tp)
    kv = max(1, math.ceil(t.kv_heads / r.tp)) * t.head_dim
    ffn = math.ceil(t.ffn / r.tp)
    # tokens the per-token ops (norms, residuals, dropouts) see on this rank
    local = tokens // r.tp if r.sequence_parallel else tokens
    norm = Stream("norm", local * h * e * 2 + local * 4 * 2)  # read x, write y; row stats
    if r.eager and t.norm == "rmsnorm":
        # torch's LayerNorm is one native kernel even in eager mode; RMSNorm is not
        norm = Stream("norm", local * h * eager_bytes("rmsnorm", e))
    residual = Stream("residual", local * h * e * 3)  # read x and the branch, write the sum
    drop = Stream("dropout", local * h * (2 * e + 1)) if t.dropout else None
    if drop is not None and not r.eager:
        # one kernel drops the branch out and adds it to the residual (Megatron's
        # bias-dropout-add fusion): read both, write the sum and the 1-byte mask
        residual, drop = Stream("dropout_residual", local * h * (3 * e + 1)), None
    ops: list[Op] = [norm]
    q = heads * t.head_dim
    if r.fused_projections or t.fused_qkv:
        ops.append(Gemm("qkv", tokens, q + 2 * kv, h))
    else:
        ops += [Gemm("q", tokens, q, h), Gemm("k", tokens, kv, h), Gemm("v", tokens, kv, h)]
    if t.rotary:
        # applied to Q and to K, a kernel each
        rotary = eager_bytes("rotary", e) if r.eager else 2.0 * e
        ops += [Stream("rotary", tokens * q * rotary), Stream("rotary", tokens * kv * rotary)]
    ops += attention_core(t, r, backward=False)
    ops.append(Gemm("attn_out", tokens, h, heads * t.head_dim))
    if t.parallel_block:
        # the MLP reads the same normed input; both branches and the input add at the end
        # (read three, write one)
        residual = Stream("residual", local * h * (e * 4 + (1 if t.dropout else 0)))
        ops += [o for o in (drop,) if o is not None]
    else:
        ops += [o for o in (drop, residual) if o is not None]
        ops.append(norm)
    if t.gated_mlp:
        if r.fused_projections or t.fused_gate_up:
            ops.append(Gemm("mlp_gate_up", tokens, 2 * ffn, h))
        else:
            ops += [Gemm("mlp_gate", tokens, ffn, h), Gemm("mlp_up", tokens, ffn, h)]
        # read gate and up, write the product
        ops.append(Stream("swiglu", tokens * ffn * (eager_bytes("swiglu", e) if r.eager
                                                    else e * 3)))
        ops.append(Gemm("mlp_down", tokens, h, ffn))
    else:
        ops.append(Gemm("mlp_up", tokens, ffn, h))
        ops.append(Stream("gelu", tokens * ffn * e * 2))
        ops.append(Gemm("mlp_down", tokens, h, ffn))
    ops += [o for o in (drop, residual) if o is not None]
    return ops


def attention_core(t: TransformerShape, r: RankShape, *, backward: bool) -> list[Op]:
    """The attention core: one flash kernel, or the unfused matmuls and the softmax, mask and
    dropout over the stored s x s scores (fp16/bf16 scores, 1-byte dropout mask)."""
    heads = _heads_per_rank(t.heads, r.tp)
    return attention_ops(r.micro_batch * heads, t.seq_len, t.seq_len * r.cp, t.head_dim,
                         flash=r.flash, dropout=t.dropout, act_bytes=r.act_bytes,
                         backward=backward)


def attention_ops(batch_heads: int, seq: int, keys: int, head_dim: int, *, flash: bool,
                  dropout: bool, act_bytes: int, backward: bool, causal: bool = True,
                  label: str = "attention") -> list[Op]:
    """``batch_heads`` heads of attention over ``seq`` queries and ``keys`` keys: one flash
    kernel, or the unfused core (its two batched matmuls as one ``Attention``) and the
    memory-bound softmax and dropout over the stored scores."""
    core = Attention(label, batch_heads, seq, head_dim, causal=causal, flash=flash,
                     backward=backward, kv_seq=keys)
    if flash:
        return [core]
    scores = batch_heads * seq * keys
    e = act_bytes
    # scale + mask + softmax fused (read, write); dropout (read, write, mask); backward reads
    # the saved output and its gradient and writes the input's gradient for each
    ops: list[Op] = [core, Stream("softmax", scores * e * (3 if backward else 2))]
    if dropout:
        ops.append(Stream("attn_dropout", scores * (e * 3 + 1 if backward else e * 2 + 1)))
    return ops


def layer_backward(t: TransformerShape, r: RankShape) -> list[Op]:
    """One layer's backward on one rank: each matmul's input gradient and weight gradient
    (two matmuls of the forward's size), the attention core's backward, and each memory-bound
    op's backward (reading what the forward saved and the output gradient, writing the input
    gradient: about twice the forward's bytes); plus what recompute runs again first."""
    ops: list[Op] = []
    if r.recompute == "full":
        ops += [recomputed(op) for op in layer_forward(t, r)]
    elif r.recompute == "op":
        ops += [recomputed(op) for op in layer_forward(t, r) if isinstance(op, Stream)]
        ops += [recomputed(g) for g in matmuls(t, r)[1::2]]
    elif r.recompute == "selective" and not r.flash:
        # selective recompute keeps everything but the attention core, which it runs again
        ops += [recomputed(op) for op in attention_core(t, r, backward=False)]
    for op in reversed(layer_forward(t, r)):
        if isinstance(op, Gemm):
            ops.append(Gemm(op.label + ".dgrad", op.m, op.k, op.n, op.count))
            ops.append(Gemm(op.label + ".wgrad", op.k, op.n, op.m, op.count))
        elif isinstance(op, Attention):
            ops += attention_core(t, r, backward=True)[:1]
        else:
            ops.append(Stream(op.label + ".grad", op.bytes * 2))
    if not r.flash:
        ops += attention_core(t, r, backward=True)[1:]
    return ops


def matmuls(t: TransformerShape, r: RankShape) -> list[Gemm]:
    """A layer's forward matmuls one by one, in the order an eager PyTorch layer runs them
    (Llama's Q, K, V, output, gate, up and down projections; GPT's fused QKV, output, and the
    MLP's two), the order torchtitan's per-op checkpointing alternates over."""
    tokens = r.micro_batch * t.seq_len
    h = t.hidden
    q = _heads_per_rank(t.heads, r.tp) * t.head_dim
    kv = max(1, math.ceil(t.kv_heads / r.tp)) * t.head_dim
    ffn = math.ceil(t.ffn / r.tp)
    if t.gated_mlp:
        return [Gemm("q", tokens, q, h), Gemm("k", tokens, kv, h), Gemm("v", tokens, kv, h),
                Gemm("attn_out", tokens, h, q), Gemm("mlp_gate", tokens, ffn, h),
                Gemm("mlp_up", tokens, ffn, h), Gemm("mlp_down", tokens, h, ffn)]
    return [Gemm("qkv", tokens, q + 2 * kv, h), Gemm("attn_out", tokens, h, q),
            Gemm("mlp_up", tokens, ffn, h), Gemm("mlp_down", tokens, h, ffn)]


def fp8_casts(ops: list[Op], *, backward: bool) -> list[Op]:
    """fp8 GEMMs (Transformer Engine) cast their 16-bit operands first: in forward each
    GEMM's input and weight (read 2 bytes, write 1), in backward its output gradient for
    both the input- and the weight-gradient GEMMs (read 2, write 1 and a transposed copy)."""
    out: list[Op] = []
    for op in ops:
        if not isinstance(op, Gemm) or op.label.startswith("recompute.") and backward:
            continue
        if backward and op.label.endswith(".dgrad"):
            out.append(Stream(op.label + ".fp8_cast", op.m * op.k * 4))
        elif not backward:
            out.append(Stream(op.label + ".fp8_cast", (op.m * op.k + op.k * op.n) * 3))
    return out


def recomputed(op: Op) -> Op:
    if isinstance(op, Gemm):
        return Gemm("recompute." + op.label, op.m, op.n, op.k, op.count)
    if isinstance(op, Attention):
        return Attention("recompute." + op.label, op.batch_heads, op.seq, op.head_dim,
                         op.causal, op.flash, op.backward, op.kv_seq)
    return Stream("recompute." + op.label, op.bytes)


def head_forward(t: TransformerShape, r: RankShape) -> list[Op]:
    """After the layers: the final norm, the LM head (vocabulary split over tensor ranks) and
    the cross-entropy over fp32 logits (written, then read for the softmax and the loss)."""
    tokens = r.micro_batch * t.seq_len
    local = tokens // r.tp if r.sequence_parallel else tokens
    vocab = math.ceil(t.vocab / r.tp)
    return [Stream("final_norm", local * t.hidden * _final_norm_bytes(t, r)),
            Gemm("lm_head", tokens, vocab, t.hidden),
            Stream("cross_entropy", tokens * vocab * loss_bytes_per_logit(r, backward=False))]


def loss_bytes_per_logit(r: RankShape, *, backward: bool) -> float:
    """Bytes per logit the loss streams in one pass (``LOSSES``): a fused kernel reads the
    logits and writes fp32 statistics forward (e + 8), and backward reads the logits and
    writes their gradient (4 + e)."""
    kernel = r.loss_kernel
    if kernel == "eager":
        return eager_bytes("cross_entropy.grad" if backward else "cross_entropy", r.act_bytes)
    if kernel == "megatron":
        return megatronloss_bytes_per_logit(r.act_bytes, backward)
    return float(4 + r.act_bytes if backward else r.act_bytes + 4 * 2)


def _final_norm_bytes(t: TransformerShape, r: RankShape) -> float:
    """Bytes per element of the final norm's forward (fused: read and write)."""
    if r.eager and t.norm == "rmsnorm":
        return eager_bytes("rmsnorm", r.act_bytes)
    return 2.0 * r.act_bytes


def head_backward(t: TransformerShape, r: RankShape) -> list[Op]:
    tokens = r.micro_batch * t.seq_len
    vocab = math.ceil(t.vocab / r.tp)
    return [Stream("cross_entropy.grad", tokens * vocab * loss_bytes_per_logit(r, backward=True)),
            Gemm("lm_head.dgrad", tokens, t.hidden, vocab),
            Gemm("lm_head.wgrad", vocab, t.hidden, tokens),
            Stream("final_norm.grad", tokens * t.hidden * _final_norm_bytes(t, r) * 2)]


def embed_forward(t: TransformerShape, r: RankShape) -> list[Op]:
    """Token (and a learned position table's) embedding lookups: rows read, activations
    written."""
    tokens = r.micro_batch * t.seq_len
    tables = 2 if t.position_table else 1
    return [Stream("embedding", tokens * t.hidden * r.act_bytes * (tables + 1))]


def embed_backward(t: TransformerShape, r: RankShape) -> list[Op]:
    """The lookups' backward: the output gradient scattered (added) into the tables' rows."""
    tokens = r.micro_batch * t.seq_len
    tables = 2 if t.position_table else 1
    return [Stream("embedding.grad", tokens * t.hidden * 4 * 3 * tables)]


def tp_collectives_per_layer(r: RankShape, kind: str, rows: int = 2) -> int:
    """Tensor-parallel collectives of one layer's ``kind`` pass, each over one layer output
    (micro-batch x seq x hidden): an all-reduce after each of its ``rows`` row-parallel
    linears (two in a transformer layer; with sequence parallelism an all-gather and a
    reduce-scatter, the same bytes) in forward, and as many in backward; full recompute runs
    the forward's again inside backward."""
    if r.tp == 1:
        return 0
    if kind == "forward":
        return rows
    return 2 * rows if r.recompute == "full" else rows


ATTENTION = ("flash2", "flash3", "flash-triton", "unfused")
ELEMENTWISE = ("fused", "eager")


@dataclass(frozen=True)
class SimOptions:
    """How the simulated run trains beyond what its ds_config says (Megatron-style options a
    DeepSpeed config has no key for). ``recompute`` None: full when the config checkpoints
    activations, else none; ``attention`` None: the GPU profile's default flash kernel;
    ``gemm_dtype`` "float8" for fp8 GEMMs (Transformer Engine), None: the training dtype."""

    recompute: str | None = None
    sequence_parallel: bool = False
    attention: str | None = None
    gemm_dtype: str | None = None
    # context-parallel ranks (each holds 1/cp of every sequence; they count as data-parallel
    # ranks for the gradient reduce): the workload's seq_len is then one rank's share
    cp: int = 1
    # tensor-parallel collectives pipelined with the GEMMs beside them (Transformer Engine's
    # userbuffers, torch's async TP) instead of blocking the layer
    tp_overlap: bool = False
    # ZeRO-1's gradient reduce: None as flowtrain's engine does it (an all-reduce, each rank
    # keeping its shard), or "reduce_scatter" as DeepSpeed's ZeRO-1 and Megatron's
    # distributed optimizer do (each rank receives only its shard's sum)
    zero1_reduce: str | None = None
    # "eager": the model's memory-bound ops run as eager PyTorch's primitive kernels (a Llama
    # block in plain PyTorch without torch.compile); "fused": as fused kernels (Megatron,
    # Transformer Engine, Apex, torch.compile)
    elementwise: str = "fused"
    # the cross-entropy's kernels (``LOSSES``); None: the framework's ("eager" with eager
    # elementwise ops)
    loss: str | None = None
    # ZeRO 1-2's all-gather of the updated parameters runs under the next step's forward
    # (Megatron's --overlap-param-gather) instead of after the optimizer step
    param_gather_overlap: bool = False
    # ZeRO-3 as PyTorch FSDP shards (FULL_SHARD): a unit per transformer block, prefetched one
    # ahead, instead of DeepSpeed's unit per module and prefetch budget
    fsdp: bool = False
    # a pipeline stage waits for its sends to complete before its next pass (Megatron's and
    # DeepSpeed's 1F1B wait on their p2p requests) instead of sending while it computes
    blocking_p2p: bool = False
    # the framework the run trains with (``sims.frameworks``): its behaviours apply where the
    # flags above leave them off
    framework: str = "flowtrain"
    # how an unmeasured model is cut into pipeline stages (flowtrain.plan.partition.PARTITIONS;
    # None: the framework's)
    partition: str | None = None

    @property
    def stage_partition(self) -> str:
        return self.partition or get_framework(self.framework).partition

    @property
    def loss_kernel(self) -> str:
        if self.loss is not None:
            return self.loss
        return "eager" if self.elementwise == "eager" else get_framework(self.framework).loss

    def __post_init__(self) -> None:
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got "
                             f"{self.recompute!r}")
        if self.attention is not None and self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got "
                             f"{self.attention!r}")
        if isinstance(self.cp, bool) or not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"cp must be an integer >= 1, got {self.cp!r}")
        if self.zero1_reduce not in (None, "reduce_scatter"):
            raise ValueError(f"zero1_reduce must be reduce_scatter or unset, got "
                             f"{self.zero1_reduce!r}")
        get_framework(self.framework)  # names the valid ones
        if self.partition is not None and self.partition not in PARTITIONS:
            raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}, got "
                             f"{self.partition!r}")
        if self.loss is not None and self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.elementwise not in ELEMENTWISE:
            raise ValueError(f"elementwise must be one of {', '.join(ELEMENTWISE)}, got "
                             f"{self.elementwise!r}")
        if self.gemm_dtype not in (None, "float8"):
            raise ValueError(f"gemm_dtype must be float8 or unset, got {self.gemm_dtype!r}")


def cfg_checkpoints_activations(cfg: FlowtrainConfig) -> bool:
    """Whether a ds_config says the model's layers are checkpointed: DeepSpeed's
    activation_checkpointing section configures deepspeed.checkpointing, which a model sets
    up only to call it, so the section's presence is read as "layers are checkpointed";
    pipeline modules say it with activation_checkpoint_interval."""
    return ("activation_checkpointing" in cfg.model_fields_set
            or cfg.pipeline.activation_checkpoint_interval > 0)


def cp_exchange_bytes(t: TransformerShape, r: RankShape) -> float:
    """Bytes one rank sends in a layer's forward under context parallelism: its K and V chunk
    passed around the ring of cp ranks (cp - 1 hops); backward sends K, V and their
    gradients (twice that)."""
    if r.cp == 1:
        return 0.0
    kv = max(1, math.ceil(t.kv_heads / r.tp)) * t.head_dim
    return (r.cp - 1) * 2 * r.micro_batch * t.seq_len * kv * r.act_bytes


def stage_layer_costs(params: Any, options: SimOptions | None, *, hidden: int = 0,
                      vocab: int = 0, seq_len: int = 0, chunks: int = 0
                      ) -> dict[int, float] | None:
    """Each layer's weight in the run's cut into pipeline stages (None: an even cut of the
    layers): ``flowtrain.plan.partition.partition_costs`` with the LM head's FLOPs per token
    (2 h V) and the attention core's (causal: 2 s h) where the model's shape is known. A
    framework that cuts only even chunks (Megatron-Core) and whose layers do not fill the
    ``chunks`` model chunks evenly counts the embedding and the loss as a layer each, the one
    way it cuts such a model (its account_for_embedding/loss_in_pipeline_split)."""
    opts = options or SimOptions()
    method = opts.stage_partition
    if opts.partition is None and chunks and get_framework(opts.framework).even_chunks:
        layers = len({n for n in (layer_of(p[0]) for p in params) if n is not None})
        if layers % chunks and (layers + 2) % chunks == 0:
            method = "ends"
    return partition_costs(params, method, layer_of=layer_of,
                           head_flops_per_token=2.0 * hidden * vocab,
                           attention_flops_per_token=2.0 * seq_len * hidden)
