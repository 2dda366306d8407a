"""``PipelineModule``: a model written as a sequence of layers, cut into pipeline stages.

Each rank keeps only its stage's layers (``LayerSpec`` layers are built only where they run).
Parameter names carry the layer's global index (``layers.5.weight``), so checkpoints of any
stage count line up. With v virtual stages (the interleaved schedule) the layers are cut into
p * v chunks and stage s holds chunks s, s + p, s + 2p, ... (Megatron-LM's assignment), running
each as its own forward (``forward(x, chunk=c)``)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from flowtrain.log import get_logger
from flowtrain.parallel import ProcessGrid, build_grid
from flowtrain.plan.partition import partition_balanced

log = get_logger("flowtrain.pipe")

PARTITION_METHODS = ("parameters", "uniform", "balanced", "type:<regex>")


class LayerSpec:
    """A layer to build later, only on the stage that runs it: ``LayerSpec(nn.Linear, 8, 16)``."""

    def __init__(self, typename: type[nn.Module], *args: Any, **kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module class, got {typename!r}")
        self.typename = typename
        self.args = args
        self.kwargs = kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class PipelineModule(nn.Module):
    """A sequence of layers trained across ``num_stages`` pipeline stages.

    ``layers``: nn.Module instances, ``LayerSpec``s or plain callables (reshapes and the like,
    without parameters). ``partition_method``: "parameters" (balance parameter counts),
    "uniform" (layer counts), "balanced" (forward FLOPs per layer, measured with
    torch.utils.flop_counter on ``example_input`` run through the layers on the meta device;
    parameter counts plus one when no example is given) or "type:<regex>" (balance the layers
    whose class name matches). ``loss_fn(outputs, labels)`` runs on the last stage.
    ``activation_checkpoint_interval`` > 0 recomputes every that many layers in backward.
    ``virtual_stages`` > 1 (the interleaved schedule) gives each stage that many model chunks;
    the pipeline engine sets it from ``pipeline.virtual_stages`` when the module was built
    without it.
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, *,
                 loss_fn: Callable[..., torch.Tensor] | None = None,
                 partition_method: str = "parameters",
                 activation_checkpoint_interval: int = 0, tp_size: int = 1,
                 example_input: Any = None, grid: ProcessGrid | None = None,
                 virtual_stages: int = 1) -> None:
        super().__init__()
        if not layers:
            raise ValueError("PipelineModule needs at least one layer")
        if grid is None:
            if num_stages is None:
                raise ValueError("PipelineModule needs num_stages= (or a grid=)")
            grid = build_grid(pp=num_stages, tp=tp_size)
        self.grid = grid
        self.num_stages = grid.shape.pp
        self.stage_id = grid.pp_rank
        self.loss_fn = loss_fn
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        specs = list(layers)
        for i, spec in enumerate(specs):
            if not (isinstance(spec, (nn.Module, LayerSpec)) or callable(spec)):
                raise TypeError(f"layer {i} is {type(spec).__name__}: a layer must be an "
                                f"nn.Module, a LayerSpec or a callable")
        self.partition_method = partition_method
        # kept (a plain list, not submodules) so the engine can re-cut the layers into the
        # config's virtual stages
        self._specs = specs
        self._layer_costs = self._costs(specs, partition_method, example_input)
        self._funcs: list[tuple[int, Any]] = []  # the stage's layers over all its chunks
        self._cut(virtual_stages)

    def _cut(self, virtual_stages: int) -> None:
        """Cuts the layers into ``num_stages * virtual_stages`` chunks and keeps this stage's,
        building the layers it did not hold yet and dropping those it no longer holds."""
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}")
        p, v, n = self.num_stages, virtual_stages, len(self._specs)
        if v > 1 and n < p * v:
            raise ValueError(f"cannot cut {n} layers into {p * v} model chunks ({p} pipeline "
                             f"stages x pipeline.virtual_stages {v}): each chunk needs at least "
                             f"one layer")
        self.virtual_stages = v
        self.parts = partition_balanced(self._layer_costs, p * v)
        # local chunk c is the model's chunk c * p + stage
        first = [c * p + self.stage_id for c in range(v)]
        self.chunk_ranges = [(self.parts[g], self.parts[g + 1]) for g in first]
        self.layer_range = self.chunk_ranges[0]
        held = dict(self._funcs)
        self.layers = nn.ModuleDict()
        self._chunk_funcs: list[list[tuple[int, Any]]] = []
        for start, end in self.chunk_ranges:
            funcs = []
            for index in range(start, end):
                spec = self._specs[index]
                layer = held[index] if index in held else \
                    spec.build() if isinstance(spec, LayerSpec) else spec
                if isinstance(layer, nn.Module):
                    self.layers[str(index)] = layer
                funcs.append((index, layer))
            self._chunk_funcs.append(funcs)
        self._funcs = [f for funcs in self._chunk_funcs for f in funcs]
        log.debug("pipeline stage built", stage=self.stage_id,
                  layers=", ".join(f"{a}..{b - 1}" for a, b in self.chunk_ranges),
                  parts=self.parts)

    def set_virtual_stages(self, virtual_stages: int) -> None:
        """Re-cuts the model into ``virtual_stages`` chunks per stage (before training: the
        layers this stage newly holds are built afresh or taken from the layer list)."""
        if virtual_stages != self.virtual_stages:
            self._cut(virtual_stages)

    def _costs(self, specs: list[Any], method: str, example: Any) -> list[float]:
        if method == "uniform":
            return [1.0] * len(specs)
        if method == "parameters":
            return [float(_param_count(s)) for s in specs]
        if method.startswith("type:"):
            pattern = re.compile(method[len("type:"):], re.IGNORECASE)
            return [1.0 if pattern.search(_class_name(s)) else 0.0 for s in specs]
        if method == "balanced":
            if example is None:
                log.warning("partition_method 'balanced' without example_input: balancing by "
                            "parameter count (plus one per layer)", console=True)
                return [float(_param_count(s)) + 1.0 for s in specs]
            return layer_flops(specs, example)
        raise ValueError(f"unknown partition_method {method!r}; choose one of "
                         f"{', '.join(PARTITION_METHODS)}")

    # -- running a stage ----------------------------------------------------------------------

    def forward(self, inputs: Any, chunk: int = 0) -> Any:
        """This stage's layers of model chunk ``chunk`` (its only one without virtual stages),
        in order (with activation checkpointing every ``activation_checkpoint_interval``
        layers)."""
        if not 0 <= chunk < self.virtual_stages:
            raise ValueError(f"model chunk {chunk} is outside 0..{self.virtual_stages - 1}")
        x = inputs
        interval = self.activation_checkpoint_interval
        if interval > 0 and torch.is_grad_enabled():
            funcs = [f for _, f in self._chunk_funcs[chunk]]
            for i in range(0, len(funcs), interval):
                piece = funcs[i:i + interval]
                x = torch.utils.checkpoint.checkpoint(_run_chunk(piece), *_as_tuple(x),
                                                      use_reentrant=False)
            return x
        for _, layer in self._chunk_funcs[chunk]:
            x = layer(*x) if isinstance(x, tuple) else layer(x)
        return x

    def stage_layers(self) -> list[tuple[int, Any]]:
        return list(self._funcs)


