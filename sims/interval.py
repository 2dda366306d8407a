"""A prediction's range as the central part of what its uncertain inputs allow: each published
figure the GPU's costs rest on anywhere between its optimistic and its pessimistic end
(together, a step time anywhere between the ends' two predictions), and each input the user did
not state equally likely to be any of its values that fit. Step-time ratios multiply, so the
contributions add in log space; the range holds the central ``LEVEL`` of their sum."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

# the share of outcomes the range holds: "an interval that holds the published step in about
# 80 % of the runs" (issue 39)
LEVEL = 0.8


def central_interval(point: float, hardware: tuple[float, float] | None,
                     inputs: Sequence[Sequence[float]] = (), level: float = LEVEL
                     ) -> tuple[float, float]:
    """The central ``level`` of ``point`` x (a hardware ratio uniform in log space between
    ``hardware``'s ends over ``point``) x (one ratio drawn from each of ``inputs``, each of its
    values equally likely; a value of 1 is the point's own), stretched to hold ``point``."""
    if point <= 0:
        return point, point
    low, high = hardware or (point, point)
    a, b = math.log(min(low, point) / point), math.log(max(high, point) / point)
    shifts: list[float] = [0.0]
    weights: list[float] = [1.0]
    for ratios in inputs:
        logs = [math.log(r) for r in ratios] or [0.0]
        combined = [(s + x, w / len(logs)) for (s, w), x in
                    itertools.product(zip(shifts, weights), logs)]
        shifts, weights = [c[0] for c in combined], [c[1] for c in combined]
    tail = (1.0 - level) / 2

    def cdf(x: float) -> float:
        total = 0.0
        for s, w in zip(shifts, weights):
            lo, hi = a + s, b + s
            if hi - lo < 1e-15:
                total += w if x >= lo else 0.0
            else:
                total += w * min(1.0, max(0.0, (x - lo) / (hi - lo)))
        return total

    def quantile(q: float) -> float:
        lo, hi = a + min(shifts), b + max(shifts)
        for _ in range(100):
            mid = (lo + hi) / 2
            if cdf(mid) < q:
                lo = mid
            else:
                hi = mid
        return hi

    # the prediction for the inputs as given is always inside
    return (min(point, point * math.exp(quantile(tail))),
            max(point, point * math.exp(quantile(1.0 - tail))))
