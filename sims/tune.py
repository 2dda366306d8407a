"""``flowtrain tune``: the best configuration of a model on a cluster, and the largest micro-batch
that fits, from the simulator first and a few real trials second.

DeepSpeed's autotuner profiles the model and then launches a short trial job for every point of
its space it cannot prune. Here the simulator predicts every point (memory first, then the
step), so the real trials are spent only on the few configurations whose predictions are too
close to separate:

1. ``search`` enumerates the space (ZeRO stage, optimizer offload, micro-batch with the
   accumulation that keeps the global batch, tensor and pipeline widths with virtual stages,
   recompute, gradient bucket and ZeRO-3 prefetch sizes), drops what cannot run or does not
   fit the devices' memory (each with its reason), ranks the rest by predicted throughput and
   marks the memory/throughput frontier.
2. ``verify`` (``sims.tune_trials``) launches the top few as short real jobs, measures them,
   refits the prediction's scale from what they show, and picks by measurement; it also
   confirms the largest micro-batch that fits with a trial, backing off while a trial runs out
   of memory.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from flowtrain.plan.zero_stage import partitions_gradients, partitions_parameters, shards_optimizer
from sims.prediction import (
    Prediction,
    SimulateError,
    load_profile,
    make_layout,
    model_spec,
    predict,
    validated_config,
)

if TYPE_CHECKING:
    from sims.hardware import HardwareProfile
    from sims.layer_ops import SimOptions
    from sims.models import ModelSpec

# reduce_bucket_size values tried: flowtrain's default bucket (25M elements) and DeepSpeed's
# (5e8); stage3_prefetch_bucket_size likewise (5e7 is DeepSpeed's default)
BUCKETS = (25_000_000, 500_000_000)
PREFETCH = (50_000_000, 500_000_000)
# recompute choices a ds_config can say (an activation_checkpointing section): none or every
# layer; Megatron's selective recompute is a simulate flag, not a DeepSpeed key
RECOMPUTE = ("none", "full")
MAX_MICRO_BATCH = 1024


class TuneError(SimulateError):
    """Bad input to ``flowtrain tune``, or nothing that fits: one line."""


@dataclass(frozen=True)
class Candidate:
    """One point of the space."""

    zero_stage: int
    micro_batch: int
    accumulation: int
    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    offload: bool = False
    recompute: str = "none"
    bucket: int = BUCKETS[0]
    prefetch: int | None = None

    def label(self) -> str:
        parts = [f"zero {self.zero_stage}" + (" offload" if self.offload else ""),
                 f"mb {self.micro_batch} x {self.accumulation}"]
        if self.tp > 1 or self.pp > 1:
            parts.append(f"tp {self.tp} pp {self.pp}" +
                         (f" v {self.virtual_stages}" if self.virtual_stages > 1 else ""))
        if self.recompute != "none":
            parts.append(f"recompute {self.recompute}")
        parts.append(f"bucket {_count(self.bucket)}")
        if self.prefetch is not None:
            parts.append(f"prefetch {_count(self.prefetch)}")
        return ", ".join(parts)

    def alone(self, micro_batch: int) -> Candidate:
        """This point at ``micro_batch`` with as few micro-batches as its pipeline holds in
        flight (one without stages): what the largest micro-batch search predicts and tries."""
        return replace(self, micro_batch=micro_batch, accumulation=max(1, self.pp))

    def options(self, model: ModelSpec, framework: str) -> SimOptions:
        """The simulator's options for this point: its recompute where the model's layers are
        known (a traced module recomputes only what its own code checkpoints)."""
        from sims.layer_ops import SimOptions

        known = getattr(model, "arch", None) is not None
        return SimOptions(recompute=self.recompute if known else None, framework=framework)

    def ds_config(self, base: dict[str, Any]) -> dict[str, Any]:
        """``base`` (the user's ds_config) with this point's values; the batch keys are this
        point's micro-batch and accumulation (train_batch_size is left for the batch rule to
        derive)."""
        cfg = copy.deepcopy(base)
        cfg.pop("train_batch_size", None)
        cfg["train_micro_batch_size_per_gpu"] = self.micro_batch
        cfg["gradient_accumulation_steps"] = self.accumulation
        zero = dict(cfg.get("zero_optimization") or {})
        zero["stage"] = self.zero_stage
        zero["reduce_bucket_size"] = self.bucket
        if self.offload:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        else:
            zero.pop("offload_optimizer", None)
        if partitions_parameters(self.zero_stage):
            if self.prefetch is not None:
                zero["stage3_prefetch_bucket_size"] = self.prefetch
        else:
            for key in [k for k in zero if k.startswith("stage3_") or k == "offload_param"]:
                zero.pop(key)
        cfg["zero_optimization"] = zero
        if self.tp > 1:
            cfg["tensor_parallel"] = {**(cfg.get("tensor_parallel") or {}), "tp_size": self.tp}
        else:
            cfg.pop("tensor_parallel", None)
        if self.pp > 1:
            pipe = {**(cfg.get("pipeline") or {}), "stages": self.pp}
            if self.virtual_stages > 1:
                pipe.update(schedule="interleaved", virtual_stages=self.virtual_stages)
            else:
                pipe.pop("virtual_stages", None)
                if pipe.get("schedule") == "interleaved":
                    pipe.pop("schedule")
            cfg["pipeline"] = pipe
        else:
            cfg.pop("pipeline", None)
        if self.recompute == "full":
            # the section configures DeepSpeed's activation checkpointing, which the model's
            # own layers call (a HF model: gradient_checkpointing_enable())
            cfg.setdefault("activation_checkpointing", {})
        else:
            cfg.pop("activation_checkpointing", None)
        return cfg


def _count(n: int) -> str:
    """Elements in short: 25M, 500M, 1.5G."""
    for unit, size in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return str(n)


@dataclass
class Point:
    """A candidate and what became of it: its prediction, or why it was dropped; what a real
    trial measured when one ran."""

    candidate: Candidate
    prediction: Prediction | None = None
    dropped: str | None = None
    measured_step_s: float | None = None
    trial_error: str | None = None
    frontier: bool = False

    @property
    def predicted_step_s(self) -> float | None:
        return self.prediction.step_time_s if self.prediction is not None else None

    @property
    def memory_bytes(self) -> float | None:
        p = self.prediction
        return p.peak_memory_bytes if p is not None else None

    def to_dict(self) -> dict[str, Any]:
        p = self.prediction
        return {"config": asdict(self.candidate), "label": self.candidate.label(),
                "dropped": self.dropped, "frontier": self.frontier,
                "predicted_step_s": self.predicted_step_s,
                "predicted_samples_per_s": p.samples_per_s if p else None,
                "predicted_memory_bytes": self.memory_bytes,
                "mfu": p.mfu if p else None,
                "measured_step_s": self.measured_step_s, "trial_error": self.trial_error}


@dataclass
class Space:
    """What ``search`` varies; None: the defaults for the model and cluster."""

    zero_stages: Sequence[int] = (0, 1, 2, 3)
    offload: Sequence[bool] | None = None
    micro_batches: Sequence[int] | None = None
    tp: Sequence[int] | None = None
    pp: Sequence[int] | None = None
    virtual_stages: Sequence[int] = (1, 2)
    recompute: Sequence[str] | None = None
    buckets: Sequence[int] = BUCKETS
    prefetch: Sequence[int] = PREFETCH


@dataclass
class TuneResult:
    """``search``'s answer: every point, fitting ones ranked by predicted throughput."""

    model: str
    cluster: str
    nodes: int
    devices_per_node: int
    global_batch: int
    memory_limit_bytes: float
    ranked: list[Point]
    dropped: list[Point]
    base_config: dict[str, Any]
    # after verify: the trials' measured / predicted step (the refit), and the pick
    scale: float | None = None
    chosen: Point | None = None
    largest_micro_batch: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Point:
        return self.chosen or self.ranked[0]

    @property
    def frontier(self) -> list[Point]:
        """The frontier's points, least memory first."""
        return sorted((p for p in self.ranked if p.frontier),
                      key=lambda p: p.memory_bytes or 0.0)

    def chosen_config(self) -> dict[str, Any]:
        return self.best.candidate.ds_config(self.base_config)

    def config_notes(self) -> list[str]:
        """What the chosen configuration needs beyond its ds_config."""
        if self.best.candidate.recompute == "selective":
            return ["selective recompute is Megatron's (--recompute-granularity selective); a "
                    "ds_config has no key for it, so the written config does not say it"]
        return []

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "cluster": self.cluster, "nodes": self.nodes,
                "devices_per_node": self.devices_per_node, "global_batch": self.global_batch,
                "memory_limit_bytes": self.memory_limit_bytes,
                "searched": len(self.ranked) + len(self.dropped),
                "ranked": [p.to_dict() for p in self.ranked],
                "dropped": [p.to_dict() for p in self.dropped],
                "frontier": [p.candidate.label() for p in self.frontier],
                "scale": self.scale, "chosen": self.best.to_dict(),
                "chosen_config": self.chosen_config(),
                "largest_micro_batch": self.largest_micro_batch, "notes": self.notes}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(max(1, limit))) + 1)]