def _run_chunk(chunk: list[Any]) -> Callable[..., Any]:
    def run(*args: Any) -> Any:
        x: Any = args if len(args) > 1 else args[0]
        for layer in chunk:
            x = layer(*x) if isinstance(x, tuple) else layer(x)
        return x
    return run


def _as_tuple(x: Any) -> tuple[Any, ...]:
    return x if isinstance(x, tuple) else (x,)


def _param_count(spec: object) -> int:
    if isinstance(spec, nn.Module):
        return sum(p.numel() for p in spec.parameters())
    if isinstance(spec, LayerSpec):
        with torch.device("meta"):
            return sum(p.numel() for p in spec.build().parameters())
    return 0


def _class_name(spec: object) -> str:
    if isinstance(spec, LayerSpec):
        return spec.typename.__name__
    return type(spec).__name__


def layer_flops(specs: Sequence[Any], example: Any) -> list[float]:
    """Forward FLOPs of each layer for ``example`` (torch.utils.flop_counter), run on the meta
    device so no real weights or activations are allocated; a layer that does no matmul-like
    work costs one FLOP per output element (so elementwise layers are not free)."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    def to_meta(x: Any) -> Any:
        if torch.is_tensor(x):
            return torch.empty_like(x, device="meta")
        if isinstance(x, tuple):
            return tuple(to_meta(t) for t in x)
        return x

    x = to_meta(example)
    costs = []
    with torch.no_grad():
        for spec in specs:
            if isinstance(spec, LayerSpec):
                with torch.device("meta"):
                    layer = spec.build()
            elif isinstance(spec, nn.Module):
                layer = copy.deepcopy(spec).to("meta")
            else:
                layer = spec
            counter = FlopCounterMode(display=False)
            with counter:
                x = layer(*x) if isinstance(x, tuple) else layer(x)
            flops = counter.get_total_flops()
            out = sum(t.numel() for t in _as_tuple(x) if torch.is_tensor(t))
            costs.append(float(flops if flops else out))
    return costs
