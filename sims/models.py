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

ParamShapes = tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Architecture:
    """The shape of a decoder-only transformer, enough to list its parameters and count its work.

    ``family`` "gpt2": learned positions, LayerNorm and linear biases, GeLU MLP of ``ffn``,
    tied LM head. "llama": rotary positions (no parameters), RMSNorm, no biases, SwiGLU
    MLP of ``ffn``, grouped-query attention with ``kv_heads``, untied LM head. ``dropout``
    changes only the activation bytes (its masks and outputs are kept for backward); ``tied``
    overrides the family's LM head (Megatron-Core's GPT unties it with
    --untie-embeddings-and-output-weights, some Llama-shaped models tie it).
    """

    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    context: int
    source: str = ""
    # None: the family's own (GPT-2 trains with dropout 0.1, Llama with none)
    dropout: bool | None = None
    # None: the family's own (GPT-2 ties the LM head to the token embedding, Llama does not)
    tied: bool | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def tied_embeddings(self) -> bool:
        return self.family == "gpt2" if self.tied is None else self.tied

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"architecture family {self.family!r} is not known; choose one of "
                             f"{', '.join(FAMILIES)}")
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"architecture {name} must be an integer > 0, got {value!r}")
        if self.dropout is None:
            object.__setattr__(self, "dropout", self.family == "gpt2")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden {self.hidden} must divide into heads {self.heads}, and "
                             f"heads into kv_heads {self.kv_heads}")


FAMILIES = ("gpt2", "llama")

_GPT2_SOURCE = ("Radford et al. 2019 (GPT-2) Table 2 layers/width; Hugging Face "
                "openai-community/gpt2* config.json for heads, vocab 50257, n_positions 1024")
_LLAMA2_SOURCE = ("Touvron et al. 2023 (arXiv:2307.09288) Table 1; Hugging Face "
                  "meta-llama/Llama-2-*-hf config.json (intermediate_size, 32000 vocab)")
_LLAMA3_SOURCE = ("Meta Llama 3 model card; Hugging Face meta-llama/Meta-Llama-3-*/config.json "
                  "(intermediate_size, num_key_value_heads 8, vocab 128256, 8192 positions)")

PRESETS: dict[str, Architecture] = {
    "gpt2": Architecture("gpt2", 12, 768, 12, 12, 3072, 50257, 1024, _GPT2_SOURCE),
    "gpt2-medium": Architecture("gpt2", 24, 1024, 16, 16, 4096, 50257, 1024, _GPT2_SOURCE),
    "gpt2-large": Architecture("gpt2", 36, 1280, 20, 20, 5120, 50257, 1024, _GPT2_SOURCE),
    "gpt2-xl": Architecture("gpt2", 48, 1600, 25, 25, 6400, 50257, 1024, _GPT2_SOURCE),
    "llama2-7b": Architecture("llama", 32, 4096, 32, 32, 11008, 32000, 4096, _LLAMA2_SOURCE),
    "llama2-13b": Architecture("llama", 40, 5120, 40, 40, 13824, 32000, 4096, _LLAMA2_SOURCE),
    "llama2-70b": Architecture("llama", 80, 8192, 64, 8, 28672, 32000, 4096, _LLAMA2_SOURCE),
    "llama3-8b": Architecture("llama", 32, 4096, 32, 8, 14336, 128256, 8192, _LLAMA3_SOURCE),
    "llama3-70b": Architecture("llama", 80, 8192, 64, 8, 28672, 128256, 8192, _LLAMA3_SOURCE),
}


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
        in first-seen order: the same units ``flowtrain.zero.build.module_units`` gives ZeRO-3
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

