"""How fast a calibrated CPU host computes now against its profile. A profile holds the speed of
its calibration's moment; a shared host's (a VM's neighbours, other jobs) drifts by tens of
percent over minutes, and every prediction on it with it. ``host_speed`` times the calibration's
own Linear pass for a moment and says how much slower (> 1) or faster (< 1) than the profile
the host computes now; ``flowtrain simulate --host-speed auto`` scales a prediction by it."""

from __future__ import annotations

import math
from typing import Any


def host_speed(hw: Any, seconds: float = 0.5) -> float:
    """The calibration's concurrency-probe Linear pass (forward and backward, one thread) timed
    for ``seconds`` now, over the profile's time for the same pass; 1.15 means 15 % slower.
    ValueError for a profile without engine costs (only a calibrated CPU host has them)."""
    import torch

    from sims.calibrate_engine import CONCURRENCY_SHAPE, time_pass

    if hw.engine is None:
        raise ValueError(f"hardware profile {hw.name!r} has no engine costs, so there is no "
                         f"calibrated speed to hold this host against (`flowtrain calibrate` "
                         f"writes them for a CPU host)")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        timed = time_pass(CONCURRENCY_SHAPE, seconds)
    finally:
        torch.set_num_threads(previous)
    return speed_ratio(hw, timed)


def speed_ratio(hw: Any, timed: dict[str, float]) -> float:
    """``timed`` (time_pass's forward_s, backward_s and flops) over the profile's prediction
    for the same pass."""
    from sims.costs import pass_seconds

    flops = timed["flops"]
    profile = pass_seconds("forward", flops, 1, hw) + pass_seconds("backward", 2 * flops, 1, hw)
    return (timed["forward_s"] + timed["backward_s"]) / profile


def check_speed(value: float, source: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}: a host speed is a positive factor (1.0: as calibrated, "
                         f"1.2: 20 % slower), got {value}")
    return value
