"""What the simulator needs to know about a model: every parameter's shape, the matmul FLOPs of a
forward pass and the activation bytes kept for backward, from published presets (GPT-2, Llama 2,
Llama 3) or traced from any ``nn.Module`` factory on the meta device."""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from flowtrain.profiling.census import OpCensus
from sims.architecture import (
    FAMILIES,
    PRESETS,
    Architecture,
    ParamShapes,
    architecture_params,
    forward_flops,
    layer_activation_bytes,
    outside_activation_bytes,
)
from sims.op_recognize import build as build_program
from sims.op_trace import Recording

__all__ = ["DTYPES", "FAMILIES", "PRESETS", "Architecture", "ModelSpec", "ParamShapes",
           "architecture_params", "forward_flops", "get_model", "layer_activation_bytes",
           "outside_activation_bytes", "resolve", "spec_from_architecture", "trace_module"]


@dataclass(frozen=True)
class ModelSpec:
    """A model as the simulator sees it. Byte and FLOP figures are per sample (one sequence).

    ``layer_activation_bytes_per_sample`` and ``layer_input_bytes_per_sample`` (one transformer
    layer's saved bytes, and its input: all that full recompute keeps) let the memory model
    place layers on pipeline stages and apply checkpointing; ``arch`` is set for presets so
    tensor parallelism can split activations by the formula instead of evenly.
    """

    name: str
    params: ParamShapes
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    forward_flops_per_sample: float
    activation_bytes_per_sample: float
    checkpointed_activation_bytes_per_sample: float
    dtype: str = "bfloat16"
    layer_activation_bytes_per_sample: float = 0.0
    layer_input_bytes_per_sample: float = 0.0
    arch: Architecture | None = None
    # a traced forward's ops besides its matmuls (flowtrain.profiling.census summary), FLOPs
    # and elements per sample, calls per forward; None for presets
    op_census: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    # what was assumed in reading the model (a Hugging Face config's inferred features, a
    # sequence length taken from it): the report's notes
    notes: tuple[str, ...] = field(default=(), compare=False, hash=False)
    # a traced forward recognized op by op (sims.op_program): what a GPU profile prices a
    # traced module with, and its activation memory under the run's kernels; None for presets
    program: Any = field(default=None, compare=False, hash=False, repr=False)

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for _, shape in self.params)

    @property
    def outside_activation_bytes_per_sample(self) -> float:
        """Saved bytes outside the transformer layers (embeddings, final norm, logits)."""
        return max(0.0, self.activation_bytes_per_sample
                   - self.layers * self.layer_activation_bytes_per_sample)

    def layer_of(self) -> tuple[int, ...]:
        """Each parameter's transformer layer index, or -1 outside the layers (the first
        all-digit component of its dotted name, as in ``h.3.attn`` or ``layers.3.mlp``)."""
        return tuple(_layer_index(name) for name, _ in self.params)

    def units(self) -> list[list[int]]:
        """Parameter indices grouped by owning module (the name without its last component),
        in first-seen order: the same units ``flowtrain.engine.strategy.module_units`` gives ZeRO-3
        for a model whose parameters are registered module by module."""
        groups: dict[str, list[int]] = {}
        for index, (name, _) in enumerate(self.params):
            groups.setdefault(name.rpartition(".")[0], []).append(index)
        return list(groups.values())

    def param_specs(self, dtype: str | None = None) -> list[tuple[str, tuple[int, ...], str, int]]:
        """(name, shape, dtype, element size): the form ``flowtrain.plan.build_step_plan`` takes."""
        dtype = dtype or self.dtype
        size = _element_size(dtype)
        return [(name, shape, dtype, size) for name, shape in self.params]


def _element_size(dtype: str) -> int:
    try:
        return torch.empty((), dtype=getattr(torch, dtype)).element_size()
    except (AttributeError, TypeError):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype name; use one of float32, "
                         "bfloat16, float16") from None


