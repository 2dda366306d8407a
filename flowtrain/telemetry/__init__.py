"""Telemetry of a flowtrain job: what each rank and the coordinator publish while it runs, the
recording in ``runs/<id>/telemetry.msgpack``, and the readers the monitor and ``trace`` use.

Schema version 1. Every record is a msgpack map with ``v`` (1), ``kind``, ``rank`` (the rank it
comes from or is about; -1 for the launcher/coordinator side) and ``t`` (unix seconds):

- ``job`` (rank -1, once at start): ``job_id``, ``world_size``, ``run_dir``, ``started``,
  ``total_steps`` (or null), ``config_summary`` (launch mode, script, ranks per node, ...).
- ``step`` (each rank, at most ``flowtrain.telemetry_hz`` per second, on the rank's timer: the
  newest optimizer step since the last record, so faster steps are sampled; the timings are the
  mean of the last (up to 4) steps since the last record):
  ``step``, ``loss`` (the step's mean micro-batch loss on this rank, or null), ``lr``,
  ``loss_scale``, ``skipped`` (skipped steps so far), ``grad_norm`` (or null when the engine did
  not compute it), ``step_s``, ``forward_s``, ``backward_s``, ``comm_s`` (exposed: the step
  waited for reduces), ``optimizer_s``, ``samples_per_s`` (job-wide: train_batch_size / step_s,
  the same on every rank; do not sum over ranks), ``tokens_per_s`` (null: the engine does not
  know tokens), ``overlap`` (1 - exposed comm / time collectives ran, 0..1; null with no
  collective, e.g. one rank), ``comm_share`` (comm_s / step_s), ``mfu`` (null),
  ``mem`` {``model_states``, ``parameters``, ``gradients``, ``optimizer_state``,
  ``process_rss``, ``device_allocated`` (null off-GPU)} in bytes.
- ``spans`` (each rank: the first step, then a step numbered a multiple of
  ``flowtrain.telemetry_spans_every``, at most one record a second; a multiple held back by
  that gap, or whose record could not be sent, goes out with the first later step the gap
  allows): ``step``, ``spans``
  [[task name, start_s, end_s], ...] relative to the step's start (names as
  in ``spans/rank<R>.jsonl`` and the StepPlan), ``step_start`` (unix seconds of the step's
  start, which lines the ranks up in ``flowtrain trace``). Its ``t`` is when that step ended
  (its spans were taken), not when the record went out.
- ``event``: ``event``, ``message`` (one readable line), ``data`` (map). Names: ``rank_joined``,
  ``rank_finished``, ``rank_failed`` (``data.source`` "rank": it reported an exception; "exit":
  the launcher saw its process fail), ``rank_exited``, ``rank_stuck`` (missed heartbeats;
  ``data.last_status``), ``join_timeout``, ``skipped_step`` (``data.reason`` "overflow" for an
  fp16 gradient overflow, ``data.loss_scale``), ``engine_started`` (rank 0; precision, ZeRO
  stage, batch sizes), ``job_ended`` (rank -1, last record; ``data.status``, ``exit_code``).
- ``heartbeat`` (each rank's beat, as the coordinator got it): ``status`` ("busy", "idle" or
  "unknown"), ``busy_actor`` (or null), ``pending_collective`` (or null).

Live: the coordinator's PUB socket sends each record under topic ``telemetry.<kind>`` in a
signed control frame; ``Subscriber`` verifies it. A running launch writes its endpoint and secret
to ``runs/<id>/telemetry.live.json`` (owner-only; ``live_endpoint`` reads it). Keys beyond
these may appear in later versions; readers ignore them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowtrain.telemetry.files import (
    LIVE_FILE,
    TELEMETRY_FILE,
    TelemetryDamage,
    TelemetryRecorder,
    TelemetryTail,
    find_run,
    live_endpoint,
    load_records,
    read_records,
    write_live_endpoint,
)
from flowtrain.telemetry.schema import (
    COORDINATOR_RANK,
    EVENTS,
    KINDS,
    MEM_KEYS,
    SCHEMA_VERSION,
    TOPICS,
    EventRecord,
    HeartbeatRecord,
    JobRecord,
    Memory,
    Record,
    SpansRecord,
    StepRecord,
    TelemetryError,
    decode,
    encode,
    event_record,
    job_record,
    topic_of,
    validate,
)
from flowtrain.telemetry.subscriber import Subscriber

if TYPE_CHECKING:
    from flowtrain.engine.parts import TelemetrySource
    from flowtrain.runtime.actor import ActorRef


def attach(engine: TelemetrySource, *, force: bool = False) -> ActorRef[Any] | None:
    """Wires the Telemetry actor into a training engine (see flowtrain.telemetry.actor.attach);
    imported on call because the actor needs torch and the schema readers do not."""
    from flowtrain.telemetry.actor import attach as attach_actor

    return attach_actor(engine, force=force)


__all__ = [
    "COORDINATOR_RANK", "EVENTS", "KINDS", "LIVE_FILE", "MEM_KEYS", "SCHEMA_VERSION",
    "TELEMETRY_FILE", "TOPICS", "EventRecord", "HeartbeatRecord", "JobRecord", "Memory",
    "Record", "SpansRecord", "StepRecord", "Subscriber", "TelemetryDamage", "TelemetryError",
    "TelemetryRecorder", "TelemetryTail", "attach", "decode", "encode", "event_record",
    "find_run", "job_record", "live_endpoint", "load_records", "read_records", "topic_of",
    "validate", "write_live_endpoint",
]
