"""The control plane: a ZeroMQ coordinator, the rank-side client, and their signed wire format."""

from __future__ import annotations

from flowtrain.control.client import ControlClient
from flowtrain.control.coordinator import (
    AllFinished,
    Coordinator,
    CoordinatorEvent,
    JoinTimeout,
    RankFailed,
    RankFinished,
    RankJoined,
    RankState,
)
from flowtrain.control.protocol import (
    REJECT_REASONS,
    SCHEMA_VERSION,
    Frame,
    FrameCodec,
    FrameRejected,
    Kind,
    RejectCounter,
)

__all__ = [
    "AllFinished",
    "ControlClient",
    "Coordinator",
    "CoordinatorEvent",
    "Frame",
    "FrameCodec",
    "FrameRejected",
    "JoinTimeout",
    "Kind",
    "REJECT_REASONS",
    "RankFailed",
    "RankFinished",
    "RankJoined",
    "RankState",
    "RejectCounter",
    "SCHEMA_VERSION",
]
