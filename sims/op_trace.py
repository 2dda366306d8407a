"""A module's forward on the meta device recorded as torch-level calls over values: each call's
name, what kind of work it is (a matmul, attention, an embedding lookup, the loss, an
elementwise or reducing op, a copy, a view that moves nothing, a constant), the values it reads
and writes with their shapes and element sizes, and the transformer layer it ran in. The
record is shape-only; ``sims.op_program`` turns it into ops priced on a GPU profile."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

GEMMS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum",
                   "__matmul__", "__rmatmul__"})
ATTENTION = frozenset({"scaled_dot_product_attention"})
EMBEDDINGS = frozenset({"embedding"})
LOSSES = frozenset({"cross_entropy", "nll_loss"})
DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "alpha_dropout", "native_dropout",
                      "feature_alpha_dropout"})
NORMS = frozenset({"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm"})
SOFTMAXES = frozenset({"softmax", "log_softmax", "_softmax"})
REDUCTIONS = frozenset({"mean", "sum", "amax", "amin", "max", "min", "var", "std", "norm",
                        "logsumexp", "prod", "cumsum", "var_mean", "std_mean", "all", "any",
                        "argmax", "argmin"}) | NORMS | SOFTMAXES
# values move, nothing is computed (a gather or a layout change writes a new tensor)
COPIES = frozenset({"cat", "concat", "concatenate", "stack", "pad", "clone", "contiguous",
                    "reshape", "repeat", "repeat_interleave", "index_select", "gather",
                    "roll", "flip", "to", "float", "half", "bfloat16", "double", "type_as",
                    "type", "copy_", "expand", "tile", "narrow_copy", "flatten", "view_as",
                    "unflatten", "chunk", "split", "__getitem__", "masked_select",
                    "scatter", "scatter_add", "index_put", "__setitem__"})
POINTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "pow", "rsqrt", "sqrt", "exp", "exp2", "log", "log1p",
    "tanh", "sigmoid", "silu", "gelu", "relu", "relu6", "leaky_relu", "elu", "selu", "mish",
    "softplus", "hardswish", "hardsigmoid", "glu", "where", "masked_fill", "clamp", "clip",
    "cos", "sin", "abs", "reciprocal", "erf", "erfc", "square", "true_divide", "floor_divide",
    "remainder", "fmod", "maximum", "minimum", "lerp", "addcmul", "addcdiv", "sign",
    "rsub", "radd", "rmul", "rdiv", "rtruediv", "truediv", "floordiv", "rpow", "eq", "ne",
    "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "bitwise_and",
    "bitwise_or", "bitwise_not", "ceil", "floor", "round", "trunc", "isnan", "isinf",
    "nan_to_num", "outer", "polar", "view_as_complex", "view_as_real", "gelu_tanh",
    "triu", "tril", "and", "or", "invert", "iadd", "isub", "imul", "idiv", "itruediv", "mod",
    "threshold", "hardtanh", "logsigmoid", "softsign", "tanhshrink"})
FACTORIES = frozenset({"arange", "ones", "zeros", "full", "empty", "tensor", "ones_like",
                       "zeros_like", "full_like", "empty_like", "rand", "randn", "randint",
                       "rand_like", "randn_like", "eye", "linspace", "logspace", "as_tensor",
                       "from_numpy", "scalar_tensor", "new_ones", "new_zeros", "new_full",
                       "new_empty", "new_tensor"})


@dataclass
class Value:
    """A tensor as the trace saw it. ``stored``: the elements its storage holds (an expanded
    view reads fewer than it has); ``kind``: "param", "buffer", "input" (given to the forward)
    or "act" (computed, or a constant made in the forward); ``grad``: it depends on a
    parameter, so its gradient is computed; ``root``: the value it is a view of (itself when
    it owns its storage)."""

    id: int
    shape: tuple[int, ...]
    elem: int
    stored: int
    kind: str
    grad: bool
    floating: bool
    root: int
    offset: int = 0  # where in its root's storage it starts, in elements

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def bytes(self) -> float:
        """What reading it streams: its elements, or its storage's when it is broadcast."""
        return float(min(self.numel, self.stored) * self.elem)


@dataclass
class Call:
    """One torch-level call: ``kind`` is gemm, attention, embedding, loss, dropout, reduction,
    pointwise, copy, factory or unknown (views and no-ops are not kept); ``region`` is the
    transformer layer it ran in, -1 before the first, -2 after the last."""

    index: int
    name: str
    kind: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    region: int
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class OpTrace:
    """A forward's calls, its values, and which values it returned."""

    calls: list[Call]
    values: dict[int, Value]
    outputs: tuple[int, ...]
    layers: int

    def root(self, value: int) -> int:
        return self.values[value].root


def call_name(func: Callable[..., Any]) -> str:
    """A torch function's plain name: ``TensorBase.add`` -> add, ``__iadd__`` -> iadd (the
    in-place form keeps its ``i``), ``__add__`` -> add, ``_VariableFunctionsClass.cat`` ->
    cat."""
    name = getattr(func, "__name__", None) or str(func)
    if name.startswith("__") and name.endswith("__") and name not in (
            "__getitem__", "__setitem__", "__matmul__", "__rmatmul__"):
        name = name[2:-2]
    return name


