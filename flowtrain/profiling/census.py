"""What a forward does besides its matmuls: a census of its other ops by cost class.

``torch.utils.flop_counter`` counts the FLOPs of matmuls and attention only. On a CPU, and for
small models anywhere, the rest of a forward (norms, activations, residual adds, softmax,
embedding lookups, the views between them) takes a large share of the step, which matmul
FLOPs alone do not show. ``OpCensus`` records, for one forward, how many ops of each
class ran and over how many elements, so the simulator can price them with rates that
``flowtrain calibrate`` measured for the same classes.

Matmul FLOPs are counted here too, with the flop counter's own formulas (its registry), so that
one pass gives both. Attention is taken whole at
``torch.nn.functional.scaled_dot_product_attention`` (a torch function mode sees the call before
dispatch), because the ops it dispatches to differ by
device: a fused flash kernel on a CPU or GPU, a chain of bmm, softmax and masking on the meta
device the simulator traces models on (and ``FlopCounterMode`` has no formula for the CPU's
fused kernel, so it counts a run's attention as 0 FLOPs and a meta trace's as its bmm's). Its
FLOPs are the bmm formula's, so a census of a run and of a meta-device trace of the same model
agree.

    with OpCensus() as census:
        model(x)
    census.summary()  # {"matmul_flops": ..., "attention_flops": ..., "attention_calls": ...,
                      #  "ops": {"norm": [calls, elements], ...}}
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

# Cost classes of non-matmul ops, each priced by its own measured per-call and per-element time.
OP_CLASSES = ("view", "elementwise", "activation", "norm", "softmax", "embedding")

# Priced by their FLOPs (the matmul pass rates): every op the flop counter has a formula for,
# and these (composites that reach the census only when not decomposed).
_MATMUL = frozenset({"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_addmm_activation",
                     "convolution", "_convolution", "addmv", "mv", "dot", "einsum"})
_FORMULAS = {packet.__name__: formula for packet, formula in flop_registry.items()
             if hasattr(packet, "__name__")}
# Metadata only: no data moves, the cost is the call (and its autograd node).
_VIEW = frozenset({
    "view", "_unsafe_view", "t", "transpose", "permute", "expand", "expand_as", "split",
    "split_with_sizes", "unbind", "chunk", "slice", "select", "unsqueeze", "squeeze", "detach",
    "alias", "as_strided", "reshape", "_reshape_alias", "narrow", "unflatten", "flatten",
    "view_as", "lift_fresh", "diagonal", "numpy_T", "_to_copy_view", "arange", "empty",
    "empty_like", "empty_strided", "new_empty", "new_empty_strided", "scalar_tensor", "ones",
    "zeros", "full", "ones_like", "zeros_like", "full_like", "new_ones", "new_zeros",
    "new_full", "_local_scalar_dense", "is_same_size", "sym_size", "sym_stride"})
_ACTIVATION = frozenset({"gelu", "silu", "sigmoid", "tanh", "erf", "softplus", "mish", "elu",
                         "selu", "celu", "hardswish", "log_sigmoid_forward", "exp", "log",
                         "sin", "cos", "rsqrt", "sqrt", "pow"})
_NORM = frozenset({"native_layer_norm", "layer_norm", "_fused_rms_norm", "rms_norm",
                   "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
                   "_native_batch_norm_legit_no_training", "_batch_norm_with_update"})
_SOFTMAX = frozenset({"_softmax", "_log_softmax", "_safe_softmax", "softmax", "log_softmax",
                      "nll_loss_forward", "nll_loss2d_forward", "cross_entropy_loss"})
_EMBEDDING = frozenset({"embedding", "embedding_bag", "_embedding_bag"})


def op_class(name: str) -> str | None:
    """The cost class of an aten op (its overload packet's name, e.g. ``"native_layer_norm"``):
    one of OP_CLASSES, or None for a matmul (priced by its FLOPs). An op the tables do not
    name is ``"elementwise"``: a pass over its elements."""
    if name in _MATMUL or name in _FORMULAS:
        return None
    if name in _VIEW:
        return "view"
    if name in _ACTIVATION:
        return "activation"
    if name in _NORM:
        return "norm"
    if name in _SOFTMAX:
        return "softmax"
    if name in _EMBEDDING:
        return "embedding"
    return "elementwise"


def attention_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> float:
    """Forward FLOPs of scaled dot-product attention, as torch.utils.flop_counter counts them:
    q @ k^T and the weights @ v, 2 FLOPs per multiply-add (no discount for a causal mask)."""
    batch = math.prod(q.shape[:-2])
    sq, d = q.shape[-2], q.shape[-1]
    sk, dv = k.shape[-2], v.shape[-1]
    return 2.0 * batch * sq * sk * d + 2.0 * batch * sq * sk * dv


class _Attention(TorchFunctionMode):
    def __init__(self, census: OpCensus) -> None:
        super().__init__()
        self.census = census

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q = args[0] if args else kwargs["query"]
        k = args[1] if len(args) > 1 else kwargs["key"]
        v = args[2] if len(args) > 2 else kwargs["value"]
        self.census.attention_calls += 1
        self.census.attention_flops += attention_flops(q, k, v)
        self.census.inside_attention += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.census.inside_attention -= 1


class _Ops(TorchDispatchMode):
    def __init__(self, census: OpCensus) -> None:
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.census.inside_attention:
            self.census.record(func.overloadpacket.__name__, args, kwargs or {}, out)
        return out


class OpCensus:
    """Counts the non-matmul ops of the code run inside it (one forward, normally), by class.
    Works on real and on meta tensors. ``summary()`` is JSON-ready."""

    def __init__(self) -> None:
        self.ops: dict[str, list[float]] = {}
        self.matmul_flops = 0.0
        self.attention_calls = 0
        self.attention_flops = 0.0
        self.inside_attention = 0
        self._modes: tuple[Any, ...] = ()

    def record(self, name: str, args: Any, kwargs: Any, out: Any) -> None:
        cls = op_class(name)
        if cls is None:
            formula = _FORMULAS.get(name)
            if formula is not None:
                self.matmul_flops += float(formula(*args, **kwargs, out_val=out))
            return
        if cls == "view":
            elements = 0
        elif cls == "embedding":  # the rows looked up, not the table
            elements = sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        else:  # the larger of what it reads and what it writes
            elements = max((t.numel() for t in tree_leaves((args, out))
                            if isinstance(t, torch.Tensor)), default=0)
        entry = self.ops.setdefault(cls, [0, 0])
        entry[0] += 1
        entry[1] += elements

    def __enter__(self) -> OpCensus:
        self._modes = (_Attention(self), _Ops(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = ()

    def summary(self) -> dict[str, Any]:
        """``{"matmul_flops": f, "attention_calls": n, "attention_flops": f, "ops": {class:
        [calls, elements]}}`` over everything run inside the census."""
        return {"matmul_flops": self.matmul_flops, "attention_calls": self.attention_calls,
                "attention_flops": self.attention_flops,
                "ops": {cls: [int(c), int(e)] for cls, (c, e) in sorted(self.ops.items())}}


def merge_summaries(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``summary()`` of several forwards run one after another (a pipeline stage's model
    chunks): FLOPs, calls and elements added up."""
    ops: dict[str, list[int]] = {}
    for summary in summaries:
        for cls, (calls, elements) in summary["ops"].items():
            entry = ops.setdefault(cls, [0, 0])
            entry[0] += int(calls)
            entry[1] += int(elements)
    return {"matmul_flops": sum(float(s["matmul_flops"]) for s in summaries),
            "attention_calls": sum(int(s["attention_calls"]) for s in summaries),
            "attention_flops": sum(float(s["attention_flops"]) for s in summaries),
            "ops": dict(sorted(ops.items()))}
