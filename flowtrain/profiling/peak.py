"""The device's peak FLOP/s, for the profiler's model FLOPs utilisation (MFU).

Where the peak comes from, first match wins:

1. ``peak_tflops`` given by the caller: the user knows the device best.
2. The calibrated profile of this host (``flowtrain calibrate`` writes it; read through
   ``flowtrain.hardware.device_peaks("this-host")``), when its kind (gpu/cpu) matches the device
   the model runs on and it has a figure for the model's dtype.
3. On CUDA, the device name matched against the builtin profiles (A100, H100, H200).

Otherwise there is no peak and the report says so instead of guessing. A profile that cannot
be read only means "no peak from it": the profiler keeps working without one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowtrain.hardware import THIS_HOST, device_peaks

# CUDA device-name fragment -> builtin profile in flowtrain.hardware (same compute per device).
_CUDA_NAMES = (("H200", "h200-x8"), ("H100", "h100-x8"), ("A100", "a100-80g-x8"))

NO_PEAK = "MFU n/a (no peak known; pass peak_tflops or run flowtrain calibrate)"


@dataclass(frozen=True)
class Peak:
    flops_per_s: float
    source: str  # where the figure came from, printed beside it


def dtype_key(dtype: torch.dtype, device: torch.device) -> str:
    """The ``peak_flops`` key for matmuls in ``dtype`` on ``device``: fp32 matmuls on a CUDA
    device with TF32 allowed run at the TF32 rate."""
    if dtype == torch.float32 and device.type == "cuda" and \
            torch.backends.cuda.matmul.allow_tf32:
        return "tfloat32"
    return str(dtype).removeprefix("torch.")


def check_peak_tflops(peak_tflops: float | None) -> float | None:
    if peak_tflops is None:
        return None
    if isinstance(peak_tflops, bool) or not isinstance(peak_tflops, (int, float)) or \
            not peak_tflops > 0 or peak_tflops == float("inf"):
        raise ValueError(f"peak_tflops must be a positive number of TFLOP/s (e.g. 312.0), got "
                         f"{peak_tflops!r}")
    return float(peak_tflops)


def find_peak(dtype: torch.dtype, device: torch.device,
              peak_tflops: float | None = None) -> Peak | None:
    """The peak FLOP/s for ``dtype`` matmuls on ``device``, or None when nothing says."""
    if peak_tflops is not None:
        return Peak(peak_tflops * 1e12, "peak_tflops")
    key = dtype_key(dtype, device)
    kind = "gpu" if device.type == "cuda" else "cpu"
    try:
        host = device_peaks(THIS_HOST)
    except Exception:  # not calibrated (or unreadable): fall through to the device name
        host = None
    if host is not None and host.kind == kind and key in host.peak_flops:
        return Peak(float(host.peak_flops[key]), f"{THIS_HOST} profile, {key}")
    if device.type == "cuda" and torch.cuda.is_available():
        name = torch.cuda.get_device_name(device).upper()
        for fragment, profile in _CUDA_NAMES:
            if fragment in name:
                try:
                    flops = device_peaks(profile).peak_flops.get(key)
                except Exception:
                    return None
                if flops:
                    return Peak(float(flops), f"{profile} profile ({fragment}), {key}")
    return None
