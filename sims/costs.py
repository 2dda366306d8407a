"""Cost functions of the simulator: seconds for compute, collectives, copies and optimizer
passes on a HardwareProfile (roofline with an efficiency curve; ring and hierarchical
collectives; fitted per-op links from calibration take precedence).
"""

from __future__ import annotations

import bisect
import math

from sims.hardware import COLLECTIVE_OPS, Curve, HardwareProfile, Link, ProfileError

# Adam over fp32 state as one streaming pass: reads parameter, gradient, exp_avg, exp_avg_sq
# (4 x 4 B) and writes parameter, exp_avg, exp_avg_sq back (3 x 4 B).
ADAM_BYTES_PER_PARAM = 28.0


def _check_size(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


# ----------------------------------------------------------------------------- compute

def efficiency_at(flops: float, hw: HardwareProfile) -> float:
    """Fraction of peak reached by an op of ``flops``: linear in log(FLOPs) between the
    curve's points, clamped to the first and last point (small ops cannot go lower, large ones
    no higher, than what was published or measured)."""
    return curve_at(hw.efficiency, flops)


def curve_at(curve: Curve, flops: float) -> float:
    """A (FLOPs, value) curve's value at ``flops``: linear in log(FLOPs) between points,
    clamped to the first and last point."""
    if flops <= curve[0][0]:
        return curve[0][1]
    if flops >= curve[-1][0]:
        return curve[-1][1]
    xs = [f for f, _ in curve]
    i = bisect.bisect_right(xs, flops)
    (f0, e0), (f1, e1) = curve[i - 1], curve[i]
    t = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
    return e0 + t * (e1 - e0)


def compute_seconds(flops: float, bytes_moved: float, dtype: str, hw: HardwareProfile) -> float:
    """Roofline: the op takes as long as the slower of its math (at the size-dependent fraction
    of peak) and its memory traffic."""
    _check_size("flops", flops)
    _check_size("bytes_moved", bytes_moved)
    if dtype not in hw.peak_flops:
        raise ValueError(f"hardware profile {hw.name!r} has no peak FLOP/s for dtype {dtype!r}; "
                         f"it has: {', '.join(sorted(hw.peak_flops))}")
    math_s = flops / (hw.peak_flops[dtype] * efficiency_at(flops, hw)) if flops else 0.0
    return max(math_s, bytes_moved / hw.memory_bandwidth)


def rank_threads(ranks_per_node: int, hw: HardwareProfile) -> int:
    """Torch threads of one rank: ``flowtrain launch`` gives each of ``ranks_per_node`` ranks
    cores // ranks (at least one). On a CPU profile a device is a core."""
    _check_count("ranks_per_node", ranks_per_node)
    return max(1, hw.devices_per_node // ranks_per_node)


def pass_seconds(kind: str, flops: float, threads: int, hw: HardwareProfile,
                 weight_bytes: float | None = None) -> float:
    """One module's forward or backward on a calibrated CPU host (``hw.engine``): its FLOPs at
    the measured rate of an ``nn.Linear`` of that size with ``threads`` threads. Below the
    smallest measured op the time stays that op's: a module call costs at least its Python and
    autograd overhead, however few FLOPs it does. With ``weight_bytes`` (the module's
    weights), corrected by the calibrated cost of weights beyond the curve's own shapes'."""
    if hw.engine is None:
        raise ValueError(f"hardware profile {hw.name!r} has no engine costs (a CPU host "
                         "calibrated by `flowtrain calibrate` has them)")
    _check_size("flops", flops)
    curve = hw.engine.threads_curve(threads, kind)
    smallest, rate = curve[0]
    base = smallest / rate if flops <= smallest else flops / curve_at(curve, flops)
    if weight_bytes is None:
        return base
    # a layer with more weights than the curve's shapes had at these FLOPs (fewer rows) runs
    # slower, one with less faster; never below half the curve's time
    forward_flops = flops if kind == "forward" else flops / 2
    extra = hw.engine.weight_seconds(threads, kind, forward_flops, weight_bytes)
    return max(0.5 * base, base + extra)


def compute_slowdown(ranks_per_node: int, hw: HardwareProfile, memory: bool = False) -> float:
    """How much slower each rank works when ``ranks_per_node`` ranks work at once on a CPU
    host, for compute-bound work or (``memory``) work bound by memory bandwidth: measured by
    calibration for the rank counts it ran; otherwise the measured figure of the nearest rank
    count scaled by the ratio of oversubscription, threads in use over cores (with no
    measurement, that ratio alone, at least 1). 1 for a single rank and on GPUs."""
    _check_count("ranks_per_node", ranks_per_node)
    if hw.kind != "cpu" or ranks_per_node == 1:
        return 1.0  # a lone rank shares the host with no other rank

    def oversubscribed(n: int) -> float:
        return max(1.0, n * rank_threads(n, hw) / hw.devices_per_node)

    measured: dict[int, float] = {}
    if hw.engine is not None:
        measured = hw.engine.memory_slowdown if memory else hw.engine.slowdown
    if ranks_per_node in measured:
        return measured[ranks_per_node]
    if not measured:
        return oversubscribed(ranks_per_node)
    near = min(measured, key=lambda n: (abs(n - ranks_per_node), n))
    return max(1.0, measured[near] * oversubscribed(ranks_per_node) / oversubscribed(near))


def channel_seconds(op: str, nbytes: float, ranks: int, hw: HardwareProfile) -> float | None:
    """One collective over the engine's shared-memory data channel (CPU ranks of one host), or
    None when the profile has no channel figures for ``op``. A rank count that was not measured
    takes the nearest measured one's latency and its per-byte time scaled by ranks + 1 over
    n + 1 (each rank copies its buffer in once and sums every rank's slot)."""
    _check_op(op)
    _check_size("nbytes", nbytes)
    _check_count("ranks", ranks)
    if ranks == 1 or nbytes == 0:
        return 0.0
    by_ranks = hw.engine.channel.get(op, {}) if hw.engine is not None else {}
    if not by_ranks:
        return None
    if ranks in by_ranks:
        return by_ranks[ranks].seconds(nbytes)
    near = min(by_ranks, key=lambda n: (abs(n - ranks), n))
    link = by_ranks[near]
    return link.latency_s + nbytes / link.bandwidth * (ranks + 1) / (near + 1)


# ----------------------------------------------------------------------------- collectives

def ring_factor(op: str, ranks: int) -> float:
    """Bytes each rank sends per byte of the full buffer (nccl-tests' bus-bandwidth factor)."""
    n = ranks
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0  # broadcast: pipelined along the ring, every rank receives the buffer once


def ring_steps(op: str, ranks: int) -> int:
    """Sequential ring steps, each paying one link latency."""
    return 2 * (ranks - 1) if op == "all_reduce" else ranks - 1


def ring_seconds(op: str, nbytes: float, ranks: int, link: Link) -> float:
    """``steps x latency + factor x bytes / bandwidth`` for a ring over ``link``."""
    if ranks == 1 or nbytes == 0:
        return 0.0
    return ring_steps(op, ranks) * link.latency_s + ring_factor(op, ranks) * nbytes / link.bandwidth


def _check_op(op: str) -> None:
    if op not in COLLECTIVE_OPS:
        raise ValueError(f"unknown collective {op!r}; choices: {', '.join(COLLECTIVE_OPS)}")


def _within_node(op: str, nbytes: float, ranks: int, hw: HardwareProfile) -> float:
    """One node: a calibrated link for exactly this op and rank count wins over the ring."""
    if ranks == 1 or nbytes == 0:
        return 0.0
    fitted = hw.collectives.get(op, {}).get(ranks)
    if fitted is not None:
        return fitted.seconds(nbytes)
    return ring_seconds(op, nbytes, ranks, hw.intra_node)


def collective_seconds(op: str, nbytes: float, ranks: int, hw: HardwareProfile,
                       nodes: int = 1) -> float:
    """Time of one collective over ``ranks`` ranks spread evenly over ``nodes`` nodes.
    ``nbytes`` is the full buffer: the all-reduced tensor, the reduce-scatter input, the
    all-gather output, the broadcast tensor.

    Across nodes it is hierarchical, as NCCL does on rail-optimised clusters: reduce-scatter
    inside each node, the inter-node ring on each rank's 1/ranks_per_node shard (all ranks of a
    node run their rings at once, each on its share of the node's network bandwidth), then
    all-gather inside each node."""
    _check_op(op)
    _check_size("nbytes", nbytes)
    _check_count("ranks", ranks)
    _check_count("nodes", nodes)
    if ranks % nodes:
        raise ValueError(f"ranks ({ranks}) must be a multiple of nodes ({nodes}): the model "
                         f"puts the same number of ranks on every node")
    if nodes == 1:
        return _within_node(op, nbytes, ranks, hw)
    per_node = ranks // nodes
    shard = nbytes / per_node
    # One NIC per device (rail-optimised); more ranks than devices share them.
    nic = Link(hw.inter_node.latency_s,
               hw.inter_node.bandwidth / max(per_node, hw.devices_per_node))
    if op == "all_reduce":
        return (_within_node("reduce_scatter", nbytes, per_node, hw)
                + ring_seconds("all_reduce", shard, nodes, nic)
                + _within_node("all_gather", nbytes, per_node, hw))
    if op == "reduce_scatter":
        return (_within_node("reduce_scatter", nbytes, per_node, hw)
                + ring_seconds("reduce_scatter", shard, nodes, nic))
    if op == "all_gather":
        return (ring_seconds("all_gather", shard, nodes, nic)
                + _within_node("all_gather", nbytes, per_node, hw))
    # broadcast: to one rank of every node over the network, then inside each node.
    return ring_seconds("broadcast", nbytes, nodes, nic) + _within_node(op, nbytes, per_node, hw)


# ----------------------------------------------------------------------------- transfers

def p2p_seconds(nbytes: float, hw: HardwareProfile, inter_node: bool) -> float:
    """One send between two ranks (pipeline activations): over the intra-node link, or over one
    device's share of the node's network bandwidth."""
    _check_size("nbytes", nbytes)
    if nbytes == 0:
        return 0.0
    if not inter_node:
        # a calibrated host's own send (header + tensor over gloo), else the ring's link
        if hw.engine is not None and hw.engine.p2p is not None:
            return hw.engine.p2p.seconds(nbytes)
        return hw.intra_node.seconds(nbytes)
    per_device = hw.inter_node.bandwidth / hw.devices_per_node
    return hw.inter_node.latency_s + nbytes / per_device


def copy_seconds(nbytes: float, hw: HardwareProfile) -> float:
    """One host<->device copy (offload traffic) over the host link."""
    _check_size("nbytes", nbytes)
    return hw.host_to_device.seconds(nbytes) if nbytes else 0.0


def optimizer_seconds(numel: int, hw: HardwareProfile, on_host: bool = False, *,
                      bytes_per_param: float = ADAM_BYTES_PER_PARAM, calls: int = 1,
                      memory_slowdown: float = 1.0) -> float:
    """Adam over ``numel`` parameters as a memory-bound pass: its arithmetic intensity (about
    a dozen FLOPs per 28 bytes) is far below any ridge point. ``on_host`` runs it in host DRAM
    (offload_optimizer: cpu), at the device's share of the host memory bandwidth. A calibrated
    CPU host (``hw.engine``) uses the engine's own fused kernel as measured, which also costs a
    fixed time per call: ``calls`` is how many tensors the engine steps one by one, and
    ``memory_slowdown`` stretches its streaming where other ranks stream memory at the same
    time."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an integer >= 0, got {numel!r}")
    _check_size("bytes_per_param", bytes_per_param)
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 0:
        raise ValueError(f"calls must be an integer >= 0, got {calls!r}")
    if hw.engine is not None:
        kernel = hw.engine.optimizer
        return calls * kernel.latency_s + numel * bytes_per_param / kernel.bandwidth * \
            memory_slowdown
    bandwidth = hw.memory_bandwidth
    if on_host and hw.kind != "cpu":
        if hw.host_memory_bandwidth <= 0:
            raise ProfileError(f"hardware profile {hw.name!r} has no host_memory_bandwidth, "
                               "needed for an optimizer step on the host; add it to the profile")
        bandwidth = hw.host_memory_bandwidth
    return numel * bytes_per_param / bandwidth
