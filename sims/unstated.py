"""What a prediction's range owes to the inputs the user did not state: the attention kernel
(no ``--attention``), activation recompute (no ``--recompute`` and nothing in the config), the
micro-batch (not in the config), and any the user marks ``--assumed``. Each is tried at its
alternatives (the profile's flash kernels; none, selective and full recompute; the
micro-batches that split the same samples per rank) where they fit the devices' memory, and
the range is the central part of the step times they allow with the figures' spread
(``sims.interval``); ``--explain`` names each."""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sims.hardware import HardwareProfile

INPUTS = ("micro-batch", "recompute", "attention")
MICRO_BATCHES = (1, 2, 4, 8, 16)


def parse_assumed(text: str | None) -> list[str]:
    """``--assumed``'s comma-separated inputs (each one of ``INPUTS``)."""
    if not text:
        return []
    names = [part.strip() for part in text.split(",") if part.strip()]
    bad = [n for n in names if n not in INPUTS]
    if bad:
        raise ValueError(f"--assumed: {', '.join(repr(b) for b in bad)} is not an input "
                         f"the range can widen by; choose from {', '.join(INPUTS)}")
    return names


def unstated(ns: argparse.Namespace, raw: dict[str, Any]) -> list[str]:
    """The inputs this command leaves to the simulator's defaults or marks as assumed."""
    out = set(parse_assumed(getattr(ns, "assumed", None)))
    if getattr(ns, "attention", None) is None:
        out.add("attention")
    if getattr(ns, "recompute", None) is None and _config_recompute(raw) == "none":
        out.add("recompute")
    micro = raw.get("train_micro_batch_size_per_gpu")
    if micro is None or micro == "auto":
        out.add("micro-batch")
    return [name for name in INPUTS if name in out]


def alternatives(name: str, ns: argparse.Namespace, raw: dict[str, Any], hw: HardwareProfile,
                 point: Any) -> list[tuple[str, argparse.Namespace, dict[str, Any]]]:
    """(label, flags, config) of each other value ``name`` might take."""
    out = []
    if name == "attention":
        kernels = hw.kernels
        for kernel in sorted(kernels.attention if kernels is not None else ()):
            if kernel != _current_attention(ns, hw):
                out.append((kernel, _with(ns, attention=kernel), raw))
    elif name == "recompute":
        current = getattr(ns, "recompute", None) or _config_recompute(raw)
        for value in ("none", "selective", "full"):
            if value != current:
                out.append((value, _with(ns, recompute=value), raw))
    elif name == "micro-batch":
        micro, accumulation = point.micro_batch_size, point.micro_batches
        per_rank = micro * accumulation
        for m in MICRO_BATCHES:
            if m != micro and per_rank % m == 0:
                changed = copy.deepcopy(raw)
                changed.pop("train_batch_size", None)
                changed["train_micro_batch_size_per_gpu"] = m
                changed["gradient_accumulation_steps"] = per_rank // m
                out.append((str(m), ns, changed))
    return out


def _current_attention(ns: argparse.Namespace, hw: HardwareProfile) -> str | None:
    kernels = hw.kernels
    return getattr(ns, "attention", None) or (kernels.default_attention if kernels else None)


def _config_recompute(raw: dict[str, Any]) -> str:
    return "full" if "activation_checkpointing" in raw or \
        (raw.get("pipeline") or {}).get("activation_checkpoint_interval") else "none"


def _with(ns: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    out = argparse.Namespace(**vars(ns))
    for key, value in changes.items():
        setattr(out, key, value)
    return out


@dataclasses.dataclass(frozen=True)
class Widening:
    """How much faster (``low``) and slower (``high``) than the point the alternatives of one
    input run, and which alternatives were tried (those that fit)."""

    name: str
    low: float
    high: float
    tried: tuple[str, ...]

    def line(self, current: str) -> str:
        values = ", ".join((current, *self.tried))
        return f"{self.name} ({values}): x{self.low:.2f} to x{self.high:.2f}"


def widen(point: Any, ns: argparse.Namespace, raw: dict[str, Any], hw: HardwareProfile,
          predict_one: Callable[[argparse.Namespace, dict[str, Any]], Any]
          ) -> Any:
    """``point`` with its range widened by each unstated input's alternatives
    (``predict_one(flags, config)`` predicts one without a range). Where ``point`` does not fit
    its devices, the alternatives that do are named (``fits_with``): an input the user did not
    state is a guess, and what the run needs to fit is the useful answer."""
    names = unstated(ns, raw)
    if not names or not point.step_time_s:
        return point
    widenings = []
    fitting: list[str] = []
    ratios: list[list[float]] = []
    for name in names:
        times, tried = [], []
        for label, flags, config in alternatives(name, ns, raw, hw, point):
            try:
                other = predict_one(flags, config)
            except ValueError:
                continue  # a value this run cannot take (a layout it does not divide into)
            if other.oom:
                continue
            times.append(other.step_time_s / point.step_time_s)
            tried.append(label)
            if point.oom:
                fitting.append(f"{name} {label} (x{times[-1]:.2f} step time)")
        if times:
            widenings.append(Widening(name, min(1.0, *times), max(1.0, *times), tuple(tried)))
            ratios.append([1.0, *times])
    if not widenings:
        return point
    fits_with = fitting if point.oom else None
    from sims.interval import central_interval

    low, high = central_interval(point.step_time_s, point.hardware_range_s, ratios)
    current = {"micro-batch": str(point.micro_batch_size),
               "recompute": getattr(ns, "recompute", None) or _config_recompute(raw),
               "attention": _current_attention(ns, hw) or "default"}
    lines = [w.line(current[w.name]) for w in widenings]
    return dataclasses.replace(
        point, step_time_range_s=(low, high),
        assumptions=[*point.assumptions,
                     "range widened by what was not stated (each value equally likely; the "
                     "range is the central 80 % with the figures' spread): " + "; ".join(lines)],
        widened_by={w.name: [w.low, w.high, list(w.tried)] for w in widenings},
        fits_with=fits_with)
