"""Recognizes a traced forward's calls (``sims.op_trace``) as the ops of an ``OpProgram``
(``sims.op_program``): matmuls by shape; attention, whether ``scaled_dot_product_attention``
or written out (product, softmax, product), with what only feeds it; the loss; the
memory-bound ops grouped into the kernels a fused implementation runs, with what each keeps for
backward; and the values tensor parallelism splits."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from sims.op_program import (
    OpProgram,
    PAttention,
    PGemm,
    PGroup,
    PItem,
    PLoss,
    Region,
)
from sims.op_trace import SOFTMAXES, Call, OpTrace, Value

FUSABLE = ("pointwise", "pointwise?", "reduction", "dropout", "copy", "factory", "embedding")
# ops whose backward needs their input (or their output, which is as large)
_KEEP_INPUT = frozenset({"pow", "rsqrt", "sqrt", "exp", "exp2", "tanh", "sigmoid", "silu",
                         "gelu", "relu", "log", "log1p", "sin", "cos", "erf", "reciprocal",
                         "softplus", "mish", "elu", "leaky_relu", "abs", "clamp", "clip",
                         "layer_norm", "rms_norm", "group_norm", "hardswish", "relu6",
                         "square", "gelu_tanh", "logsigmoid", "glu", "selu"})
# activation functions called by name (F.silu, F.gelu, ...), not spelled out as primitives
_ACTIVATIONS = frozenset({"silu", "gelu", "relu", "relu6", "mish", "elu", "selu", "leaky_relu",
                          "gelu_tanh", "softplus", "hardswish", "glu"})
_PRODUCTS = frozenset({"mul", "div", "true_divide", "truediv", "rtruediv", "rdiv", "rmul",
                       "addcmul", "addcdiv", "imul", "idiv", "itruediv"})


def build(trace: OpTrace, batch: int) -> OpProgram:
    """The program of a recorded forward of ``batch`` samples."""
    return _Builder(trace, batch).program()


class _Builder:
    def __init__(self, trace: OpTrace, batch: int) -> None:
        self.trace, self.batch = trace, batch
        self.values = trace.values
        self.calls = [c for c in trace.calls if self._priced(c)]
        self.producer: dict[int, Call] = {}
        self.consumers: dict[int, list[Call]] = {}
        for call in self.calls:
            for out in call.outputs:
                self.producer[out] = call
            for v in set(self._roots(call.inputs)):
                self.consumers.setdefault(v, []).append(call)
        self.outputs = set(self._roots(trace.outputs))
        self.taken: dict[int, str] = {}  # call index -> what absorbed it
        self.attention_kinds: dict[str, int] = {}

    def _priced(self, call: Call) -> bool:
        """Integer bookkeeping (positions, labels, masks made of indices) moves a few bytes a
        token and is left out; everything that touches floating values is priced."""
        return any(self.values[v].floating for v in call.inputs + call.outputs) or \
            call.kind in ("embedding", "loss")

    def _roots(self, values: Iterable[int]) -> list[int]:
        return [self.values[v].root for v in values]

    def _acts(self, values: Iterable[int]) -> list[int]:
        """The activation values among ``values`` (not parameters, buffers or inputs)."""
        return [v for v in values if self.values[self.values[v].root].kind == "act"
                or self.values[v].kind == "act"]

    def program(self) -> OpProgram:
        attentions = self._find_attention()
        losses = self._find_losses()
        items: dict[int, PItem] = {}
        found: list[tuple[Call, PItem]] = [*attentions, *losses]
        for call, item in found:
            items[call.index] = item
        groups = self._groups()
        for first, members in groups:
            items[first] = self._group(members)
        for call in self.calls:
            if call.index in self.taken or call.index in items:
                continue
            if call.kind == "gemm":
                gemm = self._gemm(call)
                if gemm is not None:
                    items[call.index] = gemm
                    continue
            items[call.index] = self._group([call])
        program = OpProgram(self.values, Region(), [Region() for _ in range(self.trace.layers)],
                            Region(), {}, self.batch, {}, {}, self.attention_kinds)
        region_of = {c.index: c.region for c in self.calls}
        for index in sorted(items):
            program.region(region_of[index]).items.append(items[index])
        if not any(isinstance(i, PLoss) for i in program.after.items):
            added = self._added_loss()
            if added is not None:
                program.after.items.append(added)
        program.split = self._split(program)
        for call in self.calls:
            if self.taken.get(call.index) is None and call.kind == "unknown":
                program.unrecognized[call.name] = program.unrecognized.get(call.name, 0) + 1
            if self.taken.get(call.index) is None and call.kind == "pointwise?":
                program.by_shape[call.name] = program.by_shape.get(call.name, 0) + 1
        return program

    # matmuls and attention

    def _gemm(self, call: Call) -> PGemm | None:
        ins = [self.values[v] for v in call.inputs if self.values[v].floating]
        if call.name == "einsum" or len(ins) < 2:
            return None
        if call.name in ("addmm", "baddbmm", "addbmm") and len(ins) == 3:
            ins = ins[1:]
        a, b = ins[0], ins[1]
        out = self.values[call.outputs[0]]
        if call.name == "linear":  # x @ W.T
            k = a.shape[-1]
            return PGemm(_label(call), a.numel // k, b.shape[0], k, 1, a.id, None, out.id)
        weight_b = self._is_weight(b.id)
        weight_a = self._is_weight(a.id)
        if len(a.shape) < 2 or len(b.shape) < 2:
            return None
        k = a.shape[-1]
        n = b.shape[-1]
        if weight_b and len(b.shape) == 2:
            return PGemm(_label(call), a.numel // k, n, k, 1, a.id, None, out.id)
        if weight_a and len(a.shape) == 2:  # W @ x: its transpose's shapes
            return PGemm(_label(call), b.numel // b.shape[-2] if len(b.shape) > 2 else n,
                         a.shape[0], k, 1, b.id, None, out.id)
        count = math.prod(out.shape[:-2]) if len(out.shape) > 2 else 1
        return PGemm("bmm." + _label(call), a.shape[-2], n, k, count, a.id, b.id, out.id)

    def _is_weight(self, value: int) -> bool:
        return self.values[self.values[value].root].kind in ("param", "buffer")

    def _find_attention(self) -> list[tuple[Call, PAttention]]:
        found = []
        for call in self.calls:
            if call.kind == "attention":
                q, k, v = (self.values[x] for x in call.inputs[:3])
                self.taken[call.index] = "attention"
                self._absorb_feeders(call, (q.id, k.id, v.id))
                out = self._absorb_layout(call.outputs[0])
                found.append((call, self._attention(
                    call, q, self._unrepeated(k), self._unrepeated(v), out,
                    causal=bool(call.attrs.get("causal") or call.attrs.get("masked")),
                    dropout=float(call.attrs.get("dropout", 0.0)) > 0.0, kind="sdpa")))
        for call in self.calls:
            if call.kind != "gemm" or call.index in self.taken or \
                    len(self._acts(call.inputs)) < 2 or len(call.inputs) != 2:
                continue
            chain = self._chain_to_product(call)
            if chain is None:
                continue
            members, second = chain
            q, kt = (self.values[x] for x in call.inputs)
            v = self.values[second.inputs[1]]
            names = {m.name for m in members}
            for m in (call, *members, second):
                self.taken[m.index] = "attention"
            self._absorb_feeders(call, (kt.id,))
            self._absorb_feeders(second, (v.id,))
            for m in members:
                self._absorb_feeders(m, ())
            out = self._absorb_layout(second.outputs[0])
            kt, v = self._unrepeated(kt), self._unrepeated(v)
            masked = bool(names & {"where", "masked_fill", "add", "masked_fill_", "add_"})
            dropout = any(m.kind == "dropout" and m.attrs.get("p", 0.0) > 0 for m in members)
            keys = kt.shape[-1]
            found.append((second, self._attention(second, q, kt, v, out, causal=masked,
                                                  dropout=dropout, kind="hand-written",
                                                  keys=keys)))
        return found

    def _attention(self, call: Call, q: Value, k: Value, v: Value, out: int, *, causal: bool,
                   dropout: bool, kind: str, keys: int | None = None) -> PAttention:
        self.attention_kinds[kind] = self.attention_kinds.get(kind, 0) + 1
        heads = q.shape[-3] if len(q.shape) >= 3 else 1
        batch = math.prod(q.shape[:-3]) if len(q.shape) > 3 else 1
        kv_heads = v.shape[-3] if len(v.shape) >= 3 else heads
        return PAttention(_label(call, "attention"), batch, heads, kv_heads, q.shape[-2],
                          keys if keys is not None else k.shape[-2], q.shape[-1], causal,
                          dropout, q.id, k.id, v.id, out)

    def _chain_to_product(self, first: Call) -> tuple[list[Call], Call] | None:
        """The ops from a product of two activations to a second one (``first``'s output
        scaled, masked, softmaxed, dropped out), when they form an attention."""
        members: list[Call] = []
        current = first.outputs[0]
        for _ in range(12):
            users = self.consumers.get(self.values[current].root, [])
            if len(users) != 1:
                return None
            user = users[0]
            if user.kind == "gemm":
                if len(self._acts(user.inputs)) >= 2 and \
                        self.values[user.inputs[0]].root == self.values[current].root and \
                        any(m.name in SOFTMAXES for m in members):
                    return members, user
                return None
            if user.kind not in ("pointwise", "pointwise?", "reduction", "dropout", "copy"):
                return None
            members.append(user)
            current = user.outputs[0]
        return None

    def _unrepeated(self, value: Value) -> Value:
        """The K or V an absorbed grouped-query repeat was made of (itself otherwise)."""
        maker = self.producer.get(value.root)
        if maker is not None and self.taken.get(maker.index) == "attention" and \
                maker.kind == "copy" and maker.inputs:
            # (a cache's concatenation onto an empty tensor: the tensor)
            return max((self.values[v] for v in maker.inputs), key=lambda x: x.numel)
        return value

    def _absorb_layout(self, output: int) -> int:
        """Copies that only lay the attention's output out for the projection after it (heads
        moved next to each other): a kernel writes its output in that layout. Returns the
        output as the projection reads it."""
        users = self.consumers.get(self.values[output].root, [])
        if len(users) == 1 and users[0].kind == "copy" and users[0].index not in self.taken:
            user = users[0]
            readers = [u for o in user.outputs for u in self.consumers.get(o, [])]
            if readers and all(r.kind in ("gemm", "copy") for r in readers):
                self.taken[user.index] = "attention"
                return self._absorb_layout(user.outputs[0])
        return output

    def _absorb_feeders(self, call: Call, operands: Sequence[int]) -> None:
        """What exists only to feed an attention: its mask (made from indices or buffers, no
        gradient), a K/V repeated for grouped-query heads, and Q (or K) scaled by a constant;
        a kernel does each itself (the scale is its softmax scale)."""
        for value in call.inputs:
            root = self.values[value].root
            maker = self.producer.get(root)
            if maker is None or maker.index in self.taken:
                continue
            users = self.consumers.get(root, [])
            if any(self.taken.get(u.index) != "attention" and u is not call for u in users):
                continue
            repeat = value in operands and maker.kind == "copy"
            scaled = value in operands and len(maker.inputs) == 1 and \
                maker.name.rstrip("_") in ("mul", "div", "truediv", "true_divide", "imul")
            if repeat or scaled or not self.values[root].grad:
                self.taken[maker.index] = "attention"
                self._absorb_feeders(maker, ())

    # the loss

    def _find_losses(self) -> list[tuple[Call, PLoss]]:
        found = []
        for call in self.calls:
            if call.kind != "loss" or call.index in self.taken:
                continue
            self.taken[call.index] = "loss"
            logits = self.values[call.inputs[0]]
            # casts and reshapes that only feed the loss are its kernel's
            feed = self.producer.get(logits.root)
            while feed is not None and feed.kind in ("copy", "pointwise") and \
                    feed.index not in self.taken and \
                    all(u is call or self.taken.get(u.index) == "loss"
                        for u in self.consumers.get(feed.outputs[0], [])):
                self.taken[feed.index] = "loss"
                feed = self.producer.get(self.values[feed.inputs[0]].root)
            found.append((call, PLoss("cross_entropy", logits.id, logits.numel, False)))
        return found

    def _added_loss(self) -> PLoss | None:
        """The training script's cross-entropy over the logits the forward returns (its largest
        floating output)."""
        outs = [self.values[v] for v in self.trace.outputs if self.values[v].floating]
        if not outs:
            return None
        logits = max(outs, key=lambda v: v.numel)
        return PLoss("cross_entropy", logits.id, logits.numel, True)

    # memory-bound kernels

    def _groups(self) -> list[tuple[int, list[Call]]]:
        """The fusable ops grouped into kernels: walking back from the last, an op joins the
        kernel of its output's consumers when they are all in one kernel of its region and
        nothing else (a matmul, the attention, the model's output) reads that output."""
        group_of: dict[int, int] = {}
        members: dict[int, list[Call]] = {}
        for call in reversed(self.calls):
            if call.index in self.taken or call.kind not in FUSABLE:
                continue
            joined = None
            users = [u for out in call.outputs for u in self.consumers.get(out, [])]
            escapes = any(self.values[o].root in self.outputs for o in call.outputs)
            if users and not escapes:
                kernels = {group_of.get(u.index) for u in users}
                regions = {u.region for u in users}
                if len(kernels) == 1 and None not in kernels and regions == {call.region}:
                    joined = kernels.pop()
            if joined is None:
                joined = call.index
                members[joined] = []
            group_of[call.index] = joined
            members[joined].append(call)
        for group in members.values():
            for call in group:
                self.taken[call.index] = "group"
        return [(min(c.index for c in group), sorted(group, key=lambda c: c.index))
                for group in members.values()]

    def _group(self, calls: list[Call]) -> PGroup:
        made = {o for c in calls for o in c.outputs}
        made_roots = {self.values[o].root for o in made}
        reads: dict[int, float] = {}
        eager: list[tuple[int, float]] = []
        for call in calls:
            for v in call.inputs:
                value = self.values[v]
                nbytes = value.bytes
                if call.kind == "embedding" and self._is_weight(v):
                    # a lookup reads the rows it gathers, not the table
                    nbytes = self.values[call.outputs[0]].bytes
                if not value.floating and call.kind != "embedding":
                    continue
                eager.append((v, nbytes))
                if value.root not in made_roots:
                    # views of one tensor (slices of it) are one read of it
                    key = value.root if self.values[value.root].floating else v
                    reads[key] = max(reads.get(key, 0.0), min(nbytes, self._root_bytes(v))
                                     if key != v else nbytes)
            for o in call.outputs:
                eager.append((o, self.values[o].bytes))
        member_ids = {c.index for c in calls}
        writes = []
        for o in made:
            root = self.values[o].root
            outside = any(u.index not in member_ids for u in self.consumers.get(root, []))
            if outside or root in self.outputs:
                writes.append((o, self.values[o].bytes))
        saves_eager: set[int] = set()
        masks = 0.0
        for call in calls:
            kept, mask = self._keeps(call)
            saves_eager |= kept
            masks += mask
            if call.kind == "dropout" and call.attrs.get("p", 0.0) > 0:
                # the mask is written for backward, a byte an element
                mask_bytes = float(self.values[call.outputs[0]].numel)
                writes.append((call.outputs[0], mask_bytes))
                eager.append((call.outputs[0], mask_bytes))
        inside = {v for v in saves_eager if self.values[v].root in made_roots}
        externals = {v for v in reads if self.values[v].floating and not self._is_weight(v)}
        # an activation function's output another op of the kernel multiplies by (SwiGLU's
        # SiLU) is kept unless the activation is fused too
        named = {o for c in calls if c.name.rstrip("_") in _ACTIVATIONS for o in c.outputs}
        kept_named = {v for v in inside if self.values[v].root in
                      {self.values[n].root for n in named}}
        saves = (saves_eager - inside) | kept_named | (externals if inside else set())
        saves_fused = (saves_eager - inside) | (externals if inside else set())
        scatter = tuple((c.outputs[0], 12.0 * self.values[c.outputs[0]].numel)
                        for c in calls if c.kind == "embedding")
        grad = any(self.values[o].grad for o in made) or bool(scatter)
        return PGroup(_label(calls[-1], _group_label(calls)), tuple(c.name for c in calls),
                      tuple(reads.items()), tuple(writes), tuple(eager),
                      any(c.kind == "reduction" for c in calls), tuple(sorted(saves)),
                      tuple(sorted(saves_eager)), masks, tuple(sorted(saves_fused)), scatter,
                      grad)

    def _root_bytes(self, value: int) -> float:
        """The bytes of the tensor ``value`` views (its elements as the view's dtype), or the
        view's own when the root is larger than anything read of it."""
        root = self.values[self.values[value].root]
        return max(root.bytes, self.values[value].bytes)

    def _keeps(self, call: Call) -> tuple[set[int], float]:
        """What an op keeps for its backward (activations only), and its dropout mask's
        bytes."""
        if not any(self.values[o].grad for o in call.outputs):
            return set(), 0.0
        if call.kind == "dropout":
            p = call.attrs.get("p", 0.0)
            return set(), float(self.values[call.outputs[0]].numel) if p > 0 else 0.0
        base = call.name.rstrip("_")
        acts = [v for v in call.inputs if self.values[v].floating and not self._is_weight(v)]
        if base in _KEEP_INPUT:
            return set(acts[:1]), 0.0
        if base in SOFTMAXES:
            return set(call.outputs[:1]), 0.0
        if base in _PRODUCTS:
            grads = [v for v in call.inputs if self.values[v].grad]
            # each operand is kept for the other's gradient; one without a gradient of its
            # own (positions' cos and sin, a constant scale) is not an activation
            return {v for v in acts if self.values[v].grad and any(g != v for g in grads)}, 0.0
        return set(), 0.0

    # tensor parallelism

    def _split(self, program: OpProgram) -> dict[int, bool]:
        """Which values one tensor rank holds a part of: a linear's output when its input is
        whole (column-parallel), not when its input is split (row-parallel, reduced after); the
        attention's with its queries; any other op's output when one of its inputs is split."""
        split: dict[int, bool] = {}
        values = self.values

        def is_split(v: int) -> bool:
            return split.get(v, False) or split.get(values[v].root, False)

        for call in self.calls:
            item_split = None
            if call.kind == "gemm" and len(self._acts(call.inputs)) == 1:
                act = self._acts(call.inputs)[0]
                item_split = not is_split(act)
            elif any(is_split(v) for v in call.inputs):
                item_split = True
            if item_split:
                for o in call.outputs:
                    split[o] = True
        # views of split values are split
        for vid, value in values.items():
            if split.get(value.root):
                split[vid] = True
        return split


def _label(call: Call, fallback: str | None = None) -> str:
    return fallback or call.name


def _group_label(calls: Sequence[Call]) -> str:
    """A kernel's name from what it does: a norm, a softmax, an activation, dropout, an
    embedding lookup, an add, or its first op."""
    names = [c.name.rstrip("_") for c in calls]
    kinds = {c.kind for c in calls}
    if "embedding" in kinds:
        return "embedding"
    if any(n in ("layer_norm", "rms_norm", "rsqrt", "var", "std") for n in names) or \
            ("mean" in names and "pow" in names):
        return "norm"
    if any(n in SOFTMAXES for n in names):
        return "softmax"
    for n in ("silu", "gelu", "relu", "sigmoid", "tanh", "gelu_tanh"):
        if n in names:
            return n
    if "dropout" in kinds:
        return "dropout"
    return names[0]


