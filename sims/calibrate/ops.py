"""A forward's other ops, timed for ``flowtrain calibrate``: norms, activations, residual adds,
softmax, embedding lookups, views and attention, one representative op per cost class of
``flowtrain.profiling.census``, each forward and backward at two sizes and at the thread counts
the launched ranks run with. Fitted per class into ``latency_s`` per call plus elements (for
attention, FLOPs) over ``bandwidth``: the profile's ``engine.op_costs``.

In a small transformer these ops take a large share of the step, which a matmul-only model
cannot see. The representatives are the ops models use most: ``a * b + c`` for
elementwise work (two ops), GELU for activations, LayerNorm, softmax, an embedding lookup with a
gradient for its table, a chain of views and transposes, and causal scaled dot-product
attention. ``sims.calibrate.fits.fit_op_costs`` fits the records.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from sims.calibrate.timing import least_disturbed, pick, sample
from sims.engine_costs import OP_COST_CLASSES

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


def _point_op(cls: str, i: int) -> tuple[Callable[[], torch.Tensor], float, int, list[Any]]:
    """``cls``'s representative op at its ``i``-th size (``ATTENTION_SHAPES``, ``OP_SIZES``)."""
    return _attention(ATTENTION_SHAPES[i]) if cls == "attention" else _op(cls, OP_SIZES[i])


def time_op(forward: Callable[[], torch.Tensor], leaves: Sequence[Any],
            seconds: float) -> tuple[float, float]:
    """Median forward and median backward seconds of one op, each pass timed on its own."""
    grad = torch.ones_like(forward())

    def once() -> tuple[float, float]:
        start = time.perf_counter()
        y = forward()
        middle = time.perf_counter()
        y.backward(grad)
        timed = middle - start, time.perf_counter() - middle
        for leaf in leaves:
            leaf.grad = None
        return timed

    runs = sample(once, seconds, min_reps=5)
    return pick([f for f, _ in runs], "median"), pick([b for _, b in runs], "median")


def measure_ops(thread_counts: Sequence[int], seconds_per_point: float,
                rounds: int = 3) -> list[dict[str, Any]]:
    """Each class's op at its two sizes and each thread count, the fastest of ``rounds``
    rounds (other work only lengthens an op): records of (threads, class, calls, size,
    forward_s, backward_s)."""
    previous = torch.get_num_threads()
    timed: dict[tuple[int, str, int], list[dict[str, float]]] = {}
    sized: dict[tuple[int, str, int], tuple[float, int]] = {}
    try:
        for _ in range(rounds):
            for threads in sorted(set(thread_counts)):
                torch.set_num_threads(threads)
                for cls in OP_COST_CLASSES:
                    points = ATTENTION_SHAPES if cls == "attention" else OP_SIZES
                    for i in range(len(points)):
                        forward, size, calls, leaves = _point_op(cls, i)
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
