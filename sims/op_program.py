"""A traced forward (``sims.op_trace``) recognized as the ops a GPU runs, so that a user's own
module is priced with the same kernel models as a preset (``sims.gpu_costs``):

- matmuls by their shapes: against a weight (a linear layer), or of two activations (batched);
- attention: ``scaled_dot_product_attention``, or a hand-written one (a product of two
  activations whose output reaches a second such product through a softmax, with the scaling,
  masking and dropout between them), priced by the chosen kernel (flash or unfused);
- the memory-bound ops (norms, activations, residuals, rotary, casts, copies, dropout) grouped
  as fused kernels run them: an op joins the kernel of the ops that consume its output when no
  other op needs that output, so a kernel streams its inputs and the outputs others read
  once (``--elementwise eager``: every op a kernel of its own);
- the loss over the logits (added after the model when its forward computes none);
- what is not recognized, listed with how it was priced.

Tensor parallelism splits what the ops say: a linear whose input is whole is column-parallel
(its output split), one whose input is split is row-parallel (an all-reduce after it); the
split follows the values through the other ops. Each op also says what it keeps for backward,
which gives a layer's activation memory under the chosen kernels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sims.layer_ops import (
    Attention,
    Gemm,
    Op,
    RankShape,
    Stream,
    attention_ops,
    loss_bytes_per_logit,
    recomputed,
)
from sims.op_trace import Value


@dataclass(frozen=True)
class PGemm:
    """A matmul: (m x k) @ (k x n), ``count`` at once; ``a`` the activation operand, ``b`` the
    other one when both are activations (None: a weight)."""

    label: str
    m: int
    n: int
    k: int
    count: int
    a: int
    b: int | None
    out: int


@dataclass(frozen=True)
class PAttention:
    label: str
    batch: int
    heads: int
    kv_heads: int
    seq: int
    keys: int
    head_dim: int
    causal: bool
    dropout: bool
    q: int
    k: int
    v: int
    out: int


@dataclass(frozen=True)
class PGroup:
    """Memory-bound ops run as one kernel: the values it reads and writes (value, bytes), each
    member op's own reads and writes for eager kernels, and what it keeps for backward: as one
    kernel that recomputes what it made inside from its inputs, except the outputs of named
    activation functions another of its ops reads (``saves``), with those recomputed too
    (``saves_fused``: a fused activation kernel), or as each op keeps its own
    (``saves_eager``); ``masks``: bytes of dropout masks."""

    label: str
    members: tuple[str, ...]
    reads: tuple[tuple[int, float], ...]
    writes: tuple[tuple[int, float], ...]
    eager: tuple[tuple[int, float], ...]
    reduction: bool
    saves: tuple[int, ...]
    saves_eager: tuple[int, ...]
    masks: float
    # what it keeps when its activations are fused too (their outputs recomputed)
    saves_fused: tuple[int, ...] = ()
    # an embedding lookup's backward: the output gradient added into the table's rows in
    # fp32 (read the gradient, read and write the rows: 12 bytes an element), per value
    scatter: tuple[tuple[int, float], ...] = ()
    # its outputs need a gradient (no backward for positions' cos and sin, masks, ...)
    grad: bool = True


@dataclass(frozen=True)
class PLoss:
    """The cross-entropy over ``logits`` (their elements, all tokens); ``added``: the forward
    computed none, so it is the training script's."""

    label: str
    logits: int
    elements: int
    added: bool


PItem = PGemm | PAttention | PGroup | PLoss


@dataclass
class Region:
    """The recognized ops of one part of the forward: a transformer layer, or what runs before
    the first (embeddings) or after the last (final norm, head, loss)."""

    items: list[PItem] = field(default_factory=list)


