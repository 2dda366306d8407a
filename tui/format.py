"""Short, fixed-width renderings of the figures the monitor shows (times, rates, bytes, shares)."""

from __future__ import annotations

import math
from typing import Any

MISSING = "-"


def number(value: Any) -> float | None:
    """The value as a float when it is a finite number (records may carry null or NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def seconds(value: Any) -> str:
    """``0.123s``, ``12.3s``, ``5m07s``, ``2h05m`` by size."""
    v = number(value)
    if v is None:
        return MISSING
    if v < 10:
        return f"{v:.3f}s" if v < 1 else f"{v:.2f}s"
    if v < 60:
        return f"{v:.1f}s"
    minutes, secs = divmod(int(round(v)), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def age(value: float | None) -> str:
    """A heartbeat age to a tenth of a second; it changes every tick, so it stays short."""
    return MISSING if value is None else f"{value:.1f}s"


def rate(value: Any) -> str:
    v = number(value)
    if v is None:
        return MISSING
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e4:
        return f"{v / 1e3:.1f}k"
    return f"{v:.1f}"


def size(value: Any) -> str:
    """Bytes in binary units."""
    v = number(value)
    if v is None:
        return MISSING
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024:
            return f"{v:.0f}{unit}" if unit == "B" else f"{v:.1f}{unit}"
        v /= 1024
    return f"{v:.1f}TiB"


def share(value: Any) -> str:
    """A fraction 0..1 as a percentage."""
    v = number(value)
    return MISSING if v is None else f"{v * 100:.0f}%"


def loss(value: Any) -> str:
    v = number(value)
    if v is None:
        return MISSING if value is None else str(value)
    return f"{v:.4f}" if abs(v) < 1000 else f"{v:.4g}"


def scale(value: Any) -> str:
    v = number(value)
    if v is None:
        return MISSING
    return f"{v:g}" if v < 1e7 else f"2^{math.log2(v):.0f}"


def memory(mem: Any) -> str:
    """The device memory when the rank has a device, else the process's resident set."""
    if not isinstance(mem, dict):
        return MISSING
    device = number(mem.get("device_allocated"))
    return size(device if device is not None else mem.get("process_rss"))
