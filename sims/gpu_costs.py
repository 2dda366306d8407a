"""Seconds of a transformer's ops (``sims.layer_ops``) and of NCCL collectives on a GPU, from
the profile's kernel figures (``sims.gpu_kernels``).

- A GEMM runs as output tiles on the SMs in waves: cuBLAS picks the tile that wastes least (its
  last wave partly idle, its edge tiles partly empty); the full-wave rate is the measured
  fraction of peak, shortened by the inner dimension's fixed prologue/epilogue; memory traffic
  bounds it from below (roofline), and every kernel costs a fixed overhead.
- Flash attention runs at its measured rate for the sequence length and head dim.
- A memory-bound op streams its bytes at the achieved HBM bandwidth.
- A collective inside a node moves its bus bytes at the measured bus bandwidth for its size;
  across nodes it is hierarchical (reduce-scatter in the node, a ring or tree over the nodes on
  each rank's shard at the NICs' achieved rate, all-gather in the node), and NCCL picks the
  ring or the tree, whichever has the lower latency.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from sims.gpu_kernels import GpuKernels
from sims.layer_ops import Attention, Gemm, Op, Stream

PRECISION_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


def _curve(points: tuple[tuple[float, float], ...], x: float, log_y: bool = False) -> float:
    """Linear in log(x) between points (log-log when ``log_y``), clamped at the ends."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            if log_y:
                return math.exp(math.log(y0) + t * (math.log(y1) - math.log(y0)))
            return y0 + t * (y1 - y0)
    return points[-1][1]


def gemm_fraction(m: int, n: int, k: int, kern: GpuKernels, dtype: str, batch: int = 1
                  ) -> float:
    """The fraction of peak ``batch`` (m x k) @ (k x n) GEMMs launched together reach: the
    best tile's useful share of the waves they fill, times the full-wave rate, times the inner
    dimension's share."""
    best = 0.0
    for tm, tn in kern.gemm_tiles:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / kern.sms)
        best = max(best, batch * m * n / (waves * kern.sms * tm * tn))
    if dtype not in kern.gemm_efficiency:
        raise ValueError(f"the hardware profile has no GEMM efficiency for {dtype}; it has "
                         f"{', '.join(sorted(kern.gemm_efficiency))}")
    return kern.gemm_efficiency[dtype] * best * k / (k + kern.gemm_k_overhead)


def gemm_seconds(g: Gemm, dtype: str, peaks: dict[str, float], hbm: float,
                 kern: GpuKernels) -> float:
    """``g`` (its ``count`` GEMMs one batched launch) with ``dtype`` operands: its math at the
    fraction of the dtype's peak its shape reaches, or its operands' and results' traffic,
    whichever is longer, plus one kernel's overhead."""
    if dtype not in peaks:
        raise ValueError(f"the hardware profile has no peak FLOP/s for {dtype}; it has "
                         f"{', '.join(sorted(peaks))}")
    math_s = g.flops / (peaks[dtype] * gemm_fraction(g.m, g.n, g.k, kern, dtype, g.count))
    elem = PRECISION_BYTES.get(dtype, 2)
    memory_s = g.count * (g.m * g.k + g.k * g.n + g.m * g.n) * elem / \
        (hbm * kern.memory_efficiency)
    return max(math_s, memory_s) + kern.kernel_overhead_s


def attention_fraction(a: Attention, kernel: str, kern: GpuKernels) -> float:
    """The measured fraction of peak of ``kernel`` at this sequence length, from the curve of
    the nearest head dim the profile has."""
    by_dim = kern.attention.get(kernel)
    if by_dim is None:
        raise ValueError(f"the hardware profile has no {kernel!r} attention figures; it has "
                         f"{', '.join(sorted(kern.attention))}")
    dim = min(by_dim, key=lambda d: (abs(math.log(d / a.head_dim)), -d))
    return _curve(by_dim[dim], a.keys)


def stream_seconds(s: Stream, hbm: float, kern: GpuKernels) -> float:
    return s.bytes / (hbm * kern.memory_efficiency) + kern.kernel_overhead_s


