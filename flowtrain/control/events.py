"""What the job's coordinator reports to the launcher (its events) and knows of each rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowtrain.errors import RankFailure
from flowtrain.log import get_logger


def coordinator_log() -> Any:
    # Looked up per call: a logger bound at import keeps the logging configuration of that
    # moment and would ignore configure_logging() called later by the rank or the launcher.
    return get_logger("flowtrain.control.coordinator")




@dataclass(frozen=True)
class RankJoined:
    rank: int
    host: str
    pid: int


@dataclass(frozen=True)
class RankFinished:
    rank: int


@dataclass(frozen=True)
class RankFailed:
    rank: int
    failure: RankFailure


@dataclass(frozen=True)
class JoinTimeout:
    missing: list[int]


@dataclass(frozen=True)
class AllFinished:
    pass


CoordinatorEvent = RankJoined | RankFinished | RankFailed | JoinTimeout | AllFinished


@dataclass
class RankState:
    """What the coordinator knows about one rank; ``ranks()`` hands out copies."""

    rank: int
    joined: bool = False
    host: str = ""
    pid: int = 0
    local_rank: int = 0
    last_seen: float = 0.0  # time.monotonic() of the last verified frame from the rank
    status: dict = field(default_factory=dict)  # body of its last HEARTBEAT
    finished: bool = False
    failed: bool = False  # reported a failure, or was declared stuck
    stuck: bool = False
    lost: bool = False  # --peer-recovery: left out of the group; a replacement may join


def format_status(status: dict) -> str:
    """One line from a heartbeat status: ``busy actor Foo handling Bar, pending all_reduce #3``."""
    if not status:
        return "none received"
    parts = []
    for key, value in status.items():
        if isinstance(value, (list, tuple)):
            value = "; ".join(str(item) for item in value) if value else "nothing"
        parts.append(f"{key} {value}")
    return ", ".join(parts)
