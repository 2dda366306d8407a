"""The engine section of a calibrated CPU host's profile: what flowtrain's own work costs there
(``EngineCosts``), with its checks and JSON reading."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from sims.profile_fields import (
    Curve,
    Link,
    ProfileError,
    check_curve,
    check_fields,
    check_int,
    check_number,
    count_keys,
    link_from,
)

PASS_KINDS = ("forward", "backward")
_ENGINE_REQUIRED = ("pass_rates", "optimizer")
_ENGINE_OPTIONAL = ("slowdown", "memory_slowdown", "channel", "channel_interference",
                    "channel_slowdown", "p2p",
                    "factors", "pipeline_op_s", "pipeline_message_s", "op_costs", "weight_cost",
                    "pass_weights")
# Classes of a forward's other ops (flowtrain.profiling.census.OP_CLASSES) and attention, each
# priced per call and per element (attention: per FLOP).
OP_COST_CLASSES = ("view", "elementwise", "activation", "norm", "softmax", "embedding",
                   "attention")
ENGINE_FACTOR_KINDS = ("forward", "forward_s", "backward", "backward_s", "optimizer",
                       "micro_batch_s", "step_s", "gloo_s", "zero3_fetch_s", "zero3_backward_s",
                       "bucket_s", "reduce_s")


@dataclass(frozen=True)
class EngineCosts:
    """What flowtrain's own work costs on a calibrated CPU host, measured by ``flowtrain
    calibrate`` running the engine's pieces rather than bare kernels: on a CPU a forward or
    backward is many small ops with Python and autograd in between, the data-parallel reduce
    goes over the engine's shared-memory channel (not gloo), and several ranks share the
    cores, so peak matmul rates alone predict steps far shorter than they run.

    ``pass_rates[threads][kind]``: FLOP/s of one ``nn.Linear`` forward or backward (with the
    engine's gradient-bucket hooks) by the op's FLOPs, at that many torch threads per rank.
    ``slowdown[ranks]``: how much slower each rank computes when ``ranks`` ranks compute at
    once on this host (cores shared); ``memory_slowdown[ranks]``: the same for work bound by
    memory bandwidth, which every core shares (the optimizer, zeroing gradients).
    ``channel[op][ranks]``: the
    shared-memory data channel's all_reduce / reduce_scatter. ``channel_interference``: the
    fraction of a channel collective's time that its summing takes from the rank's compute,
    and ``channel_slowdown`` how much longer the collective takes while the rank computes.
    ``p2p``: one pipeline send (gloo isend/irecv of a header and a tensor). ``optimizer``:
    the engine's fused Adam kernel, ``latency_s`` per call and ``bandwidth`` in bytes/s of
    its 28-byte-per-parameter pass. ``factors[ranks]``: what a launched engine job on
    ``ranks`` ranks (``sims.calibrate.job``) showed: how much longer its forwards and its
    backwards took than these isolated measurements predict (``forward``, ``backward``:
    factors; the engine's own threads, the launcher, OpenMP threads that do not all get a
    core; a backward also shares the cores with the reduces it starts) plus what the engine's
    other work takes from each step's forwards and backwards whatever their size
    (``forward_s``, ``backward_s``), the optimizer's factor, the time between a micro-batch's
    forward and backward (``micro_batch_s``: the loss, the engine's backward entry), what each
    step spends outside its passes, reduces and optimizer (``step_s``: the reducer's flush,
    the step's bookkeeping), and how much longer a gloo collective takes beside a live engine
    than between bare ranks (``gloo_s``); with ZeRO stage 3, what each module use that the
    hooks hand to the parameter fetcher takes in a forward beyond its gather and compute
    (``zero3_fetch_s``: the hand-off to the fetcher's actor and back, attaching the gathered
    buffer) and what each partitioned module adds to a backward (``zero3_backward_s``: its
    hooks, the release once its gradients have landed); from a run with small buckets, what
    handing each full bucket to the reducer adds to a backward (``bucket_s``) and what each
    reduce takes beyond its channel or collective (``reduce_s``). ``pipeline_op_s``: what a
    pipeline stage spends between its instructions, outside any span (the engine's bookkeeping
    around each pass), and ``pipeline_message_s`` what delivering each activation or gradient
    message takes beyond the calibrated send (the hand-offs to and from the stage's sender and
    receiver threads), both from a launched pipeline job.
    ``op_costs[threads][class][kind]``: a forward's ops besides its matmuls (norms,
    activations, residual adds, softmax, embedding lookups, views; ``OP_COST_CLASSES``), each
    class's forward and backward as ``latency_s`` per call plus elements over ``bandwidth``
    (elements/s; attention: FLOPs over FLOP/s), timed op by op at that many threads.
    ``weight_cost[threads][kind]``: seconds per byte of a Linear's weights beyond what the
    pass curve's own shapes had at that many FLOPs (``pass_weights``: (forward FLOPs, weight
    bytes) of the measured pass shapes): layers of equal FLOPs run slower the larger their
    weights (fewer rows: the weights are streamed from memory for less work)."""

    pass_rates: dict[int, dict[str, Curve]]
    optimizer: Link
    slowdown: dict[int, float] = field(default_factory=dict)
    memory_slowdown: dict[int, float] = field(default_factory=dict)
    channel: dict[str, dict[int, Link]] = field(default_factory=dict)
    channel_interference: float = 1.0
    p2p: Link | None = None
    factors: dict[int, dict[str, float]] = field(default_factory=dict)
    pipeline_op_s: float = 0.0
    pipeline_message_s: float = 0.0
    op_costs: dict[int, dict[str, dict[str, Link]]] = field(default_factory=dict)
    weight_cost: dict[int, dict[str, float]] = field(default_factory=dict)
    pass_weights: tuple[tuple[float, float], ...] = ()
    channel_slowdown: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.pass_rates, dict):  # hand-written curves may use lists
            for kinds in self.pass_rates.values():
                if isinstance(kinds, dict):
                    for kind, curve in kinds.items():
                        if isinstance(curve, list):
                            kinds[kind] = tuple(tuple(p) if isinstance(p, list) else p
                                                for p in curve)
        validate_engine(self)

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_dict(), sort_keys=True))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (rank and thread counts as string keys)."""
        out: dict[str, Any] = {
            "pass_rates": {str(t): {k: [[f, r] for f, r in curve] for k, curve in kinds.items()}
                           for t, kinds in sorted(self.pass_rates.items())},
            "optimizer": self.optimizer.to_dict(),
            "slowdown": {str(n): x for n, x in sorted(self.slowdown.items())},
            "memory_slowdown": {str(n): x for n, x in sorted(self.memory_slowdown.items())},
            "channel": {op: {str(n): link.to_dict() for n, link in sorted(by_ranks.items())}
                        for op, by_ranks in self.channel.items()},
            "channel_interference": self.channel_interference,
            "channel_slowdown": self.channel_slowdown,
        }
        if self.p2p is not None:
            out["p2p"] = self.p2p.to_dict()
        if self.factors:
            out["factors"] = {str(n): dict(f) for n, f in sorted(self.factors.items())}
        if self.pipeline_op_s:
            out["pipeline_op_s"] = self.pipeline_op_s
        if self.pipeline_message_s:
            out["pipeline_message_s"] = self.pipeline_message_s
        if self.weight_cost:
            out["weight_cost"] = {str(t): dict(k) for t, k in sorted(self.weight_cost.items())}
        if self.pass_weights:
            out["pass_weights"] = [[f, b] for f, b in self.pass_weights]
        if self.op_costs:
            out["op_costs"] = {str(t): {c: {k: link.to_dict() for k, link in kinds.items()}
                                        for c, kinds in classes.items()}
                               for t, classes in sorted(self.op_costs.items())}
        return out

    def weight_seconds(self, threads: int, kind: str, forward_flops: float,
                       weight_bytes: float) -> float:
        """What a Linear of ``weight_bytes`` of weights and ``forward_flops`` takes beyond the
        pass curve's time (negative: less), at the most measured threads up to ``threads``."""
        if not self.weight_cost or not self.pass_weights:
            return 0.0
        known = sorted(self.weight_cost)
        below = [t for t in known if t <= threads]
        per_byte = self.weight_cost[below[-1] if below else known[0]].get(kind, 0.0)
        points = self.pass_weights
        if forward_flops <= points[0][0]:
            reference = points[0][1]
        elif forward_flops >= points[-1][0]:
            reference = points[-1][1]
        else:  # log-linear between the measured shapes
            i = next(i for i, (f, _) in enumerate(points) if f >= forward_flops)
            (f0, b0), (f1, b1) = points[i - 1], points[i]
            t = (math.log(forward_flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
            reference = math.exp(math.log(b0) + t * (math.log(b1) - math.log(b0)))
        return per_byte * (weight_bytes - reference)

    def op_seconds(self, threads: int, kind: str, census: Any) -> float:
        """Seconds of ``kind`` (forward or backward) for a census of ops: ``(class, calls,
        elements)`` triples (attention: calls and FLOPs). Costs measured at ``threads``
        threads, else at the most threads measured below it; a class never measured costs
        nothing (a profile from before op costs were calibrated)."""
        if not self.op_costs:
            return 0.0
        known = sorted(self.op_costs)
        below = [t for t in known if t <= threads]
        classes = self.op_costs[below[-1] if below else known[0]]
        total = 0.0
        for cls, calls, elements in census:
            link = classes.get(cls, {}).get(kind)
            if link is not None:
                total += calls * link.latency_s + elements / link.bandwidth
        return total

    def factor(self, ranks: int, kind: str) -> float:
        """What the launched job showed of ``kind`` for ``ranks`` ranks per host: the measured
        figure, else the nearest rank count's, else none (a multiplier of 1, 0 seconds)."""
        known = [n for n, f in self.factors.items() if kind in f]
        if not known:
            return 0.0 if kind.endswith("_s") else 1.0
        near = min(known, key=lambda n: (abs(n - ranks), n))
        return self.factors[near][kind]

    def threads_curve(self, threads: int, kind: str) -> Curve:
        """The pass curve measured at ``threads`` threads, else at the most threads measured
        below it (more threads than measured are not assumed to help)."""
        known = sorted(self.pass_rates)
        below = [t for t in known if t <= threads]
        return self.pass_rates[below[-1] if below else known[0]][kind]


def validate_engine(e: EngineCosts) -> None:
    """Range checks of the engine section; messages name the field under 'engine.'."""
    if not isinstance(e.pass_rates, dict) or not e.pass_rates:
        raise ProfileError("field 'engine.pass_rates' must map thread counts to forward and "
                           f"backward curves, got {e.pass_rates!r}")
    for threads, kinds in e.pass_rates.items():
        check_int("engine.pass_rates thread count", threads, 1)
        if not isinstance(kinds, dict) or set(kinds) != set(PASS_KINDS):
            raise ProfileError(f"field 'engine.pass_rates.{threads}' must have exactly "
                               f"{', '.join(PASS_KINDS)} curves, got {kinds!r}")
        for kind, curve in kinds.items():
            check_curve(f"engine.pass_rates.{threads}.{kind}", curve, maximum=None)
    if not isinstance(e.optimizer, Link):
        raise ProfileError(f"field 'engine.optimizer' must be a Link, got {e.optimizer!r}")
    for name in ("slowdown", "memory_slowdown"):
        for ranks, factor in getattr(e, name).items():
            check_int(f"engine.{name} rank count", ranks, 1)
            check_number(f"engine.{name}.{ranks}", factor, minimum=0.0, strict=True)
    for op, by_ranks in e.channel.items():
        if op not in ("all_reduce", "reduce_scatter"):
            raise ProfileError(f"field 'engine.channel' has unknown op {op!r}; the shared-memory "
                               "channel does all_reduce and reduce_scatter")
        for ranks, link in by_ranks.items():
            check_int(f"engine.channel.{op} rank count", ranks, 2)
            if not isinstance(link, Link):
                raise ProfileError(f"field 'engine.channel.{op}.{ranks}' must be a Link, "
                                   f"got {link!r}")
    check_number("engine.channel_interference", e.channel_interference, minimum=0.0,
                  maximum=1.0)
    check_number("engine.channel_slowdown", e.channel_slowdown, minimum=1.0)
    if e.p2p is not None and not isinstance(e.p2p, Link):
        raise ProfileError(f"field 'engine.p2p' must be a Link, got {e.p2p!r}")
    check_number("engine.pipeline_op_s", e.pipeline_op_s, minimum=0.0)
    check_number("engine.pipeline_message_s", e.pipeline_message_s, minimum=0.0)
    _check_count_table("factors", e.factors, "rank", ENGINE_FACTOR_KINDS,
                       f"some of {', '.join(ENGINE_FACTOR_KINDS)} to numbers",
                       strict=lambda kind: not kind.endswith("_s"))
    _check_count_table("weight_cost", e.weight_cost, "thread", PASS_KINDS,
                       f"{' and '.join(PASS_KINDS)} to seconds per byte",
                       strict=lambda kind: False)
    if e.pass_weights:
        check_curve("engine.pass_weights", e.pass_weights, maximum=None)
    for threads, classes in e.op_costs.items():
        check_int("engine.op_costs thread count", threads, 1)
        for cls, links in classes.items():
            if cls not in OP_COST_CLASSES:
                raise ProfileError(f"field 'engine.op_costs.{threads}' has unknown op class "
                                   f"{cls!r}; valid classes: {', '.join(OP_COST_CLASSES)}")
            for kind, op_link in links.items():
                if kind not in PASS_KINDS or not isinstance(op_link, Link):
                    raise ProfileError(f"field 'engine.op_costs.{threads}.{cls}' maps "
                                       f"{' and '.join(PASS_KINDS)} to links, got {kind!r}: "
                                       f"{op_link!r}")


def _op_costs_from(d: Any) -> dict[int, dict[str, dict[str, Link]]]:
    out: dict[int, dict[str, dict[str, Link]]] = {}
    for threads, classes in count_keys("engine.op_costs", d).items():
        if not isinstance(classes, dict):
            raise ProfileError(f"field 'engine.op_costs.{threads}' must map op classes to "
                               f"forward and backward links, got {classes!r}")
        out[threads] = {}
        for cls, kinds in classes.items():
            if not isinstance(kinds, dict):
                raise ProfileError(f"field 'engine.op_costs.{threads}.{cls}' must map forward "
                                   f"and backward to links, got {kinds!r}")
            out[threads][cls] = {k: link_from(f"engine.op_costs.{threads}.{cls}.{k}", v)
                                 for k, v in kinds.items()}
    return out


def _check_count_table(name: str, table: dict[int, Any], count: str, kinds: tuple[str, ...],
                       what: str, strict: Any) -> None:
    """``engine.<name>``: rank or thread counts mapping some of ``kinds`` to numbers >= 0
    (> 0 where ``strict(kind)``)."""
    for n, by_kind in table.items():
        check_int(f"engine.{name} {count} count", n, 1)
        if not isinstance(by_kind, dict) or not set(by_kind) <= set(kinds):
            raise ProfileError(f"field 'engine.{name}.{n}' maps {what}, got {by_kind!r}")
        for kind, value in by_kind.items():
            check_number(f"engine.{name}.{n}.{kind}", value, minimum=0.0, strict=strict(kind))


def engine_from(d: Any) -> EngineCosts:
    if not isinstance(d, dict):
        raise ProfileError(f"field 'engine' must be an object, got {d!r}")
    check_fields(d, _ENGINE_REQUIRED, _ENGINE_OPTIONAL, prefix="engine.")
    rates: dict[int, dict[str, Curve]] = {}
    for threads, kinds in count_keys("engine.pass_rates", d["pass_rates"]).items():
        if not isinstance(kinds, dict):
            raise ProfileError(f"field 'engine.pass_rates.{threads}' must be an object, "
                               f"got {kinds!r}")
        rates[threads] = {k: tuple(tuple(p) if isinstance(p, list) else p for p in curve)
                          if isinstance(curve, list) else curve for k, curve in kinds.items()}
    channel_in = d.get("channel", {})
    if not isinstance(channel_in, dict):
        raise ProfileError(f"field 'engine.channel' must be an object, got {channel_in!r}")
    channel = {op: {n: link_from(f"engine.channel.{op}.{n}", link)
                    for n, link in count_keys(f"engine.channel.{op}", by_ranks).items()}
               for op, by_ranks in channel_in.items()}
    return EngineCosts(
        pass_rates=rates, optimizer=link_from("engine.optimizer", d["optimizer"]),
        slowdown=count_keys("engine.slowdown", d.get("slowdown", {})),
        memory_slowdown=count_keys("engine.memory_slowdown", d.get("memory_slowdown", {})),
        channel=channel,
        channel_interference=d.get("channel_interference", 1.0),
        channel_slowdown=d.get("channel_slowdown", 1.0),
        p2p=link_from("engine.p2p", d["p2p"]) if d.get("p2p") is not None else None,
        factors=count_keys("engine.factors", d.get("factors", {})),
        pipeline_op_s=d.get("pipeline_op_s", 0.0),
        pipeline_message_s=d.get("pipeline_message_s", 0.0),
        op_costs=_op_costs_from(d.get("op_costs", {})),
        weight_cost=count_keys("engine.weight_cost", d.get("weight_cost", {})),
        pass_weights=tuple(tuple(p) if isinstance(p, list) else p
                           for p in d.get("pass_weights", ())))
