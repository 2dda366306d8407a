"""How fast a calibrated CPU host computes now against its profile. A profile holds the speed of
its calibration's moment; a shared host's (a VM's neighbours, other jobs) drifts by tens of
percent over minutes, and every prediction on it with it. ``host_speed`` times the calibration's
own Linear pass for a moment and says how much slower (> 1) or faster (< 1) than the profile
the host computes now; ``flowtrain simulate --host-speed auto`` scales a prediction by it.

Known limit: the probe is one short pass held against a curve fitted from the least disturbed
rounds of other shapes, so it can read below 1 on a host that has not changed; ``auto`` is a
drift indicator, not a correction to trust blindly. A factor given by hand is applied exactly."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from sims.calibrate.settings import CONCURRENCY_SHAPE
from sims.costs import pass_seconds

if TYPE_CHECKING:
    from sims.hardware import HardwareProfile


def probe_seconds(seconds: float = 0.5) -> float:
    """The probe pass (the calibration's concurrency shape: forward plus backward of one
    ``nn.Linear`` with the engine's bucket hooks, one thread), median seconds over ``seconds``
    of timing now."""
    import torch  # here, so that the simulator imports this module without torch

    from sims.calibrate import engine_pieces

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        timed = engine_pieces.time_pass(CONCURRENCY_SHAPE, seconds)
    finally:
        torch.set_num_threads(previous)
    return timed["forward_s"] + timed["backward_s"]


def profile_probe_seconds(hw: HardwareProfile) -> float:
    """What ``hw`` says the probe pass takes. ValueError for a profile without engine costs
    (only a calibrated CPU host has them)."""
    if hw.engine is None:
        raise ValueError(f"hardware profile {hw.name!r} has no engine costs, so there is no "
                         f"calibrated speed to hold this host against (`flowtrain calibrate` "
                         f"writes them for a CPU host)")
    rows, n_in, n_out = CONCURRENCY_SHAPE
    flops = 2.0 * rows * n_in * n_out
    return pass_seconds("forward", flops, 1, hw) + pass_seconds("backward", 2 * flops, 1, hw)


def host_speed(hw: HardwareProfile, seconds: float = 0.5) -> float:
    """How slow this host computes now against ``hw``: the probe pass timed for ``seconds``
    over the profile's time for it; 1.15 means 15 % slower. ValueError for a profile without
    engine costs."""
    reference = profile_probe_seconds(hw)
    return probe_seconds(seconds) / reference


def check_speed(value: float, source: str) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{source}: a host speed is a positive factor (1.0: as calibrated, "
                         f"1.2: 20 % slower), got {value}")
    return value
