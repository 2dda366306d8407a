"""ZeRO-3's parameter-gather decisions: which buckets to prefetch at a use and whether a bucket
stays gathered after its forward. The engine's ``Stage3Params`` makes them live, at each module
hook, from the use order it recorded; ``stage3_uses`` replays them over one micro-batch for the
plan. Both call the two functions below, so the plan's gathers are the engine's."""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass


def prefetch_window(upcoming: Sequence[int], numel: Mapping[int, int] | Sequence[int], *,
                    skip: Container[int], in_use: int, prefetch_numel: int,
                    max_live_numel: int) -> list[int]:
    """The buckets to start gathering now: the next ``upcoming`` uses' buckets, in order, not in
    ``skip`` (gathered, requested or in use), while they fit both the prefetch budget and the
    live limit (``in_use`` elements are gathered or on their way). Stops at the first that does
    not fit, so gathers start in use order."""
    out: list[int] = []
    budget = prefetch_numel
    for u in upcoming:
        if u in skip or u in out:
            continue
        n = numel[u]
        if n > budget or in_use + n > max_live_numel:
            break
        out.append(u)
        budget -= n
        in_use += n
    return out


def reused_soon(upcoming: Sequence[int], bucket: int,
                numel: Mapping[int, int] | Sequence[int], *, live_numel: int,
                max_live_numel: int, max_reuse_distance: int) -> bool:
    """Whether ``bucket``, just used by a forward, is used again within ``max_reuse_distance``
    elements of other uses (so it stays gathered for its backward); never while more than
    ``max_live_numel`` elements are gathered."""
    if live_numel > max_live_numel:
        return False
    distance = 0
    for u in upcoming:
        if u == bucket:
            return distance <= max_reuse_distance
        distance += numel[u]
        if distance > max_reuse_distance:
            return False
    return False


@dataclass(frozen=True)
class Stage3Uses:
    """ZeRO-3's gathers over one micro-batch: at each use (forward units, then backward units
    in reverse), the buckets whose all-gather starts there, and the uses that find their
    bucket already gathered."""

    launched: tuple[tuple[int, ...], ...]  # per use position: buckets launched there
    gathered_for: tuple[tuple[int, ...], ...]  # per use position: buckets it waits for


def stage3_uses(trace: Sequence[int], numel: Mapping[int, int], *, prefetch_numel: int,
                max_live_numel: int, max_reuse_distance: int) -> Stage3Uses:
    """The engine's decisions (``prefetch_window``, ``reused_soon``) over one micro-batch's use
    order ``trace`` (one partitioned bucket per use)."""
    live: set[int] = set()
    requested: set[int] = set()
    launched: list[tuple[int, ...]] = []
    waits: list[tuple[int, ...]] = []
    forward_uses = len(trace) // 2
    for pos, b in enumerate(trace):
        need = () if b in live else (b,)
        in_use = sum(numel[u] for u in live) + sum(numel[u] for u in requested)
        out = prefetch_window(trace[pos + 1:], numel, skip=live | requested | {b},
                              in_use=in_use, prefetch_numel=prefetch_numel,
                              max_live_numel=max_live_numel)
        waits.append(need)
        launched.append(tuple(u for u in need if u not in requested) + tuple(out))
        requested.update(out)
        requested.discard(b)
        live.add(b)
        if pos < forward_uses:
            # after forward: released unless it comes back soon (its backward use)
            if not reused_soon(trace[pos + 1:], b, numel,
                               live_numel=sum(numel[u] for u in live),
                               max_live_numel=max_live_numel,
                               max_reuse_distance=max_reuse_distance):
                live.discard(b)
        else:
            live.discard(b)  # backward done: its gradients have landed
    return Stage3Uses(tuple(launched), tuple(waits))