def _layer_index(name: str) -> int:
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return -1


# -- presets ------------------------------------------------------------------------------------

def spec_from_architecture(name: str, arch: Architecture, seq_len: int,
                           notes: tuple[str, ...] = ()) -> ModelSpec:
    """A ModelSpec for ``arch`` at ``seq_len`` tokens per sample."""
    layer = layer_activation_bytes(arch, seq_len)
    layer_input = 2.0 * seq_len * arch.hidden
    outside = outside_activation_bytes(arch, seq_len)
    return ModelSpec(
        name=name, params=architecture_params(arch), layers=arch.layers, hidden=arch.hidden,
        heads=arch.heads, seq_len=seq_len, vocab=arch.vocab,
        forward_flops_per_sample=float(forward_flops(arch, seq_len)),
        activation_bytes_per_sample=arch.layers * layer + outside,
        # full recompute keeps each layer's input; backward recomputes one layer at a time, so
        # one layer's full set is live on top of them
        checkpointed_activation_bytes_per_sample=arch.layers * layer_input + layer + outside,
        layer_activation_bytes_per_sample=layer, layer_input_bytes_per_sample=layer_input,
        arch=arch, notes=notes)


def get_model(name: str, seq_len: int | None = None) -> ModelSpec:
    """A preset by name, or an architecture file or Hugging Face config by path
    (``sims.model_files``); ``seq_len`` defaults to the model's training context."""
    from sims.model_files import is_model_file, read_model_file

    notes: tuple[str, ...] = ()
    arch = PRESETS.get(name)
    label = name
    if arch is None and is_model_file(name):
        _check_seq_len(seq_len, allow_none=True)
        arch, seq_len, label, read_notes = read_model_file(name, seq_len)
        notes = tuple(read_notes)
    if arch is None:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}, "
                         "give an architecture file or a Hugging Face config.json, or trace "
                         "a module with trace_module('pkg.mod:fn', seq_len=...)")
    if seq_len is None:
        seq_len = arch.context
    _check_seq_len(seq_len)
    if arch.position == "learned" and seq_len > arch.context:
        raise ValueError(f"seq_len {seq_len} is longer than {label}'s {arch.context} learned "
                         f"positions; use seq_len <= {arch.context}")
    return spec_from_architecture(label, arch, seq_len, notes)


def _check_seq_len(seq_len: Any, allow_none: bool = False) -> None:
    if seq_len is None and allow_none:
        return
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an integer > 0, got {seq_len!r}")


# -- tracing ------------------------------------------------------------------------------------

DTYPES = ("float32", "bfloat16", "float16")