def architecture_params(arch: Architecture) -> ParamShapes:
    """Every trainable parameter in ``model.parameters()`` order, named and shaped as Hugging
    Face's GPT2LMHeadModel (Conv1D weights stored (in, out); the tied LM head is not listed
    again) or LlamaForCausalLM (Linear weights (out, in))."""
    h, f, v = arch.hidden, arch.ffn, arch.vocab
    out: list[tuple[str, tuple[int, ...]]] = []
    if arch.family == "gpt2":
        out += [("transformer.wte.weight", (v, h)), ("transformer.wpe.weight", (arch.context, h))]
        for i in range(arch.layers):
            p = f"transformer.h.{i}."
            out += [(p + "ln_1.weight", (h,)), (p + "ln_1.bias", (h,)),
                    (p + "attn.c_attn.weight", (h, 3 * h)), (p + "attn.c_attn.bias", (3 * h,)),
                    (p + "attn.c_proj.weight", (h, h)), (p + "attn.c_proj.bias", (h,)),
                    (p + "ln_2.weight", (h,)), (p + "ln_2.bias", (h,)),
                    (p + "mlp.c_fc.weight", (h, f)), (p + "mlp.c_fc.bias", (f,)),
                    (p + "mlp.c_proj.weight", (f, h)), (p + "mlp.c_proj.bias", (h,))]
        out += [("transformer.ln_f.weight", (h,)), ("transformer.ln_f.bias", (h,))]
        if not arch.tied_embeddings:
            out.append(("lm_head.weight", (v, h)))
    else:
        kv = arch.kv_dim
        out.append(("model.embed_tokens.weight", (v, h)))
        for i in range(arch.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            out += [(a + "q_proj.weight", (h, h)), (a + "k_proj.weight", (kv, h)),
                    (a + "v_proj.weight", (kv, h)), (a + "o_proj.weight", (h, h)),
                    (p + "mlp.gate_proj.weight", (f, h)), (p + "mlp.up_proj.weight", (f, h)),
                    (p + "mlp.down_proj.weight", (h, f)),
                    (p + "input_layernorm.weight", (h,)),
                    (p + "post_attention_layernorm.weight", (h,))]
        out.append(("model.norm.weight", (h,)))
        if not arch.tied_embeddings:
            out.append(("lm_head.weight", (v, h)))
    return tuple(out)


def forward_flops(arch: Architecture, seq_len: int) -> int:
    """Matmul FLOPs of one sample's forward pass, counting 2·m·n·k per (m×k)·(k×n) product.

    With s = seq_len, h = hidden, d = h / heads, g·d = kv_dim, f = ffn, V = vocab, per layer:
      Q and output projections    2·(2·s·h·h)
      K and V projections         2·(2·s·h·g·d)
      scores Q·Kᵀ, per head       2·s·s·d, times heads -> 2·s²·h (each query head scores
                                  against its group's K; GQA shares K, not the work)
      context softmax·V           2·s²·h likewise
      MLP                         2·(2·s·h·f) for GeLU (fc, proj); 3·(2·s·h·f) for SwiGLU
    plus the LM head 2·s·h·V. The causal mask does not shrink a dense matmul, so the full s²
    is counted. For GPT-2 (f = 4h, g·d = h) a layer is 24·s·h² + 4·s²·h, the usual figure.
    Elementwise work (norms, softmax, activations, rotary) is not counted, as
    ``torch.utils.flop_counter`` does not count it either.
    """
    s, h, f = seq_len, arch.hidden, arch.ffn
    attention = 2 * s * h * h * 2 + 2 * s * h * arch.kv_dim * 2 + 2 * s * s * h * 2
    mlp = (3 if arch.gated_mlp else 2) * 2 * s * h * f
    return arch.layers * (attention + mlp) + 2 * s * h * arch.vocab


def layer_activation_bytes(arch: Architecture, seq_len: int, *, tp: int = 1,
                           mask_bytes: int = 1, maps: bool = True,
                           sequence_parallel: bool = False) -> float:
    """Bytes one layer saves for backward, per sample, 16-bit activations, no recompute.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
    (arXiv:2205.05198, Sec. 4): a GPT layer keeps s·b·h·(34 + 5·a·s/h) bytes, and with
    t-way tensor parallelism (no sequence parallelism) s·b·h·(10 + 24/t + 5·a·s/(h·t)). The
    same accounting, per token, written out so that it also covers Llama's layer:
      kept whole on every tensor rank: both norm inputs 4h, the attention and MLP inputs 2h
      each, the two dropout masks 2h (1 byte each, GPT only);
      split by t: Q 2h, K and V 2·g·d each, the output projection's input 2h, and the MLP:
      GeLU input and output 2f each (16h at f = 4h), or SwiGLU's gate output, SiLU output, up
      output and their product 2f each;
      attention maps, per head and split by t: softmax output 2s, plus (GPT) its dropout mask
      s and dropout output 2s: 5·a·s, or 2·a·s without dropout.
    Grouped-query attention keeps one K/V per group; with more tensor ranks than KV heads each
    rank keeps at least one head. Flash attention keeps no maps at all, nor does selective
    recompute (it recomputes them): ``maps`` False. With ``sequence_parallel`` the part kept
    whole is split over the tensor ranks too (34/t of the paper's Sec. 4.2.2).
    """
    s, h, f, t = seq_len, arch.hidden, arch.ffn, tp
    whole = (8 * h + (2 * h * mask_bytes if arch.dropout else 0)) / (t if sequence_parallel
                                                                      else 1)
    kv_per_rank = max(arch.kv_heads / t, 1.0) * arch.head_dim
    split = 4 * h / t + 4 * kv_per_rank + (8 if arch.gated_mlp else 4) * f / t
    kept_maps = arch.heads * s * ((4 + mask_bytes) if arch.dropout else 2) / t if maps else 0.0
    return s * (whole + split + kept_maps)


def outside_activation_bytes(arch: Architecture, seq_len: int, *, tp: int = 1) -> float:
    """Saved bytes outside the layers, per sample: the embedding dropout mask (GPT), the final
    norm's input 2sh, the LM head's input 2sh and the logits the loss keeps in fp32, 4·s·V/t
    (vocab-parallel with t tensor ranks)."""
    s, h = seq_len, arch.hidden
    return s * (h if arch.dropout else 0) + 4 * s * h + 4 * s * arch.vocab / tp


def spec_from_architecture(name: str, arch: Architecture, seq_len: int) -> ModelSpec:
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
        arch=arch)


def get_model(name: str, seq_len: int | None = None) -> ModelSpec:
    """A preset by name; ``seq_len`` defaults to the model's training context."""
    arch = PRESETS.get(name)
    if arch is None:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)} "
                         "or trace a module with trace_module('pkg.mod:fn', seq_len=...)")
    if seq_len is None:
        seq_len = arch.context
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be an integer > 0, got {seq_len!r}")
    if arch.family == "gpt2" and seq_len > arch.context:
        raise ValueError(f"seq_len {seq_len} is longer than {name}'s {arch.context} learned "
                         f"positions; use seq_len <= {arch.context}")
    return spec_from_architecture(name, arch, seq_len)


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
                torch.autograd.graph.saved_tensors_hooks(recorder.pack, _unpack):
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
        layer_input_bytes_per_sample=layer_input, op_census=per_sample)


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