def _kind(name: str, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> str:
    base = name.rstrip("_") if name not in ("copy_",) else name
    if base in GEMMS:
        return "gemm"
    if base in ATTENTION:
        return "attention"
    if base in EMBEDDINGS:
        return "embedding"
    if base in LOSSES:
        return "loss"
    if base in DROPOUTS:
        return "dropout"
    if base in REDUCTIONS:
        return "reduction"
    if base in FACTORIES or not inputs:
        return "factory"
    if base in COPIES:
        return "copy"
    if base in POINTWISE:
        return "pointwise"
    # an op we do not name, with its output shaped as its largest input: elementwise work
    largest = max((t.shape for t in inputs), key=lambda s: math.prod(s), default=None)
    if len(outputs) == 1 and largest is not None and tuple(outputs[0].shape) == tuple(largest):
        return "pointwise?"
    return "unknown"


class _Recorder(TorchFunctionMode):
    def __init__(self, params: set[int], buffers: set[int]) -> None:
        super().__init__()
        self.params, self.buffers = params, buffers
        self.values: dict[int, Value] = {}
        self.by_object: dict[int, int] = {}  # id(tensor) -> its current value
        self.alive: list[torch.Tensor] = []  # keeps ids from being reused
        self.calls: list[Call] = []
        self.region = -1
        self.seen_layer = False

    def value_of(self, t: torch.Tensor) -> int:
        """The value ``t`` holds, made on first sight (a parameter, buffer or input)."""
        found = self.by_object.get(id(t))
        if found is not None:
            return found
        kind = "param" if id(t) in self.params else "buffer" if id(t) in self.buffers \
            else "input"
        return self._new(t, kind, kind == "param" and t.requires_grad, root=None)

    def _new(self, t: torch.Tensor, kind: str, grad: bool, root: int | None) -> int:
        vid = len(self.values)
        elem = t.element_size()
        try:
            stored = t.untyped_storage().nbytes() // max(1, elem)
        except (RuntimeError, NotImplementedError):
            stored = t.numel()
        try:
            offset = int(t.storage_offset())
        except (RuntimeError, NotImplementedError):
            offset = 0
        self.values[vid] = Value(vid, tuple(t.shape), elem, stored, kind, grad,
                                 t.is_floating_point() or t.is_complex(),
                                 vid if root is None else root, offset)
        self.by_object[id(t)] = vid
        self.alive.append(t)
        return vid

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        before = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        inputs = [self.value_of(t) for t in before]
        storages = {_storage(t): v for t, v in zip(before, inputs)}
        out = func(*args, **kwargs)
        produced = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not produced:
            return out
        name = call_name(func)
        grad = any(self.values[v].grad for v in inputs)
        in_place = name.endswith("_") and not name.startswith("_") or name in (
            "iadd", "isub", "imul", "idiv", "itruediv", "__setitem__")
        outputs, viewed = [], True
        for t in produced:
            known = self.by_object.get(id(t))
            if known is not None and not in_place:
                continue  # returned as it came in (a no-op .to(), contiguous(), ...)
            shared = storages.get(_storage(t))
            if shared is not None and not in_place:
                # a view: it moves nothing, and reads of it are reads of its root
                self._new(t, self.values[shared].kind if self.values[shared].kind != "input"
                          else "act", grad, root=self.values[shared].root)
                continue
            viewed = False
            outputs.append(self._new(t, "act", grad, root=None))
        if viewed or not outputs:
            return out
        kind = _kind(name, produced, before)
        attrs: dict[str, Any] = {}
        if kind == "attention":
            attrs["causal"] = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            attrs["masked"] = mask is not None
            attrs["dropout"] = float(kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0))
        elif kind == "dropout":
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            attrs["p"] = float(p) if training else 0.0
        self.calls.append(Call(len(self.calls), name, kind, tuple(inputs), tuple(outputs),
                               self.region, attrs))
        return out


def _storage(t: torch.Tensor) -> int:
    # meta storages all report data_ptr 0; the storage object's handle tells them apart
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return id(t)


class Recording:
    """Records the calls of the forward run inside it (``layers``: the transformer layers,
    whose calls are marked with their index); ``finish(output)`` gives the record."""

    def __init__(self, module: torch.nn.Module, layers: list[torch.nn.Module]) -> None:
        params = {id(p) for p in module.parameters()}
        buffers = {id(b) for b in module.buffers()}
        self.recorder = _Recorder(params, buffers)
        self.layers = layers
        self.handles: list[Any] = []

    def __enter__(self) -> Recording:
        recorder = self.recorder
        for index, block in enumerate(self.layers):
            def enter(_: Any, __: Any, *, at: int = index) -> None:
                recorder.region = at

            def leave(*_: Any) -> None:
                recorder.region = -2
            self.handles.append(block.register_forward_pre_hook(enter))
            self.handles.append(block.register_forward_hook(leave))
        recorder.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.recorder.__exit__(*exc)
        for handle in self.handles:
            handle.remove()

    def finish(self, output: Any) -> OpTrace:
        recorder = self.recorder
        outputs = tuple(recorder.by_object[id(t)] for t in tree_leaves(output)
                        if isinstance(t, torch.Tensor) and id(t) in recorder.by_object)
        return OpTrace(recorder.calls, recorder.values, outputs, len(self.layers))
