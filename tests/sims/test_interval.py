"""sims.interval: the central share of a log-uniform hardware spread times discrete inputs,
against its closed form and against sampling."""

from __future__ import annotations

import math
import random

import pytest

from sims.interval import central_interval


def test_the_figures_alone_give_the_central_share_of_their_span() -> None:
    low, high = central_interval(10.0, (8.0, 13.0), level=0.8)
    a, b = math.log(0.8), math.log(1.3)
    assert low == pytest.approx(10.0 * math.exp(a + 0.1 * (b - a)), rel=1e-9)
    assert high == pytest.approx(10.0 * math.exp(a + 0.9 * (b - a)), rel=1e-9)
    assert central_interval(10.0, None) == (10.0, 10.0)


def test_discrete_inputs_alone() -> None:
    # two equally likely values: the central 80 % spans both
    assert central_interval(4.0, None, [[1.0, 2.0]]) == pytest.approx((4.0, 8.0))
    # five equally likely values: the 10th and 90th percentiles are the lowest and highest
    low, high = central_interval(1.0, None, [[0.8, 0.9, 1.0, 1.1, 1.5]])
    assert (low, high) == pytest.approx((0.8, 1.5))
    # ten: the 10 % tails hold one value each
    low, high = central_interval(1.0, None, [[1 + i / 10 for i in range(10)]])
    assert (low, high) == pytest.approx((1.0, 1.9))


def test_against_sampling() -> None:
    rng = random.Random(7)
    hardware, inputs = (0.9, 1.15), [[1.0, 1.3], [0.95, 1.0, 1.2]]
    draws = sorted(math.exp(rng.uniform(math.log(0.9), math.log(1.15))) *
                   rng.choice(inputs[0]) * rng.choice(inputs[1]) for _ in range(200_000))
    low, high = central_interval(1.0, hardware, inputs)
    assert low == pytest.approx(draws[int(0.1 * len(draws))], rel=3e-3)
    assert high == pytest.approx(draws[int(0.9 * len(draws))], rel=3e-3)
