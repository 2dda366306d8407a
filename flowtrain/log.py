"""Structured logs: JSON lines per process in the run directory, a human console on a terminal.

Every process (each rank, the launcher) calls ``configure_logging`` once; the rank's identity is
bound into every line through structlog's context variables.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, TextIO, cast

import structlog
from structlog.typing import EventDict

_lock = threading.Lock()
_configured = False
_json_file: TextIO | None = None
# Fields of the process (rank, world_size, ...). Context variables do not reach the rank's
# event-loop thread, so identity is added by a processor instead.
_process_fields: dict[str, Any] = {}


def _add_process_fields(logger: Any, method: str, event: EventDict) -> EventDict:
    for key, value in _process_fields.items():
        event.setdefault(key, value)
    return event


class _Tee:
    """Renders one event twice: a JSON line to the run directory and a console line."""

    def __init__(self, json_file: TextIO | None, console: str) -> None:
        self._json_file = json_file
        self._json = structlog.processors.JSONRenderer()
        self._console = console
        self._human = structlog.dev.ConsoleRenderer(
            colors=console == "human" and sys.stderr.isatty())
        self._write_lock = threading.Lock()

    def __call__(self, logger: Any, method: str, event: EventDict) -> str:
        # The file gets everything; the console gets warnings and errors, plus the lines a
        # caller marked console=True (the job's progress), so a run's terminal stays readable.
        show = bool(event.pop("console", False))
        short = event.pop("console_fields", None)
        with self._write_lock:
            if self._json_file is not None:
                # str: JSONRenderer's default serializer is json.dumps (bytes need another one)
                json_line = cast(str, self._json(logger, method, dict(event)))
                self._json_file.write(json_line + "\n")
                self._json_file.flush()
            if self._console != "off" and _level_no(method) >= (logging.INFO if show else
                                                                _console_level()):
                if self._console == "json":  # JSON lines on request (FLOWTRAIN_CONSOLE=json)
                    line = cast(str, self._json(logger, method, dict(event)))
                else:
                    line = self._human(logger, method, _shortened(event, short))
                print(line, file=sys.stderr, flush=True)
        raise structlog.DropEvent


def _shortened(event: EventDict, fields: Any) -> dict[str, Any]:
    """The event with only ``fields`` (when given) and numbers to 4 significant digits: what a
    person reads on the console; the file keeps every field at full precision."""
    if not fields:
        return dict(event)
    out = {k: event[k] for k in ("event", "timestamp", "level") if k in event}
    for k in fields:
        value = event.get(k)
        if isinstance(value, float):
            value = float(f"{value:.4g}")
        if value is not None:
            out[k] = value
    return out


def _console_level() -> int:
    """FLOWTRAIN_CONSOLE_LEVEL (debug, info, warning, error) lowers or raises the bar."""
    name = os.environ.get("FLOWTRAIN_CONSOLE_LEVEL", "warning").upper()
    level = logging.getLevelName(name)
    return level if isinstance(level, int) else logging.WARNING


def _level_no(method: str) -> int:
    return logging.getLevelName(method.upper()) if method != "exception" else logging.ERROR


LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
          "error": logging.ERROR, "critical": logging.CRITICAL}


def log_level(name: str | None, default: int = logging.INFO) -> int:
    """A level by its name (any case; None: ``default``), or a ValueError naming the choices."""
    if name is None or name == "":
        return default
    found = LEVELS.get(name.strip().lower())
    if found is None:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {name!r}")
    return found


def configure_logging(
    *,
    json_path: str | os.PathLike[str] | None = None,
    console: str = "plain",
    level: int = logging.INFO,
    **context: Any,
) -> None:
    """Configures structlog for this process.

    Args:
        json_path: file that receives one JSON object per line; None for no file.
        console: "human" (colours when stderr is a terminal), "plain", "json" (the file's
            JSON lines on the console too), or "off".
        level: the lowest level written.
        context: fields bound into every line (rank, local_rank, world_size, ...).
    """
    global _configured, _json_file
    if console not in ("human", "plain", "off", "json"):
        raise ValueError(f"console must be 'human', 'plain', 'json' or 'off', got {console!r}")
    with _lock:
        if _json_file is not None:
            _json_file.close()
            _json_file = None
        if json_path is not None:
            Path(json_path).parent.mkdir(parents=True, exist_ok=True)
            _json_file = open(json_path, "a", encoding="utf-8")
        structlog.configure(
            processors=[
                structlog.contextvars.merge_contextvars,
                _add_process_fields,
                structlog.processors.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                structlog.processors.StackInfoRenderer(),
                structlog.processors.format_exc_info,
                _Tee(_json_file, console),
            ],
            wrapper_class=structlog.make_filtering_bound_logger(level),
            logger_factory=structlog.ReturnLoggerFactory(),
            cache_logger_on_first_use=False,
        )
        _process_fields.clear()
        _process_fields.update(pid=os.getpid(), **context)
        _configured = True


def get_logger(name: str | None = None, **fields: Any) -> Any:
    """A structlog logger. It is a lazy proxy: a module may create it at import time and it
    still follows a later ``configure_logging`` (file, console, level)."""
    if not _configured:
        configure_logging(console="plain")
    if name is not None:
        fields["component"] = name
    return structlog.get_logger(**fields)
