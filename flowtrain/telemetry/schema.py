"""Telemetry records, version 1: their typed shape, one validator, and the msgpack encoding.

The monitor (tui/) imports only this module's names through ``flowtrain.telemetry``, so the
schema is written once here and checked the same way by publisher, recorder and readers.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Literal, TypedDict, cast

import msgpack

SCHEMA_VERSION = 1
KINDS = ("job", "step", "spans", "event", "heartbeat")
TOPIC_PREFIX = "telemetry."
TOPICS = tuple(TOPIC_PREFIX + kind for kind in KINDS)
COORDINATOR_RANK = -1  # "rank" of records the launcher/coordinator side writes
MEM_KEYS = ("model_states", "parameters", "gradients", "optimizer_state", "process_rss",
            "device_allocated")
# Event names flowtrain emits; any other non-empty name is valid too (custom stages may add).
EVENTS = ("job_ended", "rank_joined", "rank_finished", "rank_failed", "rank_stuck",
          "rank_exited", "join_timeout", "skipped_step", "overflow", "checkpoint_saved",
          "engine_started", "rank_lost", "rank_rejoined")


class TelemetryError(ValueError):
    """A record that does not follow the schema; the message names the field, the value seen
    and what the schema wants there."""


class Memory(TypedDict):
    model_states: int
    parameters: int
    gradients: int
    optimizer_state: int
    process_rss: int
    device_allocated: int | None


# Each record type spells its own ``kind`` as a literal, so that a check of record["kind"]
# narrows a Record to that type.
class _Base(TypedDict):
    v: int
    rank: int
    t: float


class JobRecord(_Base):
    kind: Literal["job"]
    job_id: str
    world_size: int
    run_dir: str
    started: float
    total_steps: int | None
    config_summary: dict[str, Any]


class StepRecord(_Base):
    kind: Literal["step"]
    step: int
    loss: float | None
    lr: float
    loss_scale: float
    skipped: int
    grad_norm: float | None
    step_s: float
    samples_per_s: float | None
    tokens_per_s: float | None
    forward_s: float
    backward_s: float
    comm_s: float
    optimizer_s: float
    overlap: float | None
    comm_share: float
    mfu: float | None
    # mbu (memory-bandwidth utilization, float | None) rides along as an allowed extra key:
    # readers of older records see it missing (flowtrain.engine.health says how it is counted)
    mem: Memory


class SpansRecord(_Base):
    kind: Literal["spans"]
    step: int
    spans: list[list[Any]]  # [task name, start_s, end_s], seconds from the step's start
    step_start: float  # unix seconds of the step's start (lines spans up across ranks)


class EventRecord(_Base):
    kind: Literal["event"]
    event: str
    message: str
    data: dict[str, Any]


class HeartbeatRecord(_Base):
    kind: Literal["heartbeat"]
    status: str
    busy_actor: str | None
    pending_collective: str | None


Record = JobRecord | StepRecord | SpansRecord | EventRecord | HeartbeatRecord

# -- the field table the validator walks ----------------------------------------------------------
# name -> (kind of value, may be null). "num" is an int or a float, "count" an int >= 0.
_Spec = tuple[str, bool]
_COMMON: dict[str, _Spec] = {"v": ("int", False), "kind": ("str", False), "rank": ("int", False),
                             "t": ("num", False)}
_FIELDS: dict[str, dict[str, _Spec]] = {
    "job": {"job_id": ("str", False), "world_size": ("count", False), "run_dir": ("str", False),
            "started": ("num", False), "total_steps": ("count", True),
            "config_summary": ("map", False)},
    "step": {"step": ("count", False), "loss": ("num", True), "lr": ("num", False),
             "loss_scale": ("num", False), "skipped": ("count", False), "grad_norm": ("num", True),
             "step_s": ("num", False), "samples_per_s": ("num", True),
             "tokens_per_s": ("num", True), "forward_s": ("num", False),
             "backward_s": ("num", False), "comm_s": ("num", False),
             "optimizer_s": ("num", False), "overlap": ("fraction", True),
             "comm_share": ("num", False), "mfu": ("num", True), "mem": ("mem", False)},
    "spans": {"step": ("count", False), "spans": ("spans", False),
              "step_start": ("num", False)},
    "event": {"event": ("name", False), "message": ("str", False), "data": ("map", False)},
    "heartbeat": {"status": ("str", False), "busy_actor": ("str", True),
                  "pending_collective": ("str", True)},
}
_EXPECTED = {"int": "an integer", "count": "an integer >= 0", "num": "a number",
             "str": "a string", "name": "a non-empty string", "map": "a map",
             "fraction": "a number from 0 to 1", "mem": "a map of byte counts",
             "spans": "a list of [task name, start_s, end_s]"}


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is an int to Python, never to the schema


def _is_num(value: Any) -> bool:
    return type(value) is float or _is_int(value)


def _fits(kind: str, value: Any) -> bool:
    if kind == "int":
        return _is_int(value)
    if kind == "count":
        return _is_int(value) and value >= 0
    if kind == "num":
        return _is_num(value)
    if kind == "fraction":
        return _is_num(value) and 0.0 <= value <= 1.0
    if kind == "str":
        return isinstance(value, str)
    if kind == "name":
        return isinstance(value, str) and bool(value)
    if kind == "map":
        return isinstance(value, dict)
    if kind == "mem":
        return isinstance(value, dict) and _mem_problem(value) is None
    if kind == "spans":
        return isinstance(value, list) and _spans_problem(value) is None
    raise AssertionError(f"no check for field kind {kind!r}")


def _mem_problem(mem: dict[Any, Any]) -> str | None:
    for key in MEM_KEYS:
        if key not in mem:
            return f"mem has no {key!r}; it needs {', '.join(MEM_KEYS)}"
        value = mem[key]
        nullable = key == "device_allocated"
        if not ((value is None and nullable) or (_is_int(value) and value >= 0)):
            return f"mem[{key!r}] is {value!r:.60}, expected a byte count (an integer >= 0)" + \
                (" or null" if nullable else "")
    return None


def _spans_problem(spans: list[Any]) -> str | None:
    for i, span in enumerate(spans):
        if not (isinstance(span, (list, tuple)) and len(span) == 3 and isinstance(span[0], str)
                and _is_num(span[1]) and _is_num(span[2]) and span[1] <= span[2]):
            return (f"spans[{i}] is {span!r:.80}, expected [task name, start_s, end_s] "
                    "with start_s <= end_s")
    return None


def validate(record: Any) -> Record:
    """Returns ``record`` if it follows schema v1; TelemetryError naming the first problem
    otherwise. Keys beyond the schema's are allowed (a later minor addition must not break an
    older reader); missing keys, wrong types and unknown kinds are not."""
    if not isinstance(record, dict):
        raise TelemetryError(f"a telemetry record is a map, got {type(record).__name__} "
                             f"{record!r:.60}")
    version = record.get("v")
    if version != SCHEMA_VERSION or not _is_int(version):
        raise TelemetryError(f"field 'v' (schema version) is {version!r:.40}; this reader "
                             f"knows version {SCHEMA_VERSION}")
    kind = record.get("kind")
    if kind not in _FIELDS:
        raise TelemetryError(f"field 'kind' is {kind!r:.40}, expected one of {', '.join(KINDS)}")
    for name, (value_kind, nullable) in (_COMMON | _FIELDS[kind]).items():
        if name not in record:
            raise TelemetryError(f"{kind} record has no field {name!r} "
                                 f"({_EXPECTED[value_kind]}{' or null' if nullable else ''})")
        value = record[name]
        if value is None and nullable:
            continue
        if not _fits(value_kind, value):
            detail = None
            if value_kind == "mem" and isinstance(value, dict):
                detail = _mem_problem(value)
            elif value_kind == "spans" and isinstance(value, list):
                detail = _spans_problem(value)
            raise TelemetryError(
                f"{kind} record: " + (detail or f"field {name!r} is {value!r:.60}, expected "
                                      f"{_EXPECTED[value_kind]}{' or null' if nullable else ''}"))
    # The field table has just checked the map; a type checker cannot follow that check.
    return cast(Record, record)


def encode(record: Mapping[str, Any]) -> bytes:
    """The record as one msgpack map (what the PUB socket carries and telemetry.msgpack holds),
    after validating it: a bad record fails at its writer, not at every reader."""
    validate(record)
    return msgpack.packb(record, use_bin_type=True)


def decode(data: bytes) -> Record:
    """One record from its msgpack bytes; TelemetryError if they are not one valid record."""
    try:
        record = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several types (ExtraData, ValueError, ...)
        raise TelemetryError(f"not one msgpack object: {type(exc).__name__}: {exc}") from None
    return validate(record)


def topic_of(record: Mapping[str, Any]) -> str:
    """The PUB topic a record travels under: ``telemetry.<kind>``."""
    return TOPIC_PREFIX + str(record["kind"])


def _base(kind: str, rank: int, t: float | None) -> dict[str, Any]:
    return {"v": SCHEMA_VERSION, "kind": kind, "rank": rank,
            "t": time.time() if t is None else t}


def job_record(*, job_id: str, world_size: int, run_dir: str, started: float,
               total_steps: int | None, config_summary: dict[str, Any],
               t: float | None = None) -> JobRecord:
    record = _base("job", COORDINATOR_RANK, t) | {
        "job_id": job_id, "world_size": world_size, "run_dir": run_dir, "started": started,
        "total_steps": total_steps, "config_summary": config_summary}
    return cast(JobRecord, validate(record))  # validated as a "job" record


def event_record(event: str, message: str, *, rank: int = COORDINATOR_RANK,
                 data: dict[str, Any] | None = None, t: float | None = None) -> EventRecord:
    """An event; ``rank`` is the rank it is about (the coordinator's -1 for job-wide ones)."""
    record = _base("event", rank, t) | {"event": event, "message": message, "data": data or {}}
    return cast(EventRecord, validate(record))  # validated as an "event" record


def heartbeat_record(rank: int, status: dict[str, Any], t: float | None = None) -> HeartbeatRecord:
    """A rank's heartbeat status (flowtrain.runtime.rank.Rank.status) in the schema's words."""
    busy = status.get("busy")
    pending = status.get("pending")
    if isinstance(pending, (list, tuple)):
        pending = "; ".join(str(p) for p in pending) or None
    busy_actor = str(busy) if busy and busy != "idle" else None
    record = _base("heartbeat", rank, t) | {
        "status": "busy" if busy_actor else ("idle" if busy == "idle" else "unknown"),
        "busy_actor": busy_actor, "pending_collective": str(pending) if pending else None}
    return cast(HeartbeatRecord, validate(record))  # validated as a "heartbeat" record