def trace_module(factory: str, *, seq_len: int, batch: int = 1, example: str | None = None,
                 dtype: str = "bfloat16") -> ModelSpec:
    """A ModelSpec measured from a real module without allocating its weights.

    ``factory`` is "pkg.mod:fn"; ``fn()`` builds the module under ``torch.device("meta")``, so
    parameters have shapes and no storage, and a forward in training mode runs on meta inputs:
    token ids of shape (batch, seq_len) by default, or what ``example`` ("pkg.mod:fn", called as
    ``fn(batch=..., seq_len=...)`` under the meta device) returns: a tensor, a tuple of
    positional inputs or a dict of keyword inputs. FLOPs and the other ops come from
    ``flowtrain.profiling.census.OpCensus`` (torch.utils.flop_counter's formulas; shape-only,
    so it works on meta; attention counted whole, as a run's census counts it). Activation
    bytes are the storages autograd saves for backward (``saved_tensors_hooks``), each storage
    counted once, parameters and buffers excluded, plus the outputs, which stay alive until
    backward; floating parameters are cast to ``dtype`` first so the bytes are those of
    ``dtype`` training. Saved bytes are what torch keeps on this path: e.g. unfused norms keep
    more than a fused kernel, and attention keeps its maps (no flash attention on meta).

    Layers are the entries of the model's longest ``nn.ModuleList``; bytes saved while one
    runs are its own, and its inputs are what full recompute would keep. ``hidden``, ``heads``
    and ``vocab`` are 0: a traced module does not say.
    """
    for label, value in (("seq_len", seq_len), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"trace_module: {label} must be an integer > 0, got {value!r}")
    if dtype not in DTYPES:
        raise ValueError(f"trace_module: dtype {dtype!r} is not supported; choose one of "
                         f"{', '.join(DTYPES)}")
    build = resolve(factory, "factory")
    with torch.device("meta"):
        module = build()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"trace_module: factory {factory!r} returned {type(module).__name__}, "
                        "not a torch.nn.Module; make it return the model")
    # Anything the factory placed on a real device explicitly follows to meta (its memory was
    # already spent, but the trace stays shape-only from here on).
    module = module.to(device="meta").to(dtype=getattr(torch, dtype)).train()
    args, kwargs = _example_inputs(example, batch, seq_len)
    params = tuple((name, tuple(p.shape)) for name, p in module.named_parameters()
                   if p.requires_grad)
    blocks = _layer_list(module)
    recorder = _SavedBytes(_storage_keys(list(module.parameters()) + list(module.buffers())))
    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(recorder.enter(index), with_kwargs=True))
        handles.append(block.register_forward_hook(recorder.leave))
    try:
        with torch.enable_grad(), OpCensus() as census, \
                torch.autograd.graph.saved_tensors_hooks(recorder.pack, _unpack), \
                Recording(module, blocks) as recording:
            try:
                output = module(*args, **kwargs)
            except Exception as err:
                raise RuntimeError(
                    f"trace_module: the forward of {factory!r} failed on meta inputs "
                    f"{_describe(args, kwargs)}: {err}; give example='pkg.mod:fn' returning "
                    "the inputs the model takes") from err
        recorder.add_outputs(output)
    finally:
        for handle in handles:
            handle.remove()
    program = build_program(recording.finish(output), batch)
    layers = len(blocks)
    per_layer = [recorder.layer_bytes.get(i, 0.0) / batch for i in range(layers)]
    layer_mean = sum(per_layer) / layers if layers else 0.0
    layer_input = sum(recorder.input_bytes.values()) / batch / layers if layers else 0.0
    outside = recorder.outside_bytes / batch
    total = sum(per_layer) + outside
    ops = census.summary()
    per_sample = {"matmul_flops": ops["matmul_flops"] / batch,
                  "attention_calls": ops["attention_calls"],
                  "attention_flops": ops["attention_flops"] / batch,
                  "ops": {cls: [calls, elements / batch]
                          for cls, (calls, elements) in ops["ops"].items()}}
    return ModelSpec(
        name=factory, params=params, layers=layers, hidden=0, heads=0, seq_len=seq_len, vocab=0,
        forward_flops_per_sample=(ops["matmul_flops"] + ops["attention_flops"]) / batch,
        activation_bytes_per_sample=total,
        checkpointed_activation_bytes_per_sample=(
            layers * layer_input + max(per_layer, default=0.0) + outside),
        dtype=dtype, layer_activation_bytes_per_sample=layer_mean,
        layer_input_bytes_per_sample=layer_input, op_census=per_sample, program=program)


