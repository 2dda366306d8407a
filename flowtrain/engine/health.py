"""The three health figures of a step, each against its target: FLOPs utilization (> 60%),
memory-bandwidth utilization (> 75%) and the communication share of step time (< 20%).

FLOPs utilization (MFU) = 3 x the forward FLOPs of a micro-batch (counted once with
torch.utils.flop_counter) x micro-batches per step / (step time x the device's peak FLOP/s).
Memory-bandwidth utilization counts the traffic every step must make whatever the kernels:
weights read in forward and backward and gradients written, per micro-batch, plus the
optimizer's pass over this rank's shard (28 bytes per element for Adam: parameter, gradient
and two moments read; parameter and moments written) — activations are not counted, so it is a
lower bound. Peaks come from the calibrated ``this-host`` profile (``flowtrain calibrate``) or,
on a known GPU, its builtin profile; without one the figure is None ("n/a")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowtrain.engine.parts import EngineParts

if TYPE_CHECKING:
    from flowtrain.zero.sharded import ZeroOptimizer

TARGETS = {"mfu": (">", 0.60), "mbu": (">", 0.75), "comm_share": ("<", 0.20)}
ADAM_BYTES_PER_ELEMENT = 28


class Health:
    """An engine's health figures, from its parts and, under ZeRO, its optimizer's shard of
    the master weights (what the optimizer steps on this rank)."""

    def __init__(self, parts: EngineParts, zero: ZeroOptimizer | None = None) -> None:
        self.parts = parts
        self.zero = zero
        self.forward_flops: float | None = None  # one micro-batch, set by the engine
        self._peaks_read = False  # the peaks are looked up once, on first use
        self._peak: float | None = None
        self._bandwidth: float | None = None

    def _peaks(self) -> tuple[float | None, float | None]:
        if not self._peaks_read:
            self._peaks_read = True
            param = next(iter(self.parts.module.parameters()), None)
            if param is None:
                return None, None
            try:
                from flowtrain.profiling.peak import find_peak

                found = find_peak(param.dtype, param.device)
                self._peak = found.flops_per_s if found is not None else None
                from flowtrain.hardware import THIS_HOST, device_peaks

                host = device_peaks(THIS_HOST)
                if host.kind == ("gpu" if param.device.type == "cuda" else "cpu"):
                    self._bandwidth = float(host.memory_bandwidth)
            except Exception:  # no calibrated profile: the figures read "n/a"
                pass
        return self._peak, self._bandwidth

    def step_bytes(self) -> float:
        parts = self.parts
        # the specs keep full shapes where ZeRO stage 3 left placeholders
        weights = sum(e * _numel(shape) for _, shape, _, e in parts.param_specs)
        gas = parts.spec.gradient_accumulation_steps
        if self.zero is not None:
            stepped = sum(m.numel() for m in self.zero.master)
        else:
            stepped = sum(p.numel() for p in parts.trainable)
        return 3.0 * weights * gas + ADAM_BYTES_PER_ELEMENT * stepped

    def figures(self, step_s: float | None, comm_s: float | None) -> dict[str, float | None]:
        out: dict[str, float | None] = {"mfu": None, "mbu": None, "comm_share": None}
        if not step_s or step_s <= 0:
            return out
        out["comm_share"] = (comm_s or 0.0) / step_s
        peak, bandwidth = self._peaks()
        gas = self.parts.spec.gradient_accumulation_steps
        if peak and self.forward_flops:
            out["mfu"] = 3.0 * self.forward_flops * gas / (step_s * peak)
        if bandwidth:
            out["mbu"] = self.step_bytes() / (step_s * bandwidth)
        return out


def meets(name: str, value: float | None) -> bool | None:
    if value is None:
        return None
    op, target = TARGETS[name]
    return value > target if op == ">" else value < target


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


__all__ = ["Health", "TARGETS", "meets"]
