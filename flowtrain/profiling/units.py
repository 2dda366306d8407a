"""Human-readable numbers for the FLOPs profiler, in the forms DeepSpeed's profiler prints:
a count with a decimal prefix ("1.23 G"), MACs ("1.23 GMACs"), a rate ("1.23 GFLOPS"), a
parameter count ("1.23 M") and a duration ("1.23 ms").

Counts of floating-point operations carry no "FLOPS" suffix because FLOPS is a rate (per second);
only ``flops_to_string`` (used for achieved and peak throughput) appends it."""

from __future__ import annotations

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def _trim(value: float, precision: int) -> str:
    """``value`` rounded to ``precision`` decimals without trailing zeros ("1.2", "3", "0")."""
    text = f"{value:.{precision}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def _scaled(num: float, units: str | None, precision: int) -> tuple[str, str]:
    """(digits, prefix): ``num`` divided by the largest prefix it reaches, or by ``units``."""
    if units is not None:
        scales = dict((p, s) for s, p in _PREFIXES)
        if units not in scales and units != "":
            raise ValueError(f"units must be one of T, G, M, K or '' (none), got {units!r}")
        return _trim(num / scales.get(units, 1.0), precision), units
    for scale, prefix in _PREFIXES:
        if abs(num) >= scale:
            return _trim(num / scale, precision), prefix
    return _trim(num, precision), ""


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """A count with a decimal prefix: 1_234_000_000 -> "1.23 G", 512 -> "512"."""
    digits, prefix = _scaled(num, units, precision)
    return f"{digits} {prefix}" if prefix else digits


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    """A parameter count: 336_230_000 -> "336.23 M"."""
    return number_to_string(params, units, precision)


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    """Multiply-accumulates: 3_139_930_000_000 -> "3.14 TMACs"."""
    digits, prefix = _scaled(macs, units, precision)
    return f"{digits} {prefix}MACs"


def flops_to_string(flops_per_s: float, units: str | None = None, precision: int = 2) -> str:
    """A rate in floating-point operations per second: 8.19e13 -> "81.9 TFLOPS"."""
    digits, prefix = _scaled(flops_per_s, units, precision)
    return f"{digits} {prefix}FLOPS"


def duration_to_string(seconds: float, precision: int = 2) -> str:
    """Seconds in s, ms or us: 0.07667 -> "76.67 ms"."""
    if seconds == 0:
        return "0 s"
    if abs(seconds) >= 1:
        return f"{_trim(seconds, precision)} s"
    if abs(seconds) >= 1e-3:
        return f"{_trim(seconds * 1e3, precision)} ms"
    return f"{_trim(seconds * 1e6, precision)} us"


def percent(part: float, total: float) -> str:
    """``part`` as a percentage of ``total`` with two decimals; 0.00% when the total is 0."""
    return f"{100.0 * part / total:.2f}%" if total else "0.00%"
