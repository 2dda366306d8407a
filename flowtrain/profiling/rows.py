"""``ModuleRow``: one module's figures in a profile, what ``FlopsProfiler.module_rows`` gives
and the printed report reads."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModuleRow:
    """One module's profile. ``flops``, ``macs`` and ``duration`` (seconds) include the module's
    children and add up over all of its calls; ``params`` counts its parameters, children's
    included."""

    name: str  # the state-dict prefix ("" for the model itself)
    type_name: str
    depth: int  # 0 for the model itself
    params: int
    flops: int
    macs: int
    duration: float
    calls: int

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.duration if self.duration > 0 else 0.0
