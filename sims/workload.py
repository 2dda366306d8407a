"""What the planner plans for: a model's parameters and FLOPs as the engine would train them
(``Workload``, from a model description, a run's plan.json or a pipeline run's stage records),
and where the ranks are (``Layout``), with the parameter-name helpers both use."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from flowtrain.plan.buckets import ParamSpec
from flowtrain.plan.partition import partition_balanced
from flowtrain.plan.spec import DTYPE_BYTES, PRECISION_DTYPE
from sims.architecture import AttentionWidths


@dataclass(frozen=True)
class Layout:
    """Where the ranks are: ``nodes`` x ``devices_per_node`` ranks, split into ``tp``-wide
    tensor-parallel groups inside a node, ``pp`` pipeline stages and what is left as data
    parallel. Ranks are numbered tensor-parallel fastest, then data parallel, then pipeline
    (Megatron's order), which decides whether a group crosses nodes."""

    nodes: int
    devices_per_node: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer > 0, got {value!r}")
        if self.devices_per_node % self.tp:
            raise ValueError(f"tensor parallel stays inside a node: tp {self.tp} must divide the "
                             f"{self.devices_per_node} devices per node (valid: "
                             f"{', '.join(str(d) for d in _divisors(self.devices_per_node))})")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(f"tp x pp = {self.tp * self.pp} must divide the world size "
                             f"{self.world_size} ({self.nodes} nodes x {self.devices_per_node} "
                             f"devices)")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)

    @property
    def dp_nodes(self) -> int:
        """Nodes one data-parallel group spans (its ranks are ``tp`` apart)."""
        block = self.dp * self.tp
        return min(self.nodes, max(1, math.ceil(block / self.devices_per_node)))

    def pipe_link_inter_node(self, stage: int) -> bool:
        """Whether stage ``stage`` sends to stage ``stage + 1`` across nodes."""
        block = self.dp * self.tp
        return (stage * block) // self.devices_per_node != \
            ((stage + 1) * block) // self.devices_per_node


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class TransformerShape(AttentionWidths):
    """A decoder-only transformer's shapes, when the model is known by its architecture (a
    preset or a published configuration): what lets the simulator price each of a layer's ops
    by its own shape instead of sharing FLOPs among parameters. ``gated_mlp``: SwiGLU (three
    matrices of ``ffn``) instead of one activation between two; ``norm``: "layernorm" or
    "rmsnorm"; ``rotary``: rotary position embedding applied to Q and K in every layer;
    ``tied``: the LM head reuses the token embedding; ``learned_positions``: a position
    table looked up beside the tokens' (None: when not rotary); ``head_size``: each head's
    width (None: hidden / heads); ``parallel_block``: attention and MLP read one norm's output
    and add into one residual (GPT-J, GPT-NeoX, Falcon)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    gated_mlp: bool = False
    biases: bool = True
    norm: str = "layernorm"
    dropout: bool = False
    rotary: bool = False
    tied: bool = True
    learned_positions: bool | None = None
    head_size: int | None = None
    parallel_block: bool = False
    # Q, K and V one linear; a gated MLP's gate and up one (as the model's code writes them)
    fused_qkv: bool = True
    fused_gate_up: bool = True

    @property
    def position_table(self) -> bool:
        return not self.rotary if self.learned_positions is None else self.learned_positions


@dataclass(frozen=True)
class Workload:
    """What the planner needs of a model: its trainable parameters as the engine lists them,
    forward FLOPs of one sample, and the shapes that size pipeline and TP messages (0 when
    unknown, e.g. a model known only from a run's plan.json)."""

    name: str
    params: tuple[ParamSpec, ...]
    forward_flops_per_sample: float
    seq_len: int = 0
    hidden: int = 0
    layers: int = 0
    activation_bytes_per_sample: float = 0.0
    # one layer's input (the activations a pipeline stage sends on), when the shapes are unknown
    layer_input_bytes_per_sample: float = 0.0
    # A measured pipeline run's own split (its stage records): each stage's parameter indices,
    # forward FLOPs and output bytes per sample. Empty: split by layer numbers and parameter
    # count.
    stage_params: tuple[tuple[int, ...], ...] = ()
    stage_flops_per_sample: tuple[float, ...] = ()
    stage_output_bytes_per_sample: tuple[float, ...] = ()
    # an interleaved run's chunks: per stage, each chunk's [first, end) layer numbers
    stage_chunk_layers: tuple[tuple[tuple[int, int], ...], ...] = ()
    # A forward's ops besides its matmuls (flowtrain.profiling.census): (class, calls per
    # forward, elements per sample) triples, and attention's calls and FLOPs per sample (part
    # of forward_flops_per_sample, priced at attention's own rate on a calibrated CPU host).
    op_census: tuple[tuple[str, float, float], ...] = ()
    attention_calls: float = 0.0
    attention_flops_per_sample: float = 0.0
    # A measured pipeline run's census per stage (``census_fields`` of each stage record, in
    # stage order), which the planner uses for that stage instead of a share of the model's.
    # Empty: stages share the model's census by their FLOPs.
    stage_census: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)
    # The parameters are one tensor-parallel rank's own (a run's record of a split model),
    # not the whole model's: the planner takes them as they are instead of splitting them.
    split_for_tp: bool = False
    # The model's shapes, when known (presets, published configurations): the simulator then
    # prices a GPU's ops one by one (sims.layer_ops).
    transformer: TransformerShape | None = None
    # Embedding weights tied to the output head: (parameter name, token lookups per sample).
    # The head's matmul is their compute, and data parallel without ZeRO splits their gradient
    # (flowtrain.engine.embedding_rows).
    tied: tuple[tuple[str, float], ...] = ()
    # A traced module recognized op by op (sims.op_program.OpProgram): a GPU profile prices
    # each of its layers' ops as it does a known transformer's.
    program: Any = field(default=None, compare=False, hash=False)

    @staticmethod
    def census_fields(summary: Mapping[str, Any] | None, samples: int) -> dict[str, Any]:
        """Workload fields from an ``OpCensus.summary()`` of a forward of ``samples``
        samples (none: no fields)."""
        if not summary:
            return {}
        ops = summary.get("ops", {})
        return {"op_census": tuple((str(cls), float(calls), float(elements) / samples)
                                   for cls, (calls, elements) in sorted(ops.items())),
                "attention_calls": float(summary.get("attention_calls", 0)),
                "attention_flops_per_sample": float(summary.get("attention_flops", 0.0))
                / samples}

    @classmethod
    def from_model(cls, model: Any, precision: str) -> Workload:
        """From a ``sims.models.ModelSpec``; parameters take the training precision's dtype (the
        engine casts the model to fp16/bf16 for mixed precision)."""
        dtype = PRECISION_DTYPE[precision]
        elem = DTYPE_BYTES[dtype]
        params = tuple((name, tuple(shape), dtype, elem) for name, shape in model.params)
        arch = getattr(model, "arch", None)
        shape = None if arch is None else TransformerShape(
            arch.layers, arch.hidden, arch.heads, arch.kv_heads, arch.ffn, arch.vocab,
            model.seq_len, gated_mlp=arch.gated_mlp, biases=bool(arch.biases), norm=arch.norm,
            dropout=bool(arch.dropout), rotary=arch.rotary, tied=arch.tied_embeddings,
            learned_positions=arch.position == "learned", head_size=arch.head_size,
            parallel_block=arch.parallel_block, fused_qkv=bool(arch.fused_qkv),
            fused_gate_up=arch.fused_gate_up)
        # a tied preset's first parameter is its token embedding (sims.models)
        tied = ((params[0][0], float(model.seq_len)),) \
            if arch is not None and arch.tied_embeddings and params else ()
        return cls(model.name, params, float(model.forward_flops_per_sample), model.seq_len,
                   model.hidden, model.layers, float(model.activation_bytes_per_sample),
                   float(getattr(model, "layer_input_bytes_per_sample", 0.0)),
                   **cls.census_fields(getattr(model, "op_census", None), 1),
                   transformer=shape, tied=tied, program=getattr(model, "program", None))

    @classmethod
    def from_run(cls, plan: Mapping[str, Any], micro_batch_size: int,
                 name: str = "run") -> Workload:
        """From a run directory's ``plan.json`` (written by rank 0 of a launched run)."""
        params = tuple((str(n), tuple(int(d) for d in s), str(dt), int(e))
                       for n, s, dt, e in plan["param_specs"])
        flops = float(plan["forward_flops_per_micro_batch"]) / micro_batch_size
        tp_section = plan.get("config", {}).get("tensor_parallel") or {}
        tp = int(tp_section.get("tp_size") or tp_section.get("autotp_size") or 1)
        # a tensor-parallel rank recorded its own parameters and FLOPs; the planner divides a
        # stage's FLOPs among the tp ranks, so it is given the group's
        tied = tuple((str(t["param"]), float(t["lookups_per_micro_batch"]) / micro_batch_size)
                     for t in plan.get("tied_embeddings", ()))
        return cls(name, params, flops * tp, split_for_tp=tp > 1, tied=tied, **cls.census_fields(
            plan.get("forward_ops_per_micro_batch"), micro_batch_size))

    @classmethod
    def from_stages(cls, stages: Sequence[Mapping[str, Any]], micro_batch_size: int,
                    name: str = "run") -> Workload:
        """From a pipeline run's per-stage records (``stages/stage{s}.json``, in stage order):
        the stages' parameters in order, each stage's own FLOPs and the bytes it sends on."""
        params: list[ParamSpec] = []
        split: list[tuple[int, ...]] = []
        for record in stages:
            first = len(params)
            params += [(str(n), tuple(int(d) for d in shape), str(dt), int(e))
                       for n, shape, dt, e in record["param_specs"]]
            split.append(tuple(range(first, len(params))))
        flops = tuple(float(r["forward_flops_per_micro_batch"]) / micro_batch_size
                      for r in stages)
        sent = tuple(float(r["output_bytes_per_micro_batch"]) / micro_batch_size
                     for r in stages)
        # each stage's census (records written before stages kept one have none: the
        # prediction then leaves the stages' other ops out, as it did)
        census = tuple(cls.census_fields(r.get("forward_ops_per_micro_batch"),
                                         micro_batch_size) for r in stages)
        chunk_layers = tuple(tuple((int(c["layers"][0]), int(c["layers"][1]))
                                   for c in r.get("chunks", ())) for r in stages)
        return cls(name, tuple(params), sum(flops), stage_params=tuple(split),
                   stage_flops_per_sample=flops, stage_output_bytes_per_sample=sent,
                   stage_census=census if any(census) else (),
                   stage_chunk_layers=chunk_layers if any(chunk_layers) else ())