def default_space(model: ModelSpec, hw: HardwareProfile, world: int, per_node: int, space: Space
                  ) -> Space:
    """``space`` with its None fields filled for this model and cluster: offload and recompute
    on GPUs only (a CPU rank's memory is the host's already, and a traced module recomputes
    only if its own code calls checkpointing); tensor and pipeline widths for a preset on GPUs
    (the engine splits a plain module by tensor-parallel rules and a PipelineModule into stages;
    a traced factory's module may be neither), within a node for tp."""
    gpu = hw.kind == "gpu"
    known = getattr(model, "arch", None) is not None
    layers = int(getattr(model, "layers", 0) or 0)
    out = copy.copy(space)
    if out.offload is None:
        out.offload = (False, True) if gpu else (False,)
    if out.recompute is None:
        out.recompute = RECOMPUTE if gpu and known else ("none",)
    if out.tp is None:
        out.tp = [d for d in _divisors(per_node) if d <= 8] if gpu and known else (1,)
    if out.pp is None:
        out.pp = [d for d in _divisors(world) if d <= max(1, layers)] if gpu and known \
            else (1,)
    return out


def candidates(space: Space, *, world: int, global_batch: int, layers: int
               ) -> tuple[list[Candidate], list[Point]]:
    """Every point of ``space`` that keeps the global batch (micro-batch x accumulation x
    data-parallel ranks), and the points that cannot, each with its reason."""
    out: list[Candidate] = []
    dropped: list[Point] = []
    micro_batches = space.micro_batches or _powers_of_two(min(global_batch, MAX_MICRO_BATCH))
    assert space.tp is not None and space.pp is not None
    assert space.offload is not None and space.recompute is not None
    for tp, pp in itertools.product(space.tp, space.pp):
        if world % (tp * pp):
            continue
        dp = world // (tp * pp)
        chunks = [v for v in space.virtual_stages if v == 1 or (pp > 1 and layers >= pp * v)]
        for v, stage, mb in itertools.product(chunks, space.zero_stages, micro_batches):
            if shards_optimizer(stage) and dp == 1:
                continue  # ZeRO shards over data-parallel ranks; with one it is stage 0
            if global_batch % (mb * dp):
                continue
            accumulation = global_batch // (mb * dp)
            if v > 1 and accumulation % pp:
                point = Candidate(stage, mb, accumulation, tp, pp, v)
                dropped.append(Point(point, dropped=f"interleaved 1F1B needs the micro-batches "
                                     f"({accumulation}) to be a multiple of pp {pp}"))
                continue
            if partitions_gradients(stage) and pp > 1:
                continue  # DeepSpeed's pipeline engine runs ZeRO-1 at most
            offloads = space.offload if shards_optimizer(stage) else (False,)
            for offload, recompute, bucket in itertools.product(
                    offloads, space.recompute, space.buckets):
                prefetches: Iterable[int | None] = space.prefetch if partitions_parameters(stage) \
                    else (None,)
                for prefetch in prefetches:
                    out.append(Candidate(stage, mb, accumulation, tp, pp, v, offload,
                                         recompute, bucket, prefetch))
    return out, dropped


