"""A forward's other ops, timed for ``flowtrain calibrate``: norms, activations, residual adds,
softmax, embedding lookups, views and attention, one representative op per cost class of
``flowtrain.profiling.census``, each forward and backward at two sizes and at the thread counts
the launched ranks run with. Fitted per class into ``latency_s`` per call plus elements (for
attention, FLOPs) over ``bandwidth``: the profile's ``engine.op_costs``.

On this project's host these ops took a third of the demo GPT's step, which a matmul-only
model could not see. The representatives are the ops models use most: ``a * b + c`` for
elementwise work (two ops), GELU for activations, LayerNorm, softmax, an embedding lookup with a
gradient for its table, a chain of views and transposes, and causal scaled dot-product
attention.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from sims.engine_costs import OP_COST_CLASSES
from sims.profile_fields import Link

# Elements per call of the two sizes each elementwise class is timed at (rows x WIDTH): one
# dominated by the call, one by the elements, neither a shape of the benchmark models.
OP_SIZES = (24 * 96, 640 * 384)
WIDTH = 96
VIEW_CHAIN = 16  # views per timed call of the view class
EMBEDDING_ROWS = 512  # the looked-up table (its gradient is zeroed whole in each backward)
# (batch x heads, sequence, head dim) of the attention calls timed
ATTENTION_SHAPES = ((6, 48, 24), (6, 192, 24))


def _op(cls: str, elements: int) -> tuple[Callable[[], torch.Tensor], float, int, list[Any]]:
    """The representative op of ``cls`` at about ``elements`` elements per op: (a forward
    returning a tensor, the elements its ops cover together as the census counts them, the ops
    one call counts, the leaves)."""
    rows = max(1, elements // WIDTH)
    x = torch.randn(rows, WIDTH, requires_grad=True)
    if cls == "elementwise":
        b = torch.randn(rows, WIDTH, requires_grad=True)
        c = torch.randn(rows, WIDTH, requires_grad=True)
        return (lambda: x * b + c), 2.0 * x.numel(), 2, [x, b, c]
    if cls == "activation":
        return (lambda: F.gelu(x)), float(x.numel()), 1, [x]
    if cls == "norm":
        norm = torch.nn.LayerNorm(WIDTH)
        return (lambda: norm(x)), float(x.numel()), 1, [x, *norm.parameters()]
    if cls == "softmax":
        return (lambda: F.softmax(x, dim=-1)), float(x.numel()), 1, [x]
    if cls == "embedding":
        table = torch.randn(EMBEDDING_ROWS, WIDTH, requires_grad=True)
        index = torch.randint(0, EMBEDDING_ROWS, (rows,))
        return (lambda: F.embedding(index, table)), float(rows * WIDTH), 1, [table]
    if cls == "view":  # the cost is the call; a gradient flows back through each
        def chain() -> torch.Tensor:
            y = x
            for _ in range(VIEW_CHAIN // 2):
                y = y.unsqueeze(0).squeeze(0)
            return y
        return chain, 0.0, VIEW_CHAIN, [x]
    raise ValueError(f"no representative op for class {cls!r}")


def _attention(shape: tuple[int, int, int]) -> tuple[Callable[[], torch.Tensor], float, int,
                                                      list[Any]]:
    from flowtrain.profiling.census import attention_flops

    q, k, v = (torch.randn(*shape, requires_grad=True) for _ in range(3))
    return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), \
        attention_flops(q, k, v), 1, [q, k, v]


def time_op(forward: Callable[[], torch.Tensor], leaves: Sequence[Any],
            seconds: float) -> tuple[float, float]:
    """Median forward and median backward seconds of one op, each pass timed on its own."""
    y = forward()
    grad = torch.ones_like(y)
    forwards: list[float] = []
    backwards: list[float] = []
    end = time.perf_counter() + seconds
    while len(forwards) < 5 or time.perf_counter() < end:
        start = time.perf_counter()
        y = forward()
        middle = time.perf_counter()
        y.backward(grad)
        backwards.append(time.perf_counter() - middle)
        forwards.append(middle - start)
        for leaf in leaves:
            leaf.grad = None
    return statistics.median(forwards), statistics.median(backwards)


def measure_ops(thread_counts: Sequence[int], seconds_per_point: float,
                rounds: int = 3) -> list[dict[str, Any]]:
    """Each class's op at its two sizes and each thread count, the fastest of ``rounds``
    rounds (other work only lengthens an op): records of (threads, class, calls, size,
    forward_s, backward_s)."""
    from sims.calibrate_engine import least_disturbed

    previous = torch.get_num_threads()
    timed: dict[tuple[int, str, int], list[dict[str, float]]] = {}
    sized: dict[tuple[int, str, int], tuple[float, int]] = {}
    try:
        for _ in range(rounds):
            for threads in sorted(set(thread_counts)):
                torch.set_num_threads(threads)
                for cls in OP_COST_CLASSES:
                    points = ATTENTION_SHAPES if cls == "attention" else OP_SIZES
                    for i, point in enumerate(points):
                        forward, size, calls, leaves = _attention(point) \
                            if cls == "attention" else _op(cls, point)
                        fwd, bwd = time_op(forward, leaves, seconds_per_point / rounds)
                        timed.setdefault((threads, cls, i), []).append(
                            {"forward_s": fwd, "backward_s": bwd})
                        sized[(threads, cls, i)] = (size, calls)
    finally:
        torch.set_num_threads(previous)
    records = []
    for key, runs in timed.items():
        threads, cls, _ = key
        size, calls = sized[key]
        records.append({"threads": threads, "class": cls, "calls": calls, "size": size,
                        **least_disturbed(runs, ("forward_s", "backward_s"))})
    return records


def fit_op_costs(records: Sequence[dict[str, Any]]
                 ) -> dict[int, dict[str, dict[str, Link]]]:
    """Per thread count, class and pass: the line through the class's two sizes, seconds =
    calls x latency + size / bandwidth. A view costs its calls only (size 0): its latency is
    the time per call and its bandwidth unbounded in effect. A line that does not rise with
    size (a disturbed point) keeps the larger size's time per element with no latency."""
    grouped: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        grouped.setdefault((int(r["threads"]), str(r["class"])), []).append(r)
    out: dict[int, dict[str, dict[str, Link]]] = {}
    for (threads, cls), rows in sorted(grouped.items()):
        rows = sorted(rows, key=lambda r: r["size"])
        kinds: dict[str, Link] = {}
        for kind in ("forward", "backward"):
            key = f"{kind}_s"
            if cls == "view" or rows[0]["size"] <= 0:
                per_call = statistics.median(r[key] / r["calls"] for r in rows)
                kinds[kind] = Link(per_call, 1e18)
                continue
            small, large = rows[0], rows[-1]
            per_element = (large[key] - small[key]) / (large["size"] - small["size"])
            if per_element <= 0:
                kinds[kind] = Link(0.0, large["size"] / large[key])
                continue
            latency = max(0.0, small[key] - per_element * small["size"]) / small["calls"]
            # calls scale the latency; the elements of every call add up in size
            kinds[kind] = Link(latency, 1.0 / per_element)
        out.setdefault(threads, {})[cls] = kinds
    return out
