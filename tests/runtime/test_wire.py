"""Messages across ranks: registered dataclasses survive msgpack; everything else is refused."""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import pytest
import torch

from flowtrain.runtime.wire import decode, encode, message


@message
@dataclass(frozen=True)
class Inner:
    values: list


@message
@dataclass(frozen=True)
class Outer:
    name: str
    count: int
    ratio: float
    raw: bytes
    inner: Inner
    extra: dict
    nothing: None = None


def test_registered_messages_round_trip_through_msgpack() -> None:
    original = Outer("x", 3, 0.5, b"\x00\xff", Inner([1, 2.5, "a", None]), {"k": Inner([])})
    wire = msgpack.packb(encode(original))
    assert decode(msgpack.unpackb(wire, raw=False)) == original


def test_unregistered_dataclass_and_tensors_are_refused() -> None:
    @dataclass(frozen=True)
    class Loose:
        x: int

    with pytest.raises(TypeError, match="register it with @flowtrain.actors.message"):
        encode(Loose(1))
    with pytest.raises(TypeError, match="tensors cross ranks on data channels"):
        encode(torch.ones(2))
    with pytest.raises(TypeError, match="not registered on this rank"):
        decode({"__msg__": "nowhere.Missing", "f": {}})
    with pytest.raises(TypeError, match="frozen dataclass"):
        message(dict)  # type: ignore[arg-type]