def ops_seconds(ops: Iterable[Op], *, dtype: str, peaks: dict[str, float], hbm: float,
                kern: GpuKernels, attention: str, gemm_dtype: str | None = None) -> float:
    """The ops one after another on one GPU: activations and attention in ``dtype``, GEMM
    operands in ``gemm_dtype`` (fp8 training) or the same."""
    total = 0.0
    for op in ops:
        if isinstance(op, Gemm):
            total += gemm_seconds(op, gemm_dtype or dtype, peaks, hbm, kern)
        elif isinstance(op, Attention):
            if op.flash:
                rate = peaks[dtype] * attention_fraction(op, attention, kern)
                total += op.flops / rate + kern.kernel_overhead_s
            else:
                # unfused: the score and context products are batched GEMMs per head
                per_head = Gemm(op.label, op.seq, op.keys, op.head_dim, op.batch_heads)
                share = op.flops / (4.0 * op.batch_heads * op.seq * op.keys * op.head_dim)
                total += 2 * share * gemm_seconds(per_head, dtype, peaks, hbm, kern)
        else:
            total += stream_seconds(op, hbm, kern)
    return total


# ----------------------------------------------------------------------------- collectives

def bus_factor(op: str, n: int) -> float:
    """Bus bytes per buffer byte (nccl-tests' busbw factor)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    return 1.0


def intra_node_seconds(op: str, nbytes: float, ranks: int, kern: GpuKernels) -> float:
    """One collective over ``ranks`` GPUs of a node at the measured bus bandwidth for the
    buffer's size (broadcast moves as an all-gather's bytes would)."""
    if ranks == 1 or nbytes <= 0:
        return 0.0
    curve = kern.collectives["all_gather" if op == "broadcast" else op]
    busbw = _curve(curve, nbytes, log_y=True)
    return nbytes * bus_factor(op, ranks) / busbw


def inter_node_seconds(op: str, shard: float, nodes: int, nic_bandwidth: float,
                       kern: GpuKernels) -> float:
    """The inter-node part of a hierarchical collective: each rank's ``shard`` over ``nodes``
    nodes at its NIC's achieved rate; latency of NCCL's ring (a step per node and phase) or
    tree (logarithmic in nodes), whichever is lower."""
    if nodes == 1 or shard <= 0:
        return 0.0
    phases = 2 if op == "all_reduce" else 1
    ring = phases * (nodes - 1) * kern.network_step_latency_s
    tree = phases * math.ceil(math.log2(nodes)) * kern.network_step_latency_s
    latency = kern.collective_base_latency_s + (min(ring, tree) if op == "all_reduce" else ring)
    return latency + shard * bus_factor(op, nodes) / (nic_bandwidth * kern.network_efficiency)


def collective_seconds(op: str, nbytes: float, ranks: int, nodes: int, nic_bandwidth: float,
                       kern: GpuKernels) -> float:
    """One NCCL collective of an ``nbytes`` buffer over ``ranks`` GPUs on ``nodes`` nodes
    (the same number on each); ``nic_bandwidth`` is one rank's share of its node's network."""
    if ranks == 1 or nbytes <= 0:
        return 0.0
    if nodes == 1:
        return intra_node_seconds(op, nbytes, ranks, kern)
    per_node = ranks // nodes
    shard = nbytes / per_node
    across = inter_node_seconds("all_gather" if op == "broadcast" else op, shard, nodes,
                                nic_bandwidth, kern)
    scatter = intra_node_seconds("reduce_scatter", nbytes, per_node, kern)
    gather = intra_node_seconds("all_gather", nbytes, per_node, kern)
    if op == "all_reduce":
        return scatter + across + gather
    if op == "reduce_scatter":
        return scatter + across
    return across + gather  # all_gather; broadcast: to a rank of each node, then inside


def collective_algorithm(ranks: int, nodes: int) -> str:
    """How ``collective_seconds`` moves a group's all-reduce, in words (``--explain``)."""
    if ranks == 1:
        return "no collective (one rank)"
    if nodes == 1:
        return "one node: NVLink at the measured bus bandwidth for the message size"
    across = "tree" if math.ceil(math.log2(nodes)) < nodes - 1 else "ring"
    if ranks == nodes:
        return (f"one rank per node: a {across} over {nodes} nodes through its NIC (NCCL's "
                f"lower-latency choice)")
    return (f"hierarchical: reduce-scatter in the node, {across} over {nodes} nodes on each "
            f"rank's shard (NCCL's lower-latency choice), all-gather in the node")
