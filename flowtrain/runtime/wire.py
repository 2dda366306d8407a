"""Messages that cross ranks: frozen dataclasses registered with ``@message`` and encoded to
msgpack-able values, so a receiving rank rebuilds only types it knows."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

_registry: dict[str, type] = {}
_TAG = "__msg__"


def message(cls: type[T]) -> type[T]:
    """Registers a frozen dataclass as a message that may be sent to an actor on another rank.
    Its fields must be None, bool, int, float, str, bytes, lists, dicts with string keys, or
    other registered messages. Tensors travel on data channels (``flowtrain.comm``), not here."""
    if not dataclasses.is_dataclass(cls) or not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise TypeError(f"@message needs a frozen dataclass (@dataclass(frozen=True)), got {cls!r}")
    name = message_name(cls)
    existing = _registry.get(name)
    if existing is not None and existing is not cls:
        raise ValueError(f"two message classes are registered as {name!r}")
    _registry[name] = cls
    return cls


def message_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def encode(value: Any) -> Any:
    """A msgpack-able form of ``value``; raises TypeError naming what cannot cross ranks."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"dict keys sent across ranks must be str, got {type(k).__name__}")
            out[k] = encode(v)
        return out
    cls = type(value)
    if dataclasses.is_dataclass(value) and _registry.get(message_name(cls)) is cls:
        fields = {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {_TAG: message_name(cls), "f": fields}
    if cls.__module__.startswith("torch"):
        raise TypeError(f"a {cls.__name__} cannot be sent in a control message; tensors cross "
                        f"ranks on data channels (flowtrain.comm)")
    raise TypeError(f"{cls.__name__} cannot cross ranks: register it with "
                    f"@flowtrain.actors.message "
                    f"(a frozen dataclass) or send plain values")


def decode(value: Any) -> Any:
    """Rebuilds what ``encode`` produced; an unregistered message name is a TypeError."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        name = value.get(_TAG)
        if name is None:
            return {k: decode(v) for k, v in value.items()}
        cls = _registry.get(name)
        if cls is None:
            raise TypeError(f"received message type {name!r}, which is not registered on this rank")
        return cls(**{k: decode(v) for k, v in value.get("f", {}).items()})
    return value
