"""Cost functions of the simulator: seconds for compute, collectives, copies and optimizer
passes on a HardwareProfile (roofline with an efficiency curve; ring and hierarchical
collectives; fitted per-op links from calibration take precedence).
"""

from __future__ import annotations

import bisect
import math

from sims.hardware import COLLECTIVE_OPS, HardwareProfile, Link, ProfileError

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
    curve = hw.efficiency
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
        return hw.intra_node.seconds(nbytes)
    per_device = hw.inter_node.bandwidth / hw.devices_per_node
    return hw.inter_node.latency_s + nbytes / per_device


def copy_seconds(nbytes: float, hw: HardwareProfile) -> float:
    """One host<->device copy (offload traffic) over the host link."""
    _check_size("nbytes", nbytes)
    return hw.host_to_device.seconds(nbytes) if nbytes else 0.0


def optimizer_seconds(numel: int, hw: HardwareProfile, on_host: bool = False, *,
                      bytes_per_param: float = ADAM_BYTES_PER_PARAM) -> float:
    """Adam over ``numel`` parameters as a memory-bound pass: its arithmetic intensity (about
    a dozen FLOPs per 28 bytes) is far below any ridge point. ``on_host`` runs it in host DRAM
    (offload_optimizer: cpu), at the device's share of the host memory bandwidth."""
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"numel must be an integer >= 0, got {numel!r}")
    _check_size("bytes_per_param", bytes_per_param)
    bandwidth = hw.memory_bandwidth
    if on_host and hw.kind != "cpu":
        if hw.host_memory_bandwidth <= 0:
            raise ProfileError(f"hardware profile {hw.name!r} has no host_memory_bandwidth, "
                               "needed for an optimizer step on the host; add it to the profile")
        bandwidth = hw.host_memory_bandwidth
    return numel * bytes_per_param / bandwidth
