"""The fields hardware profiles are made of, and their checks: every error names the field, the
value seen and what is valid (``ProfileError``; it and the number check are
``flowtrain.hardware``'s, which reads a profile's peaks for the engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowtrain.hardware import ProfileError, check_number, is_number

LINK_FIELDS = ("latency_s", "bandwidth")

__all__ = ["LINK_FIELDS", "Curve", "Link", "ProfileError", "check_curve", "check_fields",
           "check_int", "check_number", "count_keys", "is_number", "link_from"]


@dataclass(frozen=True)
class Link:
    """One transfer path, costed as ``latency_s + bytes / bandwidth`` (bandwidth in bytes/s,
    one direction)."""

    latency_s: float
    bandwidth: float

    def __post_init__(self) -> None:
        check_number("latency_s", self.latency_s, minimum=0.0)
        check_number("bandwidth", self.bandwidth, minimum=0.0, strict=True)

    def seconds(self, nbytes: float) -> float:
        """Time to move ``nbytes`` over this link in one message."""
        return self.latency_s + nbytes / self.bandwidth

    def to_dict(self) -> dict[str, float]:
        return {"latency_s": self.latency_s, "bandwidth": self.bandwidth}


Curve = tuple[tuple[float, float], ...]  # (op FLOPs, FLOP/s) points, FLOPs increasing


def check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ProfileError(f"field {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ProfileError(f"field {name!r} must be >= {minimum}, got {value}")


def check_curve(name: str, curve: Any, *, maximum: float | None) -> None:
    """A non-empty tuple of (FLOPs, value) pairs with FLOPs strictly increasing and values
    positive (at most ``maximum`` when given: an efficiency is a fraction of peak)."""
    what = "fraction" if maximum == 1.0 else "FLOP/s"
    if not isinstance(curve, tuple) or not curve:
        raise ProfileError(f"field {name!r} must be a non-empty list of [FLOPs, {what}] "
                           f"pairs, got {curve!r}")
    previous = 0.0
    for i, point in enumerate(curve):
        if not isinstance(point, tuple) or len(point) != 2:
            raise ProfileError(f"field '{name}[{i}]' must be a [FLOPs, {what}] pair, "
                               f"got {point!r}")
        check_number(f"{name}[{i}] FLOPs", point[0], minimum=previous, strict=True)
        check_number(f"{name}[{i}] {what}", point[1], minimum=0.0, maximum=maximum,
                      strict=True)
        previous = point[0]


def check_fields(d: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...],
                 prefix: str = "") -> None:
    """Every required key of an object is there and no key is unknown; ``prefix`` (e.g.
    "engine.") names the object's place in the profile."""
    for key in required:
        if key not in d:
            raise ProfileError(f"missing field '{prefix}{key}' (required: "
                               f"{', '.join(required)})")
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:
        raise ProfileError(f"unknown field '{prefix}{unknown[0]}'; valid fields: "
                           f"{', '.join(required + optional)}")


def link_from(path: str, value: Any) -> Link:
    if not isinstance(value, dict):
        raise ProfileError(f"field {path!r} must be an object with latency_s and bandwidth, "
                           f"got {value!r}")
    for key in LINK_FIELDS:
        if key not in value:
            raise ProfileError(f"missing field '{path}.{key}'")
    extra = sorted(set(value) - set(LINK_FIELDS))
    if extra:
        raise ProfileError(f"unknown field '{path}.{extra[0]}'; a link has latency_s and "
                           "bandwidth")
    try:
        return Link(value["latency_s"], value["bandwidth"])
    except ProfileError as exc:
        raise ProfileError(str(exc).replace("field '", f"field '{path}.", 1)) from None


def count_keys(path: str, d: Any) -> dict[int, Any]:
    """A JSON object keyed by rank or thread counts, with the keys as ints."""
    if not isinstance(d, dict):
        raise ProfileError(f"field {path!r} must be an object keyed by counts, got {d!r}")
    out: dict[int, Any] = {}
    for key, value in d.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ProfileError(f"field {path!r} keys must be counts, got {key!r}") from None
    return out
