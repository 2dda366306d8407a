"""Contiguous partitions of a sequence of layers into pipeline stages: the cut the engine's
``PipelineModule`` makes and the simulator's planner replays for a model it plans unmeasured."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

# How a model unmeasured is cut into stages: "layers" (the same number of layers on each, the
# embedding on the first and the head on the last: Megatron's cut), "parameters" (layers cut so
# that parameter counts balance, the embedding's counted with the first layer and the head's
# with the last: DeepSpeed's and PipelineModule's default), "balanced" (by forward FLOPs, the
# LM head's with the last layer), "ends" (the same number of layers on each, counting the
# embedding as one more layer on the first stage and the loss as one more on the last: Llama 3's
# cut, arXiv:2407.21783 Sec. 3.3.2, "reducing one Transformer layer each from the first and the
# last stages", and Megatron-Core's account_for_embedding_in_pipeline_split and
# account_for_loss_in_pipeline_split)
PARTITIONS = ("layers", "parameters", "balanced", "ends")


def partition_balanced(costs: Sequence[float], parts: int) -> list[int]:
    """Boundaries b (len parts + 1) of contiguous parts minimising the largest part's cost;
    part i is layers [b[i], b[i+1]). Every part gets at least one layer."""
    n = len(costs)
    if parts > n:
        raise ValueError(f"cannot cut {n} layers into {parts} pipeline stages: each stage "
                         f"needs at least one layer")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cuts_for(limit: float) -> list[int] | None:
        bounds, start = [0], 0
        for _ in range(parts - 1):
            end = start + 1
            # take layers while under the limit, leaving at least one for each later part
            while end < n and prefix[end + 1] - prefix[start] <= limit and \
                    n - (end + 1) >= parts - len(bounds):
                end += 1
            bounds.append(end)
            start = end
        if prefix[n] - prefix[start] > limit + 1e-9:
            return None
        return bounds + [n]

    lo = max(costs) if costs else 0.0
    hi = prefix[n]
    best = cuts_for(hi)
    for _ in range(60):  # bisection on the largest part's cost
        mid = (lo + hi) / 2
        found = cuts_for(mid)
        if found is not None:
            best, hi = found, mid
        else:
            lo = mid
        if hi - lo <= 1e-9 * max(1.0, hi):
            break
    assert best is not None
    return best


def partition_costs(params: Sequence[tuple[str, tuple[int, ...], str, int]], method: str, *,
                    layer_of: Any, head_flops_per_token: float = 0.0,
                    attention_flops_per_token: float = 0.0) -> dict[int, float] | None:
    """Each numbered layer's weight in a ``method`` cut (None for "layers": an even cut).
    "parameters": its parameters, with those before the first layer added to the first and
    those after the last to the last; "ends": one each, and one more each for what comes
    before the first layer (keyed one below it) and after the last (one above it), which a cut
    may leave alone on a stage; "balanced": its forward FLOPs per token (2 per weight,
    plus ``attention_flops_per_token``), with the head's ``head_flops_per_token`` (the LM head
    runs on the last stage even when it shares the embedding's weight) on the last."""
    if method not in PARTITIONS:
        raise ValueError(f"partition must be one of {', '.join(PARTITIONS)}, got {method!r}")
    if method == "layers":
        return None
    costs: dict[int, float] = {}
    before = after = 0.0
    seen = False
    for name, shape, _, _ in params:
        n = layer_of(name)
        size = float(math.prod(shape))
        if n is not None:
            seen = True
            costs[n] = costs.get(n, 0.0) + size
        elif seen:
            after += size
        else:
            before += size
    if not costs:
        return None
    first, last = min(costs), max(costs)
    if method == "parameters":
        costs[first] += before
        costs[last] += after
        return costs
    if method == "ends":
        # Llama 3's chunks of one layer leave the first holding only the embedding and the
        # last only the output projection and loss: both are items of the cut themselves
        return {first - 1: 1.0, **{n: 1.0 for n in costs}, last + 1: 1.0}
    out = {n: 2.0 * size + attention_flops_per_token for n, size in costs.items()}
    out[last] += head_flops_per_token or 2.0 * after
    return out