def layer_of(name: str) -> int | None:
    """A parameter's layer number: the first all-digit part of its dotted name
    ("h.3.attn.c_attn.weight" -> 3, "model.layers.12.mlp.up_proj.weight" -> 12)."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def split_stages(params: Sequence[ParamSpec], stages: int,
                 layer_costs: Mapping[int, float] | None = None) -> list[list[int]]:
    """Parameter indices of each pipeline stage: numbered layers split evenly in order (or, with
    ``layer_costs``, cut so that the costliest stage costs least, as ``PipelineModule``'s
    partition methods cut), what comes before the first layer (embeddings) on the first stage,
    what comes after the last (final norm, head) on the last. A cost keyed below the first
    layer (above the last) makes what comes before (after) the layers an item of the cut of its
    own, which may then be alone on its stage."""
    if stages == 1:
        return [list(range(len(params)))]
    layers = sorted({n for n in (layer_of(p[0]) for p in params) if n is not None})
    costs = dict(layer_costs or {})
    # (only where the model has parameters there: an item with none would leave a stage empty)
    before = bool(layers) and layer_of(params[0][0]) is None and any(n < layers[0] for n in costs)
    after = bool(layers) and layer_of(params[-1][0]) is None and any(n > layers[-1] for n in costs)
    # the items cut: the layers, with the ends as items where the costs name them
    items: list[int | None] = [None] * bool(before) + list(layers) + [None] * bool(after)
    if len(items) < stages:
        raise ValueError(f"pp {stages} needs at least {stages} numbered layers to split the "
                         f"model into stages; its parameter names show {len(layers)}")
    if layer_costs is None:
        part = [pos * stages // len(items) for pos in range(len(items))]
    else:
        weight = [sum(c for n, c in costs.items() if n < layers[0])] * bool(before) + \
            [costs.get(n, 0.0) for n in layers] + \
            [sum(c for n, c in costs.items() if n > layers[-1])] * bool(after)
        bounds = partition_balanced(weight, stages)
        part = [s for s in range(stages) for _ in range(bounds[s], bounds[s + 1])]
    # the ends, items or not, are the first and the last of the cut: stages 0 and stages - 1
    stage_of_layer = {n: part[pos] for pos, n in enumerate(items) if n is not None}
    out: list[list[int]] = [[] for _ in range(stages)]
    seen_layer = False
    for i, p in enumerate(params):
        n = layer_of(p[0])
        if n is not None:
            seen_layer = True
            out[stage_of_layer[n]].append(i)
        else:
            out[stages - 1 if seen_layer else 0].append(i)
    return out


def interleaved_chunks(params: Sequence[ParamSpec], indices: Sequence[int],
                       layers: Sequence[Sequence[int]]) -> list[list[int]]:
    """A measured interleaved stage's parameters (``indices`` into ``params``) cut into its
    chunks, chunk c holding layers ``layers[c]`` = [first, end) (its stage record's); a
    parameter without a layer number goes with the chunk of the layer before it (the first
    chunk when none is)."""
    chunks: list[list[int]] = [[] for _ in layers]
    at = 0
    for i in indices:
        n = layer_of(params[i][0])
        if n is not None:
            found = [c for c, (a, b) in enumerate(layers) if a <= n < b]
            if not found:
                raise ValueError(f"parameter {params[i][0]!r} is in none of the stage's "
                                 f"chunks' layers {[list(r) for r in layers]}")
            at = found[0]
        chunks[at].append(i)
    return chunks


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tp_shard(spec: ParamSpec, tp: int) -> ParamSpec:
    """A weight matrix split tp ways (along its first dimension); vectors stay whole."""
    name, shape, dtype, elem = spec
    if tp == 1 or len(shape) < 2:
        return spec
    return (name, (math.ceil(shape[0] / tp), *shape[1:]), dtype, elem)


def module_units(params: Sequence[ParamSpec]) -> list[list[int]]:
    """ZeRO-3's units from parameter names: the parameters of one module (the name without its
    last part) in first-seen order, as the engine's ``module_units`` finds them on the module."""
    units: dict[str, list[int]] = {}
    for i, p in enumerate(params):
        units.setdefault(p[0].rpartition(".")[0], []).append(i)
    return list(units.values())