def resolve(target: str, what: str) -> Callable[..., Any]:
    """Imports "pkg.mod:fn" and returns ``fn``, looking in the working directory first as
    ``python -m`` does (a console script's path holds only its own directory, so a user's
    ``my_pkg`` beside them would not be found)."""
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)
    module_name, sep, attr = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not sep or not module_name or not attr or ":" in attr or not all(
            part.isidentifier() for part in module_name.split(".") + attr.split(".")):
        raise ValueError(f"trace_module: {what} must look like 'package.module:function', got "
                         f"{target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"trace_module: {what} {target!r}: cannot import {module_name!r} "
                         f"({err}); is its directory on sys.path?") from err
    found: Any = module
    for part in attr.split("."):
        if not hasattr(found, part):
            choices = sorted(name for name, value in vars(module).items()
                             if callable(value) and not name.startswith("_")
                             and getattr(value, "__module__", None) == module.__name__)
            raise ValueError(f"trace_module: {what} {target!r}: {module_name} has no "
                             f"{attr!r}; callables defined there: {', '.join(choices) or 'none'}")
        found = getattr(found, part)
    if not callable(found):
        raise TypeError(f"trace_module: {what} {target!r} is a {type(found).__name__}, not a "
                        "callable")
    return found


def _example_inputs(example: str | None, batch: int, seq_len: int
                    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if example is None:
        return (torch.zeros((batch, seq_len), dtype=torch.long, device="meta"),), {}
    make = resolve(example, "example")
    with torch.device("meta"):
        given = make(batch=batch, seq_len=seq_len)
    def to_meta(x):
        return x.to("meta") if isinstance(x, torch.Tensor) else x
    if isinstance(given, torch.Tensor):
        return (to_meta(given),), {}
    if isinstance(given, (tuple, list)):
        return tuple(torch.utils._pytree.tree_map(to_meta, list(given))), {}
    if isinstance(given, dict):
        return (), torch.utils._pytree.tree_map(to_meta, given)
    raise TypeError(f"trace_module: example {example!r} returned {type(given).__name__}; return "
                    "a tensor, a tuple of positional inputs or a dict of keyword inputs")


def _describe(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    def one(x: Any) -> str:
        return f"{tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}" \
            if isinstance(x, torch.Tensor) else type(x).__name__
    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def _layer_list(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer layers: the longest ModuleList whose entries hold parameters."""
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)
             and len(m) and all(any(True for _ in b.parameters()) for b in m)]
    if not lists:
        return []
    longest = max(lists, key=len)
    return list(longest)


def _storage_key(t: torch.Tensor) -> int:
    # Views share a storage; meta storages all report data_ptr 0, so the storage object's C
    # handle is what tells two of them apart (kept alive by the recorder, so never reused).
    return t.untyped_storage()._cdata


def _storage_keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {_storage_key(t) for t in tensors}


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


class _SavedBytes:
    """Adds up the storages autograd saves, by the layer running when each is first saved."""

    def __init__(self, exclude: set[int]) -> None:
        self.seen = set(exclude)
        self.inputs_seen = set(exclude)
        self.alive: list[torch.Tensor] = []
        self.current: int | None = None
        self.layer_bytes: dict[int, float] = {}
        self.input_bytes: dict[int, float] = {}
        self.outside_bytes = 0.0

    def _new(self, t: torch.Tensor, seen: set[int]) -> int:
        key = _storage_key(t)
        if key in seen:
            return 0
        seen.add(key)
        self.alive.append(t)
        return t.untyped_storage().nbytes()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        nbytes = self._new(t, self.seen)
        if self.current is None:
            self.outside_bytes += nbytes
        else:
            self.layer_bytes[self.current] = self.layer_bytes.get(self.current, 0.0) + nbytes
        return t

    def enter(self, index: int) -> Callable[..., None]:
        def hook(_: torch.nn.Module, args: Any, kwargs: Any) -> None:
            self.current = index
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            added = sum(self._new(x, self.inputs_seen) for x in leaves
                        if isinstance(x, torch.Tensor) and x.is_floating_point())
            self.input_bytes[index] = self.input_bytes.get(index, 0.0) + added
        return hook

    def leave(self, *_: Any) -> None:
        self.current = None

    def add_outputs(self, output: Any) -> None:
        for x in torch.utils._pytree.tree_leaves(output):
            if isinstance(x, torch.Tensor):
                self.outside_bytes += self._new(x, self.seen)
