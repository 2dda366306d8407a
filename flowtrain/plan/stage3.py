"""ZeRO-3's parameter gathers over one micro-batch, replayed as the engine's ``Stage3Params``
decides them (prefetch window, keep-for-backward, live limit)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stage3Uses:
    """ZeRO-3's gathers over one micro-batch: at each use (forward units, then backward units
    in reverse), the buckets whose all-gather starts there, and the uses that find their
    bucket already gathered."""

    launched: tuple[tuple[int, ...], ...]  # per use position: buckets launched there
    gathered_for: tuple[tuple[int, ...], ...]  # per use position: buckets it waits for


def stage3_uses(trace: Sequence[int], numel: Mapping[int, int], *, prefetch_numel: int,
                max_live_numel: int, max_reuse_distance: int) -> Stage3Uses:
    """Replays the engine's ``Stage3Params`` decisions (prefetch window, keep-for-backward,
    live limit) over one micro-batch's use order ``trace`` (one partitioned bucket per use)."""
    live: set[int] = set()
    requested: set[int] = set()
    launched: list[tuple[int, ...]] = []
    waits: list[tuple[int, ...]] = []
    forward_uses = len(trace) // 2
    for pos, b in enumerate(trace):
        need = () if b in live else (b,)
        out: list[int] = []
        budget = prefetch_numel
        in_use = sum(numel[u] for u in live) + sum(numel[u] for u in requested)
        for u in trace[pos + 1:]:
            if u in live or u in requested or u in out or u == b:
                continue
            if numel[u] > budget or in_use + numel[u] > max_live_numel:
                break
            out.append(u)
            budget -= numel[u]
            in_use += numel[u]
        waits.append(() if b in live else (b,))
        launched.append(tuple(u for u in need if u not in requested) + tuple(out))
        requested.update(out)
        requested.discard(b)
        live.add(b)
        if pos < forward_uses:
            # after forward: released unless it comes back soon (its backward use)
            distance, comes_back = 0, False
            if sum(numel[u] for u in live) <= max_live_numel:
                for u in trace[pos + 1:]:
                    if u == b:
                        comes_back = distance <= max_reuse_distance
                        break
                    distance += numel[u]
                    if distance > max_reuse_distance:
                        break
            if not comes_back:
                live.discard(b)
        else:
            live.discard(b)  # backward done: its gradients have landed
    return Stage3Uses(tuple(launched), tuple(waits))