@dataclass
class OpProgram:
    """A traced forward as ops, per region, with the values' tensor-parallel split, the
    traced micro-batch, and what was not recognized (``unrecognized``: name -> calls)."""

    values: dict[int, Value]
    before: Region
    layers: list[Region]
    after: Region
    split: dict[int, bool]
    batch: int
    unrecognized: dict[str, int]
    by_shape: dict[str, int]
    attention_kinds: dict[str, int]

    # -- per rank -------------------------------------------------------------------------

    def region(self, which: int) -> Region:
        return self.before if which == -1 else self.after if which == -2 else self.layers[which]

    def forward(self, which: int, r: RankShape) -> list[Op]:
        """Region ``which``'s forward on one rank (-1: before the layers, -2: after)."""
        return [op for item in self.region(which).items for op in self._ops(item, r)]

    def backward(self, which: int, r: RankShape) -> list[Op]:
        """Its backward, as ``sims.layer_ops.layer_backward`` derives a preset layer's: what
        recompute runs again, then each op's gradient in reverse (an embedding's is the
        scatter into its table, the loss's its own kernel's)."""
        forward = self.forward(which, r)
        special: dict[int, Op | None] = {}
        at = 0
        for item in self.region(which).items:
            lowered = self._ops(item, r)
            if isinstance(item, PLoss):
                elements = item.elements / (r.tp if self.split.get(item.logits) else 1)
                special[at] = Stream("cross_entropy.grad",
                                     elements * loss_bytes_per_logit(r, backward=True))
            elif isinstance(item, PGroup) and item.scatter:
                special[at] = Stream("embedding.grad", sum(
                    self._share(v, b, r.tp, r.sequence_parallel) for v, b in item.scatter))
            elif isinstance(item, PGroup) and not item.grad:
                special[at] = None  # nothing flows back through it
            at += len(lowered)
        ops: list[Op] = []
        if r.recompute == "full" and which >= 0:
            ops += [recomputed(op) for op in forward]
        elif r.recompute == "op" and which >= 0:
            ops += [recomputed(op) for op in forward if isinstance(op, Stream)]
            weights = [op for op in forward if isinstance(op, Gemm)
                       and not op.label.startswith("bmm")]
            ops += [recomputed(g) for g in weights[1::2]]
        elif r.recompute == "selective" and not r.flash and which >= 0:
            ops += [recomputed(op) for item in self.region(which).items
                    if isinstance(item, PAttention) for op in self._attention(item, r, False)]
        extras: list[Op] = []
        for position in reversed(range(len(forward))):
            op = forward[position]
            if position in special:
                replaced = special[position]
                if replaced is not None:
                    ops.append(replaced)
            elif isinstance(op, Gemm):
                ops.append(Gemm(op.label + ".dgrad", op.m, op.k, op.n, op.count))
                ops.append(Gemm(op.label + ".wgrad", op.k, op.n, op.m, op.count))
            elif isinstance(op, Attention):
                backward = attention_ops(op.batch_heads, op.seq, op.keys, op.head_dim,
                                         flash=op.flash, dropout=_unfused_dropout(forward),
                                         act_bytes=r.act_bytes, backward=True,
                                         causal=op.causal, label=op.label)
                ops.append(backward[0])
                extras += backward[1:]
            else:
                ops.append(Stream(op.label + ".grad", op.bytes * 2))
        return ops + extras

    def row_parallel(self, which: int) -> int:
        """Row-parallel linears of a region: the tensor-parallel all-reduces of its forward."""
        return sum(1 for item in self.region(which).items if isinstance(item, PGemm)
                   and item.b is None and self.split.get(item.a, False))

    def saved_bytes(self, which: int, *, tp: int, sequence_parallel: bool, maps: bool,
                    fused_activation: bool, eager: bool, loss_bytes: float) -> float:
        """Bytes region ``which`` keeps for backward for the whole traced micro-batch, 16-bit
        activations: each op's kept tensors, counted once; attention keeps its maps only with
        ``maps`` (unfused, no selective recompute); a fused activation kernel recomputes what it
        made inside (``fused_activation``), a fused norm always does; the loss keeps
        ``loss_bytes`` per logit."""
        kept: set[int] = set()
        extra = 0.0
        region = self.region(which)
        for item in region.items:
            if isinstance(item, PGemm):
                kept.add(item.a)
                if item.b is not None:
                    kept.add(item.b)
            elif isinstance(item, PAttention):
                kept |= {item.q, item.k, item.v, item.out}
                if maps:
                    heads = math.ceil(item.heads / tp)
                    scores = item.batch * heads * item.seq * item.keys
                    extra += scores * (2 + (3 if item.dropout else 0))
            elif isinstance(item, PGroup):
                kept |= set(item.saves_eager if eager else item.saves_fused
                            if fused_activation else item.saves)
                extra += item.masks / (tp if sequence_parallel else 1)
            elif isinstance(item, PLoss):
                extra += item.elements * loss_bytes / tp
        # each tensor counted once: views of one tensor that cover the same part of it (a
        # reshape, a transpose) are one, different parts of it (Q, K and V of a fused
        # projection) each their own
        parts: dict[tuple[int, int, int], int] = {}
        for v in kept:
            value = self.values[v]
            if value.floating:
                parts.setdefault((value.root, value.offset, value.numel), v)
        return extra + sum(self._size(v, tp, sequence_parallel) for v in parts.values())

    # -- lowering -------------------------------------------------------------------------

    def _size(self, value: int, tp: int, sequence_parallel: bool) -> float:
        """Bytes of ``value`` on one tensor rank: split over tp when the ops split it, or
        (sequence parallelism) when it is a per-token activation."""
        v = self.values[value]
        if self.split.get(value, False) or (sequence_parallel and v.kind == "act"):
            return v.bytes / tp
        return v.bytes

    def _ops(self, item: PItem, r: RankShape) -> list[Op]:
        tp = r.tp
        if isinstance(item, PGemm):
            if item.b is not None:  # both activations: split by heads with its inputs
                count = math.ceil(item.count / tp) if self.split.get(item.a) else item.count
                return [Gemm(item.label, item.m, item.n, item.k, count)]
            if self.split.get(item.a, False):  # row-parallel
                return [Gemm(item.label, item.m, item.n, math.ceil(item.k / tp), item.count)]
            return [Gemm(item.label, item.m, math.ceil(item.n / tp), item.k, item.count)]
        if isinstance(item, PAttention):
            return self._attention(item, r, False)
        if isinstance(item, PLoss):
            per_logit = loss_bytes_per_logit(r, backward=False)
            elements = item.elements / (tp if self.split.get(item.logits) else 1)
            return [Stream("cross_entropy", elements * per_logit)]
        sp = r.sequence_parallel
        if r.eager:
            return [Stream(item.label, sum(self._share(v, b, tp, sp) for v, b in item.eager))]
        moved = sum(self._share(v, b, tp, sp) for v, b in item.reads + item.writes)
        return [Stream(item.label, moved)]

    def _share(self, value: int, nbytes: float, tp: int, sp: bool) -> float:
        v = self.values[value]
        if self.split.get(value, False) or (sp and v.kind == "act"):
            return nbytes / tp
        return nbytes

    def _attention(self, item: PAttention, r: RankShape, backward: bool) -> list[Op]:
        heads = math.ceil(item.heads / r.tp) if self.split.get(item.q) else item.heads
        return attention_ops(item.batch * heads, item.seq, item.keys * r.cp, item.head_dim,
                             flash=r.flash, dropout=item.dropout, act_bytes=r.act_bytes,
                             backward=backward, causal=item.causal, label=item.label)

    # -- what --explain says ----------------------------------------------------------------

    def summary(self) -> list[str]:
        """What was recognized, and how the rest was priced, one line each."""
        counts: dict[str, int] = {}
        for region in [self.before, *self.layers, self.after]:
            for item in region.items:
                kind = type(item).__name__[1:].lower()
                counts[kind] = counts.get(kind, 0) + 1
        lines = [f"traced module: {len(self.layers)} layers; {counts.get('gemm', 0)} matmuls, "
                 f"{counts.get('attention', 0)} attentions ("
                 + ", ".join(f"{n} {k}" for k, n in sorted(self.attention_kinds.items()))
                 + f"), {counts.get('group', 0)} memory-bound kernels, "
                 f"{counts.get('loss', 0)} loss"]
        if any(isinstance(i, PLoss) and i.added for i in self.after.items):
            lines.append("loss: the forward returns logits; the cross-entropy a training "
                         "script computes over them is added")
        if self.by_shape:
            lines.append("elementwise by their shapes (names not known): " + ", ".join(
                f"{name} x{n}" for name, n in sorted(self.by_shape.items())))
        if self.unrecognized:
            lines.append("not recognized, priced as memory-bound (their inputs read and "
                         "outputs written once): " + ", ".join(
                             f"{name} x{n}" for name, n in sorted(self.unrecognized.items())))
        return lines


def _unfused_dropout(forward: Sequence[Op]) -> bool:
    """Whether the region's unfused attention drops its scores out (its forward has the
    dropout stream ``attention_ops`` adds)."""
    return any(isinstance(op, Stream) and op.label == "attn_dropout" for op in forward)


def items_of(program: OpProgram) -> Any:
    """Every recognized item, region by region (for tests and --explain)."""
    for region in [program.before, *program.layers, program.after]:
        yield from region.items