def _fit_frontier(ranked: list[Point]) -> None:
    """Marks the points no other beats on both memory and throughput."""
    best_rate = -1.0
    for p in sorted(ranked, key=lambda p: (p.memory_bytes or 0.0,
                                           -(p.prediction.samples_per_s if p.prediction
                                             else 0.0))):
        rate = p.prediction.samples_per_s if p.prediction else 0.0
        if rate > best_rate:
            p.frontier = True
            best_rate = rate


def search(model: str, config: dict[str, Any], *, cluster: str = "this-host", nodes: int = 1,
           devices_per_node: int | None = None, seq_len: int | None = None,
           global_batch: int | None = None, memory_limit_bytes: float | None = None,
           framework: str = "flowtrain", space: Space | None = None) -> TuneResult:
    """Predicts every point of ``space`` for ``model`` (a preset name or "pkg.mod:fn") with
    ``config`` (a ds_config dict: its optimizer, precision and batch) on ``nodes`` nodes of
    ``cluster``; drops what cannot run or does not fit ``memory_limit_bytes`` (default: the
    device's memory), ranks the rest by predicted throughput, best first."""
    hw = load_profile(cluster)
    per_node = devices_per_node or hw.devices_per_node
    if nodes < 1 or per_node < 1:
        raise TuneError(f"nodes and devices per node must be at least 1, got {nodes} and "
                        f"{per_node}")
    world = nodes * per_node
    limit = float(memory_limit_bytes or hw.device_memory_bytes)
    base = validated_config(config, world, "--config")
    batch = global_batch or base.global_batch
    if batch < 1:
        raise TuneError(f"the global batch must be at least 1, got {batch}")
    models: dict[tuple[int, str], ModelSpec] = {}

    def model_for(mb: int) -> ModelSpec:
        key = (mb, base.precision)
        if key not in models:
            models[key] = model_spec(model, seq_len, mb, base.precision)
        return models[key]

    first = model_for(1)
    space = default_space(first, hw, world, per_node, space or Space())
    points, dropped = candidates(space, world=world, global_batch=batch,
                                 layers=int(getattr(first, "layers", 0) or 0))
    if not points and not dropped:
        raise TuneError(f"no configuration keeps the global batch {batch} on {world} ranks: "
                        f"it must be a multiple of the data-parallel ranks")
    ranked: list[Point] = []
    for c in points:
        point = Point(c)
        try:
            layout = make_layout(nodes, per_node, c.tp, c.pp)
            cfg = validated_config(c.ds_config(config), layout.dp, c.label())
            point.prediction = predict(model_for(c.micro_batch), cfg, layout, hw,
                                       cluster=cluster, options=c.options(first, framework))
        except (SimulateError, ValueError) as exc:
            point.dropped = str(exc).splitlines()[0]
            dropped.append(point)
            continue
        need = point.memory_bytes
        if need is not None and need > limit:
            point.dropped = f"needs {need / 2**30:.2f} GiB of the {limit / 2**30:.2f} GiB a " \
                            f"device has"
            dropped.append(point)
            continue
        ranked.append(point)
    ranked.sort(key=lambda p: -(p.prediction.samples_per_s if p.prediction else 0.0))
    _fit_frontier(ranked)
    result = TuneResult(model, cluster, nodes, per_node, batch, limit, ranked, dropped, config)
    if not ranked:
        closest = min((p for p in dropped if p.memory_bytes), default=None,
                      key=lambda p: p.memory_bytes or math.inf)
        why = f"; the smallest needs {closest.memory_bytes / 2**30:.2f} GiB" \
            if closest is not None and closest.memory_bytes else ""
        raise TuneError(f"none of the {len(dropped)} configurations of {model} fits "
                        f"{limit / 2**30:.2f} GiB per device on {world} ranks{why}: add nodes, "
                        f"lower the global batch, or allow offload")
    return result


def largest_micro_batch(result: TuneResult, *, seq_len: int | None = None,
                        framework: str = "flowtrain") -> int:
    """The largest power-of-two micro-batch (accumulation 1) of the best point's configuration
    the simulator predicts to fit the memory limit."""
    hw = load_profile(result.cluster)
    c = result.best.candidate
    layout = make_layout(result.nodes, result.devices_per_node, c.tp, c.pp)
    fits = 0
    for mb in _powers_of_two(MAX_MICRO_BATCH):
        trial = c.alone(mb)
        cfg = validated_config(trial.ds_config(result.base_config), layout.dp, trial.label())
        model = model_spec(result.model, seq_len, mb, cfg.precision)
        p = predict(model, cfg, layout, hw, cluster=result.cluster,
                    options=trial.options(model, framework))
        if p.peak_memory_bytes is not None and p.peak_memory_bytes > result.memory_limit_bytes:
            break
        fits = mb
    return fits
