"""``flowtrain monitor [RUN_DIR | ENDPOINT]``: picks what to watch (a live job or a recording),
then runs the app. Everything a user can get wrong is reported as one ``MonitorInputError``
line before the screen is taken over."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from tui.source import SPEED_NAMES, LiveSource, ReplaySource, Source, parse_speed

SECRET_ENV = "FLOWTRAIN_JOB_SECRET"  # the same variable the ranks read (flowtrain.env)
PROBE_TIMEOUT_S = 0.5
# an endpoint named on the command line gets longer to answer than a run directory's probe
CONNECT_TIMEOUT_S = 3.0
TELEMETRY_FILE = "telemetry.msgpack"


class MonitorInputError(ValueError):
    """A target or option the monitor cannot use; the message says what was expected."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target", nargs="?", default=None, metavar="RUN_DIR | ENDPOINT",
        help="a run directory (runs/<job id>), its telemetry.msgpack, or a coordinator PUB "
             "endpoint such as tcp://host:port (secret from $FLOWTRAIN_JOB_SECRET); default: "
             "the newest run under ./runs")
    parser.add_argument(
        "--speed", default="1", choices=SPEED_NAMES,
        help="replay speed of a finished run: 1, 2, 10 times real time or max (default 1)")
    parser.add_argument(
        "--summary", action="store_true",
        help="print a plain-text report of the run (how it ended and why, outliers, health, "
             "events) and exit with the job's status; the default when stdout is not a "
             "terminal")
    parser.add_argument("--json", action="store_true", help="the --summary report as JSON")


def run(ns: argparse.Namespace) -> int:
    """Resolves the target, then runs the app until the user quits; or, with --summary, --json
    or no terminal to draw on, prints the run's report and returns the job's exit status."""
    if ns.summary or ns.json or not sys.stdout.isatty():
        return print_summary(ns.target, as_json=ns.json)
    source = resolve_source(ns.target, parse_speed(ns.speed))
    from tui.app import MonitorApp

    MonitorApp(source).run()
    return 0


def print_summary(target: str | None, *, as_json: bool = False) -> int:
    """The --summary report of a run directory or recording (``tui.summary``)."""
    from tui.summary import summary, summary_lines

    if target is not None and "://" in target:
        raise MonitorInputError(f"--summary reads a run's recording; {target} is a live "
                                f"endpoint: pass the run directory instead")
    run_dir = _find_run(target)
    recording = run_dir / TELEMETRY_FILE
    if target is not None and Path(target).is_file() and Path(target).name != "job.json":
        recording = Path(target)
    if not recording.is_file():
        raise MonitorInputError(f"{run_dir} has no {TELEMETRY_FILE} to summarize; pass a run "
                                f"recorded with telemetry")
    report = summary(run_dir, recording)
    print(json.dumps(report, indent=1, default=str) if as_json
          else "\n".join(summary_lines(report)))
    return int(report["exit_code"])


def resolve_source(target: str | None, speed: float = 1.0) -> Source:
    """Live when the target is an endpoint, or a run whose job.json says running and whose
    coordinator answers; otherwise a replay of the run's recording."""
    if target is not None and "://" in target:
        check_endpoint(target)
        secret = _secret_from_env(target)
        if not endpoint_answers(target, CONNECT_TIMEOUT_S):
            raise MonitorInputError(
                f"nothing answers at {target} (tried for {CONNECT_TIMEOUT_S:g} s): is the job "
                "running, and is this its coordinator's PUB endpoint? A finished run replays "
                "from its run directory")
        return LiveSource(target, secret)
    run_dir = _find_run(target)
    live = _live_endpoint(run_dir)
    if live is not None and _job_status(run_dir) == "running" and endpoint_answers(live[0]):
        return LiveSource(*live, history=run_dir / TELEMETRY_FILE)
    recording = run_dir / TELEMETRY_FILE
    if target is not None and Path(target).is_file() and Path(target).name != "job.json":
        recording = Path(target)
    if not recording.is_file():
        raise MonitorInputError(
            f"{run_dir} has no {TELEMETRY_FILE} to replay and no running coordinator to "
            "subscribe to; pass a run recorded with telemetry or a tcp:// endpoint")
    return ReplaySource(recording, speed)


def _find_run(target: str | None) -> Path:
    from flowtrain.telemetry import find_run

    try:
        return find_run(target)
    except FileNotFoundError as exc:
        raise MonitorInputError(str(exc)) from None


def _live_endpoint(run_dir: Path) -> tuple[str, bytes] | None:
    from flowtrain.telemetry import live_endpoint

    found: tuple[str, bytes] | None = live_endpoint(run_dir)
    return found


def _job_status(run_dir: Path) -> str | None:
    try:
        job: Any = json.loads((run_dir / "job.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    status = job.get("status") if isinstance(job, dict) else None
    return status if isinstance(status, str) else None


def _secret_from_env(endpoint: str) -> bytes:
    text = os.environ.get(SECRET_ENV, "")
    if not text:
        raise MonitorInputError(
            f"subscribing to {endpoint} needs the job's secret in ${SECRET_ENV} (hex); or pass "
            "the run directory, whose telemetry.live.json has both")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise MonitorInputError(
            f"${SECRET_ENV} must be hex digits, got {len(text)} characters that are not") from None


def check_endpoint(endpoint: str) -> None:
    """A ``tcp://host:port`` or ``ipc://path`` endpoint, or a MonitorInputError saying what
    is missing."""
    scheme, _, address = endpoint.partition("://")
    if scheme == "ipc":
        if not address:
            raise MonitorInputError(f"{endpoint!r} names no socket path; give ipc://PATH")
        return
    if scheme != "tcp":
        raise MonitorInputError(f"{endpoint!r}: the monitor subscribes over tcp:// or ipc://, "
                                f"got {scheme}://")
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise MonitorInputError(f"{endpoint!r} is not tcp://HOST:PORT with a port from 1 to "
                                f"65535 (the coordinator's PUB endpoint, as telemetry.live."
                                f"json records it)")


def endpoint_answers(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether something accepts connections at a ``tcp://host:port`` (or ``ipc://path``)
    endpoint: a job.json left saying "running" by a killed launcher must not mean live."""
    scheme, _, address = endpoint.partition("://")
    if scheme == "ipc":
        return Path(address).exists()
    if scheme != "tcp":
        return False
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if host in ("*", "0.0.0.0", ""):
        host = "127.0.0.1"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False
